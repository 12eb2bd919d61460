"""Training workloads, all offline: models + real data that already exist on the machine.

Why these: data-parallel training is communication-bound when the model has many parameters per
unit of compute, so every workload here has a large gradient relative to its forward/backward cost.

* ``digits-mlp``  scikit-learn's bundled handwritten digits (1797 real 8x8 images, 10 classes;
  ``n_test`` of them held out, 360 by default as in ``make run``; ``n_test=1024`` makes one image
  less than 0.1 accuracy point), a wide MLP 64-2048-2048-10 (4.35M parameters: on a 1 Gbit/s link the
  dense exchange takes several times a step's compute).
* ``digits-cnn``  the same data, a small CNN (two conv layers + two linear layers).
* ``lm``          a word-level language model (previous ``context`` words -> next word) with a
  large embedding (``vocab`` rows, default 30,000) on a real text corpus: the Python standard
  library sources (code, comments and docstrings) of the running interpreter, tokenised into
  lower-case words, built deterministically (sorted file list, fixed token budget) and cached under
  ``~/.cache/sparsync`` (``$SPARSYNC_CACHE`` overrides). ``sparse_embedding=True`` makes the
  embedding produce ``torch.sparse`` gradients (``nn.Embedding(sparse=True)``).
* ``gpt``         a decoder-only transformer (:mod:`sparsync.train.gpt`: causal self-attention,
  pre-norm, GELU MLP) on the same corpus read as characters (``a``-``z`` and space), trained with
  AdamW (weight decay, linear warm-up then cosine decay); its target is a held-out loss (lower is
  better, ``target_loss``), reported with its perplexity.
* ``linear``      logistic regression on sparse data (SparCML's MPI-SGD workload) with the
  deterministic power-law data of :func:`sparsync.linear.make_synthetic`; the weight vector is an
  ``EmbeddingBag`` (``sparse_embedding=True`` for torch sparse gradients). (SVM: use
  ``sparsync train-linear``, the SparCML contributor's own loop.)

Every workload provides: a model factory, a deterministic batch for (step, rank) from a seed (so a
resumed run sees the same data as an uninterrupted one), an evaluation (accuracy, loss) on held-out
data, and defaults (optimizer, lr, batch size, steps, and a target: ``target_accuracy``, reached at or
above, or ``target_loss``, the held-out loss reached at or below).
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import pickle
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT, seq_cross_entropy

__all__ = ["WORKLOADS", "Workload", "cache_dir", "lm_corpus", "make_workload", "workload_names"]


@dataclass
class Workload:
    """A model family + dataset + evaluation, with default hyperparameters (``defaults``)."""

    name: str
    build: Callable[[], nn.Module]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    loss_fn: Callable = F.cross_entropy
    defaults: dict = field(default_factory=dict)
    description: str = ""

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    def batch_indices(self, step: int, rank: int, world_size: int, batch_size: int, seed: int) -> torch.Tensor:
        """Indices of rank ``rank``'s batch at ``step``: a global batch of ``world_size*batch_size``
        samples taken in order from a stream of per-epoch permutations (seeded by ``seed`` and the
        epoch), so the data a step sees depends only on (seed, step), never on earlier state."""
        gb = world_size * batch_size
        start = step * gb + rank * batch_size
        pos = torch.arange(start, start + batch_size)
        epochs = pos // self.n_train
        out = torch.empty(batch_size, dtype=torch.int64)
        for e in torch.unique(epochs).tolist():
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(e))
            perm = torch.randperm(self.n_train, generator=g)
            m = epochs == e
            out[m] = perm[pos[m] % self.n_train]
        return out

    def batch(self, step, rank, world_size, batch_size, seed):
        idx = self.batch_indices(step, rank, world_size, batch_size, seed)
        return self.x_train[idx], self.y_train[idx]

    def steps_per_epoch(self, world_size: int, batch_size: int) -> int:
        return max(1, math.ceil(self.n_train / (world_size * batch_size)))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, chunk: int = 2048) -> dict:
        """Accuracy and mean loss per target on the held-out set (a sequence sample has one target per
        position; the model is put back into its previous mode after)."""
        was = model.training
        model.eval()
        correct, loss, n = 0, 0.0, 0
        for i in range(0, self.y_test.shape[0], chunk):
            x, y = self.x_test[i:i + chunk], self.y_test[i:i + chunk]
            out = model(x)
            loss += float(self.loss_fn(out, y, reduction="sum"))
            correct += int((out.argmax(-1) == y).sum())
            n += y.numel()
        model.train(was)
        return {"accuracy": correct / max(1, n), "loss": loss / max(1, n)}


# ---------------------------------------------------------------------------- digits
def _digits(n_test: int = 360):
    """(x_train, y_train, x_test, y_test): a fixed split (seed 0) with ``n_test`` held-out images;
    the features are standardised with the training part's mean and deviation."""
    from ..extras import require

    load_digits = require("sklearn.datasets", "train", "the digits workloads").load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)  # fixed split, independent of the run's seed
    perm = torch.randperm(len(y), generator=g)
    n_test = int(n_test)
    if not 1 <= n_test <= len(y) - 100:
        raise ValueError(f"digits: n_test must be in [1, {len(y) - 100}] (1797 images, >= 100 to train), got {n_test}")
    te, tr = perm[:n_test], perm[n_test:]
    mean, std = x[tr].mean(0), x[tr].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return x[tr], y[tr], x[te], y[te]


