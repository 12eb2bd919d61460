"""Report plots: bytes / density per step use a log axis only when the values span more than a factor
LOG_SPAN (a 0.0099-0.0101 density on a log axis gets unreadable ticks)."""

from __future__ import annotations

import pytest

plt = pytest.importorskip("matplotlib.pyplot")


def _axes_scales(tmp_path, density, nbytes):
    from sparsync.train import report

    runs = [({"label": "micro 0.01", "reducer": "micro"},
             [{"step": i, "density": d, "bytes_sent": b} for i, (d, b) in enumerate(zip(density, nbytes))]),
            ({"label": "dense", "reducer": "dense"}, [{"step": i, "density": 1.0, "bytes_sent": 4e6} for i in range(4)])]
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
