"""Loading a reducer's state: the whole state checked before anything changes, and one rule for a
state saved at another world size.

:meth:`Reducer.load_state_dict <sparsync.reducers.base.Reducer.load_state_dict>` calls
:func:`load_reducer_state`, which

1. **checks the whole state first** (:func:`check_reducer_state`): its reducer name, ``step`` (an
   integer >= 0), ``numel`` (that of the gradient this reducer already reduces, if it ran), the
   residual (a 1-D floating tensor of ``numel`` entries, finite), ``rank`` / ``world_size``, another
   rank's state (:func:`sparsync.rankstate.own`), and the method's own part
   (:meth:`Reducer._check_extra_state`: e.g. Ok-Topk's partition must cut ``[0, numel)`` into
   ``P`` ordered regions). Every refusal is a one-line ``ValueError``, and then nothing has changed;
2. applies it. A method whose own loading fails half-way (a check it does not expose) is put back to
   the state it had (its own ``state_dict``, reloaded), so a refused state never leaves a mix.

**Another world size** (an elastic restart from a checkpoint of ``P'`` ranks on ``P``): error
feedback's residual is this rank's unsent mass and stays valid, but everything a method derived from
the world size - partitions (Ok-Topk's balanced regions, MiCRO's owners), thresholds tuned for
``P' k`` entries, candidates' timings, the step counter that schedules re-balancing - is not. Such a
state loads **its residual only**; the rest of the method starts fresh (step 0, so the first call's
set-up check runs on every rank alike, new ranks included). The conservation identity then holds
from the first step on with the loaded residuals (Stich et al., "Sparsified SGD with Memory",
NeurIPS 2018): nothing is dropped silently. The residuals of ranks that no longer exist are not
loaded by anyone (a warning says so; :func:`sparsync.rankstate.own`). A method that cannot run from
its residual alone on another world size (``hier``, whose sites are fixed by the world size) refuses
in one line.
"""

from __future__ import annotations

import warnings

import torch

from .. import rankstate

__all__ = ["check_reducer_state", "load_reducer_state", "other_world_size"]


def _int(d: dict, key: str, what: str, low: int = 0, optional: bool = False) -> int | None:
    v = d.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{what} state: {key} must be an integer >= {low}, got {v!r}")
    return v


def other_world_size(d: dict, world_size: int) -> int | None:
    """The world size ``d`` was saved at, when it is known and differs from ``world_size``; else None."""
    saved = d.get("world_size")
    return None if saved is None or int(saved) == int(world_size) else int(saved)


def check_reducer_state(r, d) -> None:
    """Raise a one-line ``ValueError`` for anything in ``d`` that ``r`` cannot load (module docstring)."""
    what = f"{r.name} reducer"
    if not isinstance(d, dict):
        raise ValueError(f"{what} state must be a dict, got {type(d).__name__}")
    if d.get("name") != r.name:
        raise ValueError(f"state of reducer {d.get('name')!r} cannot be loaded into {r.name!r}")
    _int(d, "step", what)
    numel = _int(d, "numel", what, low=1, optional=True)
    ws = _int(d, "world_size", what, low=1, optional=True)
    rank = _int(d, "rank", what, optional=True)
    if ws is not None and rank is not None and rank >= ws:
        raise ValueError(f"{what} state: rank {rank} outside a world of {ws}")
    res = d.get("residual")
    if res is not None:
        if not isinstance(res, torch.Tensor) or res.dim() != 1 or not res.dtype.is_floating_point:
            kind = (f"a tensor of shape {tuple(res.shape)} and dtype {res.dtype}" if isinstance(res, torch.Tensor)
                    else type(res).__name__)
            raise ValueError(f"{what} state: the residual must be a 1-D floating tensor, got {kind}")
        if numel is None or res.numel() != numel:
            raise ValueError(f"{what} state: a residual of {res.numel()} entries for a gradient of {numel}")
        if not bool(torch.isfinite(res).all()):
            raise ValueError(f"{what} state: the residual holds non-finite values")
    if r.numel is not None and numel is not None and numel != r.numel:
        raise ValueError(f"{what} state: saved for a gradient of {numel} entries, this reducer reduces {r.numel}")
    extra = d.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"{what} state: extra must be a dict, got {type(extra).__name__}")
    rankstate.own(d, r.comm.rank, r.comm.world_size, what, warn=False)  # another rank's: refused
    if other_world_size(d, r.comm.world_size) is None:
        r._check_extra_state(extra or {}, numel)


def load_reducer_state(r, d) -> None:
    """Check ``d`` whole, then load it into ``r`` (module docstring); on a refusal ``r`` is unchanged."""
    check_reducer_state(r, d)
    saved_ws = other_world_size(d, r.comm.world_size)
    before = r.state_dict()
    try:
        if saved_ws is None:
            _apply(r, d)
        else:
            warnings.warn(f"{r.name} reducer: state saved at world size {saved_ws}, loaded at world size "
                          f"{r.comm.world_size}: this rank's residual is kept, the method's other state starts "
                          "fresh (not a bitwise resume)", stacklevel=4)
            fresh = {"name": r.name, "step": 0, "numel": None, "residual": None, "extra": {}}
            _apply(r, fresh)
            r.residual = _residual(r, d)
    except BaseException:
        _apply(r, before)
        raise


def _residual(r, d) -> torch.Tensor | None:
    res = d.get("residual")
    return None if res is None else res.to(r.comm.device).clone()


def _apply(r, d: dict) -> None:
    r.step = int(d["step"])
    r.numel = d["numel"]
    r.residual = _residual(r, d)
    if r.memory is not None:
        r.memory.forget_buffers()
    r._load_extra_state(d.get("extra") or {})
