"""The ``l3_*`` invariants over an :class:`kvtier.fsm.l3.L3Tier` (spec ``[invariants]``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..errors import InvariantViolation
from .options import L3Object, L3Outstanding, Prefetch
from ..lifecycle.names import HOST_VISIBLE, L3_STATE as LS
from ..records import StoreCommand, StoreOp

if TYPE_CHECKING:
    from .tier import L3Tier

__all__ = ["check_l3", "l3_outstanding"]


def check_l3(tier: L3Tier) -> None:
    """Raise :class:`InvariantViolation` for the first ``l3_*`` invariant that does not hold."""

    def fail(inv: str, o: L3Object | None, detail: str) -> InvariantViolation:
        return InvariantViolation(inv, f"object {o.label} ({o.state})" if o else "the L3 tier", detail)

    for op in tier.operations.values():
        want = {StoreOp.PUT: LS.putting, StoreOp.GET: LS.getting, StoreOp.REMOVE: LS.removing}.get(op.kind)
        for o in op.objects:
            if want is not None and (o.state != want or o.op_id != op.op_id
                                     or tier.objects.get(o.key) is not o):
                raise fail("l3_ends_by_deadline", o, f"in {op.kind.value} op {op.op_id} but {o.state}")
        if op.kind is StoreOp.PUT:
            r = op.receipt
            if r is None or r.released or any(n.host_pin < 1 or n.state not in HOST_VISIBLE for n in r.nodes):
                raise fail("l3_put_source_pinned", op.objects[0] if op.objects else None,
                           f"put {op.op_id} does not pin the host copies it reads")
        if op.kind is StoreOp.GET:
            if op.op_id not in tier.core.fetches:
                raise fail("l3_get_invisible", op.objects[0], f"get {op.op_id} owns no fetching nodes")
            if any(not o.store_answered for o in op.objects):
                raise fail("l3_visible_by_answer", op.objects[0], "fetched without the store's answer")
        if op.kind is StoreOp.REMOVE:
            for o in op.objects:
                if o.lease_holds and o.lease_until > 0 and o.state == LS.leased:  # pragma: no cover
                    raise fail("l3_lease_blocks_remove", o, "removed under a read lease")
    for o in tier.objects.values():
        if o.state in (LS.putting, LS.getting, LS.removing) and (o.op_id not in tier.operations):
            raise fail("l3_ends_by_deadline", o, "no operation in flight")
    in_get = {op_id for op_id, op in tier.operations.items() if op.kind is StoreOp.GET}
    for op_id, _ in tier.core.fetches.items():
        if op_id not in in_get:
            raise fail("l3_get_invisible", None, f"fetching nodes of get {op_id}, which is not in flight")


def l3_outstanding(tier: L3Tier, outbox: Iterable[StoreCommand], prefetches: Mapping[str, Prefetch]) -> L3Outstanding:
    """Count what ``tier`` holds or owes, in O(operations + objects)."""
    ops = tier.operations
    reserved = sum(len(p) for _, nodes in tier.core.fetches.items()
                   for n in nodes for p in n.pending.values())
    pins = sum(1 for op in ops.values() if op.receipt is not None and not op.receipt.released)
    return L3Outstanding(tuple(sorted(ops)), tuple(sorted(c.op_id for c in outbox)),
                         tuple(sorted(o for o, p in prefetches.items() if not p.done)), reserved, pins,
                         sum(1 for o in tier.objects.values() if o.state == LS.leased))
