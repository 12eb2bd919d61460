"""Stateful gradient reducers with error feedback (``ss.make_reducer``).

Every module in this package registers its reducers with :func:`register`; the package imports
all of its modules on first use, so a new method is one new file.
"""

from .base import Reducer
from .registry import REDUCERS, make_reducer, register

__all__ = ["Reducer", "REDUCERS", "make_reducer", "register"]
