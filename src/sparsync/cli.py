"""``sparsync`` command line. Subcommands live in :mod:`sparsync.commands`, one module each.

Each module there defines ``register(subparsers)`` that adds its parser and sets ``func`` (a
callable taking the parsed args and returning an exit code). Modules are discovered automatically.

Errors that reach :func:`main` end in one line on stderr, never a traceback (``SPARSYNC_TRACEBACK=1``
prints it too): exit code 2 for what the user can fix (bad input, a checkpoint or run directory that
does not fit, a runs dir that is a file or read-only, a full disk), 1 for a run that failed (a rank
crashed, stopped or raised; NaN), 130 for Ctrl-C. Table of cases: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, commands

    parser = argparse.ArgumentParser(
        prog="sparsync",
        description="Sparse gradient communication for data-parallel PyTorch on bandwidth-limited networks.",
    )
    parser.add_argument("--version", action="version", version=f"sparsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{mod.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
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
        return f"{e.strerror}{where}"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