class WideMLP(nn.Module):
    def __init__(self, width: int = 2048, depth: int = 2, n_in: int = 64, n_out: int = 10):
        super().__init__()
        layers, d = [], n_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        layers.append(nn.Linear(d, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 32, hidden: int = 256):
        super().__init__()
        self.c1 = nn.Conv2d(1, channels, 3, padding=1)
        self.c2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.f1 = nn.Linear(2 * channels * 4 * 4, hidden)
        self.f2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.c1(x))
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.f2(F.relu(self.f1(x.flatten(1))))


def _digits_mlp(width: int = 2048, depth: int = 2, n_test: int = 360) -> Workload:
    xtr, ytr, xte, yte = _digits(n_test)
    return Workload(
        "digits-mlp", lambda: WideMLP(int(width), int(depth)), xtr, ytr, xte, yte,
        defaults={"optimizer": "momentum", "lr": 0.02, "batch_size": 32, "steps": 150, "target_accuracy": 0.95,
                  "eval_every": 5},
        description=f"sklearn digits, MLP 64-{'-'.join([str(width)] * int(depth))}-10",
    )


def _digits_cnn(channels: int = 32, hidden: int = 256, n_test: int = 360) -> Workload:
    xtr, ytr, xte, yte = _digits(n_test)
    return Workload(
        "digits-cnn", lambda: SmallCNN(int(channels), int(hidden)), xtr, ytr, xte, yte,
        defaults={"optimizer": "momentum", "lr": 0.02, "batch_size": 32, "steps": 150, "target_accuracy": 0.95,
                  "eval_every": 5},
        description="sklearn digits, CNN conv32-conv64-fc256-fc10",
    )


# ---------------------------------------------------------------------------- language model
_WORD = re.compile(r"[A-Za-z]+")


