"""The kit's reads of core and facade internals, one accessor per concept.

The kit's machines check invariants against the state of the system under test: the
tree's nodes, the operations in flight, the receipts, the facade's request records.
Every such read goes through one function here, so that the kit depends on the
read-only views of :class:`~kvtier.fsm.node.core.CacheCore`'s parts and of
:class:`~kvtier.tiered.TieredCache` in this module only. Accessors return snapshots
(copies) unless they say otherwise: callers only read them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from kvtier.fsm import CacheCore
from kvtier.fsm.node import LockReceipt, Node, NodeReceipt
from kvtier.fsm.node.ops import Operation
from kvtier.fsm.records import StoreCommand, TransferCommand

if TYPE_CHECKING:
    from kvtier.fsm.request import Request, RequestEvent

    from kvtier.fsm.l3 import L3Tier

    from ..tiered import TieredCache

__all__ = [
    "nodes",
    "ops",
    "outbox",
    "writeback_queue",
    "writeback_refused",
    "device_page_free",
    "locks",
    "receipts",
    "history_groups",
    "checkpoint_groups",
    "pages_per_unit",
    "checkpoint_pages",
    "device_victim",
    "host_victim",
    "requests",
    "request_events",
    "l3_internals",
    "ended_history",
]


# -- the core (CacheCore) ----------------------------------------------------------

def nodes(core: CacheCore) -> dict[int, Node]:
    """Every node of the tree but the root, by node id."""
    return {n.node_id: n for n in core.tree}


def ops(core: CacheCore) -> dict[int, Operation]:
    """The operations in flight, by op id."""
    return core.optable.snapshot()


def outbox(core: CacheCore) -> tuple[TransferCommand, ...]:
    """Transfer commands issued and not yet taken by ``poll_commands``."""
    return core.pending_commands()


def writeback_queue(core: CacheCore) -> dict[int, Node]:
    """Nodes waiting for a tree writeback, by node id."""
    return core.writebacks.queued()


def device_page_free(core: CacheCore, group: str, page: int) -> bool:
    """Whether device page ``page`` of ``group`` is free in the core's allocator."""
    return core.device[group].is_free(page)


def writeback_refused(core: CacheCore, node_id: int) -> bool:
    """Whether the host refused ``node_id``'s tree writeback (it left the queue for that)."""
    return core.writebacks.refused(node_id)


def locks(core: CacheCore) -> dict[int, LockReceipt]:
    """Lock receipts outstanding, by receipt id."""
    return {r.receipt_id: r for r in core.receipts.locks()}


def receipts(core: CacheCore) -> dict[int, NodeReceipt]:
    """Borrow and pin receipts callers hold, by receipt id (an operation's own pin, with
    a negative id, is the operation's, not a caller's)."""
    return {r.receipt_id: r for r in core.receipts.node_receipts() if r.receipt_id > 0}


def history_groups(core: CacheCore) -> list[str]:
    """Names of the history cache groups, in layout order."""
    return list(core.history_groups)


def checkpoint_groups(core: CacheCore) -> list[str]:
    """Names of the continuation-state (checkpoint) cache groups, in layout order."""
    return list(core.ckpt_groups)


def pages_per_unit(core: CacheCore) -> dict[str, int]:
    """Pages per alignment unit of each history group."""
    return dict(core.pages_per_unit)


def checkpoint_pages(core: CacheCore) -> dict[str, int]:
    """Pages one checkpoint holds in each continuation-state group."""
    return {g.name: g.state_pages for g in core.layout.state_groups}


def device_victim(core: CacheCore, node: Node) -> bool:
    """Whether device eviction may take ``node`` now."""
    return core.evictable_on_device(node)


def host_victim(core: CacheCore, node: Node) -> bool:
    """Whether host eviction may take ``node`` now (nothing protected)."""
    return core.evictable_on_host(node)


def eviction_window(core: CacheCore) -> int:
    """The ``lru_turns`` window of the core's eviction index (clock ticks per doubling of turns)."""
    return int(getattr(core.eviction, "window", 0))


# -- the L3 tier (L3Tier) ----------------------------------------------------------------

def l3_internals(tier: L3Tier) -> tuple[int, tuple[str, ...], tuple[str, ...], tuple[tuple[Any, ...], ...],
                                         tuple[StoreCommand, ...]]:
    """What an :class:`~kvtier.fsm.l3.L3Tier` keeps beyond its public views, as a
    comparable snapshot: op ids issued, the put hint (oldest first), removes waiting, the
    prefetch records (owner, units, start, keys, op id, fetched, done) and the commands
    not yet polled."""
    prefetch = tuple((o, p.units, p.start, tuple(p.keys), p.op_id, p.fetched, p.done)
                     for o, p in sorted(tier._prefetch.items()))
    return (tier._issued, tuple(tier._hint), tuple(tier._pending_removes), prefetch, tuple(tier._outbox))


# -- the facade (TieredCache) --------------------------------------------------------------

def requests(cache: TieredCache) -> dict[str, Request]:
    """The facade's request records (live, read-only for the kit), by request id."""
    return {r.request_id: r for r in cache.table}


def request_events(cache: TieredCache) -> tuple[RequestEvent, ...]:
    """Request state changes not yet reported by ``poll``."""
    return tuple(cache.table.pending_events())


def ended_history(cache: TieredCache) -> int:
    """How many forgotten ended requests the facade still answers ``request()`` for."""
    return cache.table.ended_history


def fingerprint(cache: TieredCache) -> Hashable:
    """What a refused call must leave as it was: every node's state, key, pages and
    counts, the pools' use, the receipts, operations, commands, queued writebacks, the
    requests' records and the clock."""
    core = cache.core

    def pm(m: dict[str, list[int]]) -> tuple[Any, ...]:
        return tuple(sorted((g, tuple(p)) for g, p in m.items()))

    tree = tuple((n.node_id, n.state, tuple(map(str, n.key)), pm(n.dev), pm(n.host), pm(n.pending),
                   pm(n.dev_ckpt), pm(n.host_ckpt), n.lock_ref, n.borrow_ref, n.host_pin, n.hit_count,
                   n.last_access, n.wb_op, n.lb_op) for _, n in sorted(nodes(core).items()))
    pools = tuple((g, a.used) for g, a in sorted(core.device.items())) + tuple(
        (g, a.used) for g, a in sorted((core.host or {}).items()))
    reqs = tuple((rid, r.state, r.tokens, r.reserved, r.passes, r.results, pm(r.own), tuple(sorted(r.ops)))
                 for rid, r in sorted(requests(cache).items()))
    return (tree, pools, tuple(sorted(locks(core))), tuple(sorted(receipts(core))),
            tuple(sorted(ops(core))), tuple(c.op_id for c in outbox(core)),
            tuple(sorted(writeback_queue(core))), reqs, len(request_events(cache)), core.clock)
