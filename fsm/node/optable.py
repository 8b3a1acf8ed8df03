"""The operation table: op ids, in-flight operations, and how completions from several
ranks and layers add up to one acknowledgement (invariant ``operation_ends_once``).

A completion is taken in three steps: :meth:`OperationTable.classify` validates it and
says what it is (absorbed, new layer progress, the last acknowledgement, or nothing
yet); the core then commits node effects. Op ids grow by one from 1, so an id below the
next one that is not in flight is a settled operation: its late or duplicate completions
are absorbed and counted, with no per-operation history kept (memory stays bounded).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ..errors import DuplicateCompletion, UnknownOperation, UsageError
from .node import Node
from .ops import Operation
from ..records import Completion, Direction

__all__ = ["OperationTable", "ABSORBED", "PENDING"]

#: :meth:`OperationTable.classify`: a completion for a settled operation, absorbed.
ABSORBED = "absorbed"
#: :meth:`OperationTable.classify`: recorded; nothing to act on yet.
PENDING = "pending"


class OperationTable:
    """Operations in flight, by op id.

    Args:
        world_size: ranks that must acknowledge every operation.
        num_layers: layers of a loadback's per-layer progress.
        deadline_steps: steps after submission at which an operation fails (``None``: never).
    """

    def __init__(self, world_size: int, num_layers: int, deadline_steps: int | None) -> None:
        self.world_size = world_size
        self.num_layers = num_layers
        self.deadline_steps = deadline_steps
        self._ids = itertools.count(1)
        self._next = 1
        self._ops: dict[int, Operation] = {}
        self._fenced: dict[int, Operation] = {}  # past their deadline, copy may still run (copy_fence)
        self.step = 0

    # -- views ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ops)

    def __contains__(self, op_id: object) -> bool:
        return op_id in self._ops

    def __iter__(self) -> Iterator[Operation]:
        return iter(self._ops.values())

    def get(self, op_id: int) -> Operation | None:
        return self._ops.get(op_id)

    def snapshot(self) -> dict[int, Operation]:
        """In-flight operations by op id (a copy of the table, not of the operations)."""
        return dict(self._ops)

    def in_flight(self, direction: Direction | None = None) -> int:
        """Operations in flight (of ``direction`` only, if given)."""
        if direction is None:
            return len(self._ops)
        return sum(1 for op in self._ops.values() if op.command.direction is direction)

    def layers_done(self, op_id: int) -> int:
        """The highest layer every rank has completed for in-flight ``op_id`` (-1: none)."""
        op = self._ops[op_id]
        return min(op.layers.get(r, -1) for r in range(self.world_size))

    def settled(self, op_id: int) -> bool:
        """Whether ``op_id`` was issued and has settled for its nodes and requests (a
        fenced operation has: only its pages wait for its copy's end)."""
        return 1 <= op_id < self._next and op_id not in self._ops

    def fenced(self) -> tuple[Operation, ...]:
        """Operations past their deadline whose copy may still run, by op id."""
        return tuple(self._fenced[k] for k in sorted(self._fenced))

    def fenced_op(self, op_id: int) -> Operation | None:
        """The fenced operation ``op_id``, or ``None``."""
        return self._fenced.get(op_id)

    # -- lifecycle of an operation ---------------------------------------------------------
    def new_id(self) -> int:
        op_id = next(self._ids)
        self._next = op_id + 1
        return op_id

    def deadline(self) -> int | None:
        """The deadline step of an operation submitted now."""
        return self.step + self.deadline_steps if self.deadline_steps else None

    def add(self, op: Operation) -> None:
        self._ops[op.op_id] = op

    def remove(self, op: Operation) -> None:
        """The operation settled."""
        del self._ops[op.op_id]

    def fence(self, op: Operation) -> None:
        """The settled ``op`` passed its deadline while its copy may still run: it is
        kept, with the ranks that already acknowledged it as confirmed, until
        :meth:`confirm` has heard from every rank."""
        op.confirmed = set(op.acked)
        self._fenced[op.op_id] = op

    def unfence(self, op: Operation) -> None:
        """Every rank confirmed the fenced ``op``'s copy ended."""
        del self._fenced[op.op_id]

    def confirm(self, op: Operation, c: Completion) -> bool:
        """Record completion ``c`` of the fenced ``op``: a rank's acknowledgement (ok or
        failed) says its copy ended; a layer completion or a repeat changes nothing.

        Returns:
            True when every rank has now confirmed (the fence may be released).

        Raises:
            UsageError: rank out of range (nothing is recorded).
        """
        if not (0 <= c.rank < self.world_size):
            raise UsageError(f"completion for op {c.op_id}: rank {c.rank} outside world size {self.world_size}")
        if c.layer is not None or c.rank in op.confirmed:
            return False
        op.confirmed.add(c.rank)
        return len(op.confirmed) == self.world_size

    def poison(self, op_id: int) -> None:
        """Make ``op_id`` fail whatever its ranks report.

        Raises:
            UnknownOperation: the op is not in flight.
        """
        op = self._ops.get(op_id)
        if op is None:
            raise UnknownOperation(f"poison: op {op_id} is not in flight")
        op.ok = False

    def on_split(self, node: Node, prefix: Node) -> None:
        """``node`` was cut: operations moving it list ``prefix`` right before it."""
        for op_id in {node.wb_op, node.lb_op} - {None}:
            assert op_id is not None
            op = self._ops[op_id]
            op.nodes.insert(op.nodes.index(node), prefix)

    def expire(self, steps: int) -> list[Operation]:
        """Advance the step by ``steps``; the operations whose deadline passed, by op id."""
        self.step += steps
        return [op for op in sorted(self._ops.values(), key=lambda o: o.op_id)
                if op.command.deadline_step is not None and self.step > op.command.deadline_step]

    # -- completions -------------------------------------------------------------------
    def classify(self, c: Completion) -> str | int | Operation:
        """Validate completion ``c`` and record it (nothing is recorded when it raises).

        Returns:
            ``ABSORBED`` (a settled operation's late or duplicate completion), ``PENDING``
            (recorded; nothing to act on), an int (a loadback's new all-rank layer
            progress), or the :class:`Operation` whose last acknowledgement this was.

        Raises:
            UnknownOperation: the op id was never issued.
            DuplicateCompletion: the same (op, rank, layer) arrived twice.
            UsageError: rank out of range, or a layer on a writeback or out of range.
        """
        op = self._ops.get(c.op_id)
        if op is None:
            if self.settled(c.op_id):
                return ABSORBED
            raise UnknownOperation(f"completion for op {c.op_id}: never issued")
        if not (0 <= c.rank < self.world_size):
            raise UsageError(f"completion for op {c.op_id}: rank {c.rank} outside world size {self.world_size}")
        key = (c.rank, c.layer)
        if key in op.seen or c.rank in op.acked:
            raise DuplicateCompletion(f"op {c.op_id}: completion from rank {c.rank} "
                                      f"layer {c.layer} arrived twice (or after its ack)")
        if c.layer is not None:
            if op.direction is not Direction.LOADBACK:
                raise UsageError(f"op {c.op_id} is a writeback: layer completions are for loadbacks")
            if not 0 <= c.layer < self.num_layers:
                raise UsageError(f"op {c.op_id}: layer {c.layer} outside 0..{self.num_layers - 1}")
            op.seen.add(key)
            before = self.layers_done(c.op_id)
            op.layers[c.rank] = max(op.layers.get(c.rank, -1), c.layer)
            if not c.ok:
                op.ok = False
            after = self.layers_done(c.op_id)
            return after if after > before else PENDING
        op.seen.add(key)
        op.acked.add(c.rank)
        if not c.ok:
            op.ok = False
        return op if len(op.acked) == self.world_size else PENDING
