"""Link rates of the emulated network: parsing, printing, and the token bucket that enforces them.

A link at ``bandwidth`` bits/s is a tbf qdisc (``tc qdisc replace dev <veth> root tbf rate <bw>
burst <b> limit <l>``). ``burst`` holds one TSO/GSO super-packet (64 KiB) plus one Ethernet frame -
a smaller bucket makes tbf segment or drop them - and at least 1 ms of traffic; ``limit`` (the
queue) holds 20 ms of traffic, enough for TCP to keep the link near its line rate without a
bloated queue (:func:`tbf_params`).
"""

from __future__ import annotations

__all__ = ["MAX_BANDWIDTH", "format_bandwidth", "link_bandwidth", "parse_bandwidth", "tbf_params"]

_TSO_MAX = 65536
_ETH_FRAME = 1514
_BURST_S = 1e-3
_QUEUE_S = 20e-3
MAX_BANDWIDTH = 10**12  # bits/s; 20 ms of it in bytes stays below 2^32


def parse_bandwidth(bw) -> int | None:
    """Bits per second for tc from ``"1gbit"``, ``"100mbit"``, ``"125MB/s"``, a number (bits/s) —
    :func:`sparsync.units.parse_rate`'s one rule (the ambiguous ``gbps`` family is refused);
    ``None``/``"none"``/``"unlimited"`` -> None (no limit)."""
    from ..units import parse_rate

    if bw is None or (isinstance(bw, str) and bw.strip().lower() in ("none", "unlimited", "inf", "")):
        return None
    try:
        val = parse_rate(bw)
    except ValueError as e:
        raise ValueError(f"bad bandwidth: {e}") from None
    if not val >= 8000:  # 1 kB/s: lower is a unit mistake (the 64 KiB tbf bucket alone takes a minute)
        raise ValueError(f"bandwidth must be at least 8kbit, got {bw!r}")
    return int(val)


def link_bandwidth(bw) -> int | None:
    """:func:`parse_bandwidth`, bounded by what an emulated link can hold: at most
    :data:`MAX_BANDWIDTH` (tbf's queue of 20 ms of traffic is a 32-bit byte count)."""
    val = parse_bandwidth(bw)
    if val is not None and not val <= MAX_BANDWIDTH:
        raise ValueError(f"bandwidth must be at most {format_bandwidth(MAX_BANDWIDTH)} for an emulated link (tc's "
                         f"token bucket holds {_QUEUE_S * 1e3:g} ms of traffic in a 32-bit byte count), got {bw!r}")
    return val


def format_bandwidth(bits: int | None) -> str:
    """``1gbit``, ``100mbit``, ... (``None``: ``unlimited``)."""
    if bits is None:
        return "unlimited"
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= f:
            v = bits / f
            return f"{v:g}{unit}"
    return f"{bits}bit"


def tbf_params(bandwidth: int, burst_bytes: int | None = None, limit_bytes: int | None = None) -> tuple[int, int]:
    """(burst, limit) bytes of the tbf at ``bandwidth`` bits/s (module docstring); given values win."""
    rate_Bps = bandwidth / 8
    burst = burst_bytes or max(_TSO_MAX + _ETH_FRAME, int(rate_Bps * _BURST_S))
    limit = limit_bytes or max(4 * burst, int(rate_Bps * _QUEUE_S))
    return burst, limit
