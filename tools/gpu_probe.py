"""Probe (run by hand on a CUDA machine): which torch.distributed operations gloo carries with CUDA
tensors (2 and 3 processes on one GPU, each operation in its own group), whether NCCL accepts two
ranks on one GPU, whether a fork after ``torch.cuda.is_available()`` can use CUDA. Prints one line
per fact; never used by the library. Usage: ``python3 tools/gpu_probe.py worlds`` and
``python3 tools/gpu_probe.py fork plain|nvml|driver``."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ops(rank, P, only):
    dev = torch.device("cuda", 0)
    x = torch.full((8,), float(rank + 1), device=dev)
    want = float(P * (P + 1) / 2)

    def allreduce():
        y = x.clone()
        dist.all_reduce(y)
        return bool((y == want).all()) or y.tolist()

    def allgather():
        out = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(out, x)
        return all(bool((o == i + 1).all()) for i, o in enumerate(out))

    def allgather_into():
        out = torch.empty(P * 8, device=dev)
        dist.all_gather_into_tensor(out, x)
        return bool((out.view(P, 8)[:, 0].cpu() == torch.arange(1, P + 1).float()).all())

    def broadcast():
        y = x.clone()
        dist.broadcast(y, 0)
        return bool((y == 1).all())

    def alltoall():
        inp = torch.arange(P, dtype=torch.float32, device=dev) + 10 * rank
        out = torch.empty(P, device=dev)
        dist.all_to_all_single(out, inp, [1] * P, [1] * P)
        return bool((out.cpu() == torch.arange(P).float() * 10 + rank).all()) or out.tolist()

    def sendrecv():
        nxt, prv = (rank + 1) % P, (rank - 1) % P
        out = torch.empty(8, device=dev)
        ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, out, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return bool((out == prv + 1).all())

    def sparse():
        s = torch.sparse_coo_tensor(torch.tensor([[rank, 5]], device=dev), torch.ones(2, device=dev), (8,))
        s = s.coalesce()
        dist.all_reduce(s)
        return bool(s.coalesce().to_dense()[5].item() == P)

    def barrier():
        dist.barrier()

    f = dict(all_reduce=allreduce, all_gather=allgather, all_gather_into_tensor=allgather_into, broadcast=broadcast,
             all_to_all_single=alltoall, isend_irecv=sendrecv, sparse_all_reduce=sparse, barrier=barrier)[only]
    try:
        ok = f()
        torch.cuda.synchronize()
        return "ok" if ok in (None, True) else f"WRONG {ok}"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"


OPS = ["all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single", "isend_irecv",
       "sparse_all_reduce", "barrier"]


def _worker(rank, P, backend, path, q, only):
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.FileStore(path, P), rank=rank, world_size=P,
                                timeout=__import__("datetime").timedelta(seconds=30))
        if backend == "nccl":
            y = torch.ones(4, device="cuda")
            dist.all_reduce(y)
            torch.cuda.synchronize()
            q.put((rank, f"ok {y.tolist()}"))
        else:
            q.put((rank, _ops(rank, P, only)))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        q.put((rank, f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}"))


def worlds(cases):
    """Every ``(P, backend, op)`` case in its own process group, all at once (an op that aborts
    its ranks - gloo's TCP send of a device pointer does - hides nothing else)."""
    ctx = mp.get_context("spawn")
    runs = []
    for P, backend, only in cases:
        q = ctx.Queue()
        path = tempfile.mktemp()
        ps = [ctx.Process(target=_worker, args=(r, P, backend, path, q, only)) for r in range(P)]
        for p in ps:
            p.start()
        runs.append((P, backend, only, q, ps))
    for P, backend, only, q, ps in runs:
        got = {}
        try:
            for _ in range(P):
                r, d = q.get(timeout=120)
                got[r] = d
        except Exception:  # noqa: BLE001
            pass
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in ps]
        vals = sorted(set(map(str, got.values()))) or ["no report"]
        print(f"{backend} P={P} {only}: {' | '.join(vals)}" + ("" if len(got) == P else f" (exit codes {codes})"))
    sys.stdout.flush()


def _fork_child(q):
    try:
        y = torch.ones(3, device="cuda") * 2
        q.put(f"ok {y.sum().item()}")
    except Exception as e:  # noqa: BLE001
        q.put(f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def fork_check(mode):
    """``plain``: fork with CUDA untouched; ``nvml``: after is_available() with
    PYTORCH_NVML_BASED_CUDA_CHECK=1; ``driver``: after a plain is_available(). Then CUDA in the child."""
    if mode == "nvml":
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    if mode != "plain":
        torch.cuda.is_available()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_fork_child, args=(q,))
    p.start()
    try:
        print(f"fork ({mode}) -> child CUDA: {q.get(timeout=60)}")
    except Exception as e:  # noqa: BLE001
        print(f"fork ({mode}) -> no answer {e!r}")
    p.join(5)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "fork":
        fork_check(sys.argv[2])
    else:
        cases = [(P, "gloo", op) for P in (2, 3) for op in OPS] + [(2, "nccl", "all_reduce")]
        worlds(cases)
