"""Parameter-server baselines of the SparCML thesis' comparison (Renggli 2017, §2.1, §4.2.2).

* :mod:`.sync` — synchronous sharded PS as a sparse all-reduce (:func:`ps_allreduce`; reducer ``ps``,
  ``train-linear --algorithm ps``): every rank is a worker, ranks ``0..S-1`` also sum a shard.
* :mod:`.shard` — one server's shard under bounded staleness (the state machine, no communication).
* :mod:`.transport` — tagged ``torch.distributed`` isend/irecv with any-source receives and timeouts.
* :mod:`.async_ps` — the asynchronous PS with bounded staleness ``s`` (:func:`serve`, :class:`PSClient`;
  ``train-linear --algorithm ps-async``): dedicated server ranks, workers run up to ``s`` steps ahead of
  the slowest; ``s = 0`` is bitwise the synchronous PS.
"""

from .async_ps import PSClient, check_async_servers, serve, transport_for
from .shard import PushRecord, ShardState, StalenessViolation, apply_update, check_staleness
from .sync import check_servers, cut_shards, ps_allreduce, shard_bounds
from .transport import GlooTransport, PSTimeout

__all__ = ["GlooTransport", "PSClient", "PSTimeout", "PushRecord", "ShardState", "StalenessViolation",
           "apply_update", "check_async_servers", "check_servers", "check_staleness", "cut_shards",
           "ps_allreduce", "serve", "shard_bounds", "transport_for"]
