"""The rank-parallel facade: :class:`RankCache`, a :class:`~kvtier.tiered.TieredCache`
that records a :class:`~kvtier.parallel.digest.DecisionDigest` of its decisions.

One instance runs in every tensor-parallel rank process, over that rank's pools. It is
the facade itself (same calls, same results, same errors); besides, every result that
carries a decision is folded into :attr:`RankCache.digest`:

- page ids handed out: admissions and resumptions (hit, page table, waits, checkpoint),
  reservations, checkpoint pages the tree adopted (``step_done``, ``finish``, ``retract``);
- transfer commands: op id, direction, source and destination pages (``poll``);
- request state changes (``poll``) and the scheduler's victims (``abort_victim``);
- every node lifecycle event the core fires (node id and event: evictions, demotions,
  drops, splits, writebacks, loadbacks and their acks), through the core's ``trigger``;
- every operation that settles (op id, success), through the core's ``complete`` and
  ``advance_step``; failed ones are also kept in :attr:`RankCache.failed_ops`.

Calls that raise record nothing (they change nothing either).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvtier.fsm import Completion
from kvtier.fsm.node.ops import LayerProgress, Settled
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.node import Node, PageMap
from kvtier.fsm.request.batch import ForwardResult, Reservation, StepOutcome
from kvtier.fsm.request import Admission, PollResult

from ..tiered import TieredCache
from .digest import DecisionDigest

__all__ = ["RankCache"]


class RankCache(TieredCache):
    """:class:`~kvtier.tiered.TieredCache` for one rank of a tensor-parallel group.

    Args:
        layout: as :class:`~kvtier.tiered.TieredCache`.
        device_pages: as :class:`~kvtier.tiered.TieredCache` (page counts, not bytes:
            every rank has the same counts; its pages hold its shard).
        host_pages: likewise.
        world_size: ranks whose completions every operation needs (>= 1).
        **options: the other :class:`~kvtier.tiered.TieredCache` options.

    Attributes:
        digest: the running digest of this rank's decisions.
        failed_ops: op ids that settled as failed on this core (the last ``max_failed``).
        settled_ops: operations settled so far.

    Raises:
        ConfigError: as :class:`~kvtier.tiered.TieredCache`.
    """

    def __init__(self, layout: CacheLayout, device_pages: int | Mapping[str, int],
                 host_pages: int | Mapping[str, int] | None = None, *, world_size: int = 1,
                 max_failed: int = 100_000, **options: Any) -> None:
        super().__init__(layout, device_pages, host_pages, world_size=world_size, **options)
        self.digest = DecisionDigest()
        self.failed_ops: deque[int] = deque(maxlen=max_failed)
        self.settled_ops = 0
        core = self.core
        fire, complete, advance = core.trigger, core.complete, core.advance_step
        digest = self.digest

        def trigger(node: Node, event: str) -> None:
            fire(node, event)
            digest.add("node", node.node_id, event)

        def settled(outs: list[Any]) -> None:
            for o in outs:
                if isinstance(o, Settled):
                    digest.add("settled", o.op_id, o.ok, o.expired)
                    self.settled_ops += 1
                    if not o.ok:
                        self.failed_ops.append(o.op_id)

        def complete_(c: Completion) -> list[Settled | LayerProgress]:
            outs = complete(c)
            settled(outs)
            return outs

        def advance_(steps: int = 1) -> list[Settled]:
            outs = advance(steps)
            settled(outs)
            return outs

        # every node event and every settled operation of the core goes through these
        core.trigger = trigger  # type: ignore[method-assign,assignment,unused-ignore]
        core.complete = complete_  # type: ignore[method-assign,assignment,unused-ignore]
        core.advance_step = advance_  # type: ignore[method-assign,assignment,unused-ignore]

    def _admission(self, tag: str, request_id: str, adm: Admission | None) -> Admission | None:
        d = self.digest
        if adm is None:
            d.add(tag, request_id, None)
        else:
            d.add(tag, request_id, adm.start_token, adm.chunk_tokens, adm.hit_tokens, adm.device_hit_tokens,
                  tuple(adm.wait_ops))
            d.add_pages("table", request_id, adm.page_table)
            d.add_pages("ckpt", request_id, adm.checkpoint_pages)
        return adm

    def admit(self, request_id: str, units: Sequence[Hashable], prompt_tokens: int,
              chunk_tokens: int) -> Admission | None:
        return self._admission("admit", request_id, super().admit(request_id, units, prompt_tokens, chunk_tokens))

    def resume(self, request_id: str, chunk_tokens: int) -> Admission | None:
        return self._admission("resume", request_id, super().resume(request_id, chunk_tokens))

    def reserve(self, request_id: str, tokens: int) -> PageMap | None:
        out = super().reserve(request_id, tokens)
        self.digest.add_pages("reserve", request_id, out)
        return out

    def step_done(self, request_id: str, computed_tokens: int, *, new_units: Sequence[Hashable] = (),
                  checkpoint: bool = False) -> PageMap:
        out = super().step_done(request_id, computed_tokens, new_units=new_units, checkpoint=checkpoint)
        self.digest.add_pages("step_done", request_id, out)
        return out

    def step(self, results: Sequence[ForwardResult | tuple[Any, ...]] = (),
             reserve: Sequence[Reservation | tuple[Any, ...]] = (), *, stop_on_short: bool = False) -> StepOutcome:
        """The batched step, with every item's outcome and pages folded into the digest."""
        out = super().step(results, reserve, stop_on_short=stop_on_short)
        d = self.digest
        for i, (rid, st) in enumerate(zip(out.result_ids, out.result_status)):
            d.add("step_done", rid, st)
            d.add_pages("step_done", rid, out.adopted.get(i, {}))
        for i, (rid, st) in enumerate(zip(out.reserve_ids, out.reserve_status)):
            d.add("reserve", rid, st)
            d.add_pages("reserve", rid, out.new_pages.get(i, {}))
        return out

    def finish(self, request_id: str) -> PageMap:
        out = super().finish(request_id)
        self.digest.add_pages("finish", request_id, out)
        return out

    def retract(self, request_id: str) -> PageMap:
        out = super().retract(request_id)
        self.digest.add_pages("retract", request_id, out)
        return out

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        super().abort(request_id, reason)
        self.digest.add("abort", request_id)

    def abort_victim(self, blocked: Sequence[str], reason: str = "cache capacity exhausted") -> str | None:
        victim = super().abort_victim(blocked, reason)
        self.digest.add("victim", victim)
        return victim

    def poll(self) -> PollResult:
        out = super().poll()
        d = self.digest
        for cmd in out.commands:
            d.add_command(cmd)
        for e in out.events:
            d.add("event", e.request_id, e.state)
        return out
