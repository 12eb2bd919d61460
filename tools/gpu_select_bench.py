"""Selection kernels on one GPU (run by hand on a CUDA machine): sparsync's exact top-k
(:func:`sparsync.select.exact.topk_indices`), ``torch.topk`` of ``|x|``, and the threshold selection
(:func:`sparsync.select.threshold.threshold_indices`, threshold = the k-th magnitude, so the same
count). Milliseconds per call from CUDA events (median of ``REPS`` after ``WARMUP`` calls) and the
read bandwidth ``4 n bytes / time`` as a fraction of the H100 SXM's HBM3 peak (3.35 TB/s).
Writes a markdown table to stdout (and to the path given as the first argument)."""

import statistics
import sys

import torch

from sparsync.select.exact import topk_indices
from sparsync.select.threshold import threshold_indices

PEAK = 3.35e12
WARMUP, REPS = 3, 15


def timed(f):
    for _ in range(WARMUP):
        f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def main():
    rows = ["| n | density | k | kernel | ms / call | GB/s read | of HBM3 peak |",
            "|---|---|---|---|---|---|---|"]
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (10**7, 10**8):
        x = torch.randn(n, device="cuda", generator=g)
        for density in (0.01, 0.001):
            k = int(density * n)
            delta = float(torch.topk(x.abs(), k, sorted=False).values.min())
            kt = threshold_indices(x, delta).numel()  # k, or a few more: equal magnitudes at the k-th
            assert torch.equal(topk_indices(x, k), torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values)
            kernels = (("sparsync exact top-k", lambda x=x, k=k: topk_indices(x, k)),
                       ("torch.topk(|x|)", lambda x=x, k=k: torch.topk(x.abs(), k, sorted=False)),
                       ("sparsync threshold", lambda x=x, d=delta: threshold_indices(x, d)))
            for name, f in kernels:
                ms = timed(f)
                bw = 4 * n / (ms * 1e-3)
                count = kt if "threshold" in name else k
                rows.append(f"| {n:.0e} | {density:g} | {count} | {name} | {ms:.3f} | {bw / 1e9:.0f} "
                            f"| {bw / PEAK:.1%} |")
        del x
    text = "\n".join([f"{torch.cuda.get_device_name()}, torch {torch.__version__}", ""] + rows)
    print(text)
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text + "\n")


if __name__ == "__main__":
    main()
