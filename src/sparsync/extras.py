"""Optional dependencies behind pip extras, and the one clear error when one is missing.

``pip install sparsync`` gives the library (torch, numpy, tqdm). The training workloads on the
digits data need scikit-learn and the reports and simulator plots need matplotlib:
``pip install 'sparsync[train]'`` (both) or ``'sparsync[plots]'`` (matplotlib only);
``--tensorboard`` needs ``'sparsync[tensorboard]'``. ``make run`` / ``make test`` install them.
"""

from __future__ import annotations

import importlib

__all__ = ["MissingExtra", "require"]

_PIP_NAME = {"sklearn": "scikit-learn"}


class MissingExtra(ImportError):
    """An optional package is not installed; the message says which extra provides it."""


def require(module: str, extra: str, what: str):
    """Import ``module`` (e.g. ``"matplotlib.pyplot"``) or raise :class:`MissingExtra` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pkg = _PIP_NAME.get(module.split(".")[0], module.split(".")[0])
        raise MissingExtra(f"{what} needs {pkg}, which is not installed: pip install 'sparsync[{extra}]'") from None
