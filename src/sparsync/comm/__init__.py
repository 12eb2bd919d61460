"""Comm: the only interface gradient-exchange algorithms talk to, and its cost ledger.

Algorithms call the public methods of :class:`Comm`; two backends implement a handful of
primitives underneath (:class:`sparsync.threadcomm.ThreadComm`: ranks as threads with a virtual
alpha-beta clock; :class:`sparsync.torchcomm.TorchComm`: a real ``torch.distributed`` group).
All accounting happens in the base class, so both backends record identical ledgers.

Cost accounting follows the alpha-beta model ``x*alpha + y*beta`` (``x`` sequential message
rounds, ``y`` bytes; Hockney, "The communication challenge for MPP", Parallel Computing 20, 1994).
One module per job:

* :mod:`~sparsync.comm.ledger` - :class:`PhaseCost` and :class:`Ledger`, the per-rank record;
* :mod:`~sparsync.comm.messages` - 1-D messages, :class:`Handle`, :class:`CommError`,
  :func:`gather_padded`;
* :mod:`~sparsync.comm.p2p` - point-to-point calls and the size-header protocol of variable-size
  messages, with their cost;
* :mod:`~sparsync.comm.collective` - the collectives and the cost each records;
* :mod:`~sparsync.comm.base` - :class:`Comm`: the backend primitives, phases, sub-communicators.
"""

from __future__ import annotations

from .base import Comm
from .ledger import Ledger, PhaseCost
from .messages import CommError, Handle, gather_padded

__all__ = ["Comm", "Ledger", "PhaseCost", "Handle", "CommError", "gather_padded"]
