"""In-flight transfer operations as the core tracks them."""

from __future__ import annotations

from dataclasses import dataclass

from .node import Node
from ..records import Direction, TransferCommand

__all__ = ["Operation", "Settled", "LayerProgress"]


class Operation:
    """One submitted writeback or loadback until its copy ended (``[transfer]`` in the spec:
    ``in_flight``, then ``ended``, or ``fenced`` between a deadline and the copy's end).

    Attributes:
        command: the command handed to the transfer engine.
        nodes: the nodes whose pages move (parent first; splits insert fragments).
        acked: ranks that sent the acknowledgement.
        ok: False once any rank reported failure.
        layers: rank -> highest layer reported complete (loadbacks).
        seen: (rank, layer) pairs received, to refuse duplicates.
        checkpoint: for a loadback, the node whose continuation-state checkpoint it
            loads (or ``None``).
        state: its ``[transfer]`` state (``in_flight``, ``fenced``, ``ended``).
        handed_out: its command was handed out by ``poll_commands`` (guard ``handed_out``).
        confirmed: ranks whose copy is known to have ended (a fenced operation's release
            waits for every rank).
        fenced_dev, fenced_host: group -> the destination pages a fenced operation holds
            (device pages of a loadback, host pages of a writeback; invariant ``copy_fence``).
    """

    __slots__ = ("command", "nodes", "acked", "ok", "layers", "seen", "checkpoint", "state", "handed_out",
                 "confirmed", "fenced_dev", "fenced_host")

    def __init__(self, command: TransferCommand, nodes: list[Node], checkpoint: Node | None = None) -> None:
        self.command = command
        self.nodes = nodes
        self.acked: set[int] = set()
        self.ok = True
        self.layers: dict[int, int] = {}
        self.seen: set[tuple[int, int | None]] = set()
        self.checkpoint = checkpoint
        self.state = "in_flight"
        self.handed_out = False
        self.confirmed: set[int] = set()
        self.fenced_dev: dict[str, list[int]] = {}
        self.fenced_host: dict[str, list[int]] = {}

    @property
    def op_id(self) -> int:
        return self.command.op_id

    @property
    def label(self) -> int:
        """Its op id (lifecycle error messages say ``operation <op id>``)."""
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
