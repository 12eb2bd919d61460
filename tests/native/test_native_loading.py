"""Where the C kernels are loaded from (``sparsync.native.loader``, ``trust``, ``binding``).

A library is code: loading it runs its constructors. The planted libraries here are real builds of
``kernels.c`` (they would pass every binding check) plus a constructor that writes a marker file,
so "not loaded" is proved by the marker's absence, and the control test shows the same file IS
loaded, and its constructor runs, once its owner and mode are right. Another user is played by
chown to uid 12345 (the tests run as root; those cases skip otherwise).
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from sparsync import native
from sparsync.native import binding, build, loader, trust

pytestmark = pytest.mark.skipif(shutil.which(build.compiler()[0]) is None, reason="no C compiler here")

OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")

CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(library, marker): kernels.c with a constructor that writes ``marker``, built like the real one."""
    d = tmp_path_factory.mktemp("planted")
    marker = d / "MARKER"
    src = d / "planted.c"
    src.write_text(build.SOURCE.read_text() + CONSTRUCTOR)
    lib = d / "planted.so"
    defines = [f'-DMARKER="{marker}"', f'-DSPARSYNC_SOURCE_SHA="{build.source_sha()}"']
    subprocess.run(build.compiler() + ["-O0", "-fPIC", "-shared", *defines, "-o", str(lib), str(src), "-lm"],
                   check=True, capture_output=True)
    return lib, marker


@pytest.fixture
def checkout(monkeypatch, tmp_path):
    """A source checkout (no packaged library) whose cache is ``tmp_path/cache/native``; fresh state."""
    monkeypatch.setattr(loader, "PACKAGE_DIR", tmp_path / "package")
    (tmp_path / "package").mkdir()
    monkeypatch.setenv("SPARSYNC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSYNC_NATIVE", "1")
    monkeypatch.setattr(native, "_state", {})
    return tmp_path / "cache" / "native"


def _plant(cache: Path, planted, dir_mode=0o755, file_mode=0o755):
    lib, marker = planted
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(dir_mode)
    target = cache / build.cache_name()
    shutil.copy(lib, target)
    target.chmod(file_mode)
    if marker.exists():
        marker.unlink()
    return target, marker


def _refused(match: str, marker: Path):
    with pytest.raises(trust.Untrusted, match=match):
        loader.load()
    assert not marker.exists(), "the planted library ran"


@as_root
def test_a_library_planted_by_another_user_is_never_loaded(checkout, planted):
    target, marker = _plant(checkout, planted)
    os.chown(target, OTHER_UID, OTHER_UID)
    _refused(rf"{target.name} could have been written by another user \(owner uid {OTHER_UID}", marker)
    os.chown(target, 0, 0)
    os.chown(checkout, OTHER_UID, OTHER_UID)  # the directory: its owner could swap the file any time
    _refused(rf"{checkout} is not a directory only its owner can write.*owner uid {OTHER_UID}", marker)


def test_a_group_or_world_writable_library_or_directory_is_never_loaded(checkout, planted):
    for file_mode in (0o775, 0o757, 0o777):
        target, marker = _plant(checkout, planted, file_mode=file_mode)
        _refused(rf"{target.name} could have been written by another user .*mode {file_mode:o}", marker)
    for dir_mode in (0o775, 0o777, 0o1777):  # sticky is no excuse for the directory that holds the file
        target, marker = _plant(checkout, planted, dir_mode=dir_mode)
        _refused(rf"{checkout} is not a directory only its owner can write.*mode {dir_mode:o}", marker)
    checkout.chmod(0o755)
    checkout.parent.chmod(0o777)  # an ancestor others may write: they could rename the cache away
    _refused(rf"{checkout.parent} could be changed by another user", marker)


def test_a_symbolic_link_is_not_followed_to_a_library(checkout, planted):
    lib, marker = planted
    checkout.mkdir(parents=True)
    (checkout / build.cache_name()).symlink_to(lib)
    _refused("is a symbolic link", marker)


