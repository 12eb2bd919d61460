"""Registry of reducers: ``make_reducer(name, comm, density=0.01, **options)``."""

from __future__ import annotations

import importlib
import pkgutil

REDUCERS: dict[str, type] = {}
_loaded = False


def register(name: str):
    """Class decorator registering a :class:`~sparsync.reducers.base.Reducer` under ``name``."""

    def deco(cls):
        if name in REDUCERS and REDUCERS[name] is not cls:
            raise ValueError(f"reducer {name!r} registered twice")
        REDUCERS[name] = cls
        cls.name = name
        return cls

    return deco


def load_all() -> dict[str, type]:
    global _loaded
    if not _loaded:
        pkg = importlib.import_module(__package__)
        for mod in pkgutil.iter_modules(pkg.__path__):
            if mod.name not in ("base", "registry"):
                importlib.import_module(f"{__package__}.{mod.name}")
        _loaded = True
    return REDUCERS


def make_reducer(name: str, comm, density: float = 0.01, **options):
    """A new reducer of kind ``name`` for this rank; unknown names list the valid ones."""
    reducers = load_all()
    if name not in reducers:
        raise ValueError(f"unknown reducer {name!r}; valid: {', '.join(sorted(reducers))}")
    return reducers[name](comm, density=density, **options)
