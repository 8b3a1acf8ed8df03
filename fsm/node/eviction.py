"""The eviction index: which node to consider next when a pool runs short.

A policy orders candidates; it never decides legality (the core checks the lifecycle's
guards: unlocked, unborrowed, unpinned, no child on that tier). Every policy must decide
the same on every tensor-parallel rank: it reads only logical clocks, reuse counts and
node ids, never wall time, and its order is total (the node id breaks every tie).

:class:`EvictionPolicy` is the interface the core uses; :class:`HeapIndex` implements it
with one lazy heap per tier and a sort key per tier. Policies by name
(:data:`POLICIES`, :func:`make_policy`):

- ``lru`` (default): least recently used first, ties to the deepest node.
- ``lru_turns``: LRU in which a conversation that came back often ages slower. A node's
  key is its last use plus ``window x log2(turns)`` clock ticks (``Node.turns``: the
  conversation turn of the latest request through it), so a path that many turns
  extended outlives a one-turn path used a little later. ``window`` is
  :data:`TURN_WINDOW` clock ticks per unit of total capacity (device + host). On the
  Mooncake conversation trace the chance that a conversation comes back within the cache's
  reach grows with its turns (0.23 after one turn, 0.64 after eight: bench/RESULTS.md).
- ``lru2``: LRU on the device, LRU-2 (O'Neil, O'Neil and Weikum, SIGMOD 1993) on the
  host. Host eviction goes by the time of the second-to-last use by a distinct request,
  so a host copy only one request used goes before any two requests used (ties by the
  last use): across long gaps the host keeps shared prefixes and conversations that came
  back over one-off tails. The device stays LRU: a fresh leaf is used once by
  definition, and the next turn of its conversation is the likeliest next hit.

With an *exclusive* host tier, the host key puts nodes that a loadback brought back to
the device (``backed`` and ``reloaded``: their host copy duplicates device pages) before
every other node, so host eviction drops those duplicate copies first and the host keeps
what the device does not. (Nodes backed by a writeback are not preferred: under
``write_back`` they are about to be demoted, and their host copy is what stays.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Protocol

from ..errors import ConfigError
from ..lifecycle.names import DEVICE_RESIDENT, NODE_STATE
from .node import Node

__all__ = ["EvictionPolicy", "HeapIndex", "POLICIES", "TURN_WINDOW", "make_policy", "turns_bonus"]

Key = tuple[int, ...]
KeyFn = Callable[[Node], Key]


class EvictionPolicy(Protocol):
    """What the core needs from an eviction policy.

    ``touch`` is called whenever a node may have become a victim or its key may have gone
    down: a state change (the node and its parent), an unlock, a pin or borrow released,
    a victim spared or queued; the candidate iterators yield live nodes, each at most
    once per iteration, best victim first. A node yielded but not evicted is forgotten
    until it is touched again (whatever makes it a victim later touches it). A use that
    only raises a node's keys (a lock, a publish through it) is not reported: the index
    re-files an entry whose key went up when it comes to the top, and a node without an
    entry is no victim until something touches it.
    """

    name: str

    def touch(self, node: Node) -> None: ...

    def device_candidates(self) -> Iterator[Node]: ...

    def host_candidates(self) -> Iterator[Node]: ...


def lru_key(n: Node) -> Key:
    """Oldest first, then deepest first, then node id: a total order every rank shares."""
    return (n.last_access, -n.depth, n.node_id)


def lru2_key(n: Node) -> Key:
    """Second-to-last distinct use first (0: used by one request only), then as LRU."""
    return (n.prev_use, n.last_access, -n.depth, n.node_id)


#: ``lru_turns``: clock ticks of bonus per doubling of a node's turns, per unit of total
#: capacity (a fraction: numerator, denominator), tuned on the first 4,000 requests of the
#: conversation trace (bench/RESULTS.md, "Cache policies against the ideal LRU").
TURN_WINDOW = (1, 4)


def turns_bonus(turns: int, window: int) -> int:
    """``window x log2(turns)`` in integers (linear between powers of two), so every rank
    computes the same key."""
    b = turns.bit_length() - 1
    return window * b + ((window * (turns - (1 << b))) >> b)


def _turns_keys(window: int) -> tuple[KeyFn, KeyFn]:
    def key(n: Node) -> Key:
        return (n.last_access + turns_bonus(n.turns, window), -n.depth, n.node_id)

    return key, key


#: eviction policy name -> window (clock ticks) -> (device key, host key); smaller goes first.
POLICIES: dict[str, Callable[[int], tuple[KeyFn, KeyFn]]] = {
    "lru": lambda window: (lru_key, lru_key),
    "lru2": lambda window: (lru_key, lru2_key),
    "lru_turns": _turns_keys,
}


def _exclusive(key: KeyFn) -> KeyFn:
    def host_key(n: Node) -> Key:
        return (0 if n.reloaded and n.state in DEVICE_RESIDENT else 1,) + key(n)

    return host_key


_Entry = tuple[Key, Node]

#: the states a node may be a device eviction victim in (dropped or demoted), and a host
#: eviction victim in (evicted, or its host copy dropped)
_DEVICE_VICTIM_STATES = frozenset((NODE_STATE.device, NODE_STATE.backed))
_HOST_VICTIM_STATES = frozenset((NODE_STATE.host, NODE_STATE.backed))


class HeapIndex:
    """Candidates on lazy heaps, one per tier, each ordered by its key function.

    Each node has at most one live entry per heap (``_dev_at`` / ``_host_at``: node id ->
    the key it was filed under). A touch files a node that has no entry, or whose key
    went down (an exclusive host key does, when a loadback brings the node back); a key
    that went up (the keys are logical clocks, counts and depths, which grow) is left
    where it is: when that entry comes to the top it is filed again under the current
    key instead of being yielded. Candidates therefore come out in the order of their
    current keys, as if every touch had pushed a fresh entry, at one dictionary lookup
    per touch instead of a heap push. Keys end with the node id, so entries never tie
    and nodes are never compared. A touch files a node only on the heaps of the tiers it
    may be a victim of in its state (``device`` and ``backed`` on the device heap,
    ``host`` and ``backed`` on the host heap): the state change that brings it into such a
    state touches it again. Each heap holds at most ``4 x nodes + 256`` entries:
    past that it is rebuilt from the live nodes.

    Args:
        name: the policy's name (:data:`POLICIES`).
        nodes: returns an iterator over the tree's nodes (re-read at each rebuild).
        size: the tree's node count.
        is_live: whether a node is still in the tree.
        exclusive: host eviction takes duplicate copies (nodes also on the device) first.
        window: ``lru_turns``: clock ticks of bonus per doubling of a node's turns.
        host_tier: keep the host heap (``False`` for a cache without a host tier: nothing
            ever asks it for host candidates, so touches file device entries only).
    """

    def __init__(self, name: str, nodes: Callable[[], Iterator[Node]], size: Callable[[], int],
                 is_live: Callable[[Node], bool], *, exclusive: bool = False, window: int = 0,
                 host_tier: bool = True) -> None:
        self.name = name
        self.host_tier = host_tier
        self.window = window
        self.dev_key, host_key = POLICIES[name](window)
        self.host_key = _exclusive(host_key) if exclusive else host_key
        self._same = self.host_key is self.dev_key
        self._nodes = nodes
        self._size = size
        self._is_live = is_live
        self._dev: list[_Entry] = []
        self._host: list[_Entry] = []
        self._dev_at: dict[int, Key] = {}
        self._host_at: dict[int, Key] = {}

    def touch(self, node: Node) -> None:
        # A node is filed only on the tiers it may be a victim of in its state: whatever
        # brings it into such a state is a state change, which touches it again.
        nid = node.node_id
        state = node.state
        if state in _DEVICE_VICTIM_STATES:
            # (lru_key inline: the default policy's touch without a call)
            kd = (node.last_access, -node.depth, nid) if self.dev_key is lru_key else self.dev_key(node)
            at = self._dev_at.get(nid)
            if at is None or kd < at:
                self._dev_at[nid] = kd
                heapq.heappush(self._dev, (kd, node))
                if len(self._dev) > 4 * self._size() + 256:
                    self._dev = self._rebuilt(self.dev_key, self._dev_at)
        else:
            kd = None
        if not self.host_tier or state not in _HOST_VICTIM_STATES:
            return
        if self._same:
            kh = kd if kd is not None else self.dev_key(node)
        else:
            kh = self.host_key(node)
        at = self._host_at.get(nid)
        if at is None or kh < at:
            self._host_at[nid] = kh
            heapq.heappush(self._host, (kh, node))
            if len(self._host) > 4 * self._size() + 256:
                self._host = self._rebuilt(self.host_key, self._host_at)

    def _rebuilt(self, key: KeyFn, at: dict[int, Key]) -> list[_Entry]:
        heap = [(key(n), n) for n in self._nodes()]
        heapq.heapify(heap)
        at.clear()
        at.update((n.node_id, k) for k, n in heap)
        return heap

    def _pop(self, heap: list[_Entry], key: KeyFn, at: dict[int, Key]) -> Iterator[Node]:
        is_live = self._is_live
        lru = key is lru_key
        pop = heapq.heappop
        while heap:
            k, n = pop(heap)
            nid = n.node_id
            if at.get(nid) != k:
                continue  # superseded by a lower key filed later
            if not is_live(n):
                del at[nid]
                continue
            now = (n.last_access, -n.depth, nid) if lru else key(n)  # (lru_key inline)
            if now != k:  # its key went up since it was filed: file it again
                at[nid] = now
                heapq.heappush(heap, (now, n))
                continue
            del at[nid]  # yielded: forgotten until touched again
            yield n

    def device_candidates(self) -> Iterator[Node]:
        return self._pop(self._dev, self.dev_key, self._dev_at)

    def host_candidates(self) -> Iterator[Node]:
        return self._pop(self._host, self.host_key, self._host_at)

    def heap_sizes(self) -> tuple[int, int]:
        """Entries on the device and host heaps (stale ones included), for tests."""
        return len(self._dev), len(self._host)

    def heap_nodes(self) -> tuple[Node, ...]:
        """The node of every entry on the device heap, then the host heap, in heap order
        (stale entries included; a node may appear several times), for tests."""
        return tuple(n for _, n in self._dev) + tuple(n for _, n in self._host)


def make_policy(name: str, nodes: Callable[[], Iterator[Node]], size: Callable[[], int],
                is_live: Callable[[Node], bool], *, exclusive: bool = False, capacity_units: int = 0,
                host_tier: bool = True) -> HeapIndex:
    """The eviction index of the policy ``name``; ``capacity_units``: device + host capacity
    in cache units (``lru_turns`` scales its window with it, :data:`TURN_WINDOW`);
    ``host_tier``: whether the cache has a host tier (without one, no host heap is kept).

    Raises:
        ConfigError: unknown policy name.
    """
    if name not in POLICIES:
        raise ConfigError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}")
    window = capacity_units * TURN_WINDOW[0] // TURN_WINDOW[1]
    return HeapIndex(name, nodes, size, is_live, exclusive=exclusive, window=window, host_tier=host_tier)
