"""Timing helpers (``sparsync.bench.reducers``, ``.report``): summaries, ledger bytes, digests."""

import pytest
import torch

import sparsync as ss
from sparsync.bench.patterns import make_sparse
from sparsync.bench.reducers import digest, summarize, time_collective, time_reducer
from sparsync.bench.report import fmt_num, format_table, write_csv


def test_summarize_is_median_of_max_over_ranks():
    r0 = [{"total_s": 1.0, "comm_s": 0.5, "bytes_sent": 10, "density": 0.1},
          {"total_s": 5.0, "comm_s": 0.1, "bytes_sent": 10, "density": 0.1},
          {"total_s": 2.0, "comm_s": 0.2, "bytes_sent": 30, "density": 0.3}]
    r1 = [{"total_s": 3.0, "comm_s": 0.1, "bytes_sent": 20, "density": 0.3},
          {"total_s": 1.0, "comm_s": 0.7, "bytes_sent": 20, "density": 0.3},
          {"total_s": 4.0, "comm_s": 0.3, "bytes_sent": 10, "density": 0.1}]
    s = summarize([r0, r1])
    assert s["total_s_all"] == [3.0, 5.0, 4.0] and s["total_s"] == 4.0
    assert s["comm_s"] == 0.5  # max per step: 0.5, 0.7, 0.3
    assert s["bytes_sent"] == 20
    assert s["density"] == pytest.approx(0.2)
    assert s["steps"] == 3 and s["world_size"] == 2
    with pytest.raises(ValueError):
        summarize([r0, []])


def _collective_worker(comm):
    sv = make_sparse("random", comm.rank, comm.world_size, 10_000, 0.01)
    ag = time_collective(comm, "allgather", sv, steps=3, warmup=1, check=True)
    de = time_collective(comm, "dense", sv, steps=2, warmup=0, check=True)
    red = time_reducer(comm, "topka", 10_000, density=0.01, steps=2, warmup=1)
    return ag, de, red


