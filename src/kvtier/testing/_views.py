"""The kit's reads of core and facade internals, one accessor per concept.

The kit's machines check invariants against the state of the system under test: the
tree's nodes, the operations in flight, the receipts, the facade's request records.
Every such read goes through one function here, so that the kit depends on the
internals of :class:`~kvtier.fsm.cache.TieredPrefixCache` and
:class:`~kvtier.tiered.TieredCache` in this module only (and can be re-pointed to
public read-only views in one place). Each accessor returns the live object, not a
copy: callers only read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.fsm.cache import TieredPrefixCache
from kvtier.fsm.node import LockReceipt, Node, NodeReceipt
from kvtier.fsm.ops import Operation
from kvtier.fsm.records import TransferCommand

if TYPE_CHECKING:
    from ..tiered import RequestEvent, TieredCache, _Request

__all__ = [
    "nodes",
    "ops",
    "expired",
    "outbox",
    "writeback_queue",
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
]


# -- the core (TieredPrefixCache) ----------------------------------------------------------

def nodes(core: TieredPrefixCache) -> dict[int, Node]:
    """Every node of the tree but the root, by node id."""
    return core._nodes


def ops(core: TieredPrefixCache) -> dict[int, Operation]:
    """The operations in flight, by op id."""
    return core._ops


def expired(core: TieredPrefixCache) -> set[int]:
    """Op ids settled by their deadline (their late completions are absorbed)."""
    return core._expired


def outbox(core: TieredPrefixCache) -> list[TransferCommand]:
    """Transfer commands issued and not yet taken by ``poll_commands``."""
    return core._outbox


def writeback_queue(core: TieredPrefixCache) -> dict[int, Node]:
    """Nodes waiting for a tree writeback, by node id."""
    return core._wb_queue


def locks(core: TieredPrefixCache) -> dict[int, LockReceipt]:
    """Lock receipts outstanding, by receipt id."""
    return core._locks


def receipts(core: TieredPrefixCache) -> dict[int, NodeReceipt]:
    """Borrow and pin receipts outstanding, by receipt id."""
    return core._receipts


def history_groups(core: TieredPrefixCache) -> list[str]:
    """Names of the history cache groups, in layout order."""
    return core._history


def checkpoint_groups(core: TieredPrefixCache) -> list[str]:
    """Names of the continuation-state (checkpoint) cache groups, in layout order."""
    return core._state


def pages_per_unit(core: TieredPrefixCache) -> dict[str, int]:
    """Pages per alignment unit of each history group."""
    return core._ppu


def checkpoint_pages(core: TieredPrefixCache) -> dict[str, int]:
    """Pages one checkpoint holds in each continuation-state group."""
    return core._state_pages


def device_victim(core: TieredPrefixCache, node: Node) -> bool:
    """Whether device eviction may take ``node`` now."""
    return core._device_victim(node)


def host_victim(core: TieredPrefixCache, node: Node) -> bool:
    """Whether host eviction may take ``node`` now (nothing protected)."""
    return core._host_victim(node, set())


# -- the facade (TieredCache) --------------------------------------------------------------

def requests(cache: TieredCache) -> dict[str, _Request]:
    """The facade's request records, by request id."""
    return cache._requests


def request_events(cache: TieredCache) -> list[RequestEvent]:
    """Request state changes not yet reported by ``poll``."""
    return cache._events
