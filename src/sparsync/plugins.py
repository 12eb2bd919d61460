"""Name -> implementation registries filled by the modules of a package (collectives, reducers).

A package's modules register themselves on import; :meth:`Registry.load_all` imports every module
of the package once, so adding a method is adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil


class Registry(dict):
    def __init__(self, package: str, kind: str, skip: tuple[str, ...] = ()):
        super().__init__()
        self.package, self.kind, self.skip = package, kind, skip
        self._loaded = False

    def add(self, name: str, obj) -> None:
        if name in self and self[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self[name] = obj

    def load_all(self) -> "Registry":
        if not self._loaded:
            pkg = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                if mod.name not in self.skip:
                    importlib.import_module(f"{self.package}.{mod.name}")
            self._loaded = True
        return self

    def lookup(self, name: str):
        """The entry for ``name``; an unknown name raises ValueError listing the valid ones."""
        self.load_all()
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self))}")
        return self[name]