@as_root
def test_a_cache_reached_through_a_link_into_another_users_directory_is_refused(checkout, planted, tmp_path):
    lib, marker = planted
    theirs = tmp_path / "theirs"
    (theirs / "native").mkdir(parents=True)
    shutil.copy(lib, theirs / "native" / build.cache_name())
    os.chown(theirs, OTHER_UID, OTHER_UID)
    checkout.parent.mkdir()
    checkout.symlink_to(theirs / "native")
    _refused(rf"{theirs} could be changed by another user", marker)


def test_the_same_file_is_loaded_once_owner_and_mode_are_right(checkout, planted):
    """The control: the marker mechanism works, and the rule refuses only what it should."""
    target, marker = _plant(checkout, planted, dir_mode=0o700, file_mode=0o777)
    checkout.parent.chmod(0o1777)  # a sticky ancestor (like /tmp) is fine
    _refused("could have been written by another user", marker)
    target.chmod(0o755)
    lib, origin = loader.load()
    assert marker.exists() and origin == f"the build cache {checkout}"
    assert lib.sparsync_source_sha().decode() == build.source_sha()


def test_refusal_is_one_warning_and_the_torch_kernels(checkout, planted):
    import torch

    from sparsync.select.threshold import threshold_indices

    _, marker = _plant(checkout, planted, file_mode=0o666)
    with pytest.warns(RuntimeWarning, match=r"C kernels not loaded \(.*could have been written by another user"):
        assert not native.enabled()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        got = threshold_indices(x, 1.5)
        assert not native.enabled() and "could have been written" in native.info()["why"]
    assert torch.equal(got, torch.nonzero(x.abs() >= 1.5).squeeze(1)) and not marker.exists()


def test_a_library_without_the_kernels_falls_back_with_a_warning(checkout, tmp_path):
    src = tmp_path / "empty.c"
    src.write_text("int unrelated(void);\nint unrelated(void) { return 1; }\n")
    checkout.mkdir(parents=True)
    subprocess.run(build.compiler() + ["-shared", "-fPIC", "-o", str(checkout / build.cache_name()), str(src)],
                   check=True, capture_output=True)
    with pytest.warns(RuntimeWarning, match="is not a build of sparsync's kernels: it lacks sparsync_source_sha"):
        assert not native.enabled()  # not an AttributeError


def test_a_library_of_other_source_or_another_table_is_refused(checkout, monkeypatch, tmp_path):
    lib, origin = loader.load()  # the real build, into the private cache
    assert origin == f"the build cache {checkout}" and (checkout / build.cache_name()).exists()
    edited = tmp_path / "kernels.c"
    edited.write_text(build.SOURCE.read_text() + "\n/* edited */\n")
    with pytest.raises(binding.OtherSource, match="built from other source"):
        binding.bind(ctypes.CDLL(str(checkout / build.cache_name())), edited)
    changed = dict(binding.TABLE, sparsync_zero_nt=(None, (ctypes.c_void_p, ctypes.c_int)))
    monkeypatch.setattr(binding, "TABLE", changed)
    with pytest.raises(build.BuildError, match="table and the prototypes of kernels.c differ for sparsync_zero_nt"):
        binding.bind(ctypes.CDLL(str(checkout / build.cache_name())))


