"""Reference models of what the facade answers a scheduler, checked by the facade machine.

- :func:`check_admission`: an admission's answer agrees with the request it started: it
  starts at its hit, hands out the page table the facade then reports, waits (``loading``)
  exactly when it has a loadback to wait on, hands out no checkpoint inside a history
  replay span, and otherwise, on a device hit with continuation-state groups, hands out a
  checkpoint of every state group holding the state at the hit's end
  (``exact_continuation_state``).
- :func:`check_blocked`: an admission that found no room leaves the request waiting,
  owing nothing, holding nothing, and leaves every page and receipt where it was
  (``atomic_admission``).
- :class:`EndModel` and :func:`check_poll`: a poll hands out loadbacks before writebacks,
  every command the core issued and at most ``max_writebacks_in_flight`` tree writebacks in
  flight; it issues exactly the room the quota leaves (``max_writebacks_in_flight`` minus the
  writebacks in flight; loadbacks never count) unless no queued tree writeback is ready; it
  reports each request's end exactly once per admission, with a reason exactly when the
  request was aborted (``cache capacity exhausted`` for a victim).
- :func:`check_drained`: once every request was aborted, every forward result returned
  and every completion delivered, nothing is held, in flight or tracked.

Failures raise :class:`~kvtier.testing.models.ModelViolation` (``model_admission``,
``model_poll``, ``model_drain``) or the spec invariant they break.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.fsm import Direction
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node import HOST_VISIBLE

from . import _views as views
from .base import TERMINAL
from .content import content
from .models import ModelViolation

if TYPE_CHECKING:
    from ..tiered import Admission, PollResult, TieredCache

__all__ = ["check_admission", "held", "check_blocked", "EndModel", "check_poll", "check_quota", "writebacks_in_flight",
           "check_drained", "VICTIM_REASON"]

#: the reason the facade gives a request :meth:`~kvtier.tiered.TieredCache.abort_victim` aborts
VICTIM_REASON = "cache capacity exhausted"


def check_admission(cache: TieredCache, rid: str, adm: Admission, units: Sequence[Hashable],
                    dev: Mapping[tuple[str, int], Any]) -> None:
    """``adm`` (an accepted admission or resume of ``rid`` with unit keys ``units``) against
    the request it started; ``dev`` is the engine's device bytes (the content model)."""
    who = f"request {rid!r}"
    state = cache.request(rid).state
    waits = adm.loadback_op is not None or bool(adm.wait_ops)
    if adm.chunk_tokens < 1 or adm.start_token != adm.hit_tokens:
        raise ModelViolation("model_admission", who, f"starts at token {adm.start_token} with a chunk of "
                                                      f"{adm.chunk_tokens} after a hit of {adm.hit_tokens} tokens")
    if adm.page_table != cache.page_table(rid):
        raise ModelViolation("model_admission", who, f"handed out page table {adm.page_table}, the facade then "
                                                      f"reports {cache.page_table(rid)}")
    if state != ("loading" if waits else "running"):
        raise ModelViolation("model_admission", who, f"{state} after an admission that "
                                                      f"{'waits on a loadback' if waits else 'waits on nothing'}")
    if waits or not adm.hit_tokens:
        return
    if adm.recompute_tokens:
        if adm.checkpoint_pages:
            raise ModelViolation("model_admission", who, f"a checkpoint {adm.checkpoint_pages} inside a history "
                                                          f"replay span of {adm.recompute_tokens} tokens")
        return
    state_groups = {g.name for g in cache.layout.state_groups}
    if set(adm.checkpoint_pages) != state_groups:
        raise InvariantViolation("exact_continuation_state", who,
                                 f"a hit of {adm.hit_tokens} tokens hands out checkpoints of "
                                 f"{sorted(adm.checkpoint_pages)}, the layout's state groups are {sorted(state_groups)}")
    prefix = tuple(units[: adm.start_token // cache.layout.alignment])
    ppu = views.pages_per_unit(cache.core)
    for g, pages in adm.checkpoint_pages.items():
        for j, p in enumerate(pages):
            if dev.get((g, p)) != content(prefix, g, j, ppu):
                raise InvariantViolation("exact_continuation_state", who,
                                         f"checkpoint page {p} of {g!r} holds {dev.get((g, p))!r}, not the state "
                                         f"at its hit's end ({len(prefix)} units)")


def held(cache: TieredCache) -> tuple[dict[str, int], set[int]]:
    """Device pages held outside the tree per group, and the receipts requests hold."""
    core = cache.core
    return ({g: len(core.external_pages(g)) for g in core.device},
            {i for r in views.requests(cache).values() for i in r.receipts()})


def check_blocked(cache: TieredCache, rid: str, before: tuple[dict[str, int], set[int]]) -> None:
    """An admission of ``rid`` found no room: it waits holding nothing, and nothing moved
    (``before``: :func:`held` before the call)."""
    r = views.requests(cache).get(rid)
    if r is None or (r.state, r.owed_forward, tuple(r.ops), r.reserved) != ("waiting", 0, (), 0):
        got = None if r is None else (r.state, r.owed_forward, sorted(r.ops), r.reserved)
        raise ModelViolation("model_admission", f"request {rid!r}",
                             f"a blocked admission left (state, owed, ops, reserved) = {got}")
    now = held(cache)
    if now != before:
        raise InvariantViolation("atomic_admission", f"request {rid!r}",
                                 f"a blocked admission moved pages or receipts: held outside the tree "
                                 f"{before[0]} -> {now[0]}, receipts {sorted(before[1])} -> {sorted(now[1])}")


@dataclass
class EndModel:
    """The ends a poll may still report, per request: ``pending`` counts the ends of earlier
    admissions not yet reported (an id admitted again before its end was polled), ``ended``
    whether the current admission's end was reported; ``victims`` are requests the victim
    abort took, whose end must give :data:`VICTIM_REASON`."""

    pending: dict[str, int] = field(default_factory=dict)
    ended: dict[str, bool] = field(default_factory=dict)
    victims: set[str] = field(default_factory=set)

    def admitted(self, rid: str, previous_state: str | None) -> None:
        """``rid`` starts a new admission; ``previous_state``: its record's state before."""
        if previous_state in TERMINAL and not self.ended.get(rid, False):
            self.pending[rid] = self.pending.get(rid, 0) + 1
        self.ended[rid] = False


def writebacks_in_flight(cache: TieredCache) -> set[int]:
    """Op ids of the writebacks in flight (a request's own and tree writebacks)."""
    return {op for op, o in views.ops(cache.core).items() if o.command.direction is Direction.WRITEBACK}


def check_quota(cache: TieredCache, before: set[int]) -> None:
    """The writeback quota as a poll used it, ``before`` being the writebacks in flight when
    it began: it issues at most ``max_writebacks_in_flight`` minus those (loadbacks never
    count), and fewer only when no queued tree writeback is ready then (its parent the root
    or on the host): work waiting uses the room (``model_writeback_queue``)."""
    core = cache.core
    new = sorted(op for op, o in views.ops(core).items() if o.command.direction is Direction.WRITEBACK
                 and o.command.request_id is None and op not in before)
    room = max(0, cache.max_writebacks_in_flight - len(before))
    if len(new) > room:
        raise ModelViolation("model_writeback_queue", "the facade",
                             f"a poll issued tree writebacks {new} with {len(before)} writebacks in flight, "
                             f"max_writebacks_in_flight={cache.max_writebacks_in_flight} (room {room})")
    if len(new) < room:
        waiting = sorted(n.node_id for n in core.writebacks.queued().values()
                         if n.parent is not None and (n.parent.parent is None or n.parent.state in HOST_VISIBLE))
        if waiting:
            raise ModelViolation("model_writeback_queue", "the facade",
                                 f"a poll left room for {room - len(new)} more writebacks (in flight before: "
                                 f"{len(before)}, issued {new}, max_writebacks_in_flight="
                                 f"{cache.max_writebacks_in_flight}) while queued nodes {waiting} were ready")


def check_poll(cache: TieredCache, out: PollResult, ends: EndModel, before: set[int] | None = None) -> None:
    """What one poll answered (``out``), against the commands it must hand out, the
    writeback quota (``before``: the writebacks in flight when it began, :func:`check_quota`)
    and the ends it may report (``ends``, updated)."""
    if before is not None:
        check_quota(cache, before)
    dirs = [c.direction for c in out.commands]
    if dirs != sorted(dirs, key=lambda d: d is not Direction.LOADBACK):
        raise ModelViolation("model_poll", "the facade", f"hands out {[d.value for d in dirs]}: loadbacks first")
    core = cache.core
    if views.outbox(core):
        raise ModelViolation("model_poll", "the facade",
                             f"kept commands {[c.op_id for c in views.outbox(core)]} the core issued")
    tree = [op for op, o in views.ops(core).items()
            if o.command.direction is Direction.WRITEBACK and o.command.request_id is None]
    if len(tree) > cache.max_writebacks_in_flight:
        raise ModelViolation("model_poll", "the facade", f"tree writebacks {sorted(tree)} in flight, more than "
                                                         f"max_writebacks_in_flight={cache.max_writebacks_in_flight}")
    for ev in out.events:
        if ev.state not in TERMINAL:
            continue
        rid = ev.request_id
        if (ev.reason is not None) != (ev.state == "aborted"):
            raise ModelViolation("model_poll", f"request {rid!r}", f"reported {ev.state} with reason {ev.reason!r}")
        if ends.pending.get(rid, 0) > 0:
            ends.pending[rid] -= 1
        elif ends.ended.get(rid, False):
            raise ModelViolation("model_poll", f"request {rid!r}", f"reported {ev.state}: it ended already")
        else:
            ends.ended[rid] = True
        if rid in ends.victims and ev.state == "aborted":
            ends.victims.discard(rid)
            if ev.reason != VICTIM_REASON:
                raise ModelViolation("model_poll", f"request {rid!r}",
                                     f"the victim abort's end gives reason {ev.reason!r}, not {VICTIM_REASON!r}")


def check_drained(cache: TieredCache) -> None:
    """Nothing is held, in flight or tracked (every request aborted, every forward result
    returned, every completion delivered and polled)."""
    core = cache.core
    left = {
        "requests": sorted(views.requests(cache)),
        "operations": sorted(views.ops(core)),
        "locks": sorted(views.locks(core)),
        "node receipts": sorted(views.receipts(core)),
        "pages outside the tree": {g: sorted(core.external_pages(g)) for g in core.device
                                   if core.external_pages(g)},
        "held or moving nodes": sorted(n.node_id for n in views.nodes(core).values()
                                       if (n.lock_ref, n.borrow_ref, n.host_pin) != (0, 0, 0)
                                       or n.state not in ("device", "backed", "host")),
    }
    left = {k: v for k, v in left.items() if v}
    if left:
        raise ModelViolation("model_drain", "the facade", f"after a drain: {left}")
