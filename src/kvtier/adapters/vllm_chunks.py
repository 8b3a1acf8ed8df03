"""vLLM offload chunks on kvtier's core: the host tier behind
:class:`~kvtier.adapters.vllm_manager.KvtierOffloadingManager` (extra ``kvtier[vllm]``).

One unit of the core's radix tree is one offload chunk of one vLLM KV cache group; its
unit key is vLLM's ``OffloadKey`` (bytes). Every residency change is a lifecycle
transition of the core: a store is a writeback (``create``, ``writeback_submit``, then
``writeback_ack`` or ``writeback_fail``), an eviction a ``drop_host`` followed by the
device eviction of exactly that node. Acknowledged chunks stay ``backed`` on the core's
nominal staging pool (one page per chunk, no bytes), so a store under a stored prefix adds
one node and never republishes or demotes the prefix.

:class:`ChunkTier` is the plumbing the manager uses: the key index, the room check that
makes a refused store change nothing, exact eviction with the keys it evicted, staging
pages, insertion of new runs and their writebacks, and recency stamps.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, cast

from kvtier.fsm import CacheGroupSpec, CacheCore, ComponentSpec, Completion, ConfigError, Family, KvtierError
from kvtier.fsm.errors import CapacityError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.node import HOST_PENDING, HOST_VISIBLE, Node, PageMap

from .vllm_recency import UseOrder

__all__ = ["GROUP", "ChunkTier", "chunk_layout", "node_keys"]

#: the core's one cache group: one page = one offload chunk of one vLLM KV cache group
GROUP = "chunk"
_ON_HOST = frozenset(HOST_VISIBLE) | frozenset(HOST_PENDING)


def chunk_layout(num_layers: int = 1) -> CacheLayout:
    """The core's layout: one history group whose page (and unit) is one offload chunk.

    Page bytes are nominal (1): the scheduler side never moves bytes.

    Raises:
        ConfigError: ``num_layers`` not a positive int.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"num_layers must be a positive int, got {num_layers!r}")
    g = CacheGroupSpec(GROUP, Family.HISTORY, 1, 1, tuple(range(num_layers)), (ComponentSpec("kv", 1),))
    return CacheLayout("vllm-offload-chunks", (g,), num_layers, source="vLLM offload chunks (kvtier.adapters.vllm)")


def node_keys(n: Node) -> tuple[bytes, ...]:
    """A node's unit keys (vLLM offload keys, bytes)."""
    return cast("tuple[bytes, ...]", n.key)


