"""SparDL building blocks (Zhao et al., ICDE 2024): bags/peers, SRS, Bruck all-gather, R-SAG/B-SAG, Algorithm 2.

The reducer that ties them together is :mod:`sparsync.reducers.spardl` (``make_reducer("spardl")``).
"""

from .bags import bags, last_bag_size, num_steps, runs, schedule
from .blocksel import block_topk, topk_det
from .bruck import bruck_allgather, bruck_rounds
from .controller import HController

__all__ = [
           "HController",
           "bags",
           "block_topk",
           "bruck_allgather",
           "bruck_rounds",
           "last_bag_size",
           "num_steps",
           "runs",
           "schedule",
           "topk_det",
]
