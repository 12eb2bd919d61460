"""Selection-cost and density-tracking benchmarks for the threshold sparsifiers (MiCRO).

What:

* :func:`time_selection` - wall time of one selection kernel on one vector: exact top-k
  (``torch.topk`` of ``|x|``), the threshold kernel over the whole vector
  (:func:`~sparsync.select.threshold.threshold_indices`, as ``hard_threshold`` does), the naive
  threshold ``nonzero(|x| >= delta)``, and MiCRO's partitioned threshold (one rank's ``1/P`` slice).
* :func:`mlp_gradient_stream` / :func:`density_trace` - a realistic gradient stream: a small MLP
  trained with plain data-parallel SGD on sklearn's bundled digits (no download); on every step
  each rank's gradient is fed to several reducers at once, so they all see exactly the same stream,
  and their achieved density is recorded (used by ``tests/selection/test_micro_controller.py`` and the plot
  ``docs/img/micro_density.png``).
* :func:`comm_benchmark` - per-step time of ``micro``/``cltk``/``topka``/``hard_threshold`` (and
  ``dense``) on P ranks with :func:`sparsync.bench.reducers.time_reducer` (emulated 1 Gbit/s
  cluster when available).

Why: the MiCRO paper's claims are (1) near-zero selection cost and (2) achieved density close to
the target while the hard threshold drifts (Yoon & Oh 2023, §V). CLI:
``sparsync bench-select`` (:mod:`sparsync.commands.bench_select`).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..select.threshold import (
    Workspace,
    owned_partition,
    partition_bounds,
    threshold_indices,
)

__all__ = [
    "SELECTORS",
    "comm_benchmark",
    "compare_chunked",
    "compare_exact_topk",
    "density_trace",
    "mlp_gradient_stream",
    "plot_density",
    "time_selection",
]

SELECTORS = ("topk", "threshold_naive", "threshold", "threshold_torch", "micro_partition")


def _median_time(fn, repeat: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _torch_pass(fn):
    """``fn()`` with the C kernels switched off: the torch form of the same kernel, for side-by-side timings."""
    from .. import native

    with native.switched_off():
        return fn()


def time_selection(numel: int, density: float, selectors=SELECTORS, P: int = 4, repeat: int = 5,
                   device="cpu", seed: int = 0) -> list[dict]:
    """Median wall time of each selection kernel on a standard-normal vector of ``numel`` entries.

    The threshold kernels use the exact ``(1 - density)`` quantile of ``|x|`` (so every kernel
    selects ~``density * numel`` entries; a calibrated controller gets there in steady state).
    ``micro_partition`` is one rank's share: the threshold kernel over partition 0 of ``P``.
    ``threshold`` is the kernel as it runs (its C pass when :mod:`sparsync.native` is on),
    ``threshold_torch`` the same kernel with the C pass switched off (the chunked torch form).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(int(numel), generator=g).to(device)
    k = max(1, round(density * numel))
    sample = x[:: max(1, numel // 1_000_000)].abs().float()
    delta = float(torch.kthvalue(sample.cpu(), max(1, round((1 - density) * sample.numel()))).values)
    sync = (lambda: torch.cuda.synchronize()) if torch.device(device).type == "cuda" else (lambda: None)
    ws = Workspace()
    s, e = partition_bounds(numel, P)[owned_partition(0, 0, P)]
    fns = {
        "topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "threshold_naive": lambda: torch.nonzero(x.abs() >= delta),
        "threshold": lambda: threshold_indices(x, delta, workspace=ws),
        "threshold_torch": lambda: _torch_pass(lambda: threshold_indices(x, delta, workspace=ws)),
        "micro_partition": lambda: threshold_indices(x[s:e], delta, workspace=ws, offset=s),
    }
    out = []
    for name in selectors:
        if name not in fns:
            raise ValueError(f"unknown selector {name!r}; valid: {', '.join(fns)}")
        r = repeat if not (name == "topk" and numel >= 50_000_000) else max(1, repeat // 2)
        t = _median_time(fns[name], r, sync)
        out.append({"selector": name, "numel": int(numel), "density": density,
                    "P": P if name == "micro_partition" else 1, "device": str(device), "time_s": t})
    return out


def compare_exact_topk(numel: int, density: float, repeat: int = 7, device="cpu") -> dict:
    """``torch.topk`` vs the exact kernel (:func:`~sparsync.select.exact.topk_indices`) side by side.

    Input: the heavy-tailed benchmark gradient of rank 0 (:func:`~sparsync.bench.patterns.heavy_tail_grad`).
    The kernel is timed twice: with its candidate pass in C (:mod:`sparsync.native`; when it builds
    here) and with the torch pass. All are timed alternately (one call each per repetition, so all
    see the same machine load) after one untimed call each; ``torch.topk`` is timed as a reducer
    uses it (``|x|``, then the top-k indices sorted). Returns the medians, the ratio of
    ``torch.topk`` to the kernel, and whether all index sets are equal.
    """
    from ..select.exact import topk_indices
    from .patterns import heavy_tail_grad

    x = heavy_tail_grad(0, 0, int(numel)).to(device)
    k = max(1, round(density * numel))
    sync = (lambda: torch.cuda.synchronize()) if torch.device(device).type == "cuda" else (lambda: None)
    scratch: dict = {}
    fns = {"torch.topk": lambda: torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values,
           "exact": lambda: topk_indices(x, k, scratch),
           "exact_torch": lambda: _torch_pass(lambda: topk_indices(x, k, scratch))}
    first = {name: fn() for name, fn in fns.items()}
    ts: dict = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in ts.items()}
    sets = list(first.values())
    return {"numel": int(numel), "density": density, "k": k, "topk_s": med["torch.topk"], "exact_s": med["exact"],
            "exact_torch_s": med["exact_torch"],
            "speedup": med["torch.topk"] / med["exact"], "same_set": all(torch.equal(sets[0], s) for s in sets[1:])}


def compare_chunked(numel: int, density: float, chunk: int = 4096, bits: int = 2, P: int = 4,
                    repeat: int = 7) -> dict:
    """SparseLoCo's two kernels on a standard-normal vector, C against torch side by side: the per-chunk
    top-k (:func:`~sparsync.select.chunked.chunked_topk`, ``k = round(density * chunk)``) and the sum of
    ``P`` messages of ``bits``-bit values (:func:`~sparsync.select.quantise.sum_messages`: compared once
    into a zeroed output, then timed adding onto it). Timed alternately after one untimed call each;
    returns the medians (``topk_c_s``, ``topk_torch_s``, ``sum_c_s``, ``sum_torch_s``) and whether both
    paths gave the same bits."""
    from ..select.chunked import chunked_topk, per_chunk_k
    from ..select.quantise import bits_for, encode_message, sum_messages

    x = torch.randn(int(numel), generator=torch.Generator().manual_seed(0))
    k = per_chunk_k(density, chunk)
    idx = chunked_topk(x, chunk, k)
    local = torch.remainder(idx, chunk)
    msg, _ = encode_message(local, bits_for(min(chunk, numel)), x.index_select(0, idx), bits)
    out = torch.zeros(int(numel))

    def summed():  # the timed call adds onto what the last one left: no zero fill or copy of n entries
        return sum_messages([msg] * P, idx.numel(), bits_for(min(chunk, numel)), bits, out, chunk=chunk, k=k)

    def topk():
        return chunked_topk(x, chunk, k)

    fns = {"topk_c": topk, "topk_torch": lambda: _torch_pass(topk),
           "sum_c": summed, "sum_torch": lambda: _torch_pass(summed)}
    first = {"topk_c": topk(), "topk_torch": _torch_pass(topk), "sum_c": summed().clone()}
    out.zero_()
    first["sum_torch"] = _torch_pass(summed).clone()
    ts: dict = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    same = torch.equal(first["topk_c"], first["topk_torch"]) and torch.equal(first["sum_c"], first["sum_torch"])
    return {"numel": int(numel), "k": k, "count": idx.numel(), "same": same,
            **{f"{name}_s": statistics.median(v) for name, v in ts.items()}}


# ---------------------------------------------------------------------- realistic gradient stream
def _digits(device):
    from ..extras import require

    load_digits = require("sklearn.datasets", "train", "the density trace").load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32, device=device) / 16.0
    y = torch.tensor(y, dtype=torch.int64, device=device)
    return X, y


def make_mlp(hidden=(512, 128), seed: int = 0):
    """Digits MLP 64 -> hidden... -> 10 (ReLU), identical on every rank.

    Initialised like ``nn.Linear`` (uniform in ``+-1/sqrt(fan_in)``) but from a private generator:
    the global RNG is shared by the rank threads of the thread backend.
    """
    gen = torch.Generator().manual_seed(seed)
    layers, d = [], 64
    for h in (*hidden, 10):
        lin = torch.nn.Linear(d, h)
        with torch.no_grad():
            for p in (lin.weight, lin.bias):
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / d ** 0.5)
        layers += [lin, torch.nn.ReLU()]
        d = h
    return torch.nn.Sequential(*layers[:-1])


