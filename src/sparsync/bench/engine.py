"""Engine benchmark: merge plans on an emulated 1 Gbit/s cluster, measured vs predicted (MG-WFBP, Shi et al.).

For each reducer (dense and one sparse reducer) the benchmark first runs SparseDDP with
``merge="optimal"`` to obtain the backward profile (rank 0's, as MG-WFBP profiles, §5.1 of the
paper) and the cost model fitted on the live group (§4.2, §6.2). Then, in the same 4-rank world,
every plan (``wfbp``, ``single``, ``buckets:25``, ``mgwfbp``, ``optimal``) trains ``steps`` measured
steps after ``warmup`` steps, with that profile and cost model given (so every plan is judged under
the same model). Per plan:

* measured iteration time = forward + backward + wait + optimizer step (median over steps, max
  over ranks), non-overlapped communication = ``last_stats["wait_s"]`` (time the end of backward
  waited for communication);
* predicted = measured forward time + the timeline model of :mod:`sparsync.schedule.merge`
  (``evaluate``: backward with merged groups, ``a + b*bytes`` per group).

Models: :data:`MODELS` — ``tower`` (many small tensors plus a few large ones: 40 blocks of
Linear(128,128)+LayerNorm(128), then Linear(128,4096) and Linear(4096,128): 166 tensors, 1.73 M
parameters) and the training workloads of :mod:`sparsync.train.workloads` when present
(``digits-mlp`` ...). ``python -m sparsync.bench.engine --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

__all__ = ["MODELS", "build", "main", "run_benchmark"]


class Tower(nn.Module):
    """Many small tensors + a few large ones (the shape that makes merging matter)."""

    def __init__(self, width: int = 128, blocks: int = 40, wide: int = 4096, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh())
                                    for _ in range(blocks))
        self.up = nn.Linear(width, wide)
        self.down = nn.Linear(wide, width)
        self.head = nn.Linear(width, classes)
        self.width = width

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.down(torch.relu(self.up(x))))


def _tower(batch_size):
    model = Tower()

    def batch(step, rank, P):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        return torch.randn(batch_size, 128, generator=g), torch.randint(0, 10, (batch_size,), generator=g)

    return model, batch, nn.functional.cross_entropy


def _workload(name):
    def make(batch_size):
        from ..train.workloads import make_workload  # train sits above bench: imported when a model is built

        wl = make_workload(name)
        model = wl.build()

        def batch(step, rank, P):
            return wl.batch(step, rank, P, batch_size, 0)

        return model, batch, wl.loss_fn

    return make


MODELS = {"tower": _tower, "digits-mlp": _workload("digits-mlp"), "digits-cnn": _workload("digits-cnn"),
          "gpt": _workload("gpt")}


def build(name: str, batch_size: int = 64, seed: int = 0):
    """(model, batch(step, rank, P) -> (x, y), loss_fn) for a model of :data:`MODELS`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(MODELS))}")
    with torch.random.fork_rng(devices=[]):  # module init draws from the global RNG: seed, then restore
        torch.manual_seed(seed)
        return MODELS[name](batch_size)


