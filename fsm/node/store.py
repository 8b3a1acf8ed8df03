"""What the node core's parts share: the tree, the page ledger, the receipts, the eviction
index, the writeback queue, the operation table, the statistics and the logical clock,
with the three moves every part makes through them (:meth:`NodeStore.trigger` a node
event, :meth:`NodeStore.tick` the clock, :meth:`NodeStore.split` a node).

:class:`~kvtier.fsm.node.core.CacheCore` builds one store and hands it to its parts
(:mod:`~kvtier.fsm.node.reclaim`, :mod:`~kvtier.fsm.node.transfers`,
:mod:`~kvtier.fsm.node.publish`, :mod:`~kvtier.fsm.node.fetch`,
:mod:`~kvtier.fsm.node.invariants`), each with the sibling parts it calls: no part reaches
the core. The store checks nothing it is given (the core validated the configuration).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ..layout import CacheLayout
from ..lifecycle.machines import node_lifecycle
from ..lifecycle.names import NODE_EVENT as EV, NODE_STATE as NS
from .eviction import EvictionPolicy, make_policy
from .ledger import PageLedger
from .node import Node
from .optable import OperationTable
from .pages import PageAllocator
from .receipts import ReceiptBook
from .results import CacheStats
from .tree import RadixTree
from .writeback import WritebackQueue, WritePolicy

__all__ = ["NodeStore"]

_REMOVED = NS.removed


class NodeStore:
    """The state of one node core, shared by its parts.

    Args:
        layout: the model's cache groups.
        ledger: the page ledger (device and host allocators, the callers' pages).
        policy: the write policy.
        write_threshold: hit count at which ``write_through_selective`` backs a node up.
        world_size: ranks that acknowledge every operation.
        op_deadline_steps: scheduler steps after which an operation fails (``None``: never).
        eviction: the eviction policy's name (:data:`kvtier.fsm.node.eviction.POLICIES`).
        exclusive: an exclusive host tier (only with a host tier).

    Raises:
        ConfigError: an unknown eviction policy.

    Attributes:
        layout, policy, exclusive: as given (read-only).
        history_groups, ckpt_groups: names of the history and the continuation-state groups.
        pages_per_unit: history group -> pages per cache unit.
        tree, root, ledger, device, host, eviction, receipts, writebacks, optable, stats:
            the parts (``device``/``host``: the ledger's allocators by group; ``host`` is
            ``None`` without a host tier).
        fire: the node machine's ``fire`` (built from the spec), which :meth:`trigger` calls.
        clock: the logical clock (:meth:`tick`).
    """

    def __init__(self, layout: CacheLayout, ledger: PageLedger, *, policy: WritePolicy, write_threshold: int,
                 world_size: int, op_deadline_steps: int | None, eviction: str, exclusive: bool) -> None:
        self.layout = layout
        self.policy = policy
        self.exclusive = exclusive
        self.history_groups = tuple(g.name for g in layout.history_groups)
        self.ckpt_groups = tuple(g.name for g in layout.state_groups)
        self.pages_per_unit = {g.name: layout.pages_per_unit(g) for g in layout.history_groups}
        ids = itertools.count(1)  # node ids and receipt ids: never reused within a cache
        self.tree = RadixTree(self.pages_per_unit, ids)
        self.root = self.tree.root
        self.ledger = ledger
        self.device: dict[str, PageAllocator] = ledger.device
        self.host: dict[str, PageAllocator] | None = ledger.host
        units = sum(min((pools[g].capacity // k for g, k in self.pages_per_unit.items()), default=0)
                    for pools in (ledger.device, ledger.host) if pools)
        self.eviction: EvictionPolicy = make_policy(eviction, self.tree.__iter__, self.tree.__len__, self.tree.has,
                                                    exclusive=exclusive, capacity_units=units,
                                                    host_tier=ledger.host is not None)
        self.writebacks = WritebackQueue(policy, write_threshold, enabled=ledger.host is not None)
        self.receipts = ReceiptBook(ids, self.eviction.touch,
                                    self.writebacks.on_hit if self.writebacks.wants_hits else None)
        self.optable = OperationTable(world_size, layout.num_layers, op_deadline_steps)
        self.fire: Callable[[Node, str], str] = node_lifecycle().fire
        self.clock = 0
        self.stats = CacheStats()

    def trigger(self, node: Node, event: str) -> None:
        """Fire a node event through the spec's machine and re-file the node (and its
        parent) in the eviction index when its state changed (an internal transition,
        ``split`` or ``loadback_layer_done``, makes no victim and lowers no key: nothing
        to re-file; a split files its new fragment itself).

        Raises:
            IllegalTransition, GuardRejected: the event is refused (nothing changes).
        """
        before = node.state
        self.fire(node, event)
        self.stats.triggers += 1
        state = node.state
        if state == before:
            return
        touch = self.eviction.touch
        if state != _REMOVED:  # (a removed node is never a candidate again)
            touch(node)
        parent = node.parent
        if parent is not None and parent.parent is not None:
            touch(parent)

    def tick(self) -> int:
        """Advance the logical clock; returns the new stamp."""
        self.clock += 1
        return self.clock

    def split(self, node: Node, k: int) -> Node:
        """Split ``node`` after ``k`` units; returns the new prefix fragment (its parent).
        Both fragments keep the state, counts, receipts and in-flight operations
        (invariant ``split_preserves_ownership``)."""
        self.trigger(node, EV.split)
        prefix = self.tree.cut(node, k)
        if node.refs:  # (only receipts that list it, only operations moving it)
            self.receipts.on_split(node, prefix)
        if node.wb_op is not None or node.lb_op is not None:
            self.optable.on_split(node, prefix)
        if self.writebacks.enabled:  # (a cache without a host tier queues nothing)
            self.writebacks.on_split(node, prefix)
        self.eviction.touch(prefix)
        self.stats.splits += 1
        return prefix