def mlp_gradient_stream(comm, steps: int, hidden=(512, 128), batch: int = 32, lr: float = 0.1,
                        lr_drop_at: int | None = None, seed: int = 0):
    """Yield this rank's flat gradient for ``steps`` steps of data-parallel SGD on digits.

    Every rank holds the same model (same seed), draws a batch from its own shard (samples
    ``rank::P``), and the model is updated with the dense average gradient (an unrecorded
    all-reduce), so the stream does not depend on the reducers being measured. With
    ``lr_drop_at`` the learning rate is divided by 10 at that step (the yielded gradients are raw;
    scale them by :attr:`lr` yourself for the paper's ``eta * G`` form - see ``density_trace``).
    """
    X, y = _digits("cpu")
    P, r = comm.world_size, comm.rank
    Xs, ys = X[r::P], y[r::P]
    model = make_mlp(hidden, seed)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(seed * 7919 + r)
    for t in range(steps):
        cur_lr = lr if (lr_drop_at is None or t < lr_drop_at) else lr / 10
        sel = torch.randint(0, Xs.shape[0], (batch,), generator=gen)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(Xs[sel]), ys[sel]).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        yield t, cur_lr, flat
        with comm.unrecorded():
            avg = comm.allreduce(flat) / P
        with torch.no_grad():
            off = 0
            for p in params:
                p -= cur_lr * avg[off: off + p.numel()].view_as(p)
                off += p.numel()


