"""Per-step time of torch DDP with a dense comm hook, three ways, alternated step by step in one world:
``ss.ddp_hook("dense")`` on torch futures (the staged path: one ``async_op`` all-reduce chained with
``then``), the same hook on its FIFO communication thread (the path of multi-collective reducers), and
torch's own ``allreduce_hook``. Loopback gloo; per step the max over ranks, then the median over steps.

    flock /tmp/sparsync-bench.lock python tools/hook_paths.py --workers 4 --steps 40 --bucket-mb 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

#: futures-inplace: the staged path with ``inplace=True, nonfinite="ignore"`` (no copy, no check: what
#: torch's hook does, bar its division before the all-reduce)
CONFIGS = ("futures", "thread", "futures-inplace", "torch-allreduce")


def _setup(cfg, bucket_mb, width):
    import sparsync as ss
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_mb)
    if cfg == "torch-allreduce":
        model.register_comm_hook(None, allreduce_hook)
    else:
        opts = {"inplace": True, "nonfinite": "ignore"} if cfg == "futures-inplace" else {}
        hook = ss.ddp_hook("dense", module=model, **opts)
        hook._staged = cfg != "thread"  # False: the FIFO-thread path
        model.register_comm_hook(None, hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _worker(comm, steps, warmup, bucket_mb, width, batch):
    import torch.distributed as dist

    torch.set_num_threads(1)
    setups = {cfg: _setup(cfg, bucket_mb, width) for cfg in CONFIGS}
    times = {cfg: [] for cfg in CONFIGS}
    for step in range(warmup + steps):
        g = torch.Generator().manual_seed(1000 * comm.rank + step)
        x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
        order = CONFIGS if step % 2 == 0 else CONFIGS[::-1]
        for cfg in order:
            model, opt = setups[cfg]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step >= warmup:
                times[cfg].append(time.perf_counter() - t0)
    t = torch.tensor([times[c] for c in CONFIGS], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {c: float(t[i].median()) for i, c in enumerate(CONFIGS)}


def main(argv=None):
    from sparsync.launch import run_local

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    res = run_local(_worker, a.workers, a.steps, a.warmup, a.bucket_mb, a.width, a.batch, backend="gloo",
                    timeout=600)[0]
    base = res["torch-allreduce"]
    print(json.dumps({c: {"step_ms": round(1e3 * v, 2), "vs_torch_allreduce_hook": round(v / base, 3)}
                      for c, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
