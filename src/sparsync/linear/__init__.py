"""Linear models on naturally sparse data: SparCML's MPI-SGD (Renggli's thesis §2.2.3, §4.2).

* :mod:`.data` — :class:`SparseDataset` (CSR rows, labels in {-1, +1}), the svmlight/libsvm loader
  :func:`load_svmlight` and the synthetic power-law generator :func:`make_synthetic`.
* :mod:`.models` — logistic regression and linear SVM: margins, losses and the sparse mini-batch
  gradient (non-zero only on the features present in the batch).
* :mod:`.sgd` — data-parallel mini-batch SGD (:func:`train`) whose gradients are summed losslessly
  by a sparse all-reduce (any algorithm of :mod:`sparsync.collectives`).
"""

from .data import SparseDataset, SvmlightError, load_svmlight, make_synthetic
from .models import MODELS
from .sgd import train

__all__ = ["MODELS", "SparseDataset", "SvmlightError", "load_svmlight", "make_synthetic", "train"]
