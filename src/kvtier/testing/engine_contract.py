"""What the transfer engine promises an engine, checked by the engine machine
(:class:`~kvtier.testing.engine_plug.EngineTransfer` mixes :class:`EngineContract` in):

- ``wait_layer(op, L)`` returns exactly when the copy of the op's chunk holding its last
  layer <= ``L`` completed (before, the fake-asynchronous backend raises
  :class:`~kvtier.transfer.errors.NotReadyError`; for an op queued and not flushed it raises
  :class:`~kvtier.transfer.errors.TransferError`), and then layer ``L`` holds its bytes;
- ``cancel(op)`` answers ``"cancelled"`` exactly for an op still queued (it leaves no page
  mark: a command of the other direction on its pages is accepted at once, and its failed
  acknowledgement, never a layer, comes from the next poll), ``"fenced"`` for one issued
  (``wait=True`` returns once its copies ended) and ``"ended"`` for one acknowledged.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

import numpy as np
import torch

from kvtier.fsm import Completion, Direction, UsageError
from kvtier.fsm.records import GroupTransfer, TransferCommand
from kvtier.transfer.backends.fake_async import PendingCopy
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.errors import NotReadyError, PoisonedReadError, TransferError

from .models import ModelViolation

__all__ = ["EngineContract", "pattern"]


def pattern(value: Any, nbytes: int) -> torch.Tensor:
    """The bytes a page holding content ``value`` carries (uint8 ``[nbytes]``)."""
    digest = hashlib.sha256(repr(value).encode()).digest()
    reps = -(-nbytes // len(digest))
    return torch.from_numpy(np.frombuffer(digest * reps, dtype=np.uint8)[:nbytes].copy())



class EngineContract:
    """The checks of the module doc, over the state of
    :class:`~kvtier.testing.engine_plug.EngineTransfer` (one engine per rank)."""

    engines: list[TransferEngine]
    commands: dict[int, TransferCommand]
    specs: dict[str, Any]
    host: dict[tuple[str, int], Any]
    injected: set[tuple[int, int]]
    held: list[int]
    buffered: dict[tuple[int, int], deque[Completion]]
    probes: int
    device_pages: dict[str, int]
    host_pages: dict[str, int]

    def _pending(self, rank: int) -> list[PendingCopy]:
        raise NotImplementedError

    def _collect(self, rank: int) -> None:
        raise NotImplementedError

    def _draw(self, op: int, rank: int) -> int:
        raise NotImplementedError

    def check_layers(self, op: int, rank: int, layers: Any, what: str) -> None:
        """Every layer of ``layers`` of loadback ``op``'s destination pages on ``rank`` is
        readable and holds its source's bytes."""
        cmd = self.commands.get(op)
        if cmd is None or cmd.direction is not Direction.LOADBACK:
            return
        eng = self.engines[rank]
        wanted = set(layers)
        for t in cmd.transfers:
            spec = self.specs[t.group]
            for layer in spec.layers:
                if layer not in wanted:
                    continue
                for s, d in zip(t.src_pages, t.dst_pages):
                    value = self.host.get((t.group, s))
                    if value is None:
                        continue
                    for comp in spec.components:
                        try:
                            got = eng.read_pages("device", t.group, comp.name, layer, [d])[0]
                        except PoisonedReadError as exc:
                            raise ModelViolation("model_transfer_hazard", f"op {op} on rank {rank}",
                                                 f"layer {layer} {what}, but a copy still writes device page "
                                                 f"{d} of {t.group!r}: {exc}") from None
                        if not torch.equal(got, pattern(value, comp.page_bytes)):
                            raise ModelViolation("loaded_equals_written", f"op {op} on rank {rank}",
                                                 f"layer {layer} {what}, but device page {d} of {t.group!r} "
                                                 f"({comp.name}) does not hold its source's bytes")

    def check_waits(self) -> None:
        """For every loadback in flight and rank without an injected failure, and every
        layer ``L``: ``wait_layer(op, L)`` returns exactly when the copy of the op's chunk
        holding its last layer <= ``L`` completed (the fake-asynchronous backend raises
        :class:`NotReadyError` while it is pending; an op held queued raises
        :class:`TransferError`), and once it returns, layer ``L`` of the destination pages
        holds its bytes (a forward pass overlapping the loadback)."""
        for op, cmd in sorted(self.commands.items()):
            if cmd.direction is not Direction.LOADBACK:
                continue
            mine = {layer for t in cmd.transfers if t.src_pages
                    for layer in self.specs[t.group].layers if not cmd.layers or layer in cmd.layers}
            for rank, eng in enumerate(self.engines):
                if (op, rank) in self.injected:
                    continue
                live = op in eng.in_flight
                pending = [p for p in self._pending(rank) if op in p.op_ids and p.stream is Direction.LOADBACK]
                for layer in range(max(mine, default=-1) + 1):
                    below = [x for x in mine if x <= layer]
                    wait = live and bool(below) and any(max(below) in p.layers for p in pending)
                    try:
                        eng.wait_layer(op, layer)
                    except NotReadyError:
                        if not wait:
                            raise ModelViolation("model_layer_ready", f"op {op} on rank {rank}",
                                                 f"wait_layer({layer}) waits, but the copy of the chunk holding its "
                                                 f"layer {max(below, default=None)} completed") from None
                        continue
                    except TransferError:
                        if op in self.held:
                            continue
                        raise
                    if op in self.held:
                        raise ModelViolation("model_layer_ready", f"op {op} on rank {rank}",
                                             f"wait_layer({layer}) returned for an op queued and not flushed")
                    if wait:
                        raise ModelViolation("model_layer_ready", f"op {op} on rank {rank}",
                                             f"wait_layer({layer}) returned while the copy of the chunk holding "
                                             f"its layer {max(below)} is pending")
                    self.check_layers(op, rank, (layer,), "passed wait_layer")

    def cancel(self, cmd: TransferCommand) -> None:
        """The engine cancels an operation the core gave up on, on every rank: one still
        queued is taken out (``"cancelled"``: no byte moves, its failed acknowledgement
        comes from the next poll, and its pages are marked by nothing: a command of the
        other direction on them is accepted at once); one issued is ``"fenced"`` (its
        copies end, the next one is drawn to wait for them); one acknowledged ``"ended"``."""
        op = cmd.op_id
        held = op in self.held
        self.held = [x for x in self.held if x != op]
        for rank, eng in enumerate(self.engines):
            want = "cancelled" if op in eng.queued else "fenced" if op in eng.in_flight else "ended"
            wait = want == "fenced" and self._draw(op, rank) & 1 == 1
            got = eng.cancel(op, wait=wait)
            if got != want or op in eng.queued or (got == "cancelled") != held:
                raise ModelViolation("model_transfer_cancel", f"op {op} on rank {rank}",
                                     f"cancel answered {got!r}; it was {want} (held queued: {held})")
            if wait and any(op in p.op_ids for p in self._pending(rank)):
                raise ModelViolation("model_transfer_cancel", f"op {op} on rank {rank}",
                                     "cancel(wait=True) returned with its copies pending")
            self._collect(rank)
            if got == "cancelled":
                if [c for c in self.buffered.get((op, rank), ()) if c.ok or c.layer is not None]:
                    raise ModelViolation("model_transfer_cancel", f"op {op} on rank {rank}",
                                         "a cancelled queued op reported a success or a layer")
                self._probe(rank, cmd)

    def _probe(self, rank: int, cmd: TransferCommand) -> None:
        """Right after ``cmd`` was cancelled on ``rank`` while queued: a command of its
        direction on other pages (a filler) is queued, then one of the other direction on
        ``cmd``'s pages must be accepted (nothing marks them any more); both are then
        cancelled and forgotten. Skipped when a held command shares pages with them."""
        eng = self.engines[rank]
        load = cmd.direction is Direction.LOADBACK

        def pages(c: TransferCommand) -> set[tuple[str, str, int]]:  # (side, group, page)
            src, dst = ("host", "device") if c.direction is Direction.LOADBACK else ("device", "host")
            return {(side, t.group, p) for t in c.transfers for side, ps in ((src, t.src_pages), (dst, t.dst_pages))
                    for p in ps}

        mine = pages(cmd)
        used = set(mine)
        for op in self.held:
            other = self.commands.get(op)
            if other is not None:
                if pages(other) & mine:
                    return
                used |= pages(other)
        t0 = next((t for t in cmd.transfers if t.src_pages), None)
        if t0 is None:
            return
        free = {side: [p for p in range(n[t0.group]) if (side, t0.group, p) not in used]
                for side, n in (("device", self.device_pages), ("host", self.host_pages))}
        if not free["device"] or not free["host"]:
            return
        src, dst = ("host", "device") if load else ("device", "host")
        base = (1 << 40) + 2 * self.probes
        self.probes += 1
        filler = TransferCommand(base, cmd.direction, (GroupTransfer(t0.group, (free[src][0],), (free[dst][0],)),),
                                 cmd.layers)
        probe = TransferCommand(base + 1, Direction.WRITEBACK if load else Direction.LOADBACK,
                                tuple(GroupTransfer(t.group, t.dst_pages, t.src_pages) for t in cmd.transfers),
                                cmd.layers)
        try:
            eng.submit(filler)
            eng.submit(probe)
        except UsageError as exc:
            raise ModelViolation("model_transfer_cancel", f"op {cmd.op_id} on rank {rank}",
                                 f"cancelled while queued, its pages still refuse the other direction: {exc}") from None
        finally:
            for c in (probe, filler):
                if c.op_id in eng.queued and eng.cancel(c.op_id) != "cancelled":
                    raise ModelViolation("model_transfer_cancel", f"op {c.op_id} on rank {rank}",
                                         "a queued command was not cancelled")
            self._collect(rank)
            for c in (probe, filler):
                self.buffered.pop((c.op_id, rank), None)
