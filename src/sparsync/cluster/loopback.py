"""The null network: ranks on ``lo``, nothing built, no rate limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Loopback"]


class Loopback:
    """The null network: :class:`~sparsync.cluster.EmulatedCluster`'s interface (a context manager with
    ``placement``, ``emulated``, ``bandwidth``, ``world_size``) over ``lo``, nothing built and no rate limit.

    What ``"loopback"`` means everywhere a network is named (benchmarks, ``sparsync cluster smoke``),
    so callers need no branch of their own.
    """

    emulated = False
    bandwidth = None

    def __init__(self, world_size: int):
        self.world_size = int(world_size)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def placement(self, rank: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": "lo"}

    def __repr__(self) -> str:
        return f"loopback ({self.world_size} ranks, no bandwidth limit)"
