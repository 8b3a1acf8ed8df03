"""Hostile calls, inert calls and invariant corruptions for the L3 machine
(:mod:`kvtier.testing.l3_machine`).

- :data:`HOSTILE`: bad calls on a live L3 tier (wrong types, op ids never issued, bad
  options, a tier over a core that cannot have one, fetch reservations the table must
  refuse). Each must raise a :class:`~kvtier.fsm.errors.KvtierError` and leave both
  instances exactly as they were (:func:`fingerprint`).
- :data:`INERT`: legal calls that must do nothing here (a second prefetch for an owner
  whose prefetch is in flight, a reservation under a node that already has that child,
  forgetting an owner with nothing finished, removing no keys): each returns the
  documented "nothing" value and changes nothing.
- :data:`CORRUPTIONS`: on a deep copy of one instance, a state the ``l3_*`` invariants
  (:func:`kvtier.fsm.l3.checks.check_l3`, :meth:`kvtier.fsm.node.fetch.FetchTable.check`) forbid;
  the check must raise :class:`~kvtier.fsm.errors.InvariantViolation` naming the
  invariant.

A case that does not apply in the current state raises :class:`Skip` before calling
anything.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Hashable
from typing import Any

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import ConfigError, KvtierError
from kvtier.fsm.l3 import L3Options, L3Tier, StoreOp, StoreResult
from kvtier.fsm.lifecycle.machines import l3_lifecycle, node_lifecycle
from kvtier.fsm.lifecycle.names import HOST_VISIBLE, L3_STATE, NODE_STATE
from kvtier.fsm.node import Node
from kvtier.fsm.lifecycle.spec import load_spec

from . import _views as views
from .base import kit_layout
from .l3_steps import L3Steps


__all__ = ["Skip", "fingerprint", "copy_instance", "HOSTILE", "INERT", "CORRUPTIONS"]


class Skip(Exception):
    """The case does not apply in this state (nothing was called)."""


def _pm(m: dict[str, list[int]]) -> tuple[Any, ...]:
    return tuple(sorted((g, tuple(p)) for g, p in m.items()))


def _core_print(core: CacheCore) -> Hashable:
    nodes = tuple((n.node_id, n.state, tuple(map(str, n.key)), _pm(n.dev), _pm(n.host), _pm(n.pending),
                   n.lock_ref, n.borrow_ref, n.host_pin, n.hit_count, n.last_access, n.wb_op, n.lb_op, n.fetch_op)
                  for _, n in sorted(views.nodes(core).items()))
    pools = tuple((g, a.used) for g, a in sorted(core.device.items())) + tuple(
        (g, a.used) for g, a in sorted((core.host or {}).items()))
    fetches = tuple((op_id, tuple(n.node_id for n in ns)) for op_id, ns in sorted(core.fetches.items()))
    return (nodes, pools, fetches, tuple(sorted(views.locks(core))), tuple(sorted(views.receipts(core))),
            tuple(sorted(views.ops(core))), tuple(c.op_id for c in views.outbox(core)), core.clock)


def _tier_print(tier: L3Tier) -> Hashable:
    objects = tuple((k, o.state, o.op_id, o.host_visible, o.store_answered, o.lease_holds, o.lease_until)
                    for k, o in sorted(tier.objects.items()))
    ops = tuple((i, op.kind, tuple(o.key for o in op.objects), op.deadline, op.owner,
                 op.receipt.receipt_id if op.receipt is not None else None)
                for i, op in sorted(tier.operations.items()))
    return (objects, ops, repr(tier.stats), views.l3_internals(tier))


def fingerprint(m: L3Steps) -> Hashable:
    """Both instances: every node, pool, fetch, receipt and transfer of the cores, and every
    object, operation, counter and internal record (hint, waiting removes, prefetches,
    unpolled commands) of the tiers."""
    return tuple((_core_print(c), _tier_print(t)) for c, t in zip(m.cores, m.tiers))


def _pick(values: tuple[Any, ...], v: int) -> Any:
    return values[v % len(values)]


def _some(items: list[Any], v: int) -> Any:
    if not items:
        raise Skip()
    return items[v % len(items)]


def _ops_of(tier: L3Tier, kind: StoreOp) -> list[int]:
    return sorted(i for i, op in tier.operations.items() if op.kind is kind)


# -- hostile calls ---------------------------------------------------------------------------

#: L3Options no tier accepts (each names the first bad option): every check of L3Options.check
BAD_OPTIONS: tuple[dict[str, Any], ...] = (
    {"write_policy": "write_everything"}, {"write_threshold": 0}, {"prefetch_units": True},
    {"min_prefetch_units": 1.5}, {"max_put_units": "3"}, {"hint_size": 0}, {"world_size": 0},
    {"tp_rank": -1}, {"eviction_lookahead": None}, {"tp_rank": 2, "world_size": 2},
    {"deadline_s": 0}, {"deadline_s": -1.0}, {"lease_s": -0.5}, {"lease_s": "10"}, {"deadline_s": True},
)


def _tier_with(core: CacheCore, options: dict[str, Any]) -> L3Tier:
    return L3Tier(core, L3Options(**options))


def _bad_tier(m: L3Steps, i: int, v: int) -> None:
    """Every refused construction (the variant picks which comes last): each must raise a
    ConfigError, a bad option's naming the option; the last one's error propagates."""
    core = m.cores[i]
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("options", lambda: L3Tier(core, "options")),  # type: ignore[arg-type]
        ("host tier", lambda: L3Tier(CacheCore(core.layout, 4), L3Options())),
        ("continuation-state", lambda: L3Tier(CacheCore(kit_layout(True), 4, 4), L3Options())),
    ]
    for bad in BAD_OPTIONS:
        variants.append((next(iter(bad)), functools.partial(_tier_with, core, bad)))
    k = v % len(variants)
    last: ConfigError | None = None
    for named, call in variants[k + 1:] + variants[:k + 1]:
        try:
            call()
        except ConfigError as exc:
            if named not in str(exc):
                raise AssertionError(f"L3 tier refused with {exc}, which does not name {named!r}") from exc
            last = exc
        else:
            raise AssertionError(f"an L3 tier was built with bad {named!r}")
    assert last is not None
    raise last


def _every(what: str, variants: list[Callable[[], Any]], v: int) -> None:
    """Call every variant, the ``v``-th (mod their count) last: each must raise a
    KvtierError (one that does not apply now raises :class:`Skip` before calling
    anything); the last error propagates (:class:`Skip` if none applied)."""
    k = v % len(variants)
    last: KvtierError | None = None
    for j in [*range(k + 1, len(variants)), *range(k + 1)]:
        try:
            variants[j]()
        except Skip:
            continue
        except KvtierError as exc:
            last = exc
            continue
        raise AssertionError(f"hostile L3 call {what!r} (variant {j}) was accepted")
    if last is None:
        raise Skip()
    raise last


def _bad_prefetch(m: L3Steps, i: int, v: int) -> None:
    tier = m.tiers[i]
    _every("prefetch", [lambda: tier.prefetch(7, ["a"], m.now),  # type: ignore[arg-type]
                        lambda: tier.prefetch(None, ["a"], m.now),  # type: ignore[arg-type]
                        lambda: tier.prefetch("q-bad", 5, m.now),  # type: ignore[arg-type]
                        lambda: tier.prefetch("q-bad", None, m.now)], v)  # type: ignore[arg-type]


def _bad_offer(m: L3Steps, i: int, v: int) -> None:
    bad_units: tuple[Any, ...] = (5, None, 2.5)
    _every("offer", [functools.partial(m.tiers[i].offer, bad, m.now) for bad in bad_units], v)


def _bad_remove(m: L3Steps, i: int, v: int) -> None:
    tier = m.tiers[i]
    busy = sorted(tier.objects)  # keys in flight or leased: a refused call must not defer them
    good = [busy[v % len(busy)]] if busy else tier.keys_for(("a",))
    _every("remove", [lambda: tier.remove("abc", m.now),
                      lambda: tier.remove(5, m.now),  # type: ignore[arg-type]
                      lambda: tier.remove([*good, 5], m.now),  # type: ignore[list-item]
                      lambda: tier.remove([*good, None, *good], m.now)], v)  # type: ignore[list-item]


def _bad_complete(m: L3Steps, i: int, v: int) -> None:
    tier = m.tiers[i]
    issued = views.l3_internals(tier)[0]
    _every("complete", [lambda: tier.complete("done", m.now),  # type: ignore[arg-type]
                        lambda: tier.complete(StoreResult(issued + 1 + v % 3), m.now),
                        lambda: tier.complete(StoreResult(-v), m.now)], v)


def _host_parent(core: CacheCore, v: int) -> Node:
    node: Node = _some([n for _, n in sorted(views.nodes(core).items()) if n.state in HOST_VISIBLE], v)
    return node


def _bad_reserve(m: L3Steps, i: int, v: int) -> None:
    core = m.cores[i]
    fetches = core.fetches
    variants: list[Callable[[], Any]] = [
        lambda: CacheCore(core.layout, 4).fetches.reserve(core.root, ["a"], 1),  # no host tier
        lambda: fetches.reserve(core.root, [], 10**6),
        lambda: fetches.reserve(_foreign_node(core), ["z"], 10**6),
        lambda: fetches.reserve(_some([n for _, n in sorted(views.nodes(core).items())
                                       if n.state not in HOST_VISIBLE], v), ["z"], 10**6),
        lambda: fetches.reserve(core.root, ["z"], _some([op for op, _ in fetches.items()], v)),
        lambda: fetches.settle(_some([op for op, _ in fetches.items()], v),
                               _pick((-1, True, 1.0, 10**3), v // 7)),
    ]
    _every("fetch reservation", variants, v)


def _foreign_node(core: CacheCore) -> Node:
    other = CacheCore(core.layout, 4, 4)
    pages = other.alloc_device({g: p for g, p in other.pages_per_unit.items()})
    return other.insert(["x"], pages).node


#: (name, call(machine, instance, variant)): each must raise a KvtierError and change nothing
HOSTILE: tuple[tuple[str, Callable[[L3Steps, int, int], None]], ...] = (
    ("tier construction", _bad_tier),
    ("prefetch arguments", _bad_prefetch),
    ("offer arguments", _bad_offer),
    ("remove arguments", _bad_remove),
    ("complete a result never issued", _bad_complete),
    ("fetch reservations", _bad_reserve),
)


# -- inert calls -----------------------------------------------------------------------------

def _prefetch_in_flight(m: L3Steps, i: int, v: int) -> object:
    tier = m.tiers[i]
    owner = _some(sorted({op.owner for op in tier.operations.values()
                          if op.owner is not None and tier.prefetching(op.owner)}), v)
    return tier.prefetch(owner, ["a", "b"], m.now) is False


def _reserve_taken(m: L3Steps, i: int, v: int) -> object:
    core = m.cores[i]
    parents = [core.root, *(n for _, n in sorted(views.nodes(core).items()) if n.state in HOST_VISIBLE)]
    parent = _some([p for p in parents if p.children], v)
    first = sorted(parent.children, key=repr)[v % len(parent.children)]
    return core.fetches.reserve(parent, [first, "z"], 10**6) == []


def _forget_unknown(m: L3Steps, i: int, v: int) -> object:
    tier = m.tiers[i]
    owner = ("never-prefetched", "")[v % 2]
    tier.forget(owner)
    return not tier.prefetching(owner) and tier.fetched_units(owner) == 0 and not tier.cancel(owner, m.now)


def _remove_nothing(m: L3Steps, i: int, v: int) -> object:
    return m.tiers[i].remove(_pick(([], ()), v), m.now) == 0


#: (name, call(machine, instance, variant) -> whether it returned what the docs say)
INERT: tuple[tuple[str, Callable[[L3Steps, int, int], object]], ...] = (
    ("prefetch while that owner's is in flight", _prefetch_in_flight),
    ("reserve under a node that has that child", _reserve_taken),
    ("forget or cancel an owner never prefetched", _forget_unknown),
    ("remove no keys", _remove_nothing),
)


# -- corruptions -----------------------------------------------------------------------------

def copy_instance(tier: L3Tier) -> L3Tier:
    """A deep copy of ``tier`` and its core to corrupt. The lifecycles (built once per
    process from the spec, stateless), the spec and the layout are shared, not copied."""
    shared: list[object] = [node_lifecycle(), l3_lifecycle(), load_spec(), tier.core.layout]
    return copy.deepcopy(tier, {id(o): o for o in shared})


def _busy_object_wrong_state(t: L3Tier, v: int) -> None:
    op = t.operations[_some([i for i, op in t.operations.items() if op.kind is not StoreOp.EXISTS], v)]
    o = op.objects[v % len(op.objects)]
    o.state = L3_STATE.leased if o.state != L3_STATE.leased else L3_STATE.unknown


def _busy_object_other_op(t: L3Tier, v: int) -> None:
    op = t.operations[_some([i for i, op in t.operations.items() if op.kind is not StoreOp.EXISTS], v)]
    op.objects[v % len(op.objects)].op_id = 10**9


def _put_unpinned(t: L3Tier, v: int) -> None:
    op = t.operations[_some(_ops_of(t, StoreOp.PUT), v)]
    if op.receipt is None or v % 2:
        op.receipt = None
    else:
        t.core.release(op.receipt)


def _get_without_nodes(t: L3Tier, v: int) -> None:
    t.core.fetches.settle(_some(_ops_of(t, StoreOp.GET), v), 0)


def _get_unanswered(t: L3Tier, v: int) -> None:
    op = t.operations[_some(_ops_of(t, StoreOp.GET), v)]
    op.objects[v % len(op.objects)].store_answered = False


def _leased_marked_busy(t: L3Tier, v: int) -> None:
    o = _some([o for _, o in sorted(t.objects.items()) if o.state == L3_STATE.leased], v)
    o.state = _pick((L3_STATE.getting, L3_STATE.putting, L3_STATE.removing), v)


def _fetch_unknown_to_tier(t: L3Tier, v: int) -> None:
    if not t.core.fetches.reserve(_host_parent(t.core, v) if v % 2 else t.core.root, ["zz", "zy"], 10**6):
        raise Skip()


def _fetching_node_other_op(t: L3Tier, v: int) -> None:
    _, nodes = _some(t.core.fetches.items(), v)
    node = nodes[v % len(nodes)]
    if v % 2:
        node.fetch_op = 10**9
    else:
        node.state = NODE_STATE.host


def _node_fetching_unlisted(t: L3Tier, v: int) -> None:
    node = _some([n for _, n in sorted(views.nodes(t.core).items()) if n.state != NODE_STATE.fetching], v)
    node.state = NODE_STATE.fetching


def _check_tier(t: L3Tier) -> None:
    t.check_invariants()


def _check_fetches(t: L3Tier) -> None:
    t.core.fetches.check()


#: (name, corrupt(copy of a tier, variant), the check that must see it, the invariant it names)
CORRUPTIONS: tuple[tuple[str, Callable[[L3Tier, int], None], Callable[[L3Tier], None], str], ...] = (
    ("an object of an operation in the wrong state", _busy_object_wrong_state, _check_tier, "l3_ends_by_deadline"),
    ("an object of an operation naming another op", _busy_object_other_op, _check_tier, "l3_ends_by_deadline"),
    ("a put that no longer pins its source", _put_unpinned, _check_tier, "l3_put_source_pinned"),
    ("a get whose fetching nodes are gone", _get_without_nodes, _check_tier, "l3_get_invisible"),
    ("a get of an object the store did not answer", _get_unanswered, _check_tier, "l3_visible_by_answer"),
    ("a busy object with no operation", _leased_marked_busy, _check_tier, "l3_ends_by_deadline"),
    ("fetching nodes of a get the tier never made", _fetch_unknown_to_tier, _check_tier, "l3_get_invisible"),
    ("a get's node not fetching for it", _fetching_node_other_op, _check_fetches, "l3_get_invisible"),
    ("a fetching node no get lists", _node_fetching_unlisted, _check_fetches, "l3_get_invisible"),
)