def test_time_collective_and_reducer_thread_backend():
    P, n, k = 4, 10_000, 100
    res = ss.run_local(_collective_worker, P, backend="thread")
    for ag, de, red in res:
        assert [r["step"] for r in ag] == [0, 1, 2] and len(de) == 2 and len(red) == 2
        # ledger: ring all-gather of 8 + k*(4+4) bytes per rank (int32 indices, float32 values)
        assert all(r["bytes_received"] == (P - 1) * (8 + k * 8) and r["rounds"] == P - 1 for r in ag)
        assert all(r["bytes_sent"] == 2 * (P - 1) * n * 4 // P for r in de)
        assert all({"select_s", "comm_s", "total_s", "wall_s", "selected"} <= set(r) for r in red)
        assert all(r["selected"] == k for r in red)
    # the sum is bitwise the same on every rank, and equals the dense all-reduce of the same inputs
    assert len({ag[-1]["digest"] for ag, _, _ in res}) == 1
    ref = sum(make_sparse("random", r, P, n, 0.01).to_dense() for r in range(P))
    assert res[0][0][-1]["out_nnz"] == int(torch.count_nonzero(ref))
    with pytest.raises(ValueError, match="unknown algorithm"):
        ss.run_local(lambda c: time_collective(c, "nope", make_sparse("random", c.rank, 2, 10, 0.5)), 2)


def test_digest_distinguishes_values_and_layout():
    a = torch.arange(5.0)
    assert digest(a) == digest(a.clone()) != digest(a + 1)
    sv = ss.SparseVec(torch.tensor([1, 3]), torch.tensor([1.0, 2.0]), 5)
    sv2 = ss.SparseVec(torch.tensor([1, 4]), torch.tensor([1.0, 2.0]), 5)
    assert digest(sv) != digest(sv2)


def test_report_table_and_csv(tmp_path):
    rows = [{"a": "x", "b": 1.5, "t": [0.1, 0.2]}, {"a": "longer", "b": None}]
    txt = format_table(rows, [("a", "A"), ("b", "B")])
    lines = txt.splitlines()
    assert len(lines) == 4 and len({len(x) for x in lines}) == 1 and "-" in lines[-1]
    md = format_table(rows, [("a", "A"), ("b", "B")], markdown=True)
    assert md.splitlines()[0] == "| A | B |" and md.splitlines()[2] == "| x | 1.5 |"
    path = tmp_path / "sub" / "r.csv"
    write_csv(str(path), rows)
    assert path.read_text().splitlines() == ["a,b,t", "x,1.5,0.1;0.2", "longer,,"]
    assert fmt_num(10_000_000) == "1e7" and fmt_num(2_500_000.0) == "2.5e6" and fmt_num(0.001) == "0.001"


def _heavy_worker(comm):
    from sparsync.bench.reducers import bench_grads, collective_fn

    grads = bench_grads("heavy_tail", comm.rank, 5_000, 0, 4)
    keep = time_reducer(comm, "topka", 5_000, 0.01, steps=2, warmup=1, grads=grads)
    reset = time_reducer(comm, "topka", 5_000, 0.01, steps=2, warmup=1, grads=grads, reset_residual=True)
    sv = make_sparse("heavy_tail", comm.rank, comm.world_size, 5_000, 0.02)
    plain = collective_fn(comm, "plain_allgather", sv)()
    return keep, reset, plain, digest(plain)


def test_heavy_tail_grads_residual_modes_and_plain_allgather():
    P, n = 3, 5_000
    res = ss.run_local(_heavy_worker, P, backend="thread")
    ref = sum(make_sparse("heavy_tail", r, P, n, 0.02).to_dense() for r in range(P))
    assert len({d for *_, d in res}) == 1 and torch.allclose(res[0][2], ref, atol=1e-9)
    for keep, reset, *_ in res:
        assert all(r["selected"] == 50 for r in keep + reset)
    with pytest.raises(ValueError, match="unknown gradient pattern"):
        from sparsync.bench.reducers import bench_grads
        bench_grads("zipf", 0, 10, 0, 1)


def _baseline_worker(comm):
    from sparsync.bench.reducers import _reducers_worker

    return _reducers_worker(comm, ["topka"], 4_000, 0.01, 3, 1, 0, {}, "t", False, "heavy_tail", ("reset",),
                            ("allreduce", "plain_allgather"))


def test_reducer_bench_baseline_rows_alternate_inputs():
    """``--baselines``: the bare all-reduce and the plain all-gather of the same gradients' exact top-k
    are timed in the same process group; the plain reference alternates the two heavy-tailed inputs."""
    P, n, k = 2, 4_000, 40
    res = ss.run_local(_baseline_worker, P, backend="thread")
    for out in res:
        ar, pa, red = out["allreduce", "reset"], out["plain_allgather", "reset"], out["topka", "reset"]
        assert len(ar) == len(pa) == len(red) == 3
        assert all(r["bytes_sent"] == 2 * (P - 1) * n * 4 // P and r["density"] == 1 for r in ar)
        # the user's plain all-gather: one int64 count, then k int32 indices and k fp32 values in one buffer
        assert all(r["bytes_sent"] == (P - 1) * (8 + k * 8) and r["selected"] == k for r in pa)
        assert all(r["comm_s"] == r["total_s"] and r["select_s"] == 0 for r in ar + pa)
    # time_collective with a list of inputs runs them in turn (digest of the last step = input 1)
    def alt(comm):
        svs = [make_sparse("heavy_tail", comm.rank, P, n, 0.01, variant=j) for j in range(2)]
        last = time_collective(comm, "allgather", svs, steps=2, warmup=0, check=True)[-1]["digest"]
        return last, digest(ss.sparse_allreduce(svs[1], comm, algorithm="allgather"))
    assert all(a == b for a, b in ss.run_local(alt, P, backend="thread"))
    with pytest.raises(ValueError, match="unknown baselines"):
        from sparsync.bench.reducers import run_reducer_bench
        run_reducer_bench(["topka"], [2], 100, 0.1, baselines=("nope",))


def _threshold_worker(comm):
    from sparsync.bench.reducers import _reducers_worker

    tuned = _reducers_worker(comm, ["hard_threshold"], 200_000, 0.01, 2, 0, 0, {}, "t", False, "heavy_tail",
                             ("reset",))
    own = _reducers_worker(comm, ["hard_threshold"], 200_000, 0.01, 1, 0, 0,
                           {"hard_threshold": {"threshold": "default"}}, "t", False, "heavy_tail", ("reset",))
    return tuned["hard_threshold", "reset"], own["hard_threshold", "reset"]


def test_reducer_bench_tunes_the_fixed_threshold_to_the_workload():
    """``hard_threshold`` is a FIXED-threshold method the user tunes per setting: the bench sets it to
    the k-th largest |g| of the first gradient, averaged over ranks (the same value on every rank), so
    each rank selects ~k of the heavy-tailed workload. Its own default ``1/(2 sqrt k)`` ignores the gradients'
    scale: its density depends on n (0.7 % at n = 2e4, 4.2 % at 2e5, 28 % at 1e7)."""
    from sparsync.select.threshold import initial_threshold

    P, k = 3, 2_000
    res = ss.run_local(_threshold_worker, P, backend="thread")
    assert len({r["threshold"] for tuned, _ in res for r in tuned}) == 1  # one fixed value, every rank
    for tuned, own in res:
        assert all(0.8 * k <= r["selected"] <= 1.2 * k for r in tuned)
        assert own[0]["threshold"] == initial_threshold(k) and own[0]["selected"] > 3 * k
