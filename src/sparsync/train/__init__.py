"""Training: workloads, loop, run directories and reports (``sparsync train`` / ``compare``).

``sparsync.train.load_runs(dir)`` returns the runs of a comparison (or one run) as records
(:mod:`sparsync.train.records`); importing this package does not import torch.
"""

from .records import load_runs

__all__ = ["load_runs"]
