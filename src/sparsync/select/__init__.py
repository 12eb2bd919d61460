"""Selection kernels: which gradient entries travel. Each returns (sorted int64 indices, values).

All kernels are vectorised torch ops (no Python loops over elements) and device agnostic.

- :mod:`.topk` — exact top-k by magnitude; the density -> k rule shared by every reducer.
- :mod:`.approx` — SparCML's bucketed top-k and approximate top-k (L1/L-inf probabilities).
- :mod:`.threshold` — hard threshold and MiCRO's partitioned threshold selection + controller.
- :mod:`.blocks` — S2 Reducer's block-wise top-K by block L2 norm.
"""

from .approx import approx_topk, approx_topk_at_most, approx_topk_probs, at_most_probs, bucketed_topk
from .blocks import block_norms, block_topk
from .threshold import partitioned_threshold_select, threshold_select
from .topk import check_density, k_for_density, topk_abs

__all__ = ["topk_abs", "k_for_density", "check_density", "bucketed_topk", "approx_topk",
           "approx_topk_at_most", "approx_topk_probs", "at_most_probs", "threshold_select",
           "partitioned_threshold_select", "block_norms", "block_topk"]
