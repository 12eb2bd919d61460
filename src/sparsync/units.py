"""One parser for rates, sizes, counts and durations, used by every CLI option and the library.

The rule (``docs/train.md``, "Units"): **bits are spelled ``bit``, bytes ``B`` or ``byte``**.

* rates (:func:`parse_rate`, returns bits per second): ``1gbit``, ``100mbit``, ``500kibit``,
  ``1Gbit/s``, ``1Gb/s`` (lowercase ``b`` with ``/s`` = bits), a bare number = bits/s — all as in
  tc(8), which builds the emulated network; bytes per second as ``125MB/s``, ``125MB`` or
  ``125mbyte/s``. Prefixes are SI (k = 1e3, m/M = 1e6, g/G = 1e9, t/T = 1e12) or IEC (ki, mi, gi, ti
  = powers of 1024).
* **Rejected as ambiguous:** the ``bps`` family (``1gbps``, ``100Mbps``): tc(8) reads it as BYTES
  per second, most people as bits per second; before this module ``plan`` and ``train`` disagreed
  on exactly this (8x). A lowercase ``b`` without ``/s`` (``1gb``) is refused for the same reason.
  The error message lists the accepted forms.
* sizes (:func:`parse_size`, bytes): ``25MB`` (SI, 25e6), ``25MiB`` (IEC, 25 * 2^20), ``4096``;
  ``25mb`` is refused (bits or bytes?).
* counts (:func:`parse_count`, an int): ``1e7``, ``10000000``, ``10M``, ``2.5k``.
* durations (:func:`parse_duration`, seconds): ``50us``, ``0.2ms``, ``1e-4`` (bare = seconds).
* link rates (:func:`parse_bandwidth`, :func:`link_bandwidth`: int bits/s or None for no limit) - a rate
  as above, at least 8kbit, and for a link of the emulated network (``--bandwidth``, ``--intra``,
  ``--inter``, rate schedules) at most :data:`MAX_BANDWIDTH`; :func:`format_rate` prints every rate.

Nothing here imports torch (the CLI parses its arguments before importing it).
"""

from __future__ import annotations

import re

__all__ = ["LINK_QUEUE_S", "MAX_BANDWIDTH", "RATE_FORMS", "format_rate", "link_bandwidth", "parse_bandwidth",
           "parse_count", "parse_duration", "parse_rate", "parse_size"]

RATE_FORMS = ("accepted: 1gbit, 100mbit, 500kibit, 1Gbit/s or 1Gb/s, or a bare number (bits/s, as tc); "
              "125MB/s, 125MB or 125mbyte/s (bytes/s)")
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_IEC = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_PREFIX = r"([kKmMgGtT]i|[kKmMgGtT]|)"
#: the queue of an emulated link's token bucket, in seconds of traffic (:mod:`sparsync.cluster.bandwidth`)
LINK_QUEUE_S = 20e-3
MAX_BANDWIDTH = 10**12  # bits/s of an emulated link: LINK_QUEUE_S of it in bytes stays below 2^32


def _prefix(p: str) -> float:
    p = p.lower()
    return _IEC[p] if p in _IEC else _SI[p]


def _number(x, what: str) -> float | None:
    if isinstance(x, bool):
        raise ValueError(f"{what}: expected a number or a string, got {x!r}")
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _positive(v: float, s, what: str) -> float:
    if not v > 0 or v == float("inf"):
        forms = f"; {RATE_FORMS}" if what == "rate" else ""
        raise ValueError(f"{what} must be positive and finite, got {s!r}{forms}")
    return v