def _worker(comm, model_name, reducer, density, merges, warmup, steps, batch_size, reducer_options):
    import sparsync as ss

    torch.set_num_threads(1)
    out = {}

    def run(merge, profile=None, cost_model=None, n_steps=steps):
        model, batch, loss_fn = build(model_name, batch_size)
        ddp = ss.SparseDDP(model, comm, reducer=reducer, density=density, merge=merge,
                           reducer_options=reducer_options, profile=profile, cost_model=cost_model,
                           profile_warmup=2, profile_steps=5, nonfinite="ignore")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rows = []
        for step in range(warmup + n_steps):
            x, y = batch(step, comm.rank, comm.world_size)
            comm.barrier()
            t0 = time.perf_counter()
            loss = loss_fn(ddp(x), y)
            t1 = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t3 = time.perf_counter()
            if step >= warmup:
                st = ddp.last_stats
                rows.append([t3 - t0, t1 - t0, st["wait_s"], st["backward_s"], st["comm_s"] + st["select_s"],
                             st["density"]])
        # max over ranks of each per-step quantity, then the median over steps
        t = torch.tensor(rows, dtype=torch.float64)
        with comm.unrecorded():
            t = comm.allreduce(t.reshape(-1), "max").reshape(t.shape)
        med = t.median(dim=0).values.tolist()
        res = {"iteration_s": med[0], "forward_s": med[1], "wait_s": med[2], "backward_s": med[3],
               "reduce_s": med[4], "density": med[5], "groups": ddp.last_stats["groups"]}
        eng = ddp.engine
        ddp.close()
        return res, eng

    # calibration: optimal with profiling and a live cost-model fit
    _, eng = run("optimal", n_steps=max(1, 8 - warmup))  # 2 + 5 profiled steps, then the switch
    profile, cm = eng.profile, eng.cost_model
    out["profile"] = profile.to_dict()
    out["cost_model"] = cm.to_dict()
    for merge in merges:
        res, eng = run(merge, profile=profile, cost_model=cm)
        eng.profile, eng.cost_model = profile, cm
        pred = eng.predictions(strategies=[merge], t_f=res["forward_s"])[merge]
        res["predicted_iteration_s"] = pred["iteration_s"]
        res["predicted_non_overlapped_s"] = pred["non_overlapped_s"]
        res["predicted_groups"] = pred["groups"]
        out[merge] = res
    return out


def run_benchmark(model="tower", reducers=("dense", "topka"), density=0.01, merges=None, workers=4,
                  bandwidth="1gbit", warmup=3, steps=10, batch_size=64, loopback=False, reducer_options=None):
    from ..schedule.merge import STRATEGIES

    merges = list(merges or STRATEGIES)
    results = {}
    for red in reducers:
        opts = (reducer_options or {}).get(red, {})
        if loopback:
            from ..launch import run_local

            res = run_local(_worker, workers, model, red, density, merges, warmup, steps, batch_size, opts,
                            backend="gloo", timeout=600)
        else:
            from ..cluster import run_emulated

            res = run_emulated(_worker, workers, model, red, density, merges, warmup, steps, batch_size, opts,
                               bandwidth=bandwidth, timeout=600)
        results[red] = res[0]
    return results


def format_markdown(results, model, workers, bandwidth, density) -> str:
    lines = []
    for red, res in results.items():
        cm = res["cost_model"]
        r2 = cm.get("r2")
        lines.append(f"**{red}** (density {density if red != 'dense' else 1.0}): fitted cost model "
                     f"t = {cm['a'] * 1e3:.3g} ms + {cm['b'] * 1e9:.3g} ns/byte (R^2 {r2:.3f}); "
                     f"profiled backward {sum(res['profile']['t_b']) * 1e3:.1f} ms over "
                     f"{len(res['profile']['t_b'])} tensors")
        lines.append("")
        lines.append("| plan | groups | measured iteration (ms) | predicted iteration (ms) | measured non-overlapped "
                     "comm (ms) | predicted non-overlapped (ms) | forward (ms) | backward (ms) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for m, v in res.items():
            if m in ("profile", "cost_model"):
                continue
            lines.append(f"| {m} | {v['groups']} | {v['iteration_s'] * 1e3:.1f} | "
                         f"{v['predicted_iteration_s'] * 1e3:.1f} | {v['wait_s'] * 1e3:.1f} | "
                         f"{v['predicted_non_overlapped_s'] * 1e3:.1f} | "
                         f"{v['forward_s'] * 1e3:.1f} | {v['backward_s'] * 1e3:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync.bench.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tower", choices=sorted(MODELS))
    ap.add_argument("--reducers", default="dense,topka")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--merges", default="wfbp,single,buckets:25,mgwfbp,optimal")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--loopback", action="store_true", help="plain gloo over loopback (no emulated network)")
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args(argv)
    t0 = time.time()
    res = run_benchmark(a.model, a.reducers.split(","), a.density, a.merges.split(","), a.workers, a.bandwidth,
                        a.warmup, a.steps, a.batch_size, a.loopback)
    print(format_markdown(res, a.model, a.workers, a.bandwidth, a.density))
    print(f"(wall time {time.time() - t0:.0f} s)", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
