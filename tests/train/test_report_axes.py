"""Report plots: bytes / density per step use a log axis only when the values span more than a factor
LOG_SPAN (a 0.0099-0.0101 density on a log axis gets unreadable ticks)."""

from __future__ import annotations

import pytest

plt = pytest.importorskip("matplotlib.pyplot")


def _axes_scales(tmp_path, density, nbytes):
    from sparsync.train import report

    runs = [({"label": "micro 0.01", "reducer": "micro"},
             [{"step": i, "density": d, "bytes_sent": b} for i, (d, b) in enumerate(zip(density, nbytes))]),
            ({"label": "dense", "reducer": "dense"},
             [{"step": i, "density": 1.0, "bytes_sent": 4e6} for i in range(4)])]
    summaries = [s for s, _ in runs]
    scales = {}
    real = plt.subplots

    def recording(*a, **k):
        fig, ax = real(*a, **k)
        orig = fig.savefig

        def save(path, *sa, **sk):
            scales[str(path).rsplit("/", 1)[-1]] = ax.get_yscale()
            return orig(path, *sa, **sk)

        fig.savefig = save
        return fig, ax

    plt.subplots = recording
    try:
        report._plot_step_breakdown_and_per_step(plt, runs, summaries, tmp_path)
    finally:
        plt.subplots = real
    return scales


def test_density_axis_linear_for_a_narrow_range_log_for_a_wide_one(tmp_path):
    s = _axes_scales(tmp_path, [0.0099, 0.0101, 0.0100, 0.0100], [4e4, 4.1e4, 4e4, 4e4])
    assert s["density.png"] == "linear"  # dense (density 1) is not drawn: the range is 0.0099-0.0101
    assert s["bytes_per_step.png"] == "log"  # 4e4 (micro) next to 4e6 (dense)
    s = _axes_scales(tmp_path, [0.05, 0.02, 0.01, 0.001], [4e4, 4.1e4, 4e4, 4e4])
    assert s["density.png"] == "log"
    assert (tmp_path / "density.png").stat().st_size > 1000


def test_loopback_caveat_in_report(tmp_path):
    import json

    from sparsync.train.report import write_report

    run = tmp_path / "micro"
    run.mkdir()
    summary = {"label": "micro 0.01", "name": "micro", "reducer": "micro", "network": "loopback", "workers": 2,
               "steps": 2, "workload": "digits-mlp"}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "time_s": 0.1 * (i + 1), "loss": 1.0,
                                                             "density": 0.01, "bytes_sent": 100}) for i in range(2)))
    md = write_report(tmp_path, [run], "t").read_text()
    assert md.count("not bandwidth-limited") == 1
    md = write_report(tmp_path, [run], "t", notes=["NOTE: running over LOOPBACK (no root)"]).read_text()
    assert "not bandwidth-limited" not in md and "LOOPBACK" in md  # the caller said it already
