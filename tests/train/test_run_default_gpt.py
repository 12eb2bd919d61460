"""``run-default --workload gpt``: time to target = the time pass's mean step x the convergence pass's steps to
target, and the verdict's goals read off those estimates."""

from sparsync.commands import _run_default_gpt as g

BASE, OURS = g.BASELINE_ROWS, g.SPARSYNC_ROWS


def _conv(config, index, steps, loss, reducer):
    # a run's "config" is its run name (e.g. "ddp-fp16-single"), not the configuration string
    return {"config": f"run-{index}", "label": config, "config_index": index, "steps_to_target": steps,
            "final_test_loss": loss, "reducer": reducer, "mean_bytes_sent": 1e6}


def _time(index, train_time, compute):
    return {"config": f"run-{index}", "train_time_s": train_time, "steps_run": 48, "steps": 48, "round": 0,
            "median_compute_s": compute, "allreduce_s": 1.6}


def _rows(sparse_loss=1.30, sparse_step_time=4.56):
    n = len(BASE)
    conv = [_conv(BASE[0], 0, 760, 1.10, "ddp-fp16"), _conv(BASE[2], 2, 1000, 1.22, "ddp-localsgd16"),
            _conv(OURS[0], n, 990, 1.21, "diloco-dense"), _conv(OURS[1], n + 1, 1010, sparse_loss, "diloco-sparseloco")]
    timed = [_time(0, 48.0, None), _time(2, 9.6, None), _time(n, 9.0, 0.08), _time(n + 1, sparse_step_time, 0.09)]
    return g.merged(conv, timed)


def test_time_to_target_is_the_mean_step_times_the_steps_to_target():
    rows = _rows()
    want = [760 * 48.0 / 48, 1000 * 9.6 / 48, 990 * 9.0 / 48, 1010 * 4.56 / 48]
    assert all(abs(r["time_to_target_s"] - w) < 1e-9 for r, w in zip(rows, want))
    assert abs(rows[0]["r"] - 1.6 / 0.085) < 1e-9  # torch DDP: the round's median compute per step
    assert abs(rows[3]["util"] - 0.09 / (4.56 / 48)) < 1e-12


def test_verdict_checks_time_utilisation_and_the_loss_against_dense_diloco():
    text = g.verdict(_rows(sparse_loss=1.2201), at_rate=True)
    assert text.startswith("goal MET") and "0.48x" in text, text
    assert "NO" in g.verdict(_rows(sparse_loss=1.30), at_rate=True)  # 7.4 % above dense DiLoCo's loss
    slow = g.verdict(_rows(sparse_step_time=9.0), at_rate=True)  # compute util 48 %, 0.93x post-local SGD
    assert slow.startswith("goal NOT met") and "[NO] compute utilisation" in slow, slow
    assert g.verdict(_rows(), at_rate=False).startswith("goal: cannot judge")
