"""Sparse classification data: CSR container, svmlight/libsvm loader, synthetic power-law generator.

svmlight/libsvm format, one sample per line::

    <label> <index>:<value> <index>:<value> ... [# comment]

* indices are 1-based by default (libsvm convention; ``zero_based=True`` for 0-based files) and
  must be strictly increasing within a line; an optional ``qid:<n>`` token is accepted and ignored;
* blank lines and lines holding only a comment are skipped; every other line must parse, otherwise
  :class:`SvmlightError` names the file and line number (a line is never silently dropped);
* an index beyond the declared dimension (``n_features``) is an error with the line number;
* labels (classification; ``regression=True`` keeps real targets) must take exactly two distinct
  values (e.g. {0, 1}, {-1, +1}, {1, 2}); the smaller maps to
  -1 and the larger to +1. A third value is reported at the line where it first appears; a file with
  a single class or no samples at all is an error too.

The file is read line by line (streaming; only the parsed arrays are kept).

Synthetic data (:func:`make_synthetic`): ``n_samples`` rows with ``nnz`` feature draws each from a
Zipf law ``P(feature of frequency rank j) ~ (j+1)^-zipf`` over ``n_features`` features (feature ids
randomly permuted so frequent features are spread over the index space; repeated draws in a row are
merged), binary values scaled to unit row norm, labels ``sign(x . w* - median)`` (balanced classes)
for a ``w*`` that is Gaussian on the ``informative`` fraction of most frequent features and 0
elsewhere, a fraction ``noise`` of labels flipped. Deterministic for a given seed.
"""

from __future__ import annotations

import math
import os
from array import array
from dataclasses import dataclass

import torch

__all__ = ["SparseDataset", "SvmlightError", "load_svmlight", "make_synthetic"]


class SvmlightError(ValueError):
    """A malformed svmlight/libsvm input; the message names the file and line."""


