"""The DDP-user paths side by side: torch DDP, torch DDP + ``ss.ddp_hook`` (asynchronous and
synchronous), SparseDDP - same reducer, density and bucket plan - plus dense SparseDDP against torch DDP
on the same plan and the no-communication floor, all in one world.

Every configuration trains its own copy of the same model from the same initial weights; they take
their ``warmup + steps`` steps in turn (round robin, so changes of machine load hit all alike; a
barrier before each step; per step the max over ranks; the median over steps). For the
SparseDDP rows the step is broken down from ``last_stats``::

    step = forward + backward compute + wait (copy, check, policy, select, comm, reducer other,
           idle) + write-back + optimizer + unexplained

Every column is a per-step maximum over ranks, then the median over steps (so the parts need not add
up to the step exactly); ``unexplained`` is computed per rank and step before that. It is what the
trainer-side clock sees that none of the parts covers (hook calls,
``loss.backward`` entry/exit, Python between the parts). ``cpu_wait`` is the part of the
communication thread's non-communication work that ran off-CPU (``time.thread_time`` vs wall
time), i.e. waiting for a core shared by the ranks or for the GIL.

``python -m sparsync.bench.ddp_paths --workers 4 --bandwidth 1gbit --reducer micro --density 0.01``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

__all__ = ["CONFIGS", "main", "run"]

CONFIGS = ("floor", "ddp", "sparseddp-dense", "hook-async", "hook-sync", "sparseddp")
#: also on request: torch DDP with its ``fp16_compress_hook`` against SparseDDP dense with fp16 values
EXTRA_CONFIGS = ("ddp-fp16", "sparseddp-dense-fp16")
_PARTS = ("copy", "check", "policy", "select", "comm", "reducer_other", "idle")


def _setup(comm, cfg, model_name, reducer, density, bucket_mb, merge, batch_size):
    import sparsync as ss

    from .engine import build

    model, batch, loss_fn = build(model_name, batch_size, seed=0)
    ddp = None
    if cfg == "floor":
        fwd = model
    elif cfg in ("ddp", "ddp-fp16", "hook-async", "hook-sync"):
        fwd = nn.parallel.DistributedDataParallel(model, process_group=comm.group, bucket_cap_mb=bucket_mb)
        if cfg == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            fwd.register_comm_hook(comm.group, default_hooks.fp16_compress_hook)
        elif cfg != "ddp":
            fwd.register_comm_hook(fwd, ss.ddp_hook(reducer, density, asynchronous=cfg == "hook-async"))
    else:
        red = "dense" if cfg.startswith("sparseddp-dense") else reducer
        opts = {"value_dtype": "fp16"} if cfg.endswith("-fp16") else {}
        fwd = ddp = ss.SparseDDP(model, comm, reducer=red, density=density, merge=merge, nonfinite="ignore",
                                 reducer_options=opts)
    return model, batch, loss_fn, fwd, ddp, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _worker(comm, model_name, reducer, density, bucket_mb, merge, warmup, steps, batch_size, configs):
    """All configurations live side by side and take their steps in turn (round robin), so a change
    of machine load hits every configuration alike."""
    torch.set_num_threads(1)
    setups = {cfg: _setup(comm, cfg, model_name, reducer, density, bucket_mb, merge, batch_size) for cfg in configs}
    rows = {cfg: [] for cfg in configs}
    for step in range(warmup + steps):
        for cfg, (_model, batch, loss_fn, fwd, ddp, opt) in setups.items():
            x, y = batch(step, comm.rank, comm.world_size)
            comm.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(fwd(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if step < warmup:
                continue
            row = [t3 - t0, t1 - t0, t2 - t1, t3 - t2]
            if ddp is not None:
                st = ddp.last_stats
                parts = (t1 - t0) + st["backward_s"] + st["wait_s"] + st["writeback_s"] + (t3 - t2)
                row += [st["backward_s"], st["wait_s"], st["writeback_s"], st["cpu_wait_s"], st["copy_s"],
                        st["select_s"], st["comm_s"]] + [st[f"wait_{k}_s"] for k in _PARTS] + [row[0] - parts]
            rows[cfg].append(row)
    out = {}
    for cfg in configs:
        t = torch.tensor(rows[cfg], dtype=torch.float64)
        with comm.unrecorded():
            t = comm.allreduce(t.reshape(-1), "max").reshape(t.shape)
        med = t.median(dim=0).values.tolist()
        res = {"step_s": med[0], "forward_s": med[1], "backward_call_s": med[2], "optimizer_s": med[3]}
        ddp = setups[cfg][4]
        if ddp is not None:
            names = ["backward_s", "wait_s", "writeback_s", "cpu_wait_s", "copy_s", "select_s", "comm_s"]
            # unexplained is computed per rank and step (this rank's step minus this rank's parts)
            res.update(zip(names + [f"wait_{k}_s" for k in _PARTS] + ["unexplained_s"], med[4:]))
            res["groups"] = [len(g) for g in ddp.engine.groups]
            ddp.close()
        out[cfg] = res
    return out


def run(model="digits-mlp", reducer="micro", density=0.01, bucket_mb=None, merge="buckets:1", workers=4,
        bandwidth="1gbit", warmup=3, steps=12, batch_size=32, configs=CONFIGS, loopback=False) -> dict:
    """``bucket_mb``: torch DDP's ``bucket_cap_mb`` (None: its default, 25 MB with a 1 MB first
    bucket); ``merge``: SparseDDP's plan (``buckets:1`` groups digits-mlp exactly as DDP's default:
    [fc3, fc2] then [fc1])."""
    unknown = [c for c in configs if c not in CONFIGS + EXTRA_CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration {unknown[0]!r}; valid: {', '.join(CONFIGS + EXTRA_CONFIGS)}")
    args = (model, reducer, density, bucket_mb, merge, warmup, steps, batch_size, list(configs))
    if loopback:
        from ..launch import run_local

        return run_local(_worker, workers, *args, backend="gloo", timeout=900)[0]
    from ..cluster import run_emulated

    return run_emulated(_worker, workers, *args, bandwidth=bandwidth, timeout=900)[0]


def format_markdown(res: dict, reducer: str, density: float, merge: str = "buckets:1") -> str:
    floor = res.get("floor", {}).get("step_s")
    lines = ["| configuration | step (ms) | vs torch DDP | vs floor |", "|---|---|---|---|"]
    label = {"floor": "no communication (floor)", "ddp": "torch DDP (dense, default buckets: 25 MB, first 1 MB)",
             "sparseddp-dense": f"SparseDDP dense, {merge}", "ddp-fp16": "torch DDP + fp16_compress_hook",
             "sparseddp-dense-fp16": f"SparseDDP dense, fp16 values, {merge}",
             "hook-async": f"torch DDP + ss.ddp_hook({reducer}, {density:g}), async",
             "hook-sync": f"torch DDP + ss.ddp_hook({reducer}, {density:g}), synchronous",
             "sparseddp": f"SparseDDP {reducer} {density:g}, {merge}"}
    ddp = res.get("ddp", {}).get("step_s")
    for cfg, v in res.items():
        s = v["step_s"]
        lines.append(f"| {label.get(cfg, cfg)} | {1e3 * s:.1f} | {s / ddp:.2f}x | "
                     f"{(s / floor if floor else float('nan')):.2f}x |" if ddp else f"| {cfg} | {1e3 * s:.1f} | | |")
    lines += ["", "| SparseDDP step breakdown (ms) | " + " | ".join(c for c in res if "wait_s" in res[c]) + " |",
              "|---|" + "---|" * sum("wait_s" in v for v in res.values())]
    keys = [("step_s", "step"), ("forward_s", "forward"), ("backward_s", "backward compute"),
            *[(f"wait_{k}_s", f"wait: {k.replace('_', ' ')}") for k in _PARTS],
            ("writeback_s", "write-back (÷P, into .grad)"), ("optimizer_s", "optimizer"),
            ("unexplained_s", "unexplained"), ("cpu_wait_s", "(comm thread off-CPU, any time)"),
            ("select_s", "(select, total)"), ("comm_s", "(comm, total)")]
    for k, name in keys:
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * v[k]:.1f}" for v in res.values() if "wait_s" in v) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync.bench.ddp_paths", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="digits-mlp")
    ap.add_argument("--reducer", default="micro")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--bucket-mb", type=float, default=None, help="torch DDP bucket_cap_mb (default: DDP's)")
    ap.add_argument("--merge", default="buckets:1", help="SparseDDP merge plan")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--loopback", action="store_true", help="no emulated network (plain loopback)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.model, a.reducer, a.density, a.bucket_mb, a.merge, a.workers, a.bandwidth, a.warmup, a.steps,
              a.batch_size, a.configs.split(","), a.loopback)
    print(json.dumps(res, indent=1) if a.json else format_markdown(res, a.reducer, a.density, a.merge))
    return 0


if __name__ == "__main__":
    sys.exit(main())