def test_an_edited_source_is_built_again_under_its_own_name(checkout, monkeypatch, tmp_path):
    first = build.cache_name()
    edited = tmp_path / "kernels.c"
    edited.write_text(build.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(build, "SOURCE", edited)
    assert build.cache_name() != first
    lib, _ = loader.load()
    assert (checkout / build.cache_name()).exists() and lib.sparsync_source_sha().decode() == build.source_sha(edited)
    assert oct(checkout.stat().st_mode & 0o777) == "0o700"  # made private


def test_a_failing_or_missing_compiler_is_a_reason_not_a_crash(checkout, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-sparsync")
    with pytest.warns(RuntimeWarning, match="no C compiler .'no-such-cc-sparsync' not found"):
        assert not native.enabled()
    monkeypatch.setenv("CC", "false")
    with pytest.raises(build.BuildError, match="false failed on kernels.c"):
        loader.load()


def test_an_uncreatable_cache_builds_in_a_private_directory_left_empty(checkout, monkeypatch, tmp_path, planted):
    """The issue's case: the cache cannot be created; a library planted where a shared fallback
    directory used to be ($TMPDIR/sparsync-native-<uid>) is not looked at."""
    blocker = tmp_path / "a-file"
    blocker.write_text("where the cache directory would go")
    monkeypatch.setenv("SPARSYNC_CACHE", str(blocker))
    tmp = tmp_path / "tmp"
    (tmp / f"sparsync-native-{os.getuid()}").mkdir(parents=True)
    lib, marker = planted
    shutil.copy(lib, tmp / f"sparsync-native-{os.getuid()}" / build.cache_name())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    got, origin = loader.load()
    assert "private temporary build" in origin and got.sparsync_source_sha().decode() == build.source_sha()
    assert os.listdir(tmp) == [f"sparsync-native-{os.getuid()}"]  # the private directory is gone
    assert not marker.exists()


def test_the_issue_command_with_a_planted_fallback_runs_no_planted_code(tmp_path, planted):
    """``SPARSYNC_CACHE=/proc/x python -c "from sparsync import native; native.info()"`` in a fresh
    process of a source checkout (no packaged library), with the planted library at the old shared
    fallback path ``$TMPDIR/sparsync-native-<uid>``."""
    lib, marker = planted
    fallback = tmp_path / f"sparsync-native-{os.getuid()}"
    fallback.mkdir()
    shutil.copy(lib, fallback / build.cache_name())
    (tmp_path / "no-package").mkdir()
    env = dict(os.environ, SPARSYNC_CACHE="/proc/x", TMPDIR=str(tmp_path), SPARSYNC_NATIVE="1",
               PYTHONPATH=str(Path(native.__file__).parents[2]))
    script = ("import sys; from pathlib import Path; from sparsync.native import loader; "
              "loader.PACKAGE_DIR = Path(sys.argv[1]); from sparsync import native; print(native.info())")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "no-package")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "'enabled': True" in out.stdout and "private temporary build" in out.stdout
    assert not marker.exists()
    assert set(os.listdir(tmp_path)) == {fallback.name, "no-package"}  # the private build directory is gone


def test_a_packaged_library_is_loaded_and_no_compiler_runs(monkeypatch, tmp_path):
    """The installed case: the library setup.py put into the package is used, ``$CC`` never runs
    (a compiler that leaves a marker); a stale one (older kernels.c) sends a checkout to its cache."""
    package = tmp_path / "package"
    package.mkdir()
    build.compile_library(package / build.PACKAGED)
    ran = tmp_path / "cc-ran"
    fake_cc = tmp_path / "fake-cc"
    fake_cc.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setattr(loader, "PACKAGE_DIR", package)
    monkeypatch.setenv("SPARSYNC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake_cc))
    lib, origin = loader.load()
    assert origin == "installed with the package" and not ran.exists()
    edited = tmp_path / "kernels.c"
    edited.write_text(build.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(build, "SOURCE", edited)
    with pytest.raises(build.BuildError, match="fake-cc failed"):  # the stale copy is not used
        loader.load()
    assert ran.exists()


def test_an_install_without_kernels_warns_with_its_reason_and_compiles_nothing(monkeypatch, tmp_path):
    package = tmp_path / "package"
    package.mkdir()
    (package / build.UNAVAILABLE).write_text("no C compiler ('cc' not found; set $CC or install gcc)\n")
    monkeypatch.setattr(loader, "PACKAGE_DIR", package)
    monkeypatch.setenv("CC", "no-such-cc-sparsync")
    monkeypatch.setenv("SPARSYNC_NATIVE", "1")
    monkeypatch.setattr(native, "_state", {})
    with pytest.warns(RuntimeWarning, match=r"not built at install: no C compiler \('cc' not found"):
        assert not native.enabled()


@as_root
def test_a_packaged_library_of_another_user_is_refused(monkeypatch, tmp_path, planted):
    lib, marker = planted
    package = tmp_path / "package"
    package.mkdir()
    shutil.copy(lib, package / build.PACKAGED)
    os.chown(package / build.PACKAGED, OTHER_UID, OTHER_UID)
    monkeypatch.setattr(loader, "PACKAGE_DIR", package)
    if marker.exists():
        marker.unlink()
    _refused("could have been written by another user", marker)


def test_kernels_compile_without_warnings(tmp_path):
    cmd = build.command(str(tmp_path / "k.so")) + ["-Werror"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert binding.exported() == binding.TABLE
