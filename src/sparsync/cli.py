"""``sparsync`` command line. Subcommands live in :mod:`sparsync.commands`, one module each.

Each module there defines ``register(subparsers)`` that adds its parser and sets ``func`` (a
callable taking the parsed args and returning an exit code). Modules are discovered automatically.
"""

from __future__ import annotations

import argparse
import importlib
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


if __name__ == "__main__":
    sys.exit(main())