def _student_t(shape, df: int, gen: torch.Generator) -> torch.Tensor:
    """Student-t(``df``) samples from a private generator (thread safe, unlike the global RNG):
    ``Z / sqrt(chi2_df / df)`` with ``chi2_df`` a sum of ``df`` squared normals."""
    z = torch.randn(shape, generator=gen)
    chi2 = torch.randn((int(df),) + tuple(shape), generator=gen).square_().sum(0)
    return z / (chi2 / df).sqrt_()


def drifting_stream(comm, steps: int, numel: int = 100_000, decades: float = 2.0, df: int = 3,
                    noise: float = 1.0, seed: int = 0):
    """Yield ``(t, 1.0, g)``: a heavy-tailed gradient whose scale drifts smoothly.

    ``g = s(t) * (mu + noise * T_t)`` with ``mu`` a per-coordinate Student-t(``df``) mean shared by all
    ranks (a consistent descent direction), ``T_t`` fresh Student-t noise per rank and step, and
    ``s(t) = 10 ** (-decades * t / steps)`` (the scale falls by ``decades`` orders of magnitude over
    the run, like gradients of a converging model). Deterministic for a given seed.
    """
    mu = _student_t((int(numel),), df, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + comm.rank) * 10_007 + 1)
    for t in range(steps):
        g = (mu + noise * _student_t((int(numel),), df, gen)) * 10 ** (-decades * t / steps)
        yield t, 1.0, g


def first_kth_threshold(comm, g: torch.Tensor, density: float) -> float:
    """A sensible start for a threshold rule: the exact ``k``-th largest ``|g|`` of the first gradient
    (``k = density * n``), averaged over ranks so every rank starts from the same threshold."""
    k = max(1, round(density * g.numel()))
    kth = torch.topk(g.abs().flatten(), k, sorted=False).values.min().reshape(1).double()
    return float(comm.allreduce(kth)[0]) / comm.world_size


