"""HF Trainer, CPU DDP under torchrun (find_unused_parameters=True: the Trainer's default): 8 steps
straight vs 4 + checkpoint + resume_from_checkpoint to 8, with the sparsync Trainer callback."""

import os
import warnings

import torch
from common import DENSITY, REDUCER, data, flat, hook_used, net, out_dir, save
from torch import nn
from transformers import Trainer, TrainingArguments

from sparsync.integrations import hf as ss_hf

warnings.filterwarnings("ignore")
X, Y = data(32)  # 2 ranks x batch 4 x 4 steps: one epoch = 4 steps


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = net()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return {"x": X[i], "labels": Y[i]}


def run(sub, steps, resume=None, hooked=True):
    args = TrainingArguments(output_dir=os.path.join(out_dir(), sub), per_device_train_batch_size=4, max_steps=steps,
                             save_strategy="steps", save_steps=4, lr_scheduler_type="constant", learning_rate=0.05,
                             optim="sgd", weight_decay=0.0, use_cpu=True, report_to=[], disable_tqdm=True,
                             logging_strategy="no", remove_unused_columns=False, seed=0, ddp_backend="gloo",
                             dataloader_num_workers=0)
    model = Model()
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    cb = ss_hf.attach(trainer, REDUCER, density=DENSITY) if hooked else None
    trainer.train(resume_from_checkpoint=resume)
    ddp = trainer.model_wrapped
    return flat(model), cb, getattr(ddp, "find_unused_parameters", None)


straight, cb, find_unused = run("straight", 8)
used = hook_used(cb.hook)
run("half", 4)
ckpt = os.path.join(out_dir(), "half", "checkpoint-4")
resumed, cb, _ = run("half", 8, resume=ckpt)
dense, _, _ = run("dense", 8, hooked=False)
save({"straight": straight, "resumed": resumed, "dense": dense, "used": used and hook_used(cb.hook),
      "in_ckpt": os.path.isfile(os.path.join(ckpt, ss_hf.FILE_NAME)), "find_unused": find_unused})
if torch.distributed.is_initialized():  # every group down before exit, as torch asks
    torch.distributed.destroy_process_group()
