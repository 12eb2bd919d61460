"""Smoke tests of the MiCRO benchmark helpers and the ``sparsync bench-select`` command (tiny sizes)."""

import pytest

from sparsync.bench.selection import SELECTORS, comm_benchmark, time_selection
from sparsync.cli import main


def test_time_selection_rows():
    rows = time_selection(10_000, 0.01, repeat=1)
    assert [r["selector"] for r in rows] == list(SELECTORS)
    assert all(r["time_s"] > 0 for r in rows)
    with pytest.raises(ValueError):
        time_selection(100, 0.01, selectors=("nope",))


def test_cli_selection_and_trace(capsys, tmp_path):
    png = tmp_path / "d.png"
    assert main(["bench-select", "--parts", "selection,trace", "--sizes", "1e4", "--densities", "0.01",
                 "--repeat", "1", "--trace-steps", "6", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "exact top-k" in out and "micro (histogram, default)" in out
    assert png.stat().st_size > 1000
    assert main(["bench-select", "--parts", "bogus"]) == 2


@pytest.mark.gloo
def test_comm_benchmark_loopback():
    rows = comm_benchmark(2, 20_000, 0.01, reducers=("dense", "micro", "cltk"), steps=1, warmup=1,
                          bandwidth=None)
    assert [r["reducer"] for r in rows] == ["dense", "micro", "cltk"]
    assert rows[2]["density"] == pytest.approx(0.01)
    assert rows[1]["bytes_received"] < rows[0]["bytes_received"]


def test_parse_spec():
    from sparsync.bench.selection import parse_spec

    assert parse_spec("dense") == ("dense", {})
    assert parse_spec("micro:rule=adaptive;cap_factor=2;reuse_buffers=False;threshold=None") == (
        "micro", {"rule": "adaptive", "cap_factor": 2.0, "reuse_buffers": False, "threshold": None})
    with pytest.raises(ValueError):
        parse_spec("micro:rule")
