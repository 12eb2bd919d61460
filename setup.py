"""Build hook: compile sparsync's C kernels into the package when it is built or installed.

Everything else about the package is declared in pyproject.toml. The kernels are a plain shared
library loaded with ctypes (``sparsync/native/libsparsync_kernels.so``), not a Python extension
module, so the extension below only carries their place in the build: ``build_ext`` (run by
``pip install .`` and, in place, by ``pip install -e .``) compiles ``kernels.c`` with the one command
of ``sparsync/native/build.py``. The extension is optional: when no compiler works the install still
succeeds, says so once, and leaves the reason beside the package (the torch kernels run, and the first
use warns once with that reason).
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "src" / "sparsync" / "native"


def _build_module():
    """sparsync/native/build.py, loaded by path (standard library only: torch need not be importable)."""
    spec = importlib.util.spec_from_file_location("_sparsync_native_build", NATIVE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """``build_ext`` for the kernels: sparsync's own compile command, a warning instead of a failure."""

    def get_ext_filename(self, fullname):
        if fullname.split(".")[-1] == "libsparsync_kernels":
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name != "sparsync.native.libsparsync_kernels":
            return super().build_extension(ext)
        build = _build_module()
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        unavailable = target.with_name(build.UNAVAILABLE)
        try:
            diagnostics = build.compile_library(target)
        except build.BuildError as e:
            if target.exists():
                target.unlink()  # a build of older source would be taken for this one
            unavailable.write_text(f"{e}\n")
            print(f"WARNING: sparsync: C kernels not built ({e}); the slower torch kernels will run",
                  file=sys.stderr)
            return
        if unavailable.exists():
            unavailable.unlink()
        if diagnostics:
            print(diagnostics, file=sys.stderr)
        print(f"sparsync: C kernels built into {target}", file=sys.stderr)


setup(
    ext_modules=[Extension("sparsync.native.libsparsync_kernels", sources=["src/sparsync/native/kernels.c"],
                           optional=True)],
    cmdclass={"build_ext": BuildKernels},
)
