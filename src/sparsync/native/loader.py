"""Where the C kernels are loaded from: the build made at install, else (a source checkout) a
private build; never a file another user could have written.

:func:`load` returns ``(library, origin)`` bound by :func:`sparsync.native.binding.bind`, or raises
:class:`~sparsync.native.build.BuildError` naming the reason (the caller warns once and runs the
torch kernels). In order:

1. **installed**: the library ``setup.py`` compiled into the package (:data:`PACKAGE_DIR` /
   ``libsparsync_kernels.so``), owned by the current user or root and verified by
   :mod:`sparsync.native.trust`. Nothing is compiled. If the install-time build failed, the reason
   it left (``libsparsync_kernels.unavailable``) is raised: no compiler is tried again at run time.
2. **source checkout** (no packaged library, or one built from an older ``kernels.c``: an editable
   install whose source was edited): built once per source version into the cache
   ``$SPARSYNC_CACHE/native`` (else ``~/.cache/sparsync/native``), whose directories are made
   ``0700`` and must pass :mod:`~sparsync.native.trust` for the current user (directory and file);
   a cache that fails is refused, with the reason, and nothing in it is loaded.
3. When the cache cannot be created (a read-only or missing file system), the source is compiled
   into a fresh private temporary directory for this process, verified the same way, loaded, and
   the directory removed. There is no shared fallback location another user could fill first.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path

from . import build, trust
from .binding import OtherSource, bind
from .build import BuildError

PACKAGE_DIR = Path(__file__).parent


def cache_dir() -> Path:
    """The build cache of a source checkout: ``$SPARSYNC_CACHE/native``, else ``~/.cache/sparsync/native``."""
    base = os.environ.get("SPARSYNC_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "sparsync") / "native"


def _open(path: Path, owners: set[int]) -> ctypes.CDLL:
    real = trust.verified_library(path, owners)
    try:
        return bind(ctypes.CDLL(str(real)))
    except OSError as e:
        raise BuildError(f"could not load {real}: {e}") from None


def _installed() -> ctypes.CDLL | None:
    """The packaged library when it is the build of this source; None when there is none or it is stale."""
    path = PACKAGE_DIR / build.PACKAGED
    if not path.exists():
        why = PACKAGE_DIR / build.UNAVAILABLE
        if why.exists():
            raise BuildError(f"not built at install: {why.read_text().strip() or 'no reason given'}")
        return None
    try:
        return _open(path, {os.geteuid(), 0})
    except OtherSource:
        return None  # kernels.c edited since the install (an editable install): the cache builds it


def _make_private(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700 (never group- or world-writable)."""
    missing = []
    p = Path(os.path.abspath(directory))
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another rank made it meanwhile
            pass


def _cached() -> tuple[ctypes.CDLL, str]:
    try:
        directory = cache_dir()
    except (RuntimeError, KeyError):  # no $SPARSYNC_CACHE and no home directory
        return _private_build(), "a private temporary build (no home directory for the cache)"
    try:
        _make_private(directory)
        if not directory.is_dir():
            raise NotADirectoryError(f"{directory} is not a directory")
    except OSError:
        return _private_build(), "a private temporary build (the cache could not be created)"
    trust.verified_directory(directory, {os.geteuid()})  # before anything in it is used
    target = directory / build.cache_name()
    if not target.exists():
        try:
            build.compile_library(target)
        except PermissionError:  # a cache we may read but not write (a read-only copy)
            return _private_build(), f"a private temporary build (the cache {directory} is read-only)"
    return _open(target, {os.geteuid()}), f"the build cache {directory}"


def _private_build() -> ctypes.CDLL:
    tmp = Path(tempfile.mkdtemp(prefix="sparsync-native-"))
    try:
        target = trust.verified_directory(tmp, {os.geteuid()}) / build.cache_name()
        build.compile_library(target)
        return _open(target, {os.geteuid()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the loaded library stays mapped


def load() -> tuple[ctypes.CDLL, str]:
    """``(library, origin)``, or :class:`BuildError` with the reason (see the module doc)."""
    try:
        lib = _installed()
        if lib is not None:
            return lib, "installed with the package"
        return _cached()
    except OSError as e:  # e.g. a file that vanished between the checks, a directory we may not read
        raise BuildError(f"{e.filename or 'the kernels'}: {e.strerror or e}") from None
