"""The ctypes binding of the C kernels: one declared table, checked against the library at load.

:data:`TABLE` names every function sparsync calls with its return and argument types; nothing else
in the package declares a C signature. :func:`bind` sets ``restype``/``argtypes`` from it after
three checks, any of which refuses the library with :class:`~sparsync.native.build.BuildError`
(the caller then falls back to the torch kernels with one warning):

1. every name of the table is exported by the library (a foreign ``.so`` lacks them);
2. the library was built from the source shipped beside this module: it reports the SHA-256 of its
   source (``sparsync_source_sha``), the interface version, derived rather than numbered by hand;
3. the table equals the exported prototypes of that source (the block between ``exports: begin``
   and ``exports: end`` in ``kernels.c``; the compiler holds every definition to that block).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from . import build
from .build import BuildError


class OtherSource(BuildError):
    """The library was built from another version of ``kernels.c`` than the one beside this module."""


_i64, _int, _f32, _ptr, _str = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p

#: name -> (restype, argtypes): the one declaration of the C interface on the Python side
TABLE: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "sparsync_source_sha": (_str, ()),
    "sparsync_vectorised": (_int, ()),
    "sparsync_compact_abs_ge_f32": (_i64, (_ptr, _i64, _f32, _i64, _ptr, _i64)),
    "sparsync_compact_rows_abs_ge_f32": (_i64, (_ptr, _i64, _i64, _ptr, _ptr, _i64)),
    "sparsync_bucket_count_f32": (None, (_ptr, _i64, _ptr, _i64, _ptr, _ptr)),
    "sparsync_decode_block16": (_i64, (_ptr, _i64, _i64, _i64, _ptr)),
    "sparsync_momentum_fold_f32": (None, (_ptr, _ptr, _ptr, _i64, _f32, _int)),
    "sparsync_zero_nt": (None, (_ptr, _i64)),
    "sparsync_sum_check_f32": (_int, (_ptr, _ptr, _ptr, _i64)),
    "sparsync_take_clear_f32": (_int, (_ptr, _i64, _ptr, _i64, _ptr)),
    "sparsync_chunked_topk_f32": (_i64, (_ptr, _i64, _i64, _i64, _i64, _ptr)),
    "sparsync_add_packed_f32": (_i64, (_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _int)),
}

#: C scalar types of the exported prototypes -> ctypes (any pointer parameter is a c_void_p)
_C_TYPES = {"void": None, "int": _int, "int64_t": _i64, "float": _f32}
_BLOCK = re.compile(r"/\* exports: begin \*/(.*?)/\* exports: end \*/", re.S)
_PROTOTYPE = re.compile(r"^SPARSYNC_API\s+([\w\s]+?\**)\s*(sparsync_\w+)\((.*)\);\s*$")


def _c_type(decl: str, returned: bool) -> type | None:
    """``const float *x`` -> c_void_p, ``int64_t n`` -> c_int64; a returned ``const char *`` -> c_char_p."""
    if "*" in decl:
        base = decl.split("*")[0].replace("const", "").strip()
        return _str if returned and base == "char" else _ptr
    words = decl.replace("const", "").split()
    name = words[0] if returned else " ".join(words[:-1])
    if name not in _C_TYPES:
        raise BuildError(f"kernels.c exports a type the binding does not know: {decl!r}")
    return _C_TYPES[name]


def exported(source: Path | None = None) -> dict[str, tuple[type | None, tuple[type, ...]]]:
    """The exported prototypes of ``source`` (default: the kernels' source) in :data:`TABLE`'s form."""
    source = source or build.SOURCE
    block = _BLOCK.search(source.read_text())
    if block is None:
        raise BuildError(f"{source} has no 'exports: begin/end' block")
    table = {}
    for line in block.group(1).splitlines():
        m = _PROTOTYPE.match(line.strip())
        if m is None:
            continue
        ret, name, params = m.groups()
        args = [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]
        table[name] = (_c_type(ret, True), tuple(_c_type(a, False) for a in args))
    return table


def bind(lib: ctypes.CDLL, source: Path | None = None) -> ctypes.CDLL:
    """``lib`` with every function of :data:`TABLE` typed, after the checks of the module doc."""
    source = source or build.SOURCE
    missing = [name for name in TABLE if not hasattr(lib, name)]
    if missing:
        raise BuildError(f"{lib._name} is not a build of sparsync's kernels: it lacks {', '.join(missing)}")
    lib.sparsync_source_sha.restype, lib.sparsync_source_sha.argtypes = TABLE["sparsync_source_sha"]
    built_from, want = (lib.sparsync_source_sha() or b"").decode(errors="replace"), build.source_sha(source)
    if built_from != want:
        raise OtherSource(f"{lib._name} was built from other source (sha256 {built_from[:16]}, "
                         f"{source.name} here has {want[:16]})")
    declared = exported(source)
    if declared != TABLE:
        diff = sorted(n for n in set(declared) | set(TABLE) if declared.get(n) != TABLE.get(n))
        raise BuildError(f"the ctypes table and the prototypes of {source.name} differ for {', '.join(diff)}")
    for name, (restype, argtypes) in TABLE.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
    return lib