def cache_dir() -> Path:
    d = Path(os.environ.get("SPARSYNC_CACHE", Path.home() / ".cache" / "sparsync"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not (skip & set(p.relative_to(root).parts))]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def lm_corpus(max_tokens: int = 2_000_000) -> tuple[list[str], Path]:
    """Lower-case words of the interpreter's standard library sources, in sorted-file order, up to
    ``max_tokens``; cached as a text file keyed by the interpreter's stdlib path and version."""
    import sys

    key = hashlib.sha256(f"{sysconfig.get_paths()['stdlib']}|{sys.version}|{max_tokens}|v1".encode()).hexdigest()[:16]
    path = cache_dir() / f"lm-corpus-{key}.txt"
    if path.exists():
        return path.read_text().split(), path
    words: list[str] = []
    for f in _stdlib_files():
        try:
            text = f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        words.extend(w.lower() for w in _WORD.findall(text))
        if len(words) >= max_tokens:
            break
    words = words[:max_tokens]
    if not words:
        raise RuntimeError(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(" ".join(words))
    os.replace(tmp, path)
    return words, path


def _lm_tokens(vocab: int, max_tokens: int) -> torch.Tensor:
    """Token ids (0 = <unk>; 1.. = words by decreasing frequency, ties by the word), cached."""
    words, cpath = lm_corpus(max_tokens)
    tpath = cpath.with_name(cpath.stem + f"-v{vocab}.pt")
    if tpath.exists():
        try:
            return torch.load(tpath, weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # a broken cache: rebuilt below
            tpath.unlink(missing_ok=True)
    counts = collections.Counter(words)
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab - 1]
    ids = {w: i + 1 for i, (w, _) in enumerate(top)}
    toks = torch.tensor([ids.get(w, 0) for w in words], dtype=torch.int64)
    tmp = tpath.with_suffix(f".tmp{os.getpid()}")
    torch.save(toks, tmp)
    os.replace(tmp, tpath)
    return toks


class WordLM(nn.Module):
    """Previous ``context`` words -> embedding (``vocab`` x ``dim``) -> concat -> hidden -> vocab."""

    def __init__(self, vocab: int, dim: int, context: int, hidden: int, sparse: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, sparse=sparse)
        self.fc = nn.Linear(context * dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(self.emb(x).flatten(1))))


def _lm(vocab: int = 30000, dim: int = 64, context: int = 4, hidden: int = 128,
        sparse_embedding: bool = False, max_tokens: int = 2_000_000, n_test: int = 4096) -> Workload:
    vocab, dim, context, hidden = int(vocab), int(dim), int(context), int(hidden)
    sparse_embedding = sparse_embedding in (True, "1", "true", "True", "yes")
    toks = _lm_tokens(vocab, int(max_tokens))
    n = toks.numel() - context
    windows = toks.unfold(0, context + 1, 1)[:n]  # (n, context+1) view, no copy
    split = int(n * 0.95)
    x_train, y_train = windows[:split, :context], windows[:split, context]
    test = windows[split:]
    g = torch.Generator().manual_seed(0)
    pick = torch.randperm(test.shape[0], generator=g)[: int(n_test)]
    x_test, y_test = test[pick, :context].clone(), test[pick, context].clone()
    return Workload(
        "lm", lambda: WordLM(vocab, dim, context, hidden, sparse_embedding), x_train, y_train, x_test, y_test,
        defaults={"optimizer": "momentum", "lr": 0.5, "batch_size": 64, "steps": 200, "target_accuracy": 0.15,
                  "eval_every": 20},
        description=(f"word LM on the Python stdlib ({toks.numel()} tokens), vocab {vocab}, dim {dim}, "
                     f"context {context}, hidden {hidden}, {'sparse' if sparse_embedding else 'dense'} embedding"),
    )


# ---------------------------------------------------------------------------- gpt (transformer, AdamW)
ALPHABET = " abcdefghijklmnopqrstuvwxyz"


class SequenceWorkload(Workload):
    """A workload whose samples are sequences: evaluation averages over every held-out token."""

    def evaluate(self, model: nn.Module, chunk: int = 256) -> dict:
        """:meth:`Workload.evaluate` (loss and accuracy per held-out token) and the perplexity ``exp(loss)``."""
        ev = super().evaluate(model, chunk)
        return {**ev, "perplexity": math.exp(min(ev["loss"], 700.0))}


def _chars(max_words: int) -> torch.Tensor:
    """The corpus' first ``max_words`` words joined by spaces, as ids into :data:`ALPHABET` (cached)."""
    words, cpath = lm_corpus()
    path = cache_dir() / f"{cpath.stem}-chars{int(max_words)}.pt"
    if path.exists():
        try:
            return torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # a broken cache: rebuilt below
            path.unlink(missing_ok=True)
    text = " ".join(words[: int(max_words)]).encode("ascii")
    lut = torch.zeros(256, dtype=torch.int64)
    lut[torch.tensor(list(ALPHABET.encode("ascii")))] = torch.arange(len(ALPHABET))
    ids = lut[torch.frombuffer(bytearray(text), dtype=torch.uint8).long()]
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(ids, tmp)
    os.replace(tmp, path)
    return ids


def _positive_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or int(v) < lo:
        raise ValueError(f"workload 'gpt': {name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _gpt(width: int = 384, layers: int = 2, heads: int = 4, context: int = 32,
                 max_words: int = 500_000, n_test: int = 512) -> Workload:
    """The ``gpt`` workload (:mod:`sparsync.train.gpt`); options are checked here, each in one line."""
    width, layers, heads = _positive_int("width", width), _positive_int("layers", layers), _positive_int("heads", heads)
    context, n_test = _positive_int("context", context), _positive_int("n_test", n_test)
    max_words = _positive_int("max_words", max_words, lo=1000)
    if width % heads:
        raise ValueError(f"workload 'gpt': width ({width}) must be a multiple of heads ({heads})")
    ids = _chars(max_words)
    seqs = ids[: ids.numel() // (context + 1) * (context + 1)].view(-1, context + 1)
    split = int(seqs.shape[0] * 0.95)
    test = seqs[split:]
    if test.shape[0] < 1 or split < 1:
        raise ValueError(f"workload 'gpt': max_words={max_words} gives too little text for context {context}")
    test = test[: n_test]
    vocab = len(ALPHABET)
    return SequenceWorkload(
        "gpt", lambda: GPT(vocab, width, layers, heads, context),
        seqs[:split, :context], seqs[:split, 1:], test[:, :context].clone(), test[:, 1:].clone(),
        loss_fn=seq_cross_entropy,
        defaults={"optimizer": "adamw", "lr": 1e-3, "batch_size": 4, "steps": 600, "target_loss": 1.6,
                  "eval_every": 25, "weight_decay": 0.1, "lr_warmup": 30, "lr_schedule": "cosine"},
        description=(f"decoder-only transformer (width {width}, {layers} layers, {heads} heads, context {context}) "
                     f"on the Python stdlib's words as characters ({ids.numel()} characters, vocabulary {vocab})"),
    )


#: ``gpt-long``: the ``gpt`` model trained long enough for real synchronisation periods - 1200 steps, so
#: H = 16 / 32 give 75 / 37 outer steps - with a target that dense synchronous training reaches at about
#: 63 % of the run and DiLoCo averaging every 16 steps at about 83 % (held-out loss 1.3 at ~760 and ~990
#: steps; final 1.09 and 1.21; global batch 16 - dense as one worker of 16, DiLoCo as 4 of 4 -, one seed)
GPT_LONG_DEFAULTS = {"steps": 1200, "target_loss": 1.3, "eval_every": 50, "lr_warmup": 60}


def _gpt_long(**options) -> Workload:
    """The ``gpt-long`` preset: :func:`_gpt` with :data:`GPT_LONG_DEFAULTS` (the same model options)."""
    wl = _gpt(**options)
    wl.name = "gpt-long"
    wl.defaults = {**wl.defaults, **GPT_LONG_DEFAULTS}
    d = GPT_LONG_DEFAULTS
    wl.description = wl.description + f"; {d['steps']} steps to a held-out loss of {d['target_loss']}"
    return wl


# ---------------------------------------------------------------------------- linear (SparCML MPI-SGD)
class SparseLogReg(nn.Module):
    """Logistic regression on sparse rows: ``x = [col_0..col_{m-1}, val_0..val_{m-1}]`` (padded with
    column 0 / value 0); logits ``[0, w . x + b]`` so cross-entropy is the logistic loss."""

    def __init__(self, n_features: int, sparse: bool):
        super().__init__()
        self.w = nn.EmbeddingBag(n_features, 1, mode="sum", sparse=sparse)
        nn.init.zeros_(self.w.weight)
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        m = x.shape[1] // 2
        z = self.w(x[:, :m].long(), per_sample_weights=x[:, m:]) + self.b
        return torch.cat([torch.zeros_like(z), z], dim=1)


def _linear(n_samples: int = 20000, n_features: int = 100_000, nnz: int = 30, sparse_embedding: bool = False,
            seed: int = 0) -> Workload:
    """SparCML's linear workload on :func:`sparsync.linear.make_synthetic` data (power-law sparse rows)."""
    try:
        from ..linear import make_synthetic
    except ImportError as e:
        raise ValueError(f"workload 'linear' needs sparsync.linear ({e})") from None
    n_features = int(n_features)
    if n_features >= 1 << 24:
        raise ValueError("linear: n_features must be < 2^24 (column ids travel as float32)")
    sparse_embedding = sparse_embedding in (True, "1", "true", "True", "yes")
    ds = make_synthetic(int(n_samples), n_features, int(nnz), seed=int(seed))
    counts = ds.indptr[1:] - ds.indptr[:-1]
    m = int(counts.max())
    rowpos = torch.repeat_interleave(torch.arange(ds.n_samples), counts)
    slot = torch.arange(ds.nnz) - ds.indptr[:-1][rowpos]
    x = torch.zeros(ds.n_samples, 2 * m)
    x[rowpos, slot] = ds.indices.float()
    x[rowpos, m + slot] = ds.values.float()
    y = (ds.labels > 0).long()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(ds.n_samples, generator=g)
    n_test = ds.n_samples // 10
    te, tr = perm[:n_test], perm[n_test:]
    return Workload(
        "linear", lambda: SparseLogReg(n_features, sparse_embedding), x[tr], y[tr], x[te], y[te],
        defaults={"optimizer": "momentum" if sparse_embedding else "adam", "lr": 2.0 if sparse_embedding else 0.05,
                  "batch_size": 250, "steps": 150, "target_accuracy": 0.8, "eval_every": 10},
        description=(f"logistic regression on synthetic power-law sparse data ({ds.n_samples} rows, "
                     f"{n_features} features, ~{nnz} non-zeros per row; sparsync.linear.make_synthetic)"),
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "digits-mlp": _digits_mlp,
    "digits-cnn": _digits_cnn,
    "lm": _lm,
    "gpt": _gpt,
    "gpt-long": _gpt_long,
    "linear": _linear,
}


def workload_names() -> list[str]:
    return sorted(WORKLOADS)


def make_workload(name: str, **options) -> Workload:
    """Build workload ``name``; unknown names list the valid ones; unknown options are refused."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(workload_names())}")
    try:
        return WORKLOADS[name](**options)
    except TypeError as e:
        raise ValueError(f"workload {name!r}: bad option ({e})") from None
