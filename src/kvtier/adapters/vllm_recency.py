"""The host eviction order of the vLLM adapter (extra ``kvtier[vllm]``): the core's eviction
index, decorated (:class:`UseOrder`, an :class:`~kvtier.fsm.node.eviction.EvictionPolicy`).

The core's own ``lru`` orders by the logical clock stamped on a node's whole path at every
use: using a chunk uses its prefix. Inside vLLM that is not what happens. vLLM's connector
asks the host tier only for the chunks after the request's GPU prefix hit, so a head the
GPU cache serves is neither loaded nor offered again while its tail is; vLLM's own ``lru``
lets such a head age (``vllm/v1/kv_offload/cpu/policies/lru.py``). With the adapter's
``lru`` the host order follows what the connector does to each chunk instead:

- **Own use, ranked as vLLM's lru ranks.** A node is as recent as the last use of its
  chunks (:meth:`UseOrder.use`); a use does not refresh the chunks above it. While a
  request runs, the chunks it stores, loads or offers again (a reuse) take the request's
  rank (given at its first use) and, within it, their token position, tails first; when it
  finishes, every chunk it used takes a new rank, the head the most recent; a store of keys
  without positions and :meth:`touch` give new ranks in call order. The adapter cuts a node
  at the first and last chunk a call uses
  (:meth:`~kvtier.adapters.vllm_chunks.ChunkTier.isolate`), so the chunks of a node share
  their uses.
- **A head goes with its tails.** Eviction takes the least recently used node; when chunks
  are stored below it (the host set stays prefix-closed: invariant ``host_evict_leaves``),
  they go first, deepest first, then the node: without their head no lookup reaches them
  from the host. vLLM's ``lru`` drops the head alone and keeps tails that no lookup reaches
  once the GPU cache lets the head go.

Legality stays the core's: every candidate is checked by the core's guards (a pinned,
protected or locked chunk, or one with a chunk being written below it, is spared).
Device (staging) candidates are the inner index's, or an explicit list (``only``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.fsm import KvtierError
from kvtier.fsm.node import HOST_VISIBLE, Node

__all__ = ["UseOrder"]

_HOST = frozenset(HOST_VISIBLE)
Key = tuple[int, int, int, int]
Use = tuple[int, int]


class UseOrder:
    """The core's eviction index, decorated (see the module docstring).

    Records every node the core considered for host eviction (``considered``: the tier
    learns which chunks it evicted), and restricts the device candidates to an explicit
    list when ``only`` is set (the tier clears exactly the staging copies of chunks that
    lost their host copy). With ``own_use``, host candidates come from this index's own
    heap in own-use order, a node's stored tails before it; without, from the inner index.

    Args:
        inner: the core's eviction index (a :class:`~kvtier.fsm.node.eviction.HeapIndex`).
        nodes: returns the tree's nodes (root excluded), for rebuilds.
        is_live: whether a node is still in the tree.
        own_use: order the host by own use (above) instead of the inner index.
    """

    def __init__(self, inner: Any, nodes: Callable[[], list[Node]], is_live: Callable[[Node], bool],
                 own_use: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.own_use = own_use
        self.considered: list[Node] = []
        #: nodes whose tails host eviction began with (re-filed when they stay: :meth:`refile`)
        self.opened: list[Node] = []
        self.only: list[Node] | None = None
        self._nodes = nodes
        self._is_live = is_live
        self._uses: dict[int, Use] = {}  # node id -> (rank, -token position or 0) of its last own use
        self._kept = 0  # entries of _uses after its last pruning
        self._clock = 0
        self._heap: list[tuple[Key, Node]] = []
        self._at: dict[int, Key] = {}  # node id -> the key of its one live heap entry
        if own_use:
            inner.host_tier = False  # (the inner index keeps device entries only: nothing asks it for host ones)
            self.touch = self._touch
        else:
            self.touch = inner.touch  # (the core's, unwrapped: called on every node event)

    # ------------------------------------------------------------------ uses
    def new_rank(self) -> int:
        """A rank above every one given so far."""
        self._clock += 1
        return self._clock

    def use(self, node: Node, rank: int | None = None, position: int = 0) -> None:
        """Stamp ``node``'s own use; its ancestors keep theirs. ``rank`` None: a new rank
        (the most recent); else a running request's ``rank`` at the token ``position`` of
        the node's last chunk, which only raises the node's use (vLLM's
        ``on_request_access``)."""
        nid = node.node_id
        if rank is None:
            self._clock += 1
            u = (self._clock, 0)
        else:
            u = (rank, -position)
            old = self._uses.get(nid)
            if old is not None and old >= u:
                return
        self._uses[nid] = u
        if nid not in self._at and node.state in _HOST:
            self._file(node)  # (a key that went up stays filed low: re-filed when it comes to the top)
        if len(self._uses) > 2 * self._kept + 4096:  # (amortised O(1): forget the nodes gone)
            live = {n.node_id for n in self._nodes()}
            self._uses = {k: v for k, v in self._uses.items() if k in live}
            self._kept = len(self._uses)

    def key(self, node: Node) -> Key:
        """Oldest own use first, then deepest, then node id (a total order)."""
        u = self._uses.get(node.node_id)
        if u is None:  # a split's new prefix fragment: its uses are its one child's
            u = max((self._uses.get(c.node_id, (0, 0)) for c in node.children.values()),
                    default=(self._clock, 0))
            self._uses[node.node_id] = u
        return (u[0], u[1], -node.depth, node.node_id)

    def _file(self, node: Node) -> None:
        k = self.key(node)
        self._at[node.node_id] = k
        heapq.heappush(self._heap, (k, node))
        if len(self._heap) > 4 * len(self._at) + 256:
            self._heap = [(self.key(n), n) for n in self._nodes() if n.state in _HOST]
            heapq.heapify(self._heap)
            self._at = {n.node_id: k for k, n in self._heap}

    def _touch(self, node: Node) -> None:
        self.inner.touch(node)
        if node.state in _HOST and node.node_id not in self._at:
            self._file(node)

    def refile(self, nodes: list[Node]) -> None:
        """File again the considered ``nodes`` that host eviction spared, and the nodes
        whose tails it began with, that are still on the host (a pin or lock released
        later does not reach this index, nor does the eviction of a tail below a child)."""
        if self.own_use:
            opened, self.opened = self.opened, []
            for n in itertools.chain(nodes, opened):
                if n.node_id not in self._at and n.state in _HOST and self._is_live(n):
                    self._file(n)

    def check(self) -> None:
        """Own use: every node on the host has a heap entry (else eviction would never
        consider it, or consider it late).

        Raises:
            KvtierError: a node on the host without one.
        """
        if self.own_use:
            lost = [n.node_id for n in self._nodes() if n.state in _HOST and n.node_id not in self._at]
            if lost:
                raise KvtierError(f"host eviction order: nodes {lost[:8]} on the host have no heap entry")

    # ------------------------------------------------------------------ candidates
    def device_candidates(self) -> Iterator[Node]:
        return iter(self.only) if self.only is not None else self.inner.device_candidates()

    def host_candidates(self) -> Iterator[Node]:
        if not self.own_use:
            for n in self.inner.host_candidates():
                self.considered.append(n)
                yield n
            return
        heap, at = self._heap, self._at
        while heap:
            k, n = heapq.heappop(heap)
            nid = n.node_id
            if at.get(nid) != k:
                continue  # superseded
            if n.state not in _HOST or not self._is_live(n):
                del at[nid]
                continue
            now = self.key(n)
            if now != k:  # used since it was filed: file it under its current key
                at[nid] = now
                heapq.heappush(heap, (now, n))
                continue
            del at[nid]
            if n.children:
                yield from self._with_tails(n)
            else:
                self.considered.append(n)
                yield n

    def _with_tails(self, top: Node) -> Iterator[Node]:
        """``top``'s host subtree, deepest first (children oldest use first), ``top`` last."""
        if top.children:
            self.opened.append(top)
        stack: list[tuple[Node, Iterator[Node] | None]] = [(top, None)]
        while stack:
            n, kids = stack[-1]
            if kids is None:
                kids = iter(sorted((c for c in n.children.values() if c.state in _HOST), key=self.key)
                            if n.children else ())
                stack[-1] = (n, kids)
            c = next(kids, None)
            if c is not None:
                stack.append((c, None))
                continue
            stack.pop()
            if n.state in _HOST and self._is_live(n):
                self.considered.append(n)
                yield n
