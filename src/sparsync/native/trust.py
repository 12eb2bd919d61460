"""Whether a shared library may be loaded: only from places no other user can write.

Loading a library runs its code (its constructors run at ``dlopen``), so a library is loaded only
when nobody but the current user (and root) can have written it or can swap it before it is loaded:

* its directory is owned by one of ``owners`` and not writable by group or others;
* every directory on the way there, symbolic links followed one by one, is owned by root or the
  current user and not writable by group or others unless it is sticky (``/tmp``: others cannot
  rename or delete what they do not own);
* the file is a regular file (opened with ``O_NOFOLLOW``: a symbolic link is refused), owned by
  one of ``owners`` and not writable by group or others.

The same rule as OpenSSH's ``StrictModes`` for ``authorized_keys``. :func:`verified_library` raises
:class:`Untrusted`, naming the path and what is wrong with it, on any doubt.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .build import BuildError

#: at most this many symbolic links on the way (the kernel's own limit is 40)
_MAX_LINKS = 40


class Untrusted(BuildError):
    """A library or one of its directories could have been written by another user."""


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"


def _check_dir(path: Path, st: os.stat_result, owners: set[int], leaf: bool) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is not a directory")
    writable = stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    if leaf and (st.st_uid not in owners or writable):
        raise Untrusted(f"{path} is not a directory only its owner can write, owned by uid "
                        f"{sorted(owners)} ({_describe(st)})")
    if not leaf and (st.st_uid not in (0, os.geteuid()) or (writable and not st.st_mode & stat.S_ISVTX)):
        raise Untrusted(f"{path} could be changed by another user ({_describe(st)})")


def verified_directory(directory: Path, owners: set[int]) -> Path:
    """``directory`` resolved, after checking every directory from ``/`` to it (see the module doc)."""
    pending = list(Path(os.path.abspath(directory)).parts[1:])
    current = Path("/")
    _check_dir(current, os.stat(current), owners, leaf=False)
    links = 0
    while pending:
        name = pending.pop(0)
        if name == "..":
            current = current.parent
            continue
        nxt = current / name
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):  # the link lives in `current`, already checked: follow it
            links += 1
            if links > _MAX_LINKS:
                raise Untrusted(f"{directory}: too many symbolic links")
            target = Path(os.readlink(nxt))
            if target.is_absolute():
                current = Path("/")
            pending = list(target.parts[1:] if target.is_absolute() else target.parts) + pending
            continue
        if pending:  # the last one is checked as the leaf below
            _check_dir(nxt, st, owners, leaf=False)
        current = nxt
    _check_dir(current, os.stat(current), owners, leaf=True)
    return current


def verified_library(path: Path, owners: set[int]) -> Path:
    """``path`` (resolved) when it may be loaded (see the module doc), else :class:`Untrusted`.
    ``FileNotFoundError`` when it does not exist."""
    directory = verified_directory(path.parent, owners)
    real = directory / path.name
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(f"{real} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"{real} is not a regular file")
    if st.st_uid not in owners or stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{real} could have been written by another user ({_describe(st)}; "
                        f"loaded only when owned by uid {sorted(owners)} and writable by its owner alone)")
    return real
