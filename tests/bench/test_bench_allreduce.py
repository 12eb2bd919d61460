"""``sparsync bench allreduce|reducers`` end to end on real gloo processes (loopback), CSV output,
automatic pick-up of registered algorithms, errors recorded instead of crashing the run."""

import csv

import pytest

from sparsync.bench.allreduce import expand_algorithms, run_allreduce_bench
from sparsync.cli import main
from sparsync.collectives import load_all
from sparsync.collectives.registry import ALGORITHMS

pytestmark = pytest.mark.gloo


def _refuses(sv, comm, **_):  # raises on every rank before any communication
    raise RuntimeError("test algorithm refuses")


def test_run_allreduce_bench_exact_and_errors_recorded(monkeypatch):
    load_all()
    monkeypatch.setitem(ALGORITHMS, "zz_refuses", _refuses)
    everything = expand_algorithms("all")  # picks up whatever is registered right now
    assert everything[0] == "dense" and set(load_all()) <= set(everything) and "zz_refuses" in everything
    # run only the baselines (+ the refusing one): other people's algorithms are tested in their areas
    algos = expand_algorithms("dense,allgather,torch_sparse,zz_refuses")
    rows = run_allreduce_bench([3], [20_000], [0.01, 0.2], ["random", "disjoint"], algos,
                               repeats=2, warmup=1, progress=False, timeout=120)
    assert len(rows) == 2 * 2 * len(algos)
    for r in rows:
        if r["algorithm"] == "zz_refuses":
            assert "refuses" in r["error"] and "time_s" not in r
            continue
        assert r["correct"] is True, r  # equal to the exact sum and bitwise identical across ranks
        assert r["time_s"] > 0 and len(r["times_s"]) == 2
    dense = [r for r in rows if r["algorithm"] == "dense"]
    assert all(r["speedup"] == 1.0 and r["bytes_sent"] == 2 * 2 * 20_000 * 4 // 3 for r in dense)


def test_cli_allreduce_table_and_csv(tmp_path, capsys):
    path = tmp_path / "out.csv"
    rc = main(["bench", "allreduce", "--workers", "2,3", "--numel", "1e4", "--densities", "0.01,0.6",
               "--patterns", "random,disjoint", "--algorithms", "allgather", "--repeats", "2", "--quiet",
               "--csv", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "vs dense" in out and "allgather" in out and "needs world_size * k <= numel" in out
    rows = list(csv.DictReader(path.open()))
    # 2 world sizes x 2 densities x 2 patterns x (dense + allgather)
    assert len(rows) == 16
    ok = [r for r in rows if r["time_s"]]
    assert len(ok) == 12 and all(r["correct"] == "True" for r in ok)
    assert {r["algorithm"] for r in rows} == {"dense", "allgather"}


def test_cli_reducers(tmp_path, capsys):
    path = tmp_path / "red.csv"
    rc = main(["bench", "reducers", "--reducers", "topka", "--numel", "2e4", "--density", "0.01",
               "--workers", "2", "--steps", "2", "--warmup", "1", "--quiet", "--csv", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "topka" in out and "dense" in out
    rows = {r["reducer"]: r for r in csv.DictReader(path.open())}
    assert float(rows["topka"]["density"]) == pytest.approx(0.01)
    assert int(float(rows["topka"]["bytes_sent"])) == 8 + 200 * 8  # one stream of k=200 pairs
    assert float(rows["dense"]["speedup"]) == 1.0


def test_cli_bad_input(capsys):
    for argv, match in ((["allreduce", "--algorithms", "nope"], "unknown algorithm 'nope'"),
                        (["allreduce", "--patterns", "zipf"], "unknown pattern"),
                        (["allreduce", "--bandwidth", "fast"], "rate"),
                        (["allreduce", "--bandwidth", "1gbps"], "ambiguous"),
                        (["reducers", "--reducers", "nope"], "unknown reducer")):
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err


def test_cli_emulated_network(needs_netns, capsys):
    rc = main(["bench", "allreduce", "--workers", "2", "--numel", "1e5", "--densities", "0.01",
               "--algorithms", "allgather", "--bandwidth", "100mbit", "--repeats", "2", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0
    dense = next(ln for ln in out.splitlines() if "dense" in ln and "100mbit" in ln)
    ms = float(dense.split()[6])
    assert ms >= 0.7 * (1e5 * 4 * 8 / 100e6) * 1e3  # 2 ranks: 400 kB over a 100 Mbit/s link >= 32 ms
