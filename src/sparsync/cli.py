"""``sparsync`` command line. Subcommands live in :mod:`sparsync.commands`, one module each.

Each module there defines ``register(subparsers)`` that adds its parser and sets ``func`` (a
callable taking the parsed args and returning an exit code). Modules are discovered automatically;
one whose name starts with ``_`` holds pieces of a subcommand and is skipped.

User errors (a bad option, an unknown name, a rate that cannot be read) are one line on stderr and
exit code 2, never a traceback: argparse's own errors through :class:`Parser`, errors found while
validating through :class:`sparsync.commands.UsageError`. ``--help`` shows every default. Building
the parsers imports no torch, so ``sparsync --help`` / ``--version`` are instant.

Errors at run time that reach :func:`main` also end in one line (``SPARSYNC_TRACEBACK=1`` prints the
traceback too): exit code 2 for what the user can fix (a checkpoint or run directory that does not
fit, a runs dir that is a file or read-only, a full disk), 1 for a run that failed (a rank crashed,
stopped or raised; NaN), 130 for Ctrl-C. Table of cases: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import errno
import gc
import importlib
import os
import pkgutil
import sys

#: torchrun's own flags; given to sparsync they get a hint instead of a bare "unrecognized"
TORCHRUN_FLAGS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank", "--node_rank",
                  "--master-addr", "--master_addr", "--master-port", "--master_port", "--rdzv-backend",
                  "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--standalone")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage stays in ``--help``) and a hint for torchrun flags."""

    def error(self, message: str):
        hint = ""
        if any(f in message for f in TORCHRUN_FLAGS):
            hint = (" (that is a torchrun flag: `sparsync train` starts its own ranks, set their number with "
                    "--workers N; for several machines run `torchrun --nnodes ... --nproc-per-node ... "
                    "-m sparsync.cli train ...`, see docs/train.md)")
        elif "unrecognized arguments" in message or "invalid choice" in message:
            hint = f" (see `{self.prog} --help`)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and appends ``(default: X)`` where the help does not say it."""

    @staticmethod
    def _has_default(action) -> bool:
        d = action.default
        return bool(action.option_strings) and not (d is None or d is False or d is argparse.SUPPRESS or d == [])

    def _get_help_string(self, action):
        h = action.help or ""
        if self._has_default(action) and "default" not in h.lower():
            h += (" " if h else "") + "(default: %(default)s)"
        return h

    def _format_action(self, action):
        if not action.help and self._has_default(action):
            action.help = "(default: %(default)s)"  # argparse prints nothing for an empty help
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, commands

    parser = Parser(
        prog="sparsync", formatter_class=_Formatter,
        description="Sparse gradient communication for data-parallel PyTorch on bandwidth-limited networks.",
    )
    parser.add_argument("--version", action="version", version=f"sparsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    _orig = sub.add_parser

    def add_parser(name, **kw):  # every subcommand (and its own subcommands) shows its defaults
        kw.setdefault("formatter_class", _Formatter)
        p = _orig(name, **kw)
        _patch_subparsers(p)
        return p

    sub.add_parser = add_parser
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):  # a piece of a subcommand, not one
            continue
        importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return parser


def _patch_subparsers(p: argparse.ArgumentParser) -> None:
    orig = p.add_subparsers

    def add_subparsers(**kw):
        kw.setdefault("parser_class", Parser)
        s = orig(**kw)
        inner = s.add_parser

        def add_parser(name, **kw2):
            kw2.setdefault("formatter_class", _Formatter)
            return inner(name, **kw2)

        s.add_parser = add_parser
        return s

    p.add_subparsers = add_subparsers


def main(argv: list[str] | None = None) -> int:
    from .commands import UsageError
    from .extras import MissingExtra

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UsageError, MissingExtra) as e:
        print(f"sparsync {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        # Ctrl-C should end the program at once: the interpreter's final garbage collection of
        # everything torch and the workload allocated took 5-15 s beside other jobs (measured:
        # tests/launch/test_orphans.py); frozen objects are left to the OS (the ranks are gone,
        # the store is removed, the handlers already ran)
        gc.freeze()
        return 130
    except Exception as e:  # noqa: BLE001 - mapped to one line and an exit code
        code = exit_code(e)
        if code is None:
            raise  # a bug: keep the traceback
        if os.environ.get("SPARSYNC_TRACEBACK"):
            import traceback

            traceback.print_exc()
        print(f"sparsync {args.command}: error: {one_line(e)}", file=sys.stderr)
        return code


#: errno values of a filesystem the user must fix (permissions, a file where a directory belongs,
#: read-only, full disk, quota)
_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                errno.ENOSPC, errno.EDQUOT, errno.ENOENT, errno.ENAMETOOLONG}


def exit_code(e: BaseException) -> int | None:
    """2: the user can fix it; 1: the run failed; None: unexpected (a bug - show the traceback)."""
    from .cluster import ClusterUnavailable
    from .launch import RankFailed
    from .train.loop import NetworkUnavailable
    from .train.runs import CheckpointError, RunExists

    if isinstance(e, (CheckpointError, RunExists, NetworkUnavailable, ClusterUnavailable)):
        return 2
    if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
        return 2
    if isinstance(e, (ValueError, TypeError)) and getattr(e, "rank", None) is None:
        return 2
    if isinstance(e, (RankFailed, FloatingPointError)) or getattr(e, "rank", None) is not None:
        return 1
    return None


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (rank already named by the launcher), the path for OSError."""
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        who = f"rank {e.rank}: " if getattr(e, "rank", None) is not None else ""
        return f"{who}{e.strerror}{where}"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
