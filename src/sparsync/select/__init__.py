"""Selection kernels: which gradient entries travel. Each returns (sorted int64 indices, values).

All kernels are vectorised torch ops (no Python loops over elements) and device agnostic.
Modules: :mod:`.topk` (exact top-k by magnitude) and the others registered by later work.
"""

from .topk import topk_abs, k_for_density, check_density

__all__ = ["topk_abs", "k_for_density", "check_density"]
