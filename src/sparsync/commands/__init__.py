"""Subcommands of the ``sparsync`` CLI (one module each, discovered by :mod:`sparsync.cli`), and the
pieces they share: :class:`UsageError` (a user error: one line, exit code 2) and argument types that
read rates, counts and durations with :mod:`sparsync.units`' one rule.

Nothing here imports torch: ``sparsync --help`` builds every parser without it.
"""

from __future__ import annotations

import argparse
import re

from ..units import format_rate, parse_count, parse_duration, parse_rate


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
    a topology spec (``2x2@10gbit/200mbit``, :class:`sparsync.sites.Topology`) its canonical spelling."""
    from ..sites import Topology, is_topology_spec

    if s.strip().lower() in ("loopback", "none"):
        return s.strip().lower()
    if is_topology_spec(s):
        return Topology.from_spec(s).spec()
    return format_rate(parse_rate(s))


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