def density_trace(comm, reducers=("micro", "hard_threshold"), steps: int = 200, density: float = 0.01,
                  scale_by_lr: bool = True, options: dict | None = None, stream: str = "mlp",
                  **stream_kw) -> dict:
    """Per-step achieved density of each reducer on the same gradient stream (this rank).

    ``stream``: ``"mlp"`` (:func:`mlp_gradient_stream`) or ``"drift"`` (:func:`drifting_stream`).
    ``reducers``: names, or ``(label, name, options)`` tuples for several variants of one reducer;
    ``options`` maps reducer name -> extra options (for plain names); the option
    ``threshold="first_kth"`` starts a threshold reducer from :func:`first_kth_threshold`. Returns
    ``{name: {"density": [...], "threshold": [...], "selected": [...], "candidates": [...]}}`` plus
    ``"numel"`` (``candidates``: entries the calibration read, micro's histogram rule; else None). With
    ``scale_by_lr`` the reducers get ``lr * grad`` (MiCRO's accumulator ``e + eta G``, Algorithm 1).
    """
    from ..reducers import make_reducer

    streams = {"mlp": mlp_gradient_stream, "drift": drifting_stream}
    if stream not in streams:
        raise ValueError(f"unknown stream {stream!r}; valid: {', '.join(streams)}")
    options = options or {}
    specs = [(item, item, options.get(item, {})) if isinstance(item, str) else item for item in reducers]
    rs = {}
    trace = {label: {"density": [], "threshold": [], "selected": [], "candidates": []} for label, _, _ in specs}
    numel = None
    for _t, lr, g in streams[stream](comm, steps, **stream_kw):
        numel = g.numel()
        gin = g * lr if scale_by_lr else g
        if not rs:  # built at the first gradient: threshold="first_kth" needs it
            for label, name, opts in specs:
                if opts.get("threshold") == "first_kth":
                    opts = {**opts, "threshold": first_kth_threshold(comm, gin, density)}
                rs[label] = make_reducer(name, comm, density=density, **opts)
        for name, red in rs.items():
            red.reduce(gin)
            trace[name]["density"].append(red.stats["density"])
            trace[name]["selected"].append(red.stats["selected"])
            trace[name]["threshold"].append(red.stats.get("threshold"))
            trace[name]["candidates"].append(red.stats.get("candidates"))
    trace["numel"] = numel
    return trace


def plot_density(traces: dict, density: float, path: str, title: str = "") -> None:
    """Achieved density vs step (one line per reducer) with the target and its +-10% band."""
    from ..extras import require

    require("matplotlib", "plots", "the density plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, tr in traces.items():
        if name == "numel":
            continue
        ax.plot(range(len(tr["density"])), tr["density"], label=name)
    ax.axhline(density, color="k", lw=0.8, ls="--", label="target")
    ax.axhspan(0.9 * density, 1.1 * density, color="g", alpha=0.12, label="target +-10%")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("achieved density (entries sent per rank / n)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- communication
def comm_benchmark(P: int, numel: int, density: float, reducers=("micro", "cltk", "topka", "hard_threshold"),
                   steps: int = 5, warmup: int = 3, bandwidth: str | None = "1gbit", backend: str = "gloo",
                   seed: int = 0) -> list[dict]:
    """Per-reducer summary (median over steps of the max over ranks) on ``P`` ranks.

    ``bandwidth`` set: the emulated cluster (:func:`sparsync.cluster.run_emulated`, needs root);
    ``None``: :func:`sparsync.run_local` on ``backend`` (loopback). A reducer may carry options:
    ``"micro:rule=adaptive"`` (:func:`parse_spec`). Gradients are standard normal
    (:func:`sparsync.bench.reducers.make_grad`); ``hard_threshold`` gets the threshold that selects
    ``density`` of a standard normal vector (its ``1/(2 sqrt k)`` default would select almost
    everything on unit-scale data), so the comparison is at equal initial density.
    """
    from .reducers import summarize, time_reducer

    thr = _normal_quantile(1 - density / 2)

    def body(comm):
        res = {}
        for spec in reducers:
            name, opts = parse_spec(spec)
            if name in ("hard_threshold", "micro"):
                opts = {"threshold": thr, **opts}
            res[spec] = time_reducer(comm, name, numel, density=density, steps=steps, warmup=warmup,
                                     seed=seed, **opts)
        return res

    if bandwidth:
        from ..cluster import run_emulated

        per_rank = run_emulated(body, P, bandwidth=bandwidth)
    else:
        from ..launch import run_local

        per_rank = run_local(body, P, backend=backend, timeout=600)
    rows = []
    for name in reducers:
        s = summarize([pr[name] for pr in per_rank])
        s.update(reducer=name, P=P, numel=numel, density_target=density, bandwidth=bandwidth or "loopback")
        rows.append(s)
    return rows


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"micro:rule=adaptive,cap_factor=2"`` -> ``("micro", {"rule": "adaptive", "cap_factor": 2.0})``."""
    name, _, rest = spec.partition(":")
    opts = {}
    for kv in filter(None, rest.split(";" if ";" in rest else ",")):
        k, eq, v = kv.partition("=")
        if not eq:
            raise ValueError(f"bad reducer option {kv!r} in {spec!r} (expected key=value)")
        v = v.strip()
        consts = {"None": None, "True": True, "False": False}
        if v in consts:
            opts[k.strip()] = consts[v]
            continue
        try:
            opts[k.strip()] = float(v)
        except ValueError:
            opts[k.strip()] = v
    return name.strip(), opts


def _normal_quantile(p: float) -> float:
    """Standard normal quantile (for the equal-density hard threshold)."""
    return float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))
