"""Radix tree nodes and the receipts that hold them.

A node covers ``len(key)`` cache units (one unit = ``alignment`` tokens). Per history
group it holds page-id lists covering its units; per state group, at most one
continuation-state checkpoint (``state_pages`` pages) for exactly its own end.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Set as AbstractSet

from ..lifecycle.names import DEVICE_READABLE, DEVICE_RESIDENT, HOST_PENDING, HOST_VISIBLE, NODE_STATE

__all__ = ["Node", "NodeReceipt", "LockReceipt", "PageMap", "DEVICE_READABLE", "DEVICE_RESIDENT", "HOST_VISIBLE",
           "HOST_PENDING"]


#: cache group -> page ids (a page table, or the pages one operation or call involves).
PageMap = dict[str, list[int]]

_NO_REFS: frozenset[int] = frozenset()


class Node:
    """One radix node. Opaque to engines except for the read-only fields below.

    Attributes:
        node_id: unique id (never reused within a cache).
        state: node-residency lifecycle state (see spec/lifecycle.toml).
        key: the node's unit keys (one per cache unit).
        parent: parent node (``None`` only for the root).
        children: first unit key -> child.
        depth: units from the root to the node's end.
        dev, host, pending: history group -> page ids (device, visible host, pending host
            reservation) covering the node's units in order.
        dev_ckpt, host_ckpt, pending_ckpt: state group -> the continuation-state
            checkpoint's page ids at the node's end (device, visible host, pending host), or empty.
        lock_ref: running requests holding the node (path-wise: a lock on a node holds
            its ancestors too).
        borrow_ref: requests reading the node's device pages directly.
        host_pin: pins on the host copy (in-flight loadbacks and requests waiting on them).
        hit_count: reuse count: distinct requests that locked the node, counted when a
            request other than the last one locks it (a request re-locking its own path
            after each prefill chunk counts once); ``write_through_selective`` and the
            frequency-aware eviction policies read it.
        last_owner: the request that counted the last reuse.
        turns: the conversation turn of the latest request whose prompt went through the
            node: a request that publishes below a leaf another request also used extends
            that conversation (the leaf's turns + 1); one that branches off starts at 1.
            Only grows; the ``lru_turns`` eviction policy reads it.
        last_access: logical clock stamp of the last use (never wall time).
        prev_use: ``last_access`` when the current reuse began (0 before a second use):
            the second-to-last use, for LRU-2 eviction.
        wb_op, lb_op: op id of the in-flight writeback / loadback, or ``None``.
        fetch_op: op id of the in-flight L3 get filling its pending host pages (state
            ``fetching``; :mod:`kvtier.fsm.node.fetch`), or ``None``.
        refs: ids of the pin and borrow receipts (:class:`NodeReceipt`) that list this
            node; read-only (the set exists only while some receipt lists the node, which
            keeps the memory per node small).
    """

    __slots__ = ("node_id", "state", "key", "parent", "children", "depth", "dev", "host", "pending",
                 "dev_ckpt", "host_ckpt", "pending_ckpt", "lock_ref", "borrow_ref", "host_pin",
                 "hit_count", "last_owner", "turns", "last_access", "prev_use", "wb_op", "lb_op", "fetch_op", "_refs",
                 "chunk_checkpoint", "reloaded")

    def __init__(self, node_id: int, key: tuple[Hashable, ...], parent: Node | None) -> None:
        self.node_id = node_id
        self.state = NODE_STATE.new
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.depth: int = (parent.depth if parent is not None else 0) + len(key)
        self.dev: PageMap = {}
        self.host: PageMap = {}
        self.pending: PageMap = {}
        self.dev_ckpt: PageMap = {}
        self.host_ckpt: PageMap = {}
        self.pending_ckpt: PageMap = {}
        self.lock_ref = 0
        self.borrow_ref = 0
        self.host_pin = 0
        self.hit_count = 0
        self.last_owner: str | None = None
        self.turns = 1
        self.last_access = 0
        self.prev_use = 0
        self.wb_op: int | None = None
        self.lb_op: int | None = None
        self.fetch_op: int | None = None
        self._refs: set[int] | None = None  # ids of NodeReceipts that list this node, once any does
        self.chunk_checkpoint = False  # checkpoint left by an intermediate prefill chunk
        self.reloaded = False  # backed because a loadback brought it back (its host copy is a duplicate)

    @property
    def label(self) -> int:
        return self.node_id

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def refs(self) -> AbstractSet[int]:
        """Ids of the receipts that list this node (read-only view)."""
        return self._refs if self._refs is not None else _NO_REFS

    def add_ref(self, receipt_id: int) -> None:
        """Record that receipt ``receipt_id`` lists this node."""
        if self._refs is None:
            self._refs = {receipt_id}
        else:
            self._refs.add(receipt_id)

    def discard_ref(self, receipt_id: int) -> None:
        """Forget receipt ``receipt_id`` (no error if absent); drops the set once empty."""
        refs = self._refs
        if refs is not None:
            refs.discard(receipt_id)
            if not refs:
                self._refs = None

    def __repr__(self) -> str:
        return f"<node {self.node_id} {self.state} depth={self.depth} units={len(self.key)}>"

    # -- guard inputs (kvtier.fsm.lifecycle.guards) -------------------------------------------
    @property
    def parent_on_host(self) -> bool:
        """Parent is the root, has a visible host copy, or is written back (or fetched from
        L3) by the same op."""
        p = self.parent
        assert p is not None
        if p.parent is None or p.state in HOST_VISIBLE:
            return True
        if p.state not in HOST_PENDING:
            return False
        if p.wb_op is not None and p.wb_op == self.wb_op:
            return True
        return p.fetch_op is not None and p.fetch_op == self.fetch_op

    @property
    def parent_on_device(self) -> bool:
        p = self.parent
        assert p is not None
        return p.parent is None or p.state in DEVICE_RESIDENT

    @property
    def parent_readable(self) -> bool:
        p = self.parent
        assert p is not None
        return p.parent is None or p.state in DEVICE_READABLE

    @property
    def has_device_child(self) -> bool:
        if self.children:  # (a leaf answers without a loop)
            for c in self.children.values():
                if c.state in DEVICE_RESIDENT:
                    return True
        return False

    @property
    def has_host_child(self) -> bool:
        if self.children:
            for c in self.children.values():
                if c.state in HOST_VISIBLE or c.state in HOST_PENDING:
                    return True
        return False

    def path(self) -> list[Node]:
        """This node and its ancestors up to (excluding) the root, deepest first."""
        out = []
        n: Node | None = self
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        return out


class NodeReceipt:
    """A pin or borrow taken on an explicit list of nodes; released exactly once.

    Splits insert the new prefix fragment into every receipt that lists the split node.
    """

    __slots__ = ("receipt_id", "kind", "nodes", "owner", "released")

    def __init__(self, receipt_id: int, kind: str, nodes: list[Node], owner: str | None) -> None:
        self.receipt_id = receipt_id
        self.kind = kind  # "pin" or "borrow"
        self.nodes = nodes
        self.owner = owner
        self.released = False

    def __repr__(self) -> str:
        return f"<{self.kind} receipt {self.receipt_id} owner={self.owner!r} nodes={[n.node_id for n in self.nodes]}>"


class LockReceipt:
    """A device lock on a node and all its ancestors; released exactly once."""

    __slots__ = ("receipt_id", "node", "owner", "released")

    def __init__(self, receipt_id: int, node: Node, owner: str | None) -> None:
        self.receipt_id = receipt_id
        self.node = node
        self.owner = owner
        self.released = False

    def __repr__(self) -> str:
        return f"<lock receipt {self.receipt_id} owner={self.owner!r} node={self.node.node_id}>"