@dataclass
class SparseDataset:
    """CSR rows: row ``i`` has columns ``indices[indptr[i]:indptr[i+1]]`` with ``values`` there."""

    indptr: torch.Tensor     # int64 (n_samples + 1)
    indices: torch.Tensor    # int64 (nnz)
    values: torch.Tensor     # float (nnz)
    labels: torch.Tensor     # float (n_samples), in {-1, +1}
    n_features: int

    @property
    def n_samples(self) -> int:
        return self.labels.numel()

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    def rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather the CSR entries of ``rows``: (row position in ``rows``, column, value), vectorised."""
        starts = self.indptr[rows]
        lens = self.indptr[rows + 1] - starts
        total = int(lens.sum())
        rowpos = torch.repeat_interleave(torch.arange(rows.numel()), lens)
        offs = torch.cumsum(lens, 0) - lens
        pos = starts[rowpos] + (torch.arange(total) - offs[rowpos])
        return rowpos, self.indices[pos], self.values[pos]

    def subset(self, rows: torch.Tensor) -> SparseDataset:
        rowpos, cols, vals = self.rows(rows)
        counts = torch.bincount(rowpos, minlength=rows.numel())
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        return SparseDataset(indptr, cols, vals, self.labels[rows], self.n_features)

    def split(self, test_fraction: float, seed: int = 0) -> tuple[SparseDataset, SparseDataset]:
        """Deterministic train/test split."""
        n = self.n_samples
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        nt = round(n * test_fraction)
        return self.subset(perm[nt:].sort().values), self.subset(perm[:nt].sort().values)

    def to(self, dtype) -> SparseDataset:
        return SparseDataset(self.indptr, self.indices, self.values.to(dtype), self.labels.to(dtype), self.n_features)


# ---------------------------------------------------------------------- svmlight
def _parse_features(toks, base: int, n_features, zero_based: bool, cols, vals, err) -> int:
    """Append one line's ``index:value`` tokens to ``cols``/``vals``; returns the last column (or -1).

    ``err(msg)`` builds the exception for this line (the rules are in the module docstring)."""
    prev = -1
    for tok in toks:
        key, sep, val = tok.partition(":")
        if not sep:
            raise err(f"feature {tok!r} is not of the form index:value")
        if key == "qid":
            continue
        try:
            idx = int(key)
            v = float(val)
        except ValueError:
            raise err(f"feature {tok!r} is not of the form index:value") from None
        col = idx - base
        if col < 0:
            raise err(f"feature index {idx} is below {base} ({'0' if zero_based else '1'}-based indices)")
        if n_features is not None and col >= n_features:
            raise err(f"feature index {idx} is beyond the declared dimension {n_features}")
        if col <= prev:
            raise err(f"feature index {idx} is not larger than the previous one "
                      "(indices must be strictly increasing)")
        if not math.isfinite(v):
            raise err(f"feature value {val!r} is not finite")
        prev = col
        cols.append(col)
        vals.append(v)
    return prev


def load_svmlight(path, n_features: int | None = None, zero_based: bool = False,
                  dtype=torch.float32, regression: bool = False) -> SparseDataset:
    """Read an svmlight/libsvm file (see the module docstring for the rules and errors).

    ``regression=True``: keep the labels as real-valued targets (any number of distinct values; for
    linear regression) instead of mapping two classes to {-1, +1}."""
    name = os.fspath(path) if not hasattr(path, "read") else getattr(path, "name", "<stream>")
    if n_features is not None and int(n_features) < 1:
        raise ValueError(f"n_features must be >= 1, got {n_features}")
    base = 0 if zero_based else 1
    indptr = array("q", [0])
    cols = array("q")
    vals = array("d")
    raw_labels = array("d")
    classes: dict[float, int] = {}
    max_col = -1

    def err(lineno, msg):
        return SvmlightError(f"{name}:{lineno}: {msg}")

    fh = open(path, encoding="utf-8", errors="replace") if not hasattr(path, "read") else path  # noqa: SIM115
    try:
        for lineno, line in enumerate(fh, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            toks = text.split()
            try:
                label = float(toks[0])
            except ValueError:
                raise err(lineno, f"label {toks[0]!r} is not a number") from None
            if not math.isfinite(label):
                raise err(lineno, f"label {toks[0]!r} is not finite")
            if not regression and label not in classes:
                if len(classes) == 2:
                    seen = ", ".join(f"{c:g}" for c in sorted(classes))
                    raise err(lineno, f"third class label {label:g} (already seen {seen}); "
                                      "only binary classification (two label values) is supported")
                classes[label] = lineno
            prev = _parse_features(toks[1:], base, n_features, zero_based, cols, vals,
                                   lambda msg, lineno=lineno: err(lineno, msg))
            max_col = max(max_col, prev)
            raw_labels.append(label)
            indptr.append(len(cols))
    finally:
        if fh is not path:
            fh.close()
    if not raw_labels:
        raise SvmlightError(f"{name}: no samples (empty file or only comments/blank lines)")
    if not regression and len(classes) != 2:
        raise SvmlightError(f"{name}: all samples have label {next(iter(classes)):g}; "
                            "binary classification needs two label values")
    labels = torch.tensor(raw_labels, dtype=torch.float64)
    if not regression:
        labels = torch.where(labels == min(classes), -1.0, 1.0)
    labels = labels.to(dtype)
    nf = int(n_features) if n_features is not None else max(max_col + 1, 1)
    return SparseDataset(torch.tensor(indptr, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64),
                         torch.tensor(vals, dtype=dtype), labels, nf)


def save_svmlight(ds: SparseDataset, path) -> None:
    """Write ``ds`` as a 1-based svmlight file (labels -1/+1)."""
    with open(path, "w") as fh:
        ip = ds.indptr.tolist()
        cols = ds.indices.tolist()
        vals = ds.values.tolist()
        for i, y in enumerate(ds.labels.tolist()):
            feats = " ".join(f"{c + 1}:{v:.9g}" for c, v in zip(cols[ip[i]:ip[i + 1]], vals[ip[i]:ip[i + 1]]))
            fh.write(f"{int(y):+d} {feats}\n")


# ---------------------------------------------------------------------- synthetic
def make_synthetic(n_samples: int = 20000, n_features: int = 100_000, nnz: int = 30, seed: int = 0,
                   zipf: float = 1.1, noise: float = 0.02, informative: float = 0.01,
                   dtype=torch.float32) -> SparseDataset:
    """Deterministic high-dimensional sparse binary classification data (module docstring)."""
    if n_samples < 2 or n_features < 1 or nnz < 1:
        raise ValueError("make_synthetic needs n_samples >= 2, n_features >= 1, nnz >= 1")
    if not 0 < informative <= 1:
        raise ValueError(f"informative must be in (0, 1], got {informative}")
    if not 0 <= noise < 0.5:
        raise ValueError(f"noise must be in [0, 0.5), got {noise}")
    g = torch.Generator().manual_seed(int(seed))
    freq = (torch.arange(n_features, dtype=torch.float64) + 1.0) ** (-float(zipf))
    perm = torch.randperm(n_features, generator=g)
    probs = torch.empty(n_features, dtype=torch.float64)
    probs[perm] = freq / freq.sum()
    draws = torch.multinomial(probs, n_samples * nnz, replacement=True, generator=g)
    rows = torch.arange(n_samples).repeat_interleave(nnz)
    keys = torch.unique(rows * n_features + draws, sorted=True)
    rows, cols = keys // n_features, keys % n_features
    counts = torch.bincount(rows, minlength=n_samples)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    vals = (1.0 / counts.double().sqrt())[rows]
    w_true = torch.randn(n_features, generator=g, dtype=torch.float64)
    n_inf = max(1, round(informative * n_features))
    w_true[perm[n_inf:]] = 0.0          # only the n_inf most frequent features carry signal
    margin = torch.zeros(n_samples, dtype=torch.float64).index_add_(0, rows, vals * w_true[cols])
    y = torch.where(margin >= margin.median(), 1.0, -1.0)  # balanced classes
    flip = torch.rand(n_samples, generator=g, dtype=torch.float64) < noise
    y = torch.where(flip, -y, y)
    return SparseDataset(indptr, cols, vals.to(dtype), y.to(dtype), n_features)
