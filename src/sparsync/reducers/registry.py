"""Registry of reducers: ``make_reducer(name, comm, density=0.01, **options)``."""

from __future__ import annotations

from ..plugins import Registry
from .base import check_capabilities

REDUCERS = Registry(__package__, "reducer", skip=("base", "registry", "memory", "blockbase", "resume", "capabilities"))


def register(name: str):
    """Class decorator registering a :class:`~sparsync.reducers.base.Reducer` under ``name`` (its declared
    capabilities checked: :func:`~sparsync.reducers.base.check_capabilities`)."""

    def deco(cls):
        check_capabilities(cls)  # the declared capabilities, before the class is usable
        REDUCERS.add(name, cls)
        cls.name = name
        return cls

    return deco


def load_all() -> Registry:
    return REDUCERS.load_all()


def make_reducer(name: str, comm, density: float = 0.01, **options):
    """A new reducer of kind ``name`` for this rank; unknown names, and unknown options, list the valid ones."""
    cls = REDUCERS.lookup(name)
    cls.check_options(options)
    return cls(comm, density=density, **options)
