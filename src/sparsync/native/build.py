"""Compile ``kernels.c`` once per machine and source version, into a cache, and load it.

What: :func:`load` returns the ``ctypes`` library, building it first when the cache has none for
this source (``cc -O2 -fPIC -shared``; ~0.2 s). The file is named by a hash of the source, the
compiler command and the platform, so an edited source or another machine never loads a stale
build. Several ranks starting at once each compile into a private temporary file and
``os.replace`` it into place (atomic): the last one wins, all are identical.

Where: ``$SPARSYNC_CACHE/native`` (the cache the workloads use), else ``~/.cache/sparsync/native``;
when that is not writable, a temporary directory. ``$CC`` picks the compiler (default ``cc``).

Why not ``torch.utils.cpp_extension``: it compiles against torch's C++ headers (~1 min on two cores)
and needs ninja; these kernels take raw pointers and need nothing but a C compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O2", "-fPIC", "-shared", "-std=c99"]
LIBS = ["-lm"]  # fmaf (momentum_fold's scalar tail)
#: a build that takes longer than this is abandoned (the torch kernels are used instead)
TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The C kernels could not be compiled or loaded (the message says why)."""


def cache_dir() -> Path:
    base = os.environ.get("SPARSYNC_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "sparsync"
    return root / "native"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc")) or ["cc"]


def library_path(directory: Path | None = None) -> Path:
    """Where the build for this source, compiler and platform lives."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(" ".join(_compiler() + FLAGS + LIBS).encode())
    key.update(f"{platform.system()}-{platform.machine()}".encode())
    return (directory or cache_dir()) / f"sparsync_kernels-{key.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    cmd = _compiler() + FLAGS + ["-o", tmp, str(SOURCE)] + LIBS
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except FileNotFoundError:
        os.unlink(tmp)
        raise BuildError(f"no C compiler ({cmd[0]!r} not found; set $CC or install gcc)") from None
    except subprocess.TimeoutExpired:
        os.unlink(tmp)
        raise BuildError(f"{' '.join(cmd)} took over {TIMEOUT_S} s") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise BuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {last[0]}")
    os.replace(tmp, target)


def load() -> ctypes.CDLL:
    """The compiled kernels (built on first use); :class:`BuildError` when that is impossible."""
    target = library_path()
    if not target.exists():
        try:
            _compile(target)
        except OSError:  # the cache is not writable (permissions, a read-only file system)
            target = library_path(Path(tempfile.gettempdir()) / f"sparsync-native-{os.getuid()}")
            if not target.exists():
                _compile(target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise BuildError(f"could not load {target}: {e}") from None
