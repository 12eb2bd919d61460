"""PowerSGD rows run with the GPUs hidden from their ranks (torch's hook synchronises CUDA whenever it is
available, which fails for CPU gradients on any GPU machine); every other row runs in the launcher's
environment."""

from sparsync.train.config import TrainConfig
from sparsync.train.loop import rank_env


def test_powersgd_rows_hide_the_gpus_and_no_other_row_does():
    for r in ("ddp-powersgd1", "ddp-powersgd4"):
        assert rank_env(TrainConfig(reducer=r)) == {"CUDA_VISIBLE_DEVICES": ""}
    for r in ("ddp", "ddp-fp16", "micro", "topka"):
        assert rank_env(TrainConfig(reducer=r)) is None
