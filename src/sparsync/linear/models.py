"""Logistic regression, linear SVM and linear regression on CSR batches (SparCML thesis §2.2, §4.2.1).

The thesis' MPI-SGD lists the three linear models. Classification labels are in {-1, +1}; linear
regression takes any real targets (svmlight files loaded with ``regression=True``) and on {-1, +1}
labels is the least-squares classifier.

* logreg: ``f(w) = ln(1 + exp(-y w.x))``, ``grad = -y x / (1 + exp(y w.x))``, predict ``sign(w.x)``
  (= ``sigmoid(w.x) >= 1/2``).
* svm (hinge): ``f(w) = max(0, 1 - y w.x)``, subgradient ``-y x`` where ``y w.x < 1``, else 0.
* linreg (squared loss): ``f(w) = (w.x - y)^2 / 2``, ``grad = (w.x - y) x``; "correct" in
  :func:`evaluate` counts ``sign(w.x) == sign(y)`` (meaningful for {-1, +1} targets).

:func:`batch_gradient` returns the *sum* over the batch as a :class:`~sparsync.sparse.SparseVec`
whose support is the union of the features of the contributing samples (natural sparsity; for the
SVM only margin violators contribute). Vectorised: one gather, one ``index_add`` per batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sparse import SparseVec
from .data import SparseDataset

__all__ = ["MODELS", "batch_gradient", "evaluate", "loss_and_coef", "margins"]

MODELS = ("logreg", "svm", "linreg")


def margins(ds: SparseDataset, rows: torch.Tensor, w: torch.Tensor):
    rowpos, cols, vals = ds.rows(rows)
    m = torch.zeros(rows.numel(), dtype=w.dtype).index_add_(0, rowpos, vals.to(w.dtype) * w[cols])
    return m, (rowpos, cols, vals)


def loss_and_coef(model: str, m: torch.Tensor, y: torch.Tensor):
    """Per-sample loss and d loss / d margin."""
    ym = y * m
    if model == "logreg":
        return F.softplus(-ym), -y * torch.sigmoid(-ym)
    if model == "svm":
        return torch.clamp(1.0 - ym, min=0.0), torch.where(ym < 1.0, -y, torch.zeros_like(y))
    if model == "linreg":
        r = m - y
        return 0.5 * r * r, r
    raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")


def batch_gradient(model: str, ds: SparseDataset, rows: torch.Tensor, w: torch.Tensor) -> SparseVec:
    """Sum over ``rows`` of the per-sample (sub)gradients, as a SparseVec of dimension ``n_features``."""
    m, (rowpos, cols, vals) = margins(ds, rows, w)
    _, coef = loss_and_coef(model, m, ds.labels[rows].to(w.dtype))
    c = coef[rowpos]
    keep = c != 0
    if not bool(keep.all()):
        cols, vals, c = cols[keep], vals[keep], c[keep]
    return SparseVec.coalesce(cols, vals.to(w.dtype) * c, ds.n_features)


def evaluate(model: str, ds: SparseDataset, rows: torch.Tensor, w: torch.Tensor) -> tuple[float, float, int]:
    """(loss sum, correct predictions, count) over ``rows``."""
    if rows.numel() == 0:
        return 0.0, 0.0, 0
    m, _ = margins(ds, rows, w)
    y = ds.labels[rows].to(w.dtype)
    loss, _ = loss_and_coef(model, m, y)
    correct = ((m >= 0) == (y > 0)).sum()
    return float(loss.double().sum()), float(correct), rows.numel()
