"""MG-WFBP trace-based schedule simulation (MG-WFBP: Shi, Chu, Li, journal version 2021, §6.4, Figures 10-11).

Inputs: a **profile** of one model — forward time ``t_f``, per-tensor backward times ``t_b`` in
gradient-ready order and tensor sizes in bytes — measured on this machine by the engine's profiler
(:func:`sparsync.schedule.profiler.profile_module`: post-accumulate-grad hook timestamps, CUDA
synchronised when on a GPU), saved as JSON; and an all-reduce **cost model** ``T_ar(M) = a + b*M``
for ``N`` workers from the paper's Table II (``γ`` = 0 unless given):

* ring:                ``a = 2(N-1)α``,   ``b = 2(N-1)/N·β + (N-1)/N·γ``
* double binary trees: ``a = 2α·log2 N`` (the paper prints ``2 log N``; erratum), ``b = β + γ``

with ``α, β`` derived from the paper's cluster-1 fit (8 nodes x 2 K80 = 16 workers, 10GbE, ring:
``a = 9.72e-4 s``, ``b = 1.97e-9 s/byte``) by inverting the ring formulas at ``N0 = 16``:
``α = a/(2(N0-1)) = 32.4 µs``, ``β = b·N0/(2(N0-1)) = 1.05 ns/byte`` (implementation choice: the
paper does not say which N its fit belongs to; we take the cluster's 16 workers).

For every ``N`` in 4..2048 (powers of two) and strategy in wfbp / single (SyncEASGD) / mgwfbp
(Algorithm 1) / optimal (exact DP), the plan comes from :func:`sparsync.schedule.merge.make_plan`
and its iteration time from :func:`sparsync.schedule.merge.evaluate` (eqs. 6-9, 12-14):
``t_iter = t_f + finish of the last message``; speed-up ``S(N) = N·(t_f + Σ t_b) / t_iter`` (eq. 4).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..schedule.merge import evaluate, make_plan
from ..schedule.profiler import profile_module

__all__ = [
    "MODELS",
    "PAPER_FIT",
    "allreduce_model",
    "alpha_beta_from_fit",
    "load_profile",
    "plot_speedup",
    "profile_model",
    "simulate",
]

#: the paper's cluster-1 fit (K80, 10GbE), ring all-reduce, 16 workers
PAPER_FIT = {"a": 9.72e-4, "b": 1.97e-9, "N0": 16}
STRATEGIES = ("wfbp", "single", "mgwfbp", "optimal")


def alpha_beta_from_fit(a: float = PAPER_FIT["a"], b: float = PAPER_FIT["b"], N0: int = PAPER_FIT["N0"]):
    """Invert the ring formulas (γ = 0) at N0 workers: (α, β)."""
    return a / (2 * (N0 - 1)), b * N0 / (2 * (N0 - 1))


def allreduce_model(N: int, alpha: float, beta: float, gamma: float = 0.0, algorithm: str = "ring"):
    """``(a, b)`` of ``T_ar(M) = a + b*M`` (M in bytes) for N workers (paper Table II)."""
    if algorithm == "ring":
        return 2 * (N - 1) * alpha, 2 * (N - 1) / N * beta + (N - 1) / N * gamma
    if algorithm in ("dbtree", "double_binary_tree"):
        return 2 * alpha * math.log2(N), beta + gamma
    if algorithm == "rec_doubling":
        return alpha * math.log2(N), (beta + gamma) * math.log2(N)
    raise ValueError(f"unknown all-reduce model {algorithm!r}; valid: ring, dbtree, rec_doubling")


def simulate(profile: dict, workers=None, algorithm: str = "ring", alpha: float | None = None,
             beta: float | None = None, gamma: float = 0.0, strategies=STRATEGIES) -> list[dict]:
    """One row per (N, strategy): iteration time, non-overlapped comm, groups, speed-up."""

    if alpha is None or beta is None:
        a0, b0 = alpha_beta_from_fit()
        alpha = a0 if alpha is None else alpha
        beta = b0 if beta is None else beta
    workers = workers or [2 ** i for i in range(2, 12)]
    t_b, sizes, t_f = profile["t_b"], profile["sizes"], profile["t_f"]
    compute = t_f + sum(t_b)
    rows = []
    for N in workers:
        a, b = allreduce_model(N, alpha, beta, gamma, algorithm)
        for s in strategies:
            groups = make_plan(s, t_b, sizes, a, b)
            ev = evaluate(groups, t_b, sizes, a, b, t_f)
            rows.append({"N": N, "strategy": s, "a": a, "b": b, "iteration_s": ev["iteration_s"],
                         "non_overlapped_s": ev["non_overlapped_s"], "groups": ev["groups"],
                         "speedup": N * compute / ev["iteration_s"]})
    return rows


# ---------------------------------------------------------------------------- models to profile
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50/152 as in He et al. (torchvision layout: 161 / 467 parameter tensors)."""

    def __init__(self, blocks=(3, 4, 6, 3), classes=1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            width = 64 * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _image_model(blocks):
    def make(batch, image):
        m = ResNet(blocks)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, 3, image, image, generator=g)
        y = torch.randint(0, 1000, (batch,), generator=g)
        return m, lambda: F.cross_entropy(m(x), y)
    return make


