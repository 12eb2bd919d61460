"""Per-rank state under single-writer checkpoints: rank stamps and the gathered form.

Error feedback makes a reducer's state *per rank*: each rank's residual is what that rank did not
send yet (Seide et al., Interspeech 2014; Lin et al., "Deep Gradient Compression", ICLR 2018), so a
resume is exact only if every rank gets its own state back. Trainers that write one checkpoint from
rank 0 (Lightning, ``accelerate``'s ``save_state``, the HF Trainer) would otherwise hand rank 0's
residuals to every rank.

* :func:`stamp` adds ``rank`` and ``world_size`` to a state dict; :func:`own` checks them on load:
  another rank's state with the same world size raises ``ValueError`` (one line that names the
  gathered form); a state from another world size (an elastic restart) loads with a warning
  (the residuals of the missing ranks are lost: not a bitwise resume); an unstamped state (older
  checkpoints) loads as before.
* :func:`gather` returns the **gathered form** ``{"sparsync_gathered": 1, "world_size": P,
  "states": [state of rank 0, ..., state of rank P-1]}`` - one collective over the group, the same
  object on every rank, so whichever rank writes the checkpoint writes every rank's state; on load
  :func:`own` picks the loading rank's entry. It costs ``P`` times one rank's state in memory and in
  the file.
"""

from __future__ import annotations

import io
import warnings

import torch

GATHERED_KEY = "sparsync_gathered"


def stamp(state: dict, rank: int | None, world_size: int | None) -> dict:
    """``state`` with ``rank`` / ``world_size`` set (unchanged when they are unknown)."""
    if rank is None or world_size is None:
        return state
    return {**state, "rank": int(rank), "world_size": int(world_size)}


def is_gathered(state) -> bool:
    return isinstance(state, dict) and GATHERED_KEY in state


def own(state, rank: int | None, world_size: int | None, what: str, warn: bool = True) -> dict:
    """This rank's state from ``state`` (a stamped or unstamped state, or the gathered form).

    Raises ``ValueError`` for another rank's state of the same world size; warns (``warn``) for a
    state from another world size; None for a gathered form without this rank."""
    if is_gathered(state):
        states = state["states"]
        if rank is None:
            raise ValueError(f"{what}: a gathered state (every rank's) needs to know this rank; "
                             "load it after the process group is set up")
        if int(state.get("world_size", len(states))) != world_size:
            warn = False  # said here, once
            warnings.warn(f"{what}: the state was gathered from {len(states)} ranks, this run has {world_size}; "
                          "ranks without a saved state start fresh (not a bitwise resume)", stacklevel=3)
        if rank >= len(states):
            return None
        state = states[rank]
    if not isinstance(state, dict) or rank is None or "rank" not in state:
        return state
    saved_rank, saved_ws = int(state["rank"]), int(state.get("world_size", -1))
    if saved_ws != world_size:
        if warn:
            warnings.warn(f"{what}: state saved by rank {saved_rank} of {saved_ws}, loaded on rank {rank} of "
                          f"{world_size}: residuals follow the rank number (not a bitwise resume)", stacklevel=3)
    elif saved_rank != rank:
        raise ValueError(f"{what}: this is rank {rank}, but the state was saved by rank {saved_rank} (of {saved_ws}); "
                         "error-feedback state is per rank - save every rank's with gathered_state_dict() "
                         "(one object for a single-writer checkpoint) or one file per rank")
    return state


def gather(state: dict, comm) -> dict:
    """The gathered form of ``state`` over ``comm`` (a collective: every rank of the group calls it,
    and every rank gets the same object). ``comm``: a :class:`sparsync.Comm`."""
    buf = io.BytesIO()
    torch.save(state, buf)
    mine = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8).to(comm.device)
    with comm.unrecorded():
        parts = comm.allgatherv(mine)
    states = [torch.load(io.BytesIO(p.cpu().numpy().tobytes()), weights_only=True) for p in parts]  # data only
    return {GATHERED_KEY: 1, "world_size": comm.world_size, "states": states}
