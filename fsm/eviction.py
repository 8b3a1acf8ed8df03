"""The eviction index: which node to consider next when a pool runs short.

A policy orders candidates; it never decides legality (the core checks the lifecycle's
guards: unlocked, unborrowed, unpinned, no child on that tier). Every policy must decide
the same on every tensor-parallel rank: it may read only logical clocks and node ids,
never wall time, and its order must be total.

:class:`EvictionPolicy` is the interface; :class:`LRUIndex` (least recently used, ties
to the deepest node, then the node id) is the default.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Protocol

from .node import Node

__all__ = ["EvictionPolicy", "LRUIndex"]


class EvictionPolicy(Protocol):
    """What the core needs from an eviction policy.

    ``touch`` is called whenever a node's use, counts or state changed; the candidate
    iterators yield live nodes, each at most once per iteration, best victim first. A
    node yielded but not evicted is forgotten until it is touched again (whatever makes
    it a victim later, an unlock, a release, a child leaving, a state change, touches it).
    """

    def touch(self, node: Node) -> None: ...

    def device_candidates(self) -> Iterator[Node]: ...

    def host_candidates(self) -> Iterator[Node]: ...


_Entry = tuple[tuple[int, int, int], Node]


class LRUIndex:
    """Least-recently-used order on lazy heaps, one per tier.

    A touch pushes a new entry; stale entries (the node left the tree, or its key
    changed) are skipped when popped, so a touch costs O(log n). Keys hold the node id,
    so entries never tie and nodes are never compared. Each heap holds at most
    ``4 x nodes + 256`` entries: past that it is rebuilt from the live nodes.

    Args:
        live: the tree's nodes (an iterable re-read at each rebuild) and its size.
        is_live: whether a node is still in the tree.
    """

    def __init__(self, nodes: Callable[[], Iterator[Node]], size: Callable[[], int],
                 is_live: Callable[[Node], bool]) -> None:
        self._nodes = nodes
        self._size = size
        self._is_live = is_live
        self._dev: list[_Entry] = []
        self._host: list[_Entry] = []

    @staticmethod
    def key(n: Node) -> tuple[int, int, int]:
        """Oldest first, then deepest first, then node id: a total order every rank shares."""
        return (n.last_access, -n.depth, n.node_id)

    def touch(self, node: Node) -> None:
        key = self.key(node)
        heapq.heappush(self._dev, (key, node))
        heapq.heappush(self._host, (key, node))
        limit = 4 * self._size() + 256
        if len(self._dev) > limit:
            self._dev = self._rebuilt()
        if len(self._host) > limit:
            self._host = self._rebuilt()

    def _rebuilt(self) -> list[_Entry]:
        heap = [(self.key(n), n) for n in self._nodes()]
        heapq.heapify(heap)
        return heap

    def _pop(self, heap: list[_Entry]) -> Iterator[Node]:
        while heap:
            key, n = heapq.heappop(heap)
            if self._is_live(n) and key == self.key(n):
                yield n

    def device_candidates(self) -> Iterator[Node]:
        return self._pop(self._dev)

    def host_candidates(self) -> Iterator[Node]:
        return self._pop(self._host)

    def heap_sizes(self) -> tuple[int, int]:
        """Entries on the device and host heaps (stale ones included), for tests."""
        return len(self._dev), len(self._host)

    def heap_nodes(self) -> tuple[Node, ...]:
        """The node of every entry on the device heap, then the host heap, in heap order
        (stale entries included; a node may appear several times), for tests."""
        return tuple(n for _, n in self._dev) + tuple(n for _, n in self._host)