def _workload_model(name, **opts):
    def make(batch, image=None):
        from ..train.workloads import make_workload  # train sits above sim: imported when a model is built

        wl = make_workload(name, **opts)
        m = wl.build()
        x, y = wl.batch(0, 0, 1, batch, 0)
        return m, lambda: wl.loss_fn(m(x), y)
    return make


MODELS = {
    "resnet50": (_image_model((3, 4, 6, 3)), {"batch": 4, "image": 112}),
    "resnet152": (_image_model((3, 8, 36, 3)), {"batch": 2, "image": 112}),
    "digits-mlp": (_workload_model("digits-mlp"), {"batch": 32}),
    "digits-cnn": (_workload_model("digits-cnn"), {"batch": 32}),
    "lm": (_workload_model("lm"), {"batch": 64}),
}


def profile_model(name: str, batch: int | None = None, image: int | None = None, steps: int = 5,
                  warmup: int = 2, device: str = "cpu") -> dict:
    """Measure a model's profile with the engine's profiler; returns the JSON-able profile dict."""

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(MODELS))}")
    make, d = MODELS[name]
    batch = batch or d["batch"]
    image = image or d.get("image")
    with torch.random.fork_rng(devices=[]):  # module init draws from the global RNG: seed it, then restore
        torch.manual_seed(0)
        m, loss_fn = make(batch, image)
    m.to(device)
    params = [p for p in m.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    prof, t_f = profile_module(m, loss_fn, steps=steps, warmup=warmup)
    sizes = [params[i].numel() * params[i].element_size() for i in prof.order]
    return {"model": name, "device": device, "batch": batch, "image": image, "t_f": t_f, "t_b": list(prof.t_b),
            "sizes": sizes, "order": list(prof.order), "tensors": len(sizes), "params": sum(p.numel() for p in params),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "profile_wall_s": time.perf_counter() - t0}


def load_profile(path) -> dict:
    d = json.loads(Path(path).read_text())
    for k in ("t_b", "sizes", "t_f"):
        if k not in d:
            raise ValueError(f"profile {path} has no {k!r} (expected the output of `sparsync simulate profile`)")
    if len(d["t_b"]) != len(d["sizes"]):
        raise ValueError(f"profile {path}: t_b and sizes differ in length")
    return d


def plot_speedup(results: dict, path, title: str) -> None:
    """``results``: {panel title: rows of :func:`simulate`} -> speed-up vs workers, one panel each."""
    from ..extras import require

    require("matplotlib", "plots", "the schedule plot").use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4.2), squeeze=False)
    for ax, (panel, rows) in zip(axes[0], results.items()):
        Ns = sorted({r["N"] for r in rows})
        for s, style in zip(STRATEGIES, ("-o", "-s", "-^", "--x")):
            pts = sorted((r["N"], r["speedup"]) for r in rows if r["strategy"] == s)
            label = {"single": "SyncEASGD (single)", "mgwfbp": "MG-WFBP (Alg. 1)", "optimal": "optimal (DP)",
                     "wfbp": "WFBP"}[s]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=4, label=label)
        ax.plot(Ns, Ns, ":", color="grey", label="linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("workers N")
        ax.set_ylabel("speed-up over 1 worker")
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
