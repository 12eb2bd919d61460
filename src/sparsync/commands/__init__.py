"""Subcommands of the ``sparsync`` CLI (one module each, discovered by :mod:`sparsync.cli`)."""
