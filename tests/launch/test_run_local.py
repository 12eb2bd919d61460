"""run_local: results in rank order, failures re-raised fast with the rank named, never a hang."""

import os
import time

import pytest
import torch

import sparsync as ss
from sparsync.launch import RankFailed
from sparsync.threadcomm import MAX_THREAD_RANKS, ThreadWorld


def _rank_and_size(comm, offset, scale=1):
    return (comm.rank + offset) * scale, comm.world_size


@pytest.mark.parametrize("backend", ["thread", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_results_in_rank_order_with_args(backend):
    res = ss.run_local(_rank_and_size, 3, 10, backend=backend, scale=2)
    assert res == [(20, 3), (22, 3), (24, 3)]


def _fail_on_rank_2(comm):
    if comm.rank == 2:
        raise ValueError("bad shard")
    comm.barrier()  # the others would wait forever without fail-fast
    return comm.rank


@pytest.mark.parametrize("backend", ["thread", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_exception_on_one_rank_fails_fast_and_names_it(backend):
    t = time.monotonic()
    with pytest.raises(ValueError, match="rank 2: bad shard") as info:
        ss.run_local(_fail_on_rank_2, 4, backend=backend, timeout=60)
    assert info.value.rank == 2
    assert time.monotonic() - t < 20, "must not wait for the collective timeout"


class _Unpicklable(RuntimeError):
    def __reduce__(self):
        raise TypeError("holds a lock")


def _raise_unpicklable(comm):
    if comm.rank == 1:
        raise _Unpicklable("bad state")
    comm.barrier()


@pytest.mark.gloo
def test_unpicklable_exception_arrives_as_text_with_the_reason():
    with pytest.raises(RankFailed, match=r"rank 1.*_Unpicklable: bad state \(the exception itself could not be "
                                         r"pickled: TypeError: holds a lock\)"):
        ss.run_local(_raise_unpicklable, 2, backend="gloo", timeout=30)


def _die(comm):
    if comm.rank == 1:
        os._exit(3)
    comm.barrier()


@pytest.mark.gloo
def test_rank_that_dies_silently_is_reported():
    t = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 .*died"):
        ss.run_local(_die, 2, backend="gloo", timeout=30)
    assert time.monotonic() - t < 40


def _hang(comm):
    if comm.rank == 0:
        time.sleep(60)
    return comm.rank


@pytest.mark.gloo
def test_overall_timeout_kills_stragglers():
    t = time.monotonic()
    # either gloo's own timeout fires on the waiting rank or our deadline does: both name a rank
    with pytest.raises(RuntimeError, match=r"rank \d|ranks \["):
        ss.run_local(_hang, 2, backend="gloo", timeout=1)
    assert time.monotonic() - t < 45


def _torch_tensor_result(comm):
    return torch.full((3,), float(comm.rank))


@pytest.mark.gloo
def test_tensors_come_back_from_processes():
    res = ss.run_local(_torch_tensor_result, 2, backend="gloo")
    assert [r.tolist() for r in res] == [[0.0] * 3, [1.0] * 3]


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        ss.run_local(_rank_and_size, 2, 0, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        ss.run_local(_rank_and_size, 0, 0)
    with pytest.raises(ValueError, match="world_size"):
        ss.run_local(_rank_and_size, True, 0)


@pytest.mark.parametrize("make", [lambda P: ss.run_local(_rank_and_size, P, 0),
                                  lambda P: ThreadWorld(P)], ids=["run_local", "ThreadWorld"])
def test_thread_rank_limit_is_one_named_limit(make):
    """run_local's thread backend and ThreadWorld share MAX_THREAD_RANKS; the error names it."""
    assert MAX_THREAD_RANKS == 256
    assert make(MAX_THREAD_RANKS) is not None  # the limit itself is allowed
    for bad in (MAX_THREAD_RANKS + 1, 4096):
        with pytest.raises(ValueError, match=rf"1\.\.{MAX_THREAD_RANKS} .*MAX_THREAD_RANKS.*got {bad}"):
            make(bad)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="world_size"):
            make(bad)
    with pytest.raises(ValueError, match="positive integer, got 2.5"):
        make(2.5)


def test_comm_from_env_without_torchrun(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(RuntimeError, match="not started by torchrun"):
        ss.comm_from_env()


def _backward_on_rank(comm):
    """A backward pass in the rank, then the gradients' sum over the ranks."""
    w = torch.full((3,), float(comm.rank + 1), requires_grad=True)
    (w * w).sum().backward()
    return float(comm.allreduce(w.grad.clone()).sum())


@pytest.mark.gloo
def test_ranks_spawn_once_autograd_device_threads_run():
    """After a backward pass on a machine with an accelerator, torch's autograd device threads
    (``pt_autograd_<d>``) run in the parent and a forked rank could not run backward: the ranks are
    spawned then, where the function pickles. A CPU-only machine never starts them, so a thread
    given that name stands in."""
    import ctypes
    import threading

    from sparsync import launch

    stop, named = threading.Event(), threading.Event()

    def autograd_like():
        ctypes.CDLL(None).prctl(15, b"pt_autograd_7", 0, 0, 0)  # PR_SET_NAME
        named.set()
        stop.wait(60)

    assert launch._pick_start_method(None) == ("spawn" if torch.cuda.is_initialized() or
                                               launch.autograd_threads_started() else "fork")
    t = threading.Thread(target=autograd_like, daemon=True)
    t.start()
    try:
        assert named.wait(10)
        assert launch.autograd_threads_started()
        assert launch._pick_start_method(None) == "spawn"
        assert launch._pick_start_method("fork") == "fork"  # an explicit choice is kept
        # a local function cannot be sent to a spawned rank: forked (collectives need no backward)
        with pytest.warns(UserWarning, match="module-level function"):
            assert launch._pick_start_method(None, (lambda comm: comm.rank, (), {}, None)) == "fork"
        assert launch._pick_start_method(None, (_backward_on_rank, (), {}, None)) == "spawn"
        with pytest.warns(UserWarning, match="module-level function"):
            assert ss.run_local(lambda comm: comm.allreduce(torch.ones(2)).tolist(), 2, backend="gloo",
                                timeout=60) == [[2.0, 2.0]] * 2
        assert ss.run_local(_backward_on_rank, 2, backend="gloo", timeout=60) == [18.0, 18.0]  # 3 * 2 * (1 + 2)
    finally:
        stop.set()
        t.join(10)


def _env_of_rank(comm):
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("SPARSYNC_TEST_ENV")


def test_env_is_set_in_every_rank_before_it_runs():
    """``run_local(..., env=)`` sets the variables in every rank process (how CPU ranks of a baseline
    that torch breaks on GPU machines - PowerSGD's hook synchronises CUDA for CPU gradients - are
    run with the GPUs hidden); thread ranks share this process and refuse it in one line."""
    got = ss.run_local(_env_of_rank, 2, backend="gloo", timeout=60,
                       env={"CUDA_VISIBLE_DEVICES": "", "SPARSYNC_TEST_ENV": "x"})
    assert got == [("", "x")] * 2
    with pytest.raises(ValueError, match="backend='gloo'"):
        ss.run_local(_env_of_rank, 2, backend="thread", env={"A": "1"})

