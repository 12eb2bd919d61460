"""Training steps of the digits MLP on one GPU, and the same rows on the CPU cores, step by step.

Run by hand on a CUDA machine: ``python3 tools/gpu_train_steps.py [out.md] [--steps N] [--cpu-cores C]``.
Each row of ``CONFIGS`` (``sparsync compare --configs`` syntax, ``make run``'s options) runs ``WORKERS``
gloo ranks (``sparsync.run_local``) for ``--steps`` steps of ``make run``'s job (digits MLP, 4.35M
parameters, batch 32 per rank, SGD with Nesterov momentum):

* **cuda**: every rank's model, data and reducer on the one GPU; its collectives go through gloo with
  CUDA tensors (``TorchComm(device="cuda")``; NCCL refuses two ranks on one GPU), so every exchange
  crosses host memory and loopback TCP;
* **cpu**: the same rows on the CPU, each rank pinned to ``--cpu-cores`` cores of its own
  (``os.sched_setaffinity``, as many torch threads; 0: unpinned), over loopback.

The clock is the trainer's (``sparsync.train.loop``): forward, backward (for SparseDDP its compute,
the rest is waiting for the exchange) and optimizer step, with ``torch.cuda.synchronize()`` at every
boundary on the GPU; SparseDDP's own breakdown (``last_stats``: select, comm, wait). Medians over the
steps after ``WARMUP``, rank 0. Prints a markdown table (and writes it to ``out.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import sparsync as ss

WORKERS, WARMUP = 4, 5
CONFIGS = ("dense;ddp;ddp-fp16;"
           "micro:0.02,momentum=0.9,masking=false,warmup_steps=20,warmup_start=0.05,value_dtype=fp16;"
           "topka:0.01")
KEYS = ("step_s", "forward_s", "backward_s", "optimizer_s", "compute_s", "select_s", "comm_s", "wait_s")


def _rank(comm, c: dict, steps: int, device: str, cores: int):
    from sparsync.torchcomm import TorchComm
    from sparsync.train.loop import _close, _step_record, _wrap
    from sparsync.train.optim import make_optimizer, set_lr
    from sparsync.train.runs import TrainConfig
    from sparsync.train.workloads import make_workload

    if device == "cuda":
        torch.cuda.set_device(0)
        comm = TorchComm(device=torch.device("cuda", 0))
        sync = torch.cuda.synchronize
    else:
        if cores:  # 0: no pinning, torch's threads as they are
            first = comm.rank * cores
            os.sched_setaffinity(0, set(range(first, first + cores)))
            torch.set_num_threads(cores)

        def sync():
            pass
    cfg = TrainConfig(reducer=c["reducer"], density=c["density"], merge=c["merge"], reducer_options=c["options"],
                      convergence=c["convergence"] or {}, ddp_options=c["ddp"], workers=comm.world_size,
                      optimizer="nesterov", steps=steps, progress=False)
    wl = make_workload(cfg.workload)
    cfg.fill_defaults(wl)
    torch.manual_seed(cfg.seed)
    model = wl.build().to(device)
    numel = sum(p.numel() for p in model.parameters())
    fwd, ddp = _wrap(cfg, model, comm)
    opt = make_optimizer(cfg, model.parameters())
    recs = []
    for step in range(steps):
        x, y = (t.to(device) for t in wl.batch(step, comm.rank, comm.world_size, cfg.batch_size, cfg.seed))
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        set_lr(opt, cfg, step)
        loss = wl.loss_fn(fwd(x), y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        recs.append(_step_record(cfg, model, ddp, numel, step, float(loss.detach()), 0.0, (t0, t1, t2, t3)))
    _close(ddp)
    name = torch.cuda.get_device_name() if device == "cuda" else f"{cores} cores per rank"
    return {"label": cfg.label(), "recs": recs, "loss": recs[-1]["loss"], "where": name}


def _median(recs, key):
    vals = [r.get(key) for r in recs[WARMUP:]]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def main():
    from sparsync.commands.compare import parse_configs

    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cpu-cores", type=int, default=4)
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--configs", default=CONFIGS)
    a = ap.parse_args()
    if "cpu" in a.devices and a.cpu_cores * WORKERS > len(os.sched_getaffinity(0)):
        ap.error(f"--cpu-cores {a.cpu_cores} x {WORKERS} ranks is more than the {len(os.sched_getaffinity(0))} "
                 "cores here (0: unpinned)")
    lines = [f"digits MLP, {WORKERS} gloo ranks, {a.steps} steps, medians of steps {WARMUP}..{a.steps - 1} "
             f"(rank 0), torch {torch.__version__}", "",
             "| device | row | step ms | forward | backward | optimizer | compute | select | comm | wait "
             "| MB sent / step | loss at the end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for device in a.devices.split(","):
        for c in parse_configs(a.configs, 0.01, "single"):
            t = time.perf_counter()
            res = ss.run_local(_rank, WORKERS, c, a.steps, device, a.cpu_cores, backend="gloo", timeout=300)[0]
            med = {k: _median(res["recs"], k) for k in KEYS}
            sent = _median(res["recs"], "bytes_sent")
            cells = " | ".join("-" if med[k] is None else f"{1e3 * med[k]:.2f}" for k in KEYS)
            lines.append(f"| {device} ({res['where']}) | {res['label']} | {cells} "
                         f"| {'-' if sent is None else f'{sent / 1e6:.2f}'} | {res['loss']:.3f} |")
            print(lines[-1], f"({time.perf_counter() - t:.1f} s)", flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