def parse_rate(s) -> float:
    """Bits per second from ``"1gbit"``, ``"1Gb/s"``, ``"125MB/s"``, ``1e9`` (see the module rule).

    ValueError (naming the accepted forms) for anything else, including the ambiguous ``gbps``.
    """
    v = _number(s, "rate")
    if v is not None:
        return _positive(v, s, "rate")
    text = str(s).strip()
    m = re.fullmatch(_NUM + r"\s*" + _PREFIX + r"(.*)", text)
    if not m:
        raise ValueError(f"cannot read a rate from {s!r}; {RATE_FORMS}")
    num, pre, unit = float(m.group(1)), m.group(2), m.group(3)
    low = unit.lower()
    if re.fullmatch(r"bps|b/sec", low) or low.endswith("bps"):
        raise ValueError(f"rate {s!r} is ambiguous: tc reads '{pre}{unit}' as BYTES per second, most people as "
                         f"bits per second; write {m.group(1)}{pre.lower()}bit for bits/s or "
                         f"{m.group(1)}{pre.upper()}B/s for bytes/s ({RATE_FORMS})")
    if not low and pre:
        raise ValueError(f"rate {s!r} has no unit (bits or bytes?); {RATE_FORMS}")
    if low in ("", "bit", "bits", "bit/s", "bits/s") or unit == "b/s":
        mult = 1.0
    elif unit in ("B", "B/s") or low in ("byte", "bytes", "byte/s", "bytes/s"):
        mult = 8.0
    else:
        raise ValueError(f"cannot read a rate from {s!r}; {RATE_FORMS}")
    return _positive(num * _prefix(pre) * mult, s, "rate")


def format_rate(bits_per_s: float | None) -> str:
    """``1e9`` -> ``"1gbit"`` (the tc spelling, which :func:`parse_rate` reads back); None (no limit):
    ``"unlimited"``, which :func:`parse_bandwidth` reads back."""
    if bits_per_s is None:
        return "unlimited"
    for unit, f in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= f:
            return f"{bits_per_s / f:.12g}{unit}"
    return f"{bits_per_s:.12g}bit"


def parse_bandwidth(bw) -> int | None:
    """Bits per second of a link from ``"1gbit"``, ``"100mbit"``, ``"125MB/s"``, a number (bits/s) -
    :func:`parse_rate`'s one rule - at least 8kbit; ``None``/``"none"``/``"unlimited"`` -> None (no limit)."""
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
    :data:`MAX_BANDWIDTH` (tbf's queue of :data:`LINK_QUEUE_S` of traffic is a 32-bit byte count)."""
    val = parse_bandwidth(bw)
    if val is not None and not val <= MAX_BANDWIDTH:  # the bound in gbit ("1000gbit"), as the docs spell it
        raise ValueError(f"bandwidth must be at most {MAX_BANDWIDTH / 1e9:g}gbit for an emulated link (tc's "
                         f"token bucket holds {LINK_QUEUE_S * 1e3:g} ms of traffic in a 32-bit byte count), got {bw!r}")
    return val


def parse_size(s) -> int:
    """Bytes from ``"25MB"`` (SI), ``"25MiB"`` (IEC), ``"4k"``/``"4KB"``, ``4096``; ``"25mb"`` is refused."""
    v = _number(s, "size")
    if v is None:
        text = str(s).strip()
        m = re.fullmatch(_NUM + r"\s*" + _PREFIX + r"(B|bytes?|)", text, flags=0)
        if not m:
            raise ValueError(f"cannot read a size in bytes from {s!r}; accepted: 4096, 4k, 25MB (SI), 25MiB (IEC), "
                             "2GB (a lowercase 'b' could mean bits and is refused)")
        v = float(m.group(1)) * _prefix(m.group(2))
    if v < 0 or v != v:
        raise ValueError(f"size must be >= 0, got {s!r}")
    return int(round(v))


def parse_count(s) -> int:
    """A whole count from ``"1e7"``, ``"10000000"``, ``"10M"``, ``"2.5k"``; refuses fractions and negatives."""
    v = _number(s, "count")
    if v is None:
        m = re.fullmatch(_NUM + r"\s*([kKmMgG]?)", str(s).strip())
        if not m:
            raise ValueError(f"cannot read a count from {s!r}; accepted: 10000000, 1e7, 10M, 2.5k")
        v = float(m.group(1)) * _SI[m.group(2).lower()]
    if v < 0 or v != int(v):
        raise ValueError(f"expected a whole non-negative count, got {s!r}")
    return int(v)


def parse_duration(s) -> float:
    """Seconds from ``"50us"``, ``"0.2ms"``, ``"2s"``, ``"1e-4"`` (a bare number is seconds)."""
    v = _number(s, "duration")
    if v is None:
        m = re.fullmatch(_NUM + r"\s*(s|ms|us|µs|ns|)", str(s).strip().lower())
        if not m:
            raise ValueError(f"cannot read a duration from {s!r}; accepted: 50us, 0.2ms, 2s, 1e-4 (seconds)")
        v = float(m.group(1)) * {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]
    if v < 0 or v != v:
        raise ValueError(f"duration must be >= 0, got {s!r}")
    return v
