"""The facade machine's plug points: the simulated transfer engine and the scheduler
adapter. An engine subclasses either and returns its own from
:meth:`~kvtier.testing.machines.FacadeMachine.make_transfer` /
:meth:`~kvtier.testing.machines.FacadeMachine.make_scheduler` to run the kit's rules and
invariants against its own integration.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvtier.fsm import Completion, Direction
from kvtier.fsm.request.batch import SHORT
from kvtier.fsm.records import TransferCommand

from ..tiered import Admission, ForwardResult, PollResult, Reservation, TieredCache

__all__ = ["TransferBackend", "SchedulerAdapter"]


class TransferBackend:
    """The simulated transfer engine: per-(op, rank) completion queues and a byte store
    per tier. Bytes move when an operation settles (success: source to destination;
    failure or deadline: the destination holds garbage), so a source page modified or
    reused while the copy is in flight shows up as wrong bytes (invariants 3, 4, 12).

    An engine plugs in its own backend by subclassing this one (e.g. doing real copies
    between CPU tensors in :meth:`apply`) and returning it from
    :meth:`FacadeMachine.make_transfer`.
    """

    def __init__(self, world_size: int, num_layers: int) -> None:
        self.world_size = world_size
        # the first, a middle and the last layer: layer readiness differs between them
        self.layers = sorted({0, num_layers // 2, num_layers - 1})
        self.dev: dict[tuple[str, int], Any] = {}
        self.host: dict[tuple[str, int], Any] = {}
        self.commands: dict[int, TransferCommand] = {}
        self.queues: dict[int, list[list[Completion]]] = {}

    def submit(self, cmd: TransferCommand) -> None:
        """Accept a command (once per op id)."""
        if cmd.op_id in self.commands:
            return
        self.commands[cmd.op_id] = cmd
        queues = []
        for rank in range(self.world_size):
            q: list[Completion] = []
            if cmd.direction is Direction.LOADBACK:
                q += [Completion(cmd.op_id, rank, True, layer) for layer in self.layers]
            q.append(Completion(cmd.op_id, rank, True, None))
            queues.append(q)
        self.queues[cmd.op_id] = queues

    def ready(self) -> list[tuple[int, int]]:
        """(op, rank) pairs with a completion to deliver, in a fixed order."""
        return [(op, r) for op, qs in sorted(self.queues.items()) for r, q in enumerate(qs) if q]

    def upcoming(self, op: int, rank: int) -> Completion | None:
        """The next completion of ``op`` on ``rank`` :meth:`take` would hand out, when this
        backend knows it in advance (``None``: none pending, or not known)."""
        queues = self.queues.get(op)
        return queues[rank][0] if queues is not None and queues[rank] else None

    def take(self, op: int, rank: int, ok: bool) -> Completion:
        """The next completion of ``op`` on ``rank`` (reporting ``ok``)."""
        ev = self.queues[op][rank].pop(0)
        if not any(self.queues[op]):
            del self.queues[op]
        return Completion(ev.op_id, ev.rank, ok, ev.layer)

    def apply(self, op: int, ok: bool) -> None:
        """The operation settled: move its bytes (or leave garbage on failure)."""
        cmd = self.commands.pop(op, None)
        if cmd is None:
            return
        src, dst = ((self.dev, self.host) if cmd.direction is Direction.WRITEBACK else (self.host, self.dev))
        for t in cmd.transfers:
            for s, d in zip(t.src_pages, t.dst_pages):
                dst[(t.group, d)] = src.get((t.group, s)) if ok else ("garbage", op)


class SchedulerAdapter:
    """How the facade machine talks to the system under test. The default calls the
    :class:`TieredCache` directly; an engine's adapter calls its own scheduler, which
    must end in the same :class:`TieredCache` (``self.cache``) for the invariants."""

    #: whether ``reserve`` and ``step_done`` go through the batched ``TieredCache.step``
    #: (one item each) or the single-request calls (``TieredCache.reserve`` / ``step_done``)
    batched: bool = True

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache

    def admit(self, request_id: str, units: Sequence[Hashable], prompt_tokens: int,
              chunk_tokens: int) -> Admission | None:
        return self.cache.admit(request_id, units, prompt_tokens, chunk_tokens)

    # reserve and step_done go through the batched step (TieredCache.step), one item each:
    # a refused item re-raises its error, a short reservation is None
    def reserve(self, request_id: str, tokens: int) -> dict[str, list[int]] | None:
        if not self.batched:
            return self.cache.reserve(request_id, tokens)
        out = self.cache.step(reserve=[Reservation(request_id, tokens)])
        out.raise_first()
        return None if out.reserve_status[0] == SHORT else out.new_pages.get(0, {})

    def step_done(self, request_id: str, computed_tokens: int, new_units: Sequence[Hashable],
                  checkpoint: bool) -> dict[str, list[int]] | None:
        """Returns the checkpoint pages the tree adopted (the engine fills them); through
        the batched step, as an engine's scheduler calls it (or the single call)."""
        if not self.batched:
            return self.cache.step_done(request_id, computed_tokens, new_units=tuple(new_units),
                                        checkpoint=checkpoint)
        out = self.cache.step(results=[ForwardResult(request_id, computed_tokens, tuple(new_units), checkpoint)])
        out.raise_first()
        return out.adopted.get(0, {})

    def finish(self, request_id: str) -> dict[str, list[int]] | None:
        return self.cache.finish(request_id)

    def retract(self, request_id: str) -> dict[str, list[int]] | None:
        return self.cache.retract(request_id)

    def resume(self, request_id: str, chunk_tokens: int) -> Admission | None:
        return self.cache.resume(request_id, chunk_tokens)

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self.cache.abort(request_id, reason)

    def complete(self, completion: Completion) -> None:
        self.cache.complete(completion)

    def advance_step(self, steps: int) -> None:
        self.cache.advance_step(steps)

    def layer_ready(self, request_id: str, layer: int) -> bool:
        return self.cache.layer_ready(request_id, layer)

    def poll(self) -> PollResult:
        return self.cache.poll()

