"""The ``gpt-long`` preset: the ``gpt`` model and data with a run long enough for real periods."""

from sparsync.train.workloads import make_workload


def test_gpt_long_is_gpt_trained_long_enough_for_thirty_outer_steps_at_h32():
    short, long = make_workload("gpt"), make_workload("gpt-long")
    assert long.name == "gpt-long"
    assert sum(p.numel() for p in long.build().parameters()) == sum(p.numel() for p in short.build().parameters())
    assert long.x_train.shape == short.x_train.shape and (long.x_test == short.x_test).all()
    assert long.defaults["steps"] // 32 >= 30 and long.defaults["steps"] % long.defaults["eval_every"] == 0
    assert {k: v for k, v in long.defaults.items() if k not in ("steps", "target_loss", "eval_every", "lr_warmup")} \
        == {k: v for k, v in short.defaults.items() if k not in ("steps", "target_loss", "eval_every", "lr_warmup")}
