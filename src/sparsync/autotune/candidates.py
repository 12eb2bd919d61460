"""The configurations the ``auto`` reducer (:mod:`sparsync.reducers.auto`) chooses among: a
:class:`Candidate` is one registered reducer at one density with one value precision (``outer`` for
``hier``); :func:`parse_candidate` reads its spelling (``"dense:fp16"``, ``"micro:0.02"``,
``"hier:micro:0.01"``) and rejects, in one line, what the registry cannot build."""

from __future__ import annotations

from ..reducers.base import VALUE_DTYPES
from ..reducers.registry import REDUCERS

__all__ = ["Candidate", "candidate_list", "parse_candidate", "listed", "conserving", "for_adaptive_optimizer"]


class Candidate:
    """One configuration auto can run: ``reducer`` at ``density`` with ``value_dtype`` values;
    ``outer`` for ``hier`` (the reducer between sites)."""

    __slots__ = ("reducer", "density", "value_dtype", "outer")

    def __init__(self, reducer: str, density: float = 1.0, value_dtype: str = "fp32", outer: str | None = None):
        self.reducer, self.density, self.value_dtype, self.outer = reducer, float(density), value_dtype, outer

    @property
    def sparse(self) -> bool:
        return self.reducer != "dense"

    @property
    def spec(self) -> str:
        """The spelling :func:`parse_candidate` reads (also the label in stats and reports)."""
        parts = [self.reducer] + ([self.outer] if self.outer else [])
        if self.sparse:
            parts.append(f"{self.density:g}")
        if self.value_dtype != "fp32":
            parts.append(self.value_dtype)
        return ":".join(parts)

    def __repr__(self) -> str:
        return f"Candidate({self.spec})"


def parse_candidate(spec: str, density: float = 0.01) -> Candidate:
    """``"dense"``, ``"dense:fp16"``, ``"micro:0.01"``, ``"micro:0.02:fp16"``, ``"hier:micro:0.01"``;
    ValueError (one line) for anything else."""
    parts = [p.strip() for p in str(spec).split(":") if p.strip()]
    if not parts:
        raise ValueError(f"auto: empty candidate {spec!r}")
    name, rest, outer = parts[0], parts[1:], None
    if name in ("auto",):
        raise ValueError("auto: a candidate cannot be 'auto' itself")
    known = REDUCERS.load_all()
    if name not in known:
        raise ValueError(f"auto: candidate {spec!r}: unknown reducer {name!r}; valid: {', '.join(sorted(known))}")
    if name == "hier":
        if not rest or rest[0] in VALUE_DTYPES or _is_number(rest[0]):
            raise ValueError(f"auto: candidate {spec!r}: hier needs its outer reducer, e.g. 'hier:micro:0.01'")
        outer, rest = rest[0], rest[1:]
        if outer not in REDUCERS.load_all() or outer in ("hier", "auto"):
            raise ValueError(f"auto: candidate {spec!r}: {outer!r} cannot be hier's outer reducer")
    d, vd = (1.0 if name == "dense" else density), "fp32"
    for p in rest:
        if p in VALUE_DTYPES:
            vd = p
        elif _is_number(p) and 0 < float(p) <= 1:
            d = float(p)
        else:
            raise ValueError(f"auto: candidate {spec!r}: {p!r} is neither a density in (0, 1] nor one of "
                             f"{', '.join(VALUE_DTYPES)}")
    cls = REDUCERS.lookup(outer or name)
    if VALUE_DTYPES[vd] is not None and not cls.supports_value_dtype:
        raise ValueError(f"auto: candidate {spec!r}: reducer {outer or name!r} cannot send {vd} values")
    return Candidate(name, d, vd, outer)


def candidate_list(candidates, density: float, sparse: str, densities, values, layout) -> tuple[list, tuple]:
    """(the candidates, the densities) of auto's options: ``candidates`` as given, else dense, dense at
    each half precision of ``values`` and ``sparse`` at each of ``densities`` with each of ``values``,
    also under ``hier`` when ``layout`` has several sites of several ranks. One-line ValueErrors."""
    values, densities = listed(values), listed(densities)  # "fp32/fp16", "0.01/0.02" from the CLI
    if any(v not in VALUE_DTYPES for v in values):
        raise ValueError(f"auto: values must be among {', '.join(VALUE_DTYPES)}, got {values!r}")
    try:
        densities = tuple(float(d) for d in densities)
    except (TypeError, ValueError):
        raise ValueError(f"auto: densities must be numbers in (0, 1], got {densities!r}") from None
    if not densities or any(not (0 < d <= 1) for d in densities):
        raise ValueError(f"auto: densities must be in (0, 1], got {densities!r}")
    multi = layout is not None and len(layout) > 1 and len(layout[0]) > 1
    if candidates is None:
        candidates = ["dense"] + [f"dense:{v}" for v in values if v != "fp32"]
        candidates += [f"{p}{sparse}:{d:g}:{v}" for p in [""] + ["hier:"] * multi for d in densities for v in values]
    out = [parse_candidate(c, density) for c in listed(candidates)]
    if not out:
        raise ValueError("auto: no candidates")
    if any(c.reducer == "hier" for c in out) and not multi:
        raise ValueError("auto: a hier candidate needs several sites of several ranks (sites= or the "
                         "environment, see sparsync.site_layout)")
    return out, densities


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def listed(v):
    """A list option given as one string (``"a/b"``, ``"a,b"``, ``"a;b"``) or a single value, as a list."""
    if isinstance(v, str):
        return [p.strip() for p in v.replace(";", ",").replace("/", ",").split(",") if p.strip()]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def conserving(c: Candidate) -> bool:
    cls = REDUCERS.lookup(c.outer or c.reducer)
    return bool(cls.conserving) and (VALUE_DTYPES[c.value_dtype] is None or cls.value_dtype_conserving)


def for_adaptive_optimizer(options: dict) -> dict:
    """``auto``'s options when the optimizer normalises each coordinate (Adam, AdamW): unless they
    name the candidates themselves (``candidates``, ``densities`` or ``sparse``), only the exchanges
    that leave the optimisation unchanged - dense, and dense with the half-precision ``values``.

    Why: auto's convergence cost of low density is calibrated for SGD with error feedback. Under
    Adam a coordinate's accumulated update that arrives in one burst moves it by about one learning
    rate however large it is, so per-step top-k with error feedback alone loses far more than the
    kept mass says (the reason 1-bit Adam compresses the momentum after a dense warm-up: Tang et al.,
    "1-bit Adam", ICML 2021); on the transformer workload MiCRO at 1 % and 5 % never reaches the
    loss target. Sparse exchange under AdamW needs a dense warm-up and a high density, which a user
    states as a fixed configuration (``micro:0.2,dense_steps=150``)."""
    if any(k in options for k in ("candidates", "densities", "sparse")):
        return dict(options)
    values = listed(options.get("values", ("fp32", "fp16")))
    return {**options, "candidates": ["dense"] + [f"dense:{v}" for v in values if v != "fp32"]}
