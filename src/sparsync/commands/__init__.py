"""Subcommands of the ``sparsync`` CLI (one module each, discovered by :mod:`sparsync.cli`), and the
pieces they share: :class:`UsageError` (a user error: one line, exit code 2), argument types that
read rates, counts and durations with :mod:`sparsync.units`' one rule, bounded numbers
(:func:`float_in`, :func:`int_in`) and ``key=value`` options (:func:`parse_kv`). A module whose name
starts with ``_`` holds pieces of a subcommand and is not one itself.

Nothing here imports torch: ``sparsync --help`` builds every parser without it.
"""

from __future__ import annotations

import argparse
import math
import re

from ..units import format_rate, link_bandwidth, parse_count, parse_duration, parse_rate


class UsageError(ValueError):
    """A user error the CLI reports as one line (``sparsync <command>: error: ...``), exit code 2."""


def _arg_type(fn, name):
    def conv(s):
        try:
            return fn(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    conv.__name__ = name
    return conv


def _network(s: str) -> str:
    """``loopback`` / ``none`` stay; a rate becomes its canonical tc spelling (``1Gb/s`` -> ``1gbit``);
    a topology spec (``2x2@10gbit/200mbit``, :class:`sparsync.sites.Topology`) its canonical spelling.
    A rate is bounded as an emulated link's (:func:`sparsync.units.link_bandwidth`, the one bound of
    ``--bandwidth``, ``--rate-schedule`` and a topology's levels), so a rate no link can hold is refused
    while the options are read: before any network of a list runs."""
    from ..sites import Topology, is_topology_spec

    if s.strip().lower() in ("loopback", "none"):
        return s.strip().lower()
    if is_topology_spec(s):
        return Topology.from_spec(s).spec()
    bits = parse_rate(s)  # an unreadable rate: the accepted forms
    link_bandwidth(s)
    return format_rate(bits)


def _positive_int(s) -> int:
    v = parse_count(s)
    if v < 1:
        raise ValueError(f"expected a positive integer, got {s!r}")
    return v


def _density(s) -> float:
    v = float(s)
    if not 0 < v <= 1:
        raise ValueError(f"density must be in (0, 1], got {s!r}")
    return v


def _list(fn):
    def conv(s):
        items = [x.strip() for x in str(s).split(",") if x.strip()]
        if not items:
            raise ValueError(f"expected a comma-separated list, got {s!r}")
        return [fn(x) for x in items]

    return conv


#: argparse ``type=`` callables; a bad value is one line naming the accepted forms
RATE = _arg_type(lambda s: format_rate(parse_rate(s)), "rate")
NETWORK = _arg_type(_network, "network")
NETWORKS = _arg_type(_list(_network), "networks")
COUNT = _arg_type(parse_count, "count")
COUNTS = _arg_type(_list(parse_count), "counts")
WORKERS = _arg_type(_positive_int, "workers")
WORKERS_LIST = _arg_type(_list(_positive_int), "workers list")
DURATION = _arg_type(parse_duration, "duration")
DENSITY = _arg_type(_density, "density")
DENSITIES = _arg_type(_list(_density), "densities")
NAMES = _arg_type(_list(str), "names")


class _Deprecated(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        print(f"note: {option_string} is deprecated; use {self.metavar}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def doc_text(doc: str) -> str:
    """A docstring as ``--help`` text: Sphinx roles (``:mod:`x```) and double backquotes become `x`."""
    return re.sub(r":[a-z]+:`", "`", doc).replace("``", "`")


def deprecated_alias(parser, old: str, new: str, dest: str, type=None) -> None:  # noqa: A002
    """``old`` still works (hidden from --help, a note on stderr) and fills ``dest`` like ``new``."""
    parser.add_argument(old, dest=dest, type=type, action=_Deprecated, metavar=new, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


#: what a key=value error adds: a site layout's commas and semicolons split the list unless quoted
QUOTE_HINT = "a value holding ',' or ';' is quoted, e.g. sites=\"0,2;1,3\""


def split_unquoted(text: str, sep: str, what: str = "value") -> list[str]:
    """``text`` split at every ``sep`` outside a quoted part (``'...'`` or ``"..."``; the quotes are
    kept, :func:`parse_value` removes them): ``'a=1,sites="0,1;2,3"'`` -> ``['a=1', 'sites="0,1;2,3"']``.
    UsageError (one line) for a quote that is never closed."""
    parts, cur, quote = [], [], None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == sep:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if quote:
        raise UsageError(f"{what} {text!r}: the quote {quote} is never closed")
    parts.append("".join(cur))
    return parts


def parse_kv(items: list[str] | None, what: str) -> dict:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (numbers and true/false parsed). Items are split at
    commas outside quotes, so a value holding commas is quoted: ``sites="0,1;2,3"`` (a site layout)."""
    out = {}
    for it in items or []:
        for part in split_unquoted(it, ",", what):
            if not part:
                continue
            if "=" not in part:
                raise UsageError(f"{what} must look like key=value, got {part!r} ({QUOTE_HINT})")
            k, v = part.split("=", 1)
            out[k.strip()] = parse_value(v.strip())
    return out


def parse_value(v: str):
    """A ``key=value`` value: a quoted one (``'...'`` or ``"..."``) as the string inside the quotes;
    else true/yes and false/no as booleans, then an int, then a float, else the string."""
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        return v[1:-1]
    low = v.lower()
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def float_in(lo, hi, what, lo_open=True):
    """argparse type: a finite number in ``(lo, hi]`` (``[lo, hi]`` with ``lo_open=False``)."""
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected a number, got {s!r}") from None
        if not ((lo < v if lo_open else lo <= v) and v <= hi and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number in {'(' if lo_open else '['}{lo:g}, "
                                             f"{hi:g}], got {s!r}")
        return v

    return conv


#: largest seed: every generator seed derived from it (seed * mix + epoch ...) stays inside torch's 64 bits
SEED_MAX = 2**31 - 1
#: largest --timeout / --time-limit in seconds (a year; what torch's collective timeouts can hold)
SECONDS_MAX = 365 * 86400.0


def int_in(lo, hi, what):
    """argparse type: an integer in ``[lo, hi]`` (``1e3``-style integral numbers accepted)."""
    def conv(s):
        try:
            v = parse_count(s) if not str(s).strip().startswith("-") else -parse_count(str(s).strip()[1:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected an integer, got {s!r}") from None
        if not lo <= v <= hi:
            rng = f">= {lo}" if hi >= 2**62 else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{what} must be an integer {rng}, got {s!r}")
        return v

    return conv


SEED = int_in(0, SEED_MAX, "--seed")
