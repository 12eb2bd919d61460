"""Lightning, CPU DDP under torchrun: straight 2 epochs vs 1 epoch + checkpoint + resume, with the
sparsync callback; and a run without it (must differ: the hook really ran on CPU)."""

import os
import warnings

import lightning as L
import torch
from common import DENSITY, REDUCER, data, flat, hook_used, net, out_dir, save
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparsync.integrations.lightning import SparsyncCallback

warnings.filterwarnings("ignore")


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(epochs, callbacks, ckpt_in=None, ckpt_out=None):
    m = Module()
    t = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=epochs, callbacks=callbacks,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=out_dir())
    loader = DataLoader(TensorDataset(*data()), batch_size=8)  # 32 per rank: 4 steps per epoch
    t.fit(m, loader, ckpt_path=ckpt_in)
    if ckpt_out:
        t.save_checkpoint(ckpt_out)  # every rank builds it, rank 0 writes it
    return flat(m.net)


cb = SparsyncCallback(REDUCER, density=DENSITY)
straight = fit(2, [cb])
used = hook_used(cb.hook)
path = os.path.join(out_dir(), "half.ckpt")
fit(1, [SparsyncCallback(REDUCER, density=DENSITY)], ckpt_out=path)
cb = SparsyncCallback(REDUCER, density=DENSITY)
resumed = fit(2, [cb], ckpt_in=path)
dense = fit(2, [])
save({"straight": straight, "resumed": resumed, "dense": dense, "used": used and hook_used(cb.hook),
      "in_ckpt": "sparsync_hook" in torch.load(path, weights_only=False)})
if torch.distributed.is_initialized():  # every group down before exit, as torch asks
    torch.distributed.destroy_process_group()