class ChunkTier:
    """kvtier's core holding vLLM offload chunks (see the module docstring).

    Args:
        num_chunks: host capacity in chunks (keys of one group each), >= 0.
        staging_chunks: pages of the core's nominal staging pool.
        eviction: the core's eviction policy (:data:`kvtier.fsm.node.eviction.POLICIES`);
            ``lru`` orders the host by each chunk's own use, a head with its tails
            (:mod:`kvtier.adapters.vllm_recency`), the others by the core's clock.

    Raises:
        ConfigError: bad capacities or an unknown eviction policy.
    """

    def __init__(self, num_chunks: int, staging_chunks: int, eviction: str) -> None:
        self.num_chunks = num_chunks
        self.staging_chunks = staging_chunks
        self.core = CacheCore(chunk_layout(), {GROUP: staging_chunks}, {GROUP: num_chunks},
                              policy="write_through", eviction=eviction)
        #: the host eviction order (the core's index, decorated); ``own_use``: stamps are own uses
        self.victims = UseOrder(self.core.eviction, self.core.nodes, self.core.tree.has, own_use=eviction == "lru")
        self.core.eviction = self.victims
        self.own_use = self.victims.own_use
        #: key -> (the node that held it, its offset from that node's end): a split keeps
        #: a node's suffix and moves its prefix into a new parent, so the offset finds the
        #: key again, in the node or walking up
        self.index: dict[bytes, tuple[Node, int]] = {}

    def resolve(self, key: bytes) -> Node | None:
        """The live node holding ``key``, or None."""
        got = self.index.get(key)
        if got is None:
            return None
        n, d = got
        k = n.key
        if len(k) > d and k[-1 - d] == key and self.core.tree.has(n):
            return n
        a: Node | None = n
        while a is not None and a.parent is not None and len(a.key) <= d:
            d -= len(a.key)
            a = a.parent
        if a is None or a.parent is None or a.key[-1 - d] != key or not self.core.tree.has(a):
            del self.index[key]
            return None
        self.index[key] = (a, d)
        return a

    def add_to_index(self, n: Node) -> None:
        """Index the keys of a new node."""
        keys = node_keys(n)
        last = len(keys) - 1
        for i, k in enumerate(keys):
            self.index[k] = (n, last - i)

    @staticmethod
    def path_to(node: Node, key: bytes) -> tuple[bytes, ...]:
        """Unit keys from the root to ``key`` (inside ``node``)."""
        parts: list[tuple[Any, ...]] = [node.key[:node.key.index(key) + 1]]
        a = node.parent
        while a is not None and a.parent is not None:
            parts.append(a.key)
            a = a.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    @staticmethod
    def top(node: Node) -> Node:
        """``node``'s ancestor just below the root (``node`` itself at the top)."""
        while node.parent is not None and node.parent.parent is not None:
            node = node.parent
        return node

    def host_slot(self, node: Node, key: bytes) -> int:
        """The host page (vLLM's chunk slot) of ``key`` in ``node`` (as :meth:`resolve`
        returned it): its acknowledged copy, or its reservation while it is written."""
        pages = node.host.get(GROUP) or node.pending[GROUP]
        got = self.index.get(key)
        i = len(node.key) - 1 - got[1] if got is not None and got[0] is node else node.key.index(key)
        return int(pages[i])

    def used(self) -> int:
        """Host chunks holding acknowledged or reserved copies."""
        assert self.core.host is not None
        return int(self.core.host[GROUP].used)

    def free(self) -> int:
        assert self.core.host is not None
        return int(self.core.host[GROUP].free)

    def sweep(self) -> None:
        """Forget dead index entries once the index is twice the host capacity
        (amortised O(1) per insert; keeps the index bounded)."""
        if len(self.index) > 2 * self.num_chunks + 1024:
            for key in list(self.index):
                self.resolve(key)

    # ------------------------------------------------------------------ room
    def can_free(self, need: int, held: Iterable[Node]) -> bool:
        """Whether host eviction can make ``need`` chunks free without touching ``held``
        (chunks pinned by loads, being written, or protected by the store).

        A chunk can go unless it, or a chunk below it in its prefix, is held (eviction
        takes host leaves: invariant 9). So the chunks that cannot go are exactly those on
        the root paths of the held nodes; the walk is over those paths only.
        """
        free = self.free()
        if need <= free:
            return True
        blocked = 0
        seen: set[int] = set()
        for n in held:
            a: Node | None = n
            while a is not None and a.parent is not None and a.node_id not in seen:
                seen.add(a.node_id)
                if a.state in _ON_HOST:
                    blocked += len(a.key)
                a = a.parent
        return need - free <= self.used() - blocked

    def make_room(self, need: int, protect: Collection[Node]) -> list[bytes]:
        """Evict host chunks (the core's order, exact) until ``need`` chunks are free;
        returns the evicted keys. Call only after :meth:`can_free` said yes.

        Raises:
            KvtierError: eviction freed less than :meth:`can_free` promised (a kvtier
                defect: the check and the core's eviction disagree).
        """
        short = need - self.free()
        if short <= 0:
            return []
        self.victims.considered = []
        self.victims.opened = []
        self.core.evict_host({GROUP: short}, protect=protect)
        evicted = self.take_evicted()
        if self.free() < need:
            raise KvtierError(f"host eviction freed {short - (need - self.free())} of the {short} chunks the room "
                              "check promised")
        return evicted

    def take_evicted(self) -> list[bytes]:
        """Keys of the chunks the core's host eviction took since the last call (nodes it
        removed, or whose host copy it dropped); their staging copies are cleared."""
        considered, self.victims.considered = self.victims.considered, []
        evicted: list[bytes] = []
        dropped: list[Node] = []
        spared: list[Node] = []
        for n in dict.fromkeys(considered):  # (a node may be considered twice)
            alive = self.core.tree.has(n)
            if alive and n.state in _ON_HOST:
                spared.append(n)  # spared (pinned, protected, locked, a tail being written, or not needed)
                continue
            evicted.extend(node_keys(n))
            if alive:
                dropped.append(n)
        self.victims.refile(spared)
        self.clear_staging(dropped)
        for k in evicted:
            self.index.pop(k, None)
        return evicted

    def clear_staging(self, nodes: Iterable[Node]) -> None:
        """Drop the staging copies of ``nodes`` that hold no host copy (``device``
        state: their host copy was evicted or their writeback failed), through the core's
        device eviction restricted to exactly these nodes."""
        gone = [n for n in nodes if self.core.tree.has(n) and n.state == "device"]
        if not gone:
            return
        gone.sort(key=lambda n: -n.depth)  # (a tail before its head: a node goes only without a child there)
        self.victims.only = gone
        try:
            self.core.evict_device({GROUP: sum(len(n.dev.get(GROUP, ())) for n in gone)})
        finally:
            self.victims.only = None

    # ------------------------------------------------------------------ stores
    def stage(self, units: int) -> PageMap | None:
        """Staging pages for a path of ``units`` chunks; when the staging pool is full,
        the least recently used staged leaves are demoted (their host copies stay)."""
        try:
            return self.core.alloc_device({GROUP: units}, evict=False)
        except CapacityError:
            self.core.evict_device({GROUP: max(units, self.staging_chunks // 4)})
            try:
                return self.core.alloc_device({GROUP: units}, evict=False)
            except CapacityError:
                return None

    def insert(self, paths: Sequence[tuple[bytes, ...]], pages: Sequence[PageMap]) -> tuple[list[Node], list[int]]:
        """Insert each path with its staging pages and submit the writebacks of the new
        nodes; returns the created nodes and the op ids.

        Raises:
            KvtierError: a new node is not being written (its parent is not on the host:
                the caller chains only under acknowledged chunks); the store is rolled back.
        """
        created: list[Node] = []
        for path, pm in zip(paths, pages):
            res = self.core.insert(path, pm)
            spare = {g: p for g, p in res.duplicates.items() if p}
            for g, p in res.kept.items():
                spare.setdefault(g, []).extend(p)
            if spare:
                self.core.free_device(spare)
            created.extend(res.created)
            for n in res.created:
                self.add_to_index(n)
        op_ids = [c.op_id for c in self.core.issue_writebacks()]
        stuck = [n.node_id for n in created if n.state != "writing"]
        if stuck:
            self.rollback(created, op_ids)
            raise KvtierError(f"store: new nodes {stuck} could not be written back (their parent is not on the host)")
        return created, op_ids

    def rollback(self, created: list[Node], op_ids: list[int]) -> None:
        """Undo a store: fail its writebacks (``writeback_fail``) and drop its nodes."""
        for op in op_ids:
            self.core.poison(op)
            self.core.complete(Completion(op, 0, False))
        self.clear_staging(created)
        for n in created:
            for k in node_keys(n):
                self.resolve(k)

    def settle(self, op_ids: Sequence[int], keys: Iterable[bytes], success: bool) -> None:
        """Acknowledge (``writeback_ack``) or fail (``writeback_fail``) a store's
        writebacks; a failed store's chunks leave the staging pool and the index."""
        for op in op_ids:
            if not success:
                self.core.poison(op)
            self.core.complete(Completion(op, 0, success))
        if not success:
            nodes = {id(n): n for n in (self.resolve(k) for k in keys) if n is not None}
            self.clear_staging(nodes.values())
            for k in keys:
                self.resolve(k)

    def stamp(self, node: Node, owner: str | None) -> None:
        """Stamp the recency of ``node``: its own use (``lru``), or its path's (a lock and
        an unlock on the core's logical clock)."""
        if self.own_use:
            self.victims.use(node)
        else:
            self.core.unlock(self.core.lock(node, owner=owner))

    def isolate(self, keys: Sequence[bytes], nodes: Collection[Node] = ()) -> list[Node]:
        """Cut the acknowledged nodes holding ``keys`` so that each begins at its first key
        of ``keys`` and ends at its last (the chunks of a node then share their own uses);
        returns those nodes, in the order of ``keys``. ``nodes``: the nodes holding
        ``keys``, when the caller knows them (no cut is needed when each holds its ends).
        Keys not stored, or still being written, are ignored."""
        if nodes:
            want = set(keys)
            has = self.core.tree.has
            if all(has(n) and n.key[0] in want and n.key[-1] in want for n in nodes):
                return list(nodes)
        spans: dict[int, list[Any]] = {}
        index = self.index
        for k in keys:
            n = self.resolve(k)
            if n is None or n.state not in HOST_VISIBLE:
                continue
            i = len(n.key) - 1 - index[k][1]
            sp = spans.get(n.node_id)
            if sp is None:
                spans[n.node_id] = [n, i, i]
            elif i < sp[1]:
                sp[1] = i
            elif i > sp[2]:
                sp[2] = i
        out = []
        for n, lo, hi in spans.values():
            if hi + 1 < len(n.key):
                n = self.core.split(n, hi + 1)  # (the new prefix fragment holds the span)
            if lo > 0:
                self.core.split(n, lo)  # (n keeps the span)
            out.append(n)
        return out

    def stamp_offer(self, keys: Sequence[bytes], reused: Collection[Node], parents: Iterable[Node],
                    created: Collection[Node], st: Any, use: tuple[Any, Any] | None = None) -> None:
        """Stamp the chunks of a ``prepare_store`` offer. Own use (``lru``; after the
        insert; ``use``: the request's ``(ChainOrder, ReqContext)``): the new nodes and the
        offered chunks stored already (a reuse, as vLLM's lru records it, refused offers
        too) are used by the request (:meth:`use_by`); the parents its runs chain under
        are not. The core's clock (before the insert, which stamps the new nodes' paths):
        the reused nodes in reverse offer order, skipping those the stamp of a deeper one
        (or the coming insert under a parent) covers."""
        if self.own_use:
            assert use is not None
            if created:
                self.use_by(st, created, *use, fresh=True)
            if reused:
                self.use_by(st, self.isolate(keys, reused), *use)
            return
        covered: set[int] = set()
        for p in parents:
            covered.update(a.node_id for a in p.path())
        for n in reversed(list(reused)):
            if n.node_id not in covered:
                self.stamp(n, st.req_id)
                covered.update(a.node_id for a in n.path())

    def use_by(self, st: Any, nodes: Iterable[Node], order: Any, ctx: Any, fresh: bool = False) -> None:
        """Own-use order: request ``st`` stored, loaded or reused ``nodes``: each takes the
        request's rank at the token position of its last chunk; one without a position
        keeps its use, or with ``fresh`` (a new node) takes a new rank."""
        use = self.victims.use
        if not st.rank:
            st.rank = self.victims.new_rank()
        rank, used, coords = st.rank, st.used, st.coord
        for n in nodes:
            used[n.node_id] = n
            last = n.key[-1]
            c = coords.get(last) or order.coord(last, ctx, st)
            if c is not None:
                use(n, rank, c[0])
            elif fresh:
                use(n)

    def finish(self, st: Any) -> None:
        """Own-use order: request ``st`` finished: every node it used takes a new rank,
        tails first, so its head is the most recent (vLLM's lru commits a request's
        recency so)."""
        if not st.used:
            return
        has, coords = self.core.tree.has, st.coord
        nodes = [n for n in st.used.values() if has(n) and n.state in _ON_HOST]
        st.used = {}
        if len(nodes) > 1:
            nodes.sort(key=lambda n: (coords.get(n.key[-1], (0, 0)), n.depth), reverse=True)
        use = self.victims.use
        for n in nodes:
            use(n)

    def stamp_heads(self, order: Any, node: Node, st: Any) -> None:
        """Stamp, after ``node``, the chunks of request ``st`` that precede it in another
        tree (a run stored under the root because its parent was not acknowledged on the
        host), following the request's chain ``order``: a head then stays more recent
        than its tail. (Own-use order ranks a request's chunks by token position: a no-op.)"""
        if self.own_use:
            return
        seen: set[int] = set()
        n = node
        while True:
            top = self.top(n)
            c = st.coord.get(node_keys(top)[0])
            pc = order.pred(c, st) if c is not None else None
            pk = st.seq.get(pc) if pc is not None else None
            p = self.resolve(pk) if pk is not None else None
            if p is None or p.node_id in seen or self.top(p) is top:
                return
            seen.add(p.node_id)
            self.stamp(p, st.req_id)
            n = p
