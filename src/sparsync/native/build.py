"""Compile ``kernels.c`` into a shared library: one command, used at install and by the developer path.

What: :func:`compile_library` runs ``$CC`` (default ``cc``) with :data:`FLAGS` and :data:`WARNINGS`
on :data:`SOURCE` and puts the library at ``target`` atomically (a private temporary file in the
target's directory, made readable by all and writable by the owner only, then ``os.replace``: ranks
that build at once each write their own file, the last rename wins, all are identical). The
library reports the SHA-256 of the source it was built from (``sparsync_source_sha``, passed as
``-DSPARSYNC_SOURCE_SHA``): that digest is the interface version, checked at load
(:mod:`sparsync.native.binding`), so no version number is kept in sync by hand.

When: ``setup.py`` calls it when the package is built or installed (``pip install .``,
``pip install -e .``) and puts the library into the package (:data:`PACKAGED`); if that fails it
writes the reason next to it (:data:`UNAVAILABLE`) and the install goes on with the torch kernels.
At run time :mod:`sparsync.native.loader` compiles only in a source checkout (no packaged library, or
one built from other source): never after a successful install.

Why not ``torch.utils.cpp_extension``: it compiles against torch's C++ headers (~1 min on two cores)
and needs ninja; these kernels take raw pointers and need nothing but a C compiler.

This module uses the standard library only: ``setup.py`` loads it by path, before sparsync (and
torch) can be imported.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
#: the library's file name inside the package (loaded with ctypes: not a Python extension module)
PACKAGED = "libsparsync_kernels.so"
#: written instead of :data:`PACKAGED` when the install-time build failed: the reason, one line
UNAVAILABLE = "libsparsync_kernels.unavailable"
#: only the functions kernels.c declares with SPARSYNC_API are exported
FLAGS = ["-O2", "-fPIC", "-shared", "-std=c99", "-fvisibility=hidden"]
#: kernels.c compiles clean under these (a test adds -Werror)
WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wmissing-prototypes", "-Wconversion"]
LIBS = ["-lm"]  # fmaf (momentum_fold's scalar tail)
#: a build that takes longer than this is abandoned (the torch kernels are used instead)
TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The C kernels could not be compiled, or a library was refused (the message says why)."""


def compiler() -> list[str]:
    """The compiler command: ``$CC`` split like a shell would, default ``cc``."""
    return shlex.split(os.environ.get("CC", "cc")) or ["cc"]


def source_sha(source: Path | None = None) -> str:
    """The SHA-256 (hex) of the kernels' source (default :data:`SOURCE`): what a library built from it reports."""
    return hashlib.sha256((source or SOURCE).read_bytes()).hexdigest()


def cache_name(source: Path | None = None) -> str:
    """The file name of a build of ``source`` in a cache: keyed by the source, the compiler command
    and the platform, so an edited source or another machine never finds a stale build."""
    key = hashlib.sha256()
    key.update((source or SOURCE).read_bytes())
    key.update(" ".join(compiler() + FLAGS + LIBS).encode())
    key.update(f"{platform.system()}-{platform.machine()}".encode())
    return f"sparsync_kernels-{key.hexdigest()[:16]}.so"


def command(output: str, source: Path | None = None) -> list[str]:
    """The full compile command for ``source`` (default :data:`SOURCE`) into ``output``."""
    source = source or SOURCE
    return (compiler() + FLAGS + WARNINGS + [f'-DSPARSYNC_SOURCE_SHA="{source_sha(source)}"', "-o", output,
                                             str(source)] + LIBS)


def compile_library(target: Path, source: Path | None = None) -> str:
    """Compile ``source`` (default :data:`SOURCE`) into ``target`` (its directory must exist); returns
    the compiler's diagnostics (warnings), :class:`BuildError` with the reason when no library came out."""
    source = source or SOURCE
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    cmd = command(tmp, source)
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except FileNotFoundError:
            raise BuildError(f"no C compiler ({cmd[0]!r} not found; set $CC or install gcc)") from None
        except subprocess.TimeoutExpired:
            raise BuildError(f"{cmd[0]} took over {TIMEOUT_S} s to compile {source.name}") from None
        if proc.returncode != 0:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise BuildError(f"{cmd[0]} failed on {source.name} (exit {proc.returncode}): {last[0]}")
        os.chmod(tmp, 0o755)  # the linker made it with the umask's mode: group/others never write it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return (proc.stderr or proc.stdout).strip()
