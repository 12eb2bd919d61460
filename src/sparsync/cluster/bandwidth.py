"""Link rates of the emulated network: the token bucket that enforces them. Reading and printing a rate
(:func:`parse_bandwidth`, :func:`link_bandwidth`, :func:`format_bandwidth`) lives in :mod:`sparsync.units`
(``sparsync.sites`` reads topology rates too) and stays importable from here.

A link at ``bandwidth`` bits/s is a tbf qdisc (``tc qdisc replace dev <veth> root tbf rate <bw>
burst <b> limit <l>``). ``burst`` holds one TSO/GSO super-packet (64 KiB) plus one Ethernet frame -
a smaller bucket makes tbf segment or drop them - and at least 1 ms of traffic; ``limit`` (the
queue) holds 20 ms of traffic, enough for TCP to keep the link near its line rate without a
bloated queue (:func:`tbf_params`).
"""

from __future__ import annotations

from ..units import LINK_QUEUE_S, MAX_BANDWIDTH, link_bandwidth, parse_bandwidth
from ..units import format_rate as format_bandwidth

__all__ = ["MAX_BANDWIDTH", "format_bandwidth", "link_bandwidth", "parse_bandwidth", "tbf_params"]

_TSO_MAX = 65536
_ETH_FRAME = 1514
_BURST_S = 1e-3
_QUEUE_S = LINK_QUEUE_S


def tbf_params(bandwidth: int, burst_bytes: int | None = None, limit_bytes: int | None = None) -> tuple[int, int]:
    """(burst, limit) bytes of the tbf at ``bandwidth`` bits/s (module docstring); given values win."""
    rate_Bps = bandwidth / 8
    burst = burst_bytes or max(_TSO_MAX + _ETH_FRAME, int(rate_Bps * _BURST_S))
    limit = limit_bytes or max(4 * burst, int(rate_Bps * _QUEUE_S))
    return burst, limit
