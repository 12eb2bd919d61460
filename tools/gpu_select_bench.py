"""Selection kernels on one GPU (run by hand on a CUDA machine), against ``torch.topk`` on the same GPU.

Per size ``n`` and density (``k = density * n``) of a fp32 normal vector:

* sparsync's exact top-k (:func:`sparsync.select.exact.topk_indices`: the path it picks by size) and
  each of its two GPU paths forced (:func:`~sparsync.select.exact.torch_topk_rows`,
  :func:`~sparsync.select.exact.sampled_rows`), every result checked against the tie rule (ties at
  the ``k``-th magnitude occur in fp32 from ~1e7 elements on);
* ``torch.topk(|x|, k)`` bare (unsorted indices, any tie choice) and with its indices sorted (the
  output sparsync returns);
* the threshold selection (:func:`sparsync.select.threshold.threshold_indices`, MiCRO and hard
  threshold; threshold = the ``k``-th magnitude, so the same count);
* block selection (:func:`sparsync.select.blocks.block_topk`: the ``density`` share of 256-element
  blocks of largest norm);
* the count sketch (:class:`sparsync.sketch.CountSketch`, S2) encoding the ``k`` selected entries
  (1 and 3 rows, ``ratio`` 0.5: ``k / 2`` cells per row).

Milliseconds per call from CUDA events (median of ``REPS`` after ``WARMUP`` calls), GB/s = the bytes a
kernel must read (``4 n``; the sketch ``12 k``: its int64 indices and fp32 values) over the time, as a
fraction of the datasheet HBM peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s) and of a device-to-device
copy measured here (bytes read + written). Usage: ``python3 tools/gpu_select_bench.py [out.md] [sizes]``
(sizes comma-separated, default ``1e6,1e7,3e7,6e7,1e8,5e8``). Prints the markdown table.
"""

import statistics
import sys

import torch

from sparsync.select import exact
from sparsync.select.blocks import block_topk, num_blocks
from sparsync.select.exact import topk_indices
from sparsync.select.threshold import Workspace, threshold_indices
from sparsync.sketch import CountSketch, sketch_columns

WARMUP, REPS = 3, 15
PEAKS = {"H100": 3.35e12, "H200": 4.8e12}
DENSITIES = (0.01, 0.001)


def timed(f, reps=REPS):
    for _ in range(WARMUP):
        f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GB device-to-device copy."""
    n = 1 << 29
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    ms = timed(lambda: dst.copy_(src), 10)
    return 2 * 4 * n / (ms * 1e-3)


def tie_rule(x: torch.Tensor, k: int) -> torch.Tensor:
    """The documented answer at any scale: every ``|x| > v`` and the lowest-index ``|x| == v`` up to k."""
    a = x.abs()
    v = torch.topk(a, k, sorted=False).values.min()
    gt = torch.nonzero(a > v).squeeze(1)
    eq = torch.nonzero(a == v).squeeze(1)
    return torch.sort(torch.cat([gt, eq[:k - gt.numel()]])).values, int(eq.numel())


def case(x, density, ws, scratch, peak, copy) -> list[str]:
    """The table rows of one vector and density (every exact result checked first)."""
    n = x.numel()
    rows = []
    k = int(density * n)
    want, ties = tie_rule(x, k)
    auto = topk_indices(x, k, scratch)
    X = x.view(1, -1)
    checks = {"auto": torch.equal(auto, want),
              "torch path": torch.equal(exact.torch_topk_rows(X, k)[0], want),
              "sampled path": torch.equal(exact.sampled_rows(X, k, scratch)[0], want)}
    delta = float(x.abs()[want].min())
    kt = threshold_indices(x, delta, workspace=ws).numel()
    nb = num_blocks(n, 256)
    K = max(1, round(density * nb))
    idx, vals = want, x[want]
    sk1 = CountSketch(1, sketch_columns(k, 1), device="cuda")
    sk3 = CountSketch(3, sketch_columns(k, 3), device="cuda")
    note = f"ties at the k-th: {ties}; exact == tie rule: " + ", ".join(f"{p} {v}" for p, v in checks.items())
    kernels = [
        ("sparsync exact top-k", lambda: topk_indices(x, k, scratch), 4 * n, note),
        ("  its torch.topk path", lambda: exact.torch_topk_rows(X, k), 4 * n, ""),
        ("  its sampled path", lambda: exact.sampled_rows(X, k, scratch), 4 * n, ""),
        ("torch.topk(abs(x))", lambda: torch.topk(x.abs(), k, sorted=False), 4 * n, "unsorted, any ties"),
        ("torch.topk(abs(x)) + sort", lambda: torch.topk(x.abs(), k, sorted=False).indices.sort(), 4 * n,
         "sorted, any ties"),
        ("threshold selection", lambda: threshold_indices(x, delta, workspace=ws), 4 * n, f"{kt} selected"),
        ("block selection (256)", lambda: block_topk(x, K, 256), 4 * n, f"{K} of {nb} blocks"),
        ("count sketch encode, 1 row", lambda: sk1.encode(idx, vals), 12 * k, f"{sk1.columns} columns"),
        ("count sketch encode, 3 rows", lambda: sk3.encode(idx, vals), 12 * k, f"{sk3.columns} columns"),
    ]
    for label, f, nbytes, extra in kernels:
        ms = timed(f)
        bw = nbytes / (ms * 1e-3)
        rows.append(f"| {n:.0e} | {density:g} | {label} | {ms:.3f} | {bw / 1e9:.0f} | {bw / peak:.1%} "
                    f"| {bw / copy:.1%} | {extra} |")
        print(rows[-1], flush=True)
    return rows


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    sizes = [int(float(s)) for s in (sys.argv[2] if len(sys.argv) > 2 else "1e6,1e7,3e7,6e7,1e8,5e8").split(",")]
    name = torch.cuda.get_device_name()
    peak = next((v for key, v in PEAKS.items() if key in name), float("nan"))
    copy = copy_bandwidth()
    head = [f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; datasheet HBM peak "
            f"{peak / 1e12:.2f} TB/s, device-to-device copy measured here {copy / 1e12:.2f} TB/s (read + write); "
            f"exact top-k on the GPU takes torch.topk below {exact.DEVICE_TOPK_BELOW:.3g} elements", "",
            "| n | density | kernel | ms / call | GB/s | of peak | of copy | note |",
            "|---|---|---|---|---|---|---|---|"]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    ws, scratch = Workspace(), {}
    for n in sizes:
        x = torch.randn(n, device="cuda", generator=g)
        for density in DENSITIES:
            rows += case(x, density, ws, scratch, peak, copy)
        del x
        scratch.clear()
        torch.cuda.empty_cache()
    text = "\n".join(head + rows)
    print("\n" + text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
