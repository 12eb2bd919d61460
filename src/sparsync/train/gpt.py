"""The ``gpt`` workload: a small decoder-only transformer on the Python standard library's text.

Model (GPT-2's layout, Radford et al. 2019): token + learned position embeddings, ``layers`` blocks of
pre-norm causal self-attention (``heads`` heads, :func:`torch.nn.functional.scaled_dot_product_attention`
with ``is_causal=True``) and a pre-norm GELU MLP (4x width), a final LayerNorm and a linear head.
Initialisation as GPT-2: normal(0, 0.02), the residual projections scaled by ``1/sqrt(2 layers)``.

Data: the words of the ``lm`` workload's corpus (:func:`sparsync.train.workloads.lm_corpus`: the
interpreter's standard-library sources, lower-case words in sorted-file order), joined by single
spaces and read character by character (27 symbols: ``a``-``z`` and the space), cut into
non-overlapping sequences of ``context + 1`` characters; the last 5 % of the text is held out.
A sample is a sequence: input its first ``context`` characters, target the same shifted by one.

Why it has this shape: the regime of language-model training on slow links is a gradient whose
all-reduce costs more than the step's compute. With few tokens per worker (``batch_size`` x
``context``) and a wide model, a 1 Gbit/s ring all-reduce of the ~3.6M fp32 gradient (about 170 ms
on 4 ranks) takes several times the step's compute on a CPU core.

Evaluation: the held-out mean cross-entropy per character (nats; the time-to-target metric, lower
is better), its perplexity ``exp(loss)`` and next-character accuracy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "seq_cross_entropy"]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` attends to positions ``<= t`` only."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (GELU, 4x width)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer: ``(B, T)`` token ids -> ``(B, T, vocab)`` next-token logits."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x):
        T = x.shape[1]
        if T > self.context:
            raise ValueError(f"GPT: sequence of {T} tokens is longer than the context {self.context}")
        h = self.tok(x) + self.pos(torch.arange(T, device=x.device))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def seq_cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` targets, over every position."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction=reduction)
