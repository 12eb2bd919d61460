"""Accelerate, CPU DDP under torchrun: 8 steps straight vs 4 + save_state + load_state + 4, with the
hook on the prepared model and its gathered state registered for checkpointing."""

import os
import warnings

import torch
from accelerate import Accelerator
from common import DENSITY, REDUCER, data, flat, hook_used, net, out_dir, rank, save
from torch import nn

from sparsync.integrations import accelerate as ss_acc

warnings.filterwarnings("ignore")
X, Y = data()


def run(start, stop, load=None, store=None, hooked=True):
    acc = Accelerator(cpu=True)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    hook = ss_acc.register(acc, model, REDUCER, density=DENSITY) if hooked else None
    if load:
        acc.load_state(load)
    for s in range(start, stop):
        i = (s * 2 + rank()) % 8 * 8
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(model(X[i:i + 8]), Y[i:i + 8]))
        opt.step()
    if store:
        acc.save_state(store)
    return flat(acc.unwrap_model(model)), hook


straight, hook = run(0, 8)
used = hook_used(hook)
path = os.path.join(out_dir(), "state")
run(0, 4, store=path)
resumed, hook = run(4, 8, load=path)
dense, _ = run(0, 8, hooked=False)
save({"straight": straight, "resumed": resumed, "dense": dense, "used": used and hook_used(hook),
      "in_ckpt": any(f.startswith("custom_checkpoint") for f in os.listdir(path))})
if torch.distributed.is_initialized():  # every group down before exit, as torch asks
    torch.distributed.destroy_process_group()
