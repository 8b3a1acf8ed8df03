"""Host reservations for L3 gets: prefix chunks fetched from a shared store into the host
tier (node states ``fetching`` -> ``host``; spec ``[node]`` events ``fetch_submit``,
``fetch_ack``, ``fetch_fail``).

A get is given a chain of unit keys that continues a node with a visible host copy (or the
root). :meth:`FetchTable.reserve` creates one node per unit, each in ``fetching`` with its
host pages reserved as ``pending`` (invisible to matching: invariant ``l3_get_invisible``)
and ``fetch_op`` set; :meth:`FetchTable.settle` turns an acknowledged prefix of them into
visible host copies (``fetch_ack``) and removes the rest deepest first (``fetch_fail``), so
a failed, missing or expired get only shortens the hit. A node covers one unit, so a
fetching node is never split. The core calls nothing here on its own; the L3 tier
(:mod:`kvtier.fsm.l3`) drives it through :meth:`FetchTable.reserve` and
:meth:`FetchTable.settle` (``CacheCore.fetches``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..errors import InvariantViolation, KvtierError, UsageError
from ..lifecycle.names import HOST_VISIBLE, NODE_EVENT as EV, NODE_STATE as NS
from .node import Node, PageMap
from .reclaim import Reclaimer
from .store import NodeStore

__all__ = ["FetchTable"]


class FetchTable:
    """The L3 gets in flight into the host tier: op id -> its fetching nodes, parent first,
    over one node core's ``store``; ``reclaimer`` makes host room for them."""

    def __init__(self, store: NodeStore, reclaimer: Reclaimer) -> None:
        self._store = store
        self._reclaimer = reclaimer
        self._ops: dict[int, list[Node]] = {}

    def __len__(self) -> int:
        return len(self._ops)

    def __contains__(self, op_id: object) -> bool:
        return op_id in self._ops

    def nodes(self, op_id: int) -> tuple[Node, ...]:
        """The fetching nodes of get ``op_id`` (parent first).

        Raises:
            KeyError: ``op_id`` is not in flight.
        """
        return tuple(self._ops[op_id])

    def items(self) -> list[tuple[int, tuple[Node, ...]]]:
        """(op id, its nodes) for every get in flight."""
        return [(k, tuple(v)) for k, v in self._ops.items()]

    def reserve(self, parent: Node, keys: Sequence[Hashable], op_id: int) -> list[Node]:
        """Create up to ``len(keys)`` fetching nodes, one unit each, chained under ``parent``,
        with host pages reserved for every history group. Host pages short are reclaimed from
        unpinned host leaves off ``parent``'s path; if still short, fewer units are reserved.

        Returns:
            The nodes, parent first (empty when nothing could be reserved: no room, or
            ``parent`` already has a child starting with ``keys[0]``).

        Raises:
            UsageError: no host tier, ``op_id`` already in flight, ``parent`` not the root or
                a node of this tree with a visible host copy, or no keys (nothing changes).
        """
        store = self._store
        if store.host is None:
            raise UsageError("fetch_reserve: the cache has no host tier")
        if op_id in self._ops:
            raise UsageError(f"fetch_reserve: op {op_id} is already in flight")
        if not keys:
            raise UsageError("fetch_reserve: no unit keys")
        if parent is not store.root:
            store.tree.members("fetch_reserve", [parent])
            if parent.state not in HOST_VISIBLE:
                raise UsageError(f"fetch_reserve: node {parent.node_id} is {parent.state}; a fetched chain "
                                 f"continues the root or a node with a visible host copy")
        if keys[0] in parent.children:
            return []
        ppu = store.pages_per_unit
        want = len(keys)
        short = store.ledger.host_short({g: p * want for g, p in ppu.items()})
        if short:
            self._reclaimer.evict_host(short, protect=parent.path())
        host = store.host
        fits = min(host[g].free // p for g, p in ppu.items() if p > 0) if ppu else want
        n = min(want, fits)
        made: list[Node] = []
        prev = parent
        for i in range(n):
            node = store.tree.new_leaf(prev, (keys[i],))
            node.fetch_op = op_id
            node.pending = {g: host[g].alloc(p) for g, p in ppu.items()}
            node.last_access = store.tick()
            store.trigger(node, EV.fetch_submit)
            store.tree.link(node)
            made.append(node)
            prev = node
        if made:
            self._ops[op_id] = made
            store.stats.fetches += 1
        return made

    def settle(self, op_id: int, acked: int) -> list[Node]:
        """End get ``op_id``: its first ``acked`` nodes become visible host copies
        (``fetch_ack``, parent first); the others are removed deepest first
        (``fetch_fail``: their reservations freed).

        Returns:
            The nodes now on the host.

        Raises:
            KeyError: ``op_id`` is not in flight (nothing changes).
            UsageError: ``acked`` not an int in 0..len(nodes) (nothing changes).
        """
        nodes = self._ops[op_id]
        if isinstance(acked, bool) or not isinstance(acked, int) or not 0 <= acked <= len(nodes):
            raise UsageError(f"fetch_settle: acked must be an int in 0..{len(nodes)}, got {acked!r}")
        store = self._store
        del self._ops[op_id]
        for node in reversed(nodes[acked:]):
            if node.children:  # pragma: no cover - fetching nodes get no children but fetching ones
                raise KvtierError(f"fetch_settle: node {node.node_id} has children")
            store.ledger.release_host(node.pending)
            node.pending = {}
            node.fetch_op = None
            store.trigger(node, EV.fetch_fail)
            store.tree.unlink(node)
            store.stats.fetch_failed_units += 1
        stamp = store.tick()
        for node in nodes[:acked]:
            pending: PageMap = node.pending
            node.host = pending
            node.pending = {}
            node.fetch_op = None
            node.last_access = stamp
            store.trigger(node, EV.fetch_ack)
            store.stats.fetched_units += 1
        return list(nodes[:acked])

    def check(self) -> None:
        """Invariant ``l3_get_invisible``: every fetching node belongs to exactly the get
        its ``fetch_op`` names, and every get in flight holds only fetching nodes.

        Raises:
            InvariantViolation: naming the node.
        """
        listed: set[int] = set()
        for op_id, nodes in self._ops.items():
            for n in nodes:
                if n.state != NS.fetching or n.fetch_op != op_id:
                    raise InvariantViolation("l3_get_invisible", f"node {n.node_id} ({n.state})",
                                             f"in get {op_id} but not fetching for it")
                listed.add(n.node_id)
        for n in self._store.tree:
            if n.state == NS.fetching and n.node_id not in listed:
                raise InvariantViolation("l3_get_invisible", f"node {n.node_id} (fetching)",
                                         "fetching but no get in flight lists it")
