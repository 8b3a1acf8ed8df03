"""In-flight transfer operations as the core tracks them."""

from __future__ import annotations

from dataclasses import dataclass

from .node import Node
from ..records import Direction, TransferCommand

__all__ = ["Operation", "Settled", "LayerProgress"]


class Operation:
    """One submitted writeback or loadback until it settles.

    Attributes:
        command: the command handed to the transfer engine.
        nodes: the nodes whose pages move (parent first; splits insert fragments).
        acked: ranks that sent the acknowledgement.
        ok: False once any rank reported failure.
        layers: rank -> highest layer reported complete (loadbacks).
        seen: (rank, layer) pairs received, to refuse duplicates.
        checkpoint: for a loadback, the node whose continuation-state checkpoint it
            loads (or ``None``).
    """

    __slots__ = ("command", "nodes", "acked", "ok", "layers", "seen", "checkpoint")

    def __init__(self, command: TransferCommand, nodes: list[Node], checkpoint: Node | None = None) -> None:
        self.command = command
        self.nodes = nodes
        self.acked: set[int] = set()
        self.ok = True
        self.layers: dict[int, int] = {}
        self.seen: set[tuple[int, int | None]] = set()
        self.checkpoint = checkpoint

    @property
    def op_id(self) -> int:
        return self.command.op_id

    @property
    def direction(self) -> Direction:
        return self.command.direction


@dataclass(frozen=True, slots=True)
class Settled:
    """An operation ended (once, on every rank, or by its deadline).

    Attributes:
        op_id: the operation.
        direction: writeback or loadback.
        ok: success on every rank.
        request_id: the owning request, or ``None`` for tree-owned writebacks.
        node_ids: the nodes it moved.
        expired: True when the deadline (not a real completion) failed it.
    """

    op_id: int
    direction: Direction
    ok: bool
    request_id: str | None
    node_ids: tuple[int, ...]
    expired: bool = False


@dataclass(frozen=True, slots=True)
class LayerProgress:
    """Layers up to ``layer`` of loadback ``op_id`` are complete on every rank."""

    op_id: int
    layer: int
