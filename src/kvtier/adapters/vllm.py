"""kvtier as vLLM's KV offloading manager (vLLM 0.33, extra ``kvtier[vllm]``).

vLLM's ``OffloadingConnector`` loads an out-of-tree ``OffloadingSpec`` named in
``kv_connector_extra_config`` (``spec_name``, ``spec_module_path``). This module provides:

- :class:`KvtierOffloadingSpec`: the spec (``get_manager`` for the scheduler,
  ``get_worker`` for each worker).
- :class:`KvtierOffloadingManager`: the scheduler side. Its host-tier bookkeeping is
  kvtier's verified core: a radix tree of offload chunks whose every residency change is a
  lifecycle transition. A store is a two-phase writeback (``prepare_store`` submits it, the
  chunks are invisible to lookups until ``complete_store(success=True)`` acknowledges it;
  a failure is the ``writeback_fail`` transition and the chunks are dropped); a load pins
  its host sources until ``complete_load``; eviction takes least-recently-used host
  leaves, exactly (a leaf is split so that only the chunks needed go, deepest first), so
  a prefix never loses its head before its tail (deterministic: the core's logical
  clock, never wall time). Acknowledged chunks stay ``backed`` on the core's nominal
  staging pool, so a store adds one node under its stored prefix and touches nothing
  else.
- :class:`KvtierOffloadingWorker`: the worker side. It moves the bytes with kvtier's
  :class:`~kvtier.transfer.TransferEngine` (``cpu`` backend without a GPU, ``numba`` or
  ``torch`` on one) between vLLM's KV tensors and a host pool, with layer-wise completion
  of loads (:meth:`KvtierOffloadingWorker.layers_done`).

Keys: vLLM's ``OffloadKey`` (block hash + group index; hash-chained, so a key names its
whole prefix) is the unit key of the tree; one unit = one offload chunk of one KV cache
group. Full-attention groups form chains from the root (the parent of chunk ``i`` is
chunk ``i - 1`` of the same group, found from the request's key positions,
``ReqContext.get_offload_key_position``); sliding-window (and other sparse) groups' chunks
are single-unit nodes at the root, since vLLM stores only the window before reachable
boundaries. Host capacity is counted in keys of one group each (vLLM #56871).

How vLLM's calls map onto kvtier's lifecycle is in the README, section "kvtier inside
vLLM".
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-untyped, import-not-found, unused-ignore]

from kvtier.fsm import CacheGroupSpec, ComponentSpec, Completion, ConfigError, Direction, Family, KvtierError
from kvtier.fsm import GroupTransfer, TransferCommand
from kvtier.fsm import CacheCore as Core  # the one import of the core class
from kvtier.fsm.errors import CapacityError
from kvtier.fsm.node.eviction import EvictionPolicy
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.node import HOST_VISIBLE, LockReceipt, Node, NodeReceipt, PageMap

__all__ = [
    "GROUP",
    "KvtierOffloadingManager",
    "KvtierOffloadingSpec",
    "KvtierOffloadingWorker",
    "chunk_layout",
]

#: the core's one cache group: one page = one offload chunk of one vLLM KV cache group
GROUP = "chunk"


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


@dataclass
class _Store:
    """One prepare_store call's writeback operations (one job on vLLM's side)."""

    keys: frozenset[bytes]
    op_ids: list[int]


@dataclass
class _Load:
    """One prepare_load call: the pin on the host sources and the locks (recency)."""

    keys: frozenset[bytes]
    pin: NodeReceipt | None
    locks: list[LockReceipt]


@dataclass
class _Request:
    """What the manager keeps per request (dropped once finished and drained)."""

    req_id: str
    # group index -> chunk index -> key (full-attention groups): parents of new chains
    chain: dict[int, dict[int, bytes]] = field(default_factory=dict)
    stores: list[_Store] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)
    finished: bool = False


def _keys(n: Node) -> tuple[bytes, ...]:
    """A node's unit keys (the adapter's units are vLLM offload keys, bytes)."""
    return cast("tuple[bytes, ...]", n.key)


class _Victims:
    """The core's eviction policy, decorated (an :class:`~kvtier.fsm.node.eviction.EvictionPolicy`).

    Records every node the core considered for host eviction (so the manager learns which
    chunks it evicted: ``evicted_keys`` and removal events), and can restrict the device
    candidates to an explicit list (so the manager clears exactly the staging copies of
    the chunks that lost their host copy). Order and legality stay the core's: the
    wrapped policy orders host victims, the core checks every guard.
    """

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.considered: list[Node] = []
        self.only: list[Node] | None = None

    def touch(self, node: Node) -> None:
        self.inner.touch(node)

    def device_candidates(self) -> Iterator[Node]:
        return iter(self.only) if self.only is not None else self.inner.device_candidates()

    def host_candidates(self) -> Iterator[Node]:
        for n in self.inner.host_candidates():
            self.considered.append(n)
            yield n


class KvtierOffloadingManager(OffloadingManager):  # type: ignore[misc, unused-ignore]
    """vLLM ``OffloadingManager`` whose host tier is kvtier's radix core.

    Acknowledged chunks stay ``backed`` in the core (a host copy, plus a nominal device
    copy on the core's staging pool standing for vLLM's GPU blocks): a store under a
    stored prefix then adds one node and never republishes or demotes the prefix, so the
    scheduler-side cost of a store does not grow with the prefix's depth or with the
    number of conversations that branch off a shared system prompt. Host eviction is the
    core's (least recently used host leaf first, exact: a victim leaf is split so that
    only the chunks needed go, deepest first); a chunk that loses its host copy leaves the
    staging pool at once.

    Args:
        num_chunks: host capacity in offload chunks (keys of one group each), >= 1.
        tokens_per_chunk: vLLM KV cache group id -> tokens per offload chunk, for the
            groups whose chunks chain (full attention). Keys of other groups, and keys
            whose request position is unknown, are stored as single-chunk nodes.
        sliding_window_groups: group ids stored as single-chunk nodes (sliding window,
            Mamba and other groups vLLM stores sparsely).
        enable_events: collect ``OffloadingEvent`` records for :meth:`take_events`.
        staging_chunks: staging pages of the core (nominal device copies); default
            ``2 * num_chunks + 4096`` (acknowledged chunks, plus the stores in flight
            and one request's prefix path).
        store_threshold: offers of a chunk before it is stored (vLLM's
            ``store_threshold``; 1: store on the first offer). Offers are counted in a
            least-recently-offered table of ``max_tracker_size`` keys.
        max_tracker_size: keys the offer counter tracks (with ``store_threshold >= 2``).
        eviction: the core's host eviction policy (:data:`kvtier.fsm.node.eviction.POLICIES`:
            ``"lru"``, ``"lru_turns"``, ``"lru2"``).
        chain: hang a store's run of chunks under its stored parent chunk (one radix
            tree per conversation: a head is never evicted before its tails). ``False``:
            every run is a tree of its own under the root (eviction goes by recency alone
            across runs, tail first within a run, as vLLM's ``lru`` ranks a request's
            chunks).

    Raises:
        ConfigError: a non-positive capacity, token count, threshold or tracker size, or
            an unknown eviction policy.
    """

    def __init__(self, num_chunks: int, *, tokens_per_chunk: Mapping[int, int] | None = None,
                 sliding_window_groups: Collection[int] = (), enable_events: bool = False,
                 staging_chunks: int | None = None, store_threshold: int = 1,
                 max_tracker_size: int = 64_000, eviction: str = "lru", chain: bool = True) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ConfigError(f"num_chunks must be an int >= 1 (host offload chunks), got {num_chunks!r}")
        tpc = dict(tokens_per_chunk or {})
        for g, t in tpc.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ConfigError(f"tokens_per_chunk[{g!r}] must be an int >= 1, got {t!r}")
        for name, v in (("store_threshold", store_threshold), ("max_tracker_size", max_tracker_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        self.num_chunks = num_chunks
        self._tpc = {g: t for g, t in tpc.items() if g not in set(sliding_window_groups)}
        self._sparse = frozenset(sliding_window_groups)
        self._staging = staging_chunks if staging_chunks is not None else 2 * num_chunks + 4096
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._eviction_name = eviction
        self.chain = chain
        self.medium = Medium.CPU
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._new_core()
        #: seconds spent inside this manager's calls (scheduler-side time)
        self.busy_s = 0.0
        self.calls = 0
        self.refused_stores = 0
        self.retried_stores = 0
        self.rootless_chunks = 0
        self.evicted_chunks = 0
        self.stores_skipped = 0
        self._batch_alloc: list[int] = []
        self._batch_skipped = 0

    def _new_core(self) -> None:
        self.core = Core(chunk_layout(), {GROUP: self._staging}, {GROUP: self.num_chunks}, policy="write_through",
                         eviction=self._eviction_name)
        self._victims = _Victims(self.core.eviction)
        self.core.eviction = self._victims
        self._index: dict[bytes, Node] = {}
        self._reqs: dict[str, _Request] = {}
        self._counts: OrderedDict[bytes, int] | None = OrderedDict() if self.store_threshold >= 2 else None
        self._pending_evicted: list[bytes] = []  # evicted by a refused store, reported by the next

    # ------------------------------------------------------------------ helpers
    def _req(self, ctx: ReqContext) -> _Request:
        st = self._reqs.get(ctx.req_id)
        if st is None:
            st = self._reqs[ctx.req_id] = _Request(ctx.req_id)
        return st

    def _alive(self, n: Node) -> bool:
        return self.core.tree.has(n)

    def _resolve(self, key: bytes) -> Node | None:
        """The live node holding ``key``, or None. Splits move a key into a new ancestor
        (the split node keeps the suffix), so the walk goes up from the indexed node."""
        n: Node | None = self._index.get(key)
        if n is None:
            return None
        start = n
        while n is not None and n.parent is not None and key not in n.key:
            n = n.parent
        if n is None or n.parent is None or not self._alive(n):
            del self._index[key]
            return None
        if n is not start:
            self._index[key] = n
        return n

    def _path_to(self, node: Node, key: bytes) -> tuple[bytes, ...]:
        """Unit keys from the root to ``key`` (inside ``node``)."""
        parts: list[tuple[Any, ...]] = [node.key[:node.key.index(key) + 1]]
        a = node.parent
        while a is not None and a.parent is not None:
            parts.append(a.key)
            a = a.parent
        return tuple(itertools.chain.from_iterable(reversed(parts)))

    def _chunk_index(self, key: bytes, ctx: ReqContext) -> int | None:
        tpc = self._tpc.get(get_offload_group_idx(OffloadKey(key)))
        if tpc is None:
            return None
        pos = ctx.get_offload_key_position(OffloadKey(key))
        if pos is None or pos % tpc:
            return None
        return int(pos // tpc - 1)

    def _clear_staging(self, nodes: Iterable[Node]) -> None:
        """Drop the staging copies of ``nodes`` that hold no host copy (``device`` state:
        their host copy was evicted or their writeback failed), through the core's device
        eviction restricted to exactly these nodes."""
        gone = [n for n in nodes if self._alive(n) and n.state == "device"]
        if not gone:
            return
        self._victims.only = gone
        try:
            self.core.evict_device({GROUP: sum(len(n.dev.get(GROUP, ())) for n in gone)})
        finally:
            self._victims.only = None

    def _take_evicted(self) -> list[bytes]:
        """Keys of the chunks the core's host eviction took since the last call (nodes it
        removed, or whose host copy it dropped); their staging copies are cleared."""
        considered, self._victims.considered = self._victims.considered, []
        evicted: list[bytes] = []
        dropped: list[Node] = []
        for n in dict.fromkeys(considered):  # (a node may be considered twice)
            alive = self._alive(n)
            if alive and n.state in HOST_VISIBLE:
                continue  # spared (pinned, protected, or not needed)
            evicted.extend(_keys(n))
            if alive:
                dropped.append(n)
        self._clear_staging(dropped)
        for k in evicted:
            self._index.pop(k, None)
        if evicted:
            self.evicted_chunks += len(evicted)
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=[OffloadKey(k) for k in evicted], medium=self.medium,
                                                   removed=True))
        return evicted

    def _make_room(self, need: int, protect: Collection[Node]) -> list[bytes] | None:
        """Evict host chunks (the core's order) until ``need`` chunks are free.

        Returns the evicted keys, or None if the host cannot free enough (pinned or
        in-flight chunks); what was evicted stays evicted (and is reported by the next
        store)."""
        assert self.core.host is not None
        short = need - self.core.host[GROUP].free
        if short <= 0:
            return []
        self._victims.considered = []
        self.core.evict_host({GROUP: short}, protect=protect)
        evicted = self._take_evicted()
        if self.core.host[GROUP].free < need:
            self._pending_evicted.extend(evicted)
            return None
        return evicted

    def _sweep(self) -> None:
        """Forget dead index entries once the index is twice the host capacity
        (amortised O(1) per insert; keeps the index bounded)."""
        if len(self._index) > 2 * self.num_chunks + 1024:
            for key in list(self._index):
                self._resolve(key)

    def _timed(self, t0: float) -> None:
        self.busy_s += time.perf_counter() - t0
        self.calls += 1

    def _threshold(self, keys: list[bytes]) -> set[bytes]:
        """vLLM's store_threshold: count this offer; the keys offered often enough."""
        counts = self._counts
        assert counts is not None
        seen = [k for k in keys if k in counts]
        for k in seen:
            counts.move_to_end(k)
            counts[k] += 1
        unprotected = len(counts) - len(seen)
        for k in keys:
            if k in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[k] = 1
        return {k for k in keys if counts.get(k, 0) >= self.store_threshold}
    # ------------------------------------------------------------------ vLLM API
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        t0 = time.perf_counter()
        self._req(req_context)
        self._timed(t0)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT: the chunk's host copy is acknowledged (node ``host``, ``backed`` or
        ``loading``); HIT_PENDING: its writeback is in flight (``writing``); MISS
        otherwise. RETRY is never returned: the host index answers synchronously."""
        t0 = time.perf_counter()
        n = self._resolve(key)
        if n is None:
            out = LookupResult.MISS
        elif n.state in HOST_VISIBLE:
            out = LookupResult.HIT
        elif n.state == "writing":
            out = LookupResult.HIT_PENDING
        else:
            out = LookupResult.MISS
        if out is not LookupResult.MISS:
            idx = self._chunk_index(key, req_context)
            if idx is not None:
                self._req(req_context).chain.setdefault(get_offload_group_idx(key), {})[idx] = key
        self._timed(t0)
        return out

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the host copies of ``keys`` (and lock their nodes, which stamps their
        recency, the deepest first) until :meth:`complete_load` with the same keys.

        Raises:
            KvtierError: a key has no acknowledged host copy (nothing changes).
        """
        t0 = time.perf_counter()
        keys = list(keys)
        st = self._req(req_context)
        nodes: dict[int, Node] = {}
        slots: list[int] = []
        for key in keys:
            n = self._resolve(key)
            if n is None or n.state not in HOST_VISIBLE:
                raise KvtierError(f"prepare_load: chunk {bytes(key).hex()[:16]}.. of request {st.req_id!r} "
                                  f"has no acknowledged host copy ({n.state if n else 'absent'})")
            slots.append(n.host[GROUP][n.key.index(key)])
            nodes.setdefault(n.node_id, n)
        for key in keys:
            idx = self._chunk_index(key, req_context)
            if idx is not None:
                st.chain.setdefault(get_offload_group_idx(key), {})[idx] = key
        pin = self.core.pin(list(nodes.values()), owner=st.req_id) if nodes else None
        # deepest first: a shallower chunk gets the later stamp (tails go before heads)
        locks = [self.core.lock(n, owner=st.req_id) for n in sorted(nodes.values(), key=lambda x: -x.depth)]
        st.loads.append(_Load(frozenset(keys), pin, locks))
        self._timed(t0)
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Stamp the recency of ``keys`` (a lock and unlock of their nodes)."""
        t0 = time.perf_counter()
        for key in reversed(list(keys)):
            n = self._resolve(key)
            if n is not None:
                self.core.unlock(self.core.lock(n, owner=req_context.req_id))
        self._timed(t0)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the pin and locks taken by the :meth:`prepare_load` of these keys.

        Raises:
            KvtierError: no load of exactly these keys is in flight for the request.
        """
        t0 = time.perf_counter()
        st = self._reqs.get(req_context.req_id)
        want = frozenset(keys)
        load = next((x for x in st.loads if x.keys == want), None) if st else None
        if st is None or load is None:
            raise KvtierError(f"complete_load: request {req_context.req_id!r} has no load of these "
                              f"{len(want)} chunks in flight")
        st.loads.remove(load)
        if load.pin is not None:
            self.core.release(load.pin)
        for lock in load.locks:
            self.core.unlock(lock)
        self._maybe_drop(st)
        self._timed(t0)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Start the writeback of the offered chunks that the host does not hold yet.

        Host room comes first: least-recently-used host chunks are evicted (their keys are
        ``evicted_keys``), never one this offer holds or chains from. Returns ``None``
        (vLLM retries next step) when the host cannot free enough (its chunks are pinned by
        loads or in flight), or when a chain's parent is still being written by another
        operation. A run of chunks whose parent chunk is not on the host is stored as a
        chain from the root (vLLM reaches it while its GPU prefix cache holds the prefix).
        With ``store_threshold >= 2``, only chunks offered that often are stored.
        """
        t0 = time.perf_counter()
        try:
            return self._prepare_store(list(keys), req_context)
        finally:
            self._timed(t0)

    def _prepare_store(self, keys: list[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        st = self._req(ctx)
        eligible = self._threshold([bytes(k) for k in keys]) if self._counts is not None else None
        chains: dict[int, list[tuple[int, bytes]]] = {}
        flat: list[bytes] = []
        reused: dict[int, Node] = {}
        skipped = 0
        for key in keys:
            g = get_offload_group_idx(key)
            idx = self._chunk_index(key, ctx)
            if idx is not None:
                st.chain.setdefault(g, {})[idx] = key
            n = self._resolve(key)
            if n is not None:
                if n.state in HOST_VISIBLE:
                    reused.setdefault(n.node_id, n)
                continue  # (written by another store: it becomes visible on its ack)
            if eligible is not None and key not in eligible:
                skipped += 1
                continue
            if idx is None:
                flat.append(key)
            else:
                chains.setdefault(g, []).append((idx, key))
        self.stores_skipped += skipped
        self._batch_skipped += skipped
        paths: list[tuple[bytes, ...]] = []
        new_keys: list[bytes] = []
        parents: dict[int, Node] = {}
        for g, items in chains.items():
            items.sort()
            runs: list[list[tuple[int, bytes]]] = []
            for idx, ckey in items:
                if runs and runs[-1][-1][0] == idx - 1:
                    runs[-1].append((idx, ckey))
                else:
                    runs.append([(idx, ckey)])
            for run in runs:
                first = run[0][0]
                prefix: tuple[bytes, ...] = ()
                if first > 0:
                    pkey = st.chain.get(g, {}).get(first - 1)
                    parent = self._resolve(pkey) if pkey is not None else None
                    if parent is not None and parent.state == "writing":
                        self.retried_stores += 1
                        return None  # written by another operation: retry next step
                    if parent is None or parent.state not in HOST_VISIBLE or pkey is None:
                        # the parent chunk is not on the host: the run hangs from the root
                        # (reachable while vLLM's GPU cache holds the prefix)
                        self.rootless_chunks += len(run)
                    elif self.chain:
                        prefix = self._path_to(parent, pkey)
                        parents.setdefault(parent.node_id, parent)
                run_keys = tuple(k for _, k in run)
                paths.append(prefix + run_keys)
                new_keys.extend(run_keys)
        for fkey in flat:
            paths.append((fkey,))
            new_keys.append(fkey)
        if not new_keys:
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]),
                                      evicted_keys=self._flush_evicted([]))
        # keep the offered chunks the host already holds, and the parents of the new runs,
        # out of the eviction below; the locks also stamp their recency
        guarded = {**reused, **parents}
        guards = [self.core.lock(n, owner=st.req_id) for n in sorted(guarded.values(), key=lambda x: -x.depth)]
        created: list[Node] = []
        try:
            evicted = self._make_room(len(new_keys), guarded.values())
            if evicted is None:
                self.refused_stores += 1
                return None
            for path in paths:
                pages = self._stage(len(path))
                if pages is None:
                    self._rollback(created, [])
                    self.refused_stores += 1
                    return None
                res = self.core.insert(path, pages)
                spare = {grp: p for grp, p in res.duplicates.items() if p}
                for grp, p in res.kept.items():
                    spare.setdefault(grp, []).extend(p)
                if spare:
                    self.core.free_device(spare)
                created.extend(res.created)
                for n in res.created:
                    for k in _keys(n):
                        self._index[k] = n
            commands = self.core.issue_writebacks()
            op_ids = [c.op_id for c in commands]
            evicted += self._take_evicted()  # (none expected: the room was made above)
            if any(n.state != "writing" for n in created):
                self._rollback(created, op_ids)
                self._pending_evicted.extend(evicted)
                self.refused_stores += 1
                return None
        finally:
            for lock in guards:
                self.core.unlock(lock)
        st.stores.append(_Store(frozenset(new_keys), op_ids))
        self._batch_alloc.append(len(new_keys))
        want = set(new_keys)
        keys_to_store = [k for k in keys if k in want]
        slots = []
        for k in keys_to_store:
            n = self._index[k]
            slots.append(n.pending[GROUP][n.key.index(k)])
        self._sweep()
        return PrepareStoreOutput(keys_to_store=keys_to_store, store_spec=CPULoadStoreSpec(slots),
                                  evicted_keys=self._flush_evicted(evicted))

    def _flush_evicted(self, evicted: list[bytes]) -> list[OffloadKey]:
        out = [OffloadKey(k) for k in itertools.chain(self._pending_evicted, evicted)]
        self._pending_evicted = []
        return out

    def _stage(self, units: int) -> PageMap | None:
        """Staging pages for a path of ``units`` chunks; when the staging pool is full,
        the least recently used staged leaves are demoted (their host copies stay)."""
        try:
            return self.core.alloc_device({GROUP: units}, evict=False)
        except CapacityError:
            self.core.evict_device({GROUP: max(units, self._staging // 4)})
            try:
                return self.core.alloc_device({GROUP: units}, evict=False)
            except CapacityError:
                return None

    def _rollback(self, created: list[Node], op_ids: list[int]) -> None:
        """Undo a store that could not take every chunk: fail its writebacks (the
        ``writeback_fail`` transition) and drop the staged nodes."""
        for op in op_ids:
            self.core.poison(op)
            self.core.complete(Completion(op, 0, False))
        self._clear_staging(created)
        for n in created:
            for k in _keys(n):
                self._resolve(k)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Acknowledge (``success``) or fail the writeback of one :meth:`prepare_store`.

        Raises:
            KvtierError: no store of exactly these keys is in flight for the request.
        """
        t0 = time.perf_counter()
        st = self._reqs.get(req_context.req_id)
        want = frozenset(keys)
        store = next((x for x in st.stores if x.keys == want), None) if st else None
        if st is None or store is None:
            raise KvtierError(f"complete_store: request {req_context.req_id!r} has no store of these "
                              f"{len(want)} chunks in flight")
        st.stores.remove(store)
        for op in store.op_ids:
            if not success:
                self.core.poison(op)
            self.core.complete(Completion(op, 0, success))
        if self.events is not None:
            if success:
                self.events.append(OffloadingEvent(keys=[OffloadKey(k) for k in store.keys], medium=self.medium,
                                                   removed=False))
            else:
                self.events.append(OffloadingEvent(keys=[OffloadKey(k) for k in store.keys], medium=self.medium,
                                                   removed=True, metadata_only=True))
        if not success:
            nodes = {id(n): n for n in (self._resolve(k) for k in store.keys) if n is not None}
            self._clear_staging(nodes.values())
            for k in store.keys:
                self._resolve(k)
        self._maybe_drop(st)
        self._timed(t0)

    def on_request_finished(self, req_context: ReqContext) -> None:
        t0 = time.perf_counter()
        st = self._reqs.get(req_context.req_id)
        if st is not None:
            st.finished = True
            self._maybe_drop(st)
        self._timed(t0)

    def _maybe_drop(self, st: _Request) -> None:
        if st.finished and not st.stores and not st.loads:
            self._reqs.pop(st.req_id, None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        out, self.events = self.events, []
        return out

    def reset_cache(self) -> None:
        """Drop every chunk and every request's state (vLLM discards the jobs in flight)."""
        self._new_core()

    def get_stats(self) -> Any:
        """vLLM's CPU offloading gauges for this manager (an ``OffloadingConnectorStats``):
        host usage (acknowledged and in-flight chunks over capacity), write usage (chunks
        being stored), read usage (the rest), the sizes of this batch's stores and, with
        ``store_threshold >= 2``, the chunks skipped. The batch counters reset."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
            OffloadingConnectorStats,
        )
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics  # type: ignore[import-untyped, import-not-found, unused-ignore]

        stats = OffloadingConnectorStats()
        usage = self.host_chunks_used() / self.num_chunks
        writing = sum(len(s.keys) for r in self._reqs.values() for s in r.stores) / self.num_chunks
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in self._batch_alloc:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._batch_alloc.clear()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - writing, 0.0))
        if self.store_threshold >= 2:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, self._batch_skipped)
            self._batch_skipped = 0
        return stats

    # ------------------------------------------------------------------ introspection
    def in_flight(self) -> int:
        """Stores and loads prepared and not yet completed, over all requests."""
        return sum(len(r.stores) + len(r.loads) for r in self._reqs.values())

    def tracked_requests(self) -> int:
        return len(self._reqs)

    def host_chunks_used(self) -> int:
        """Host chunks holding acknowledged or reserved copies."""
        assert self.core.host is not None
        return int(self.core.host[GROUP].used)

    def check_invariants(self) -> None:
        """The core's invariants, then the adapter's: every in-flight store names live
        ``writing`` operations, every in-flight load holds a live pin, and every staged
        node holds a host copy or is being written (no orphaned staging copy).

        Raises:
            InvariantViolation: from the core.
            KvtierError: an adapter record disagrees with the core.
        """
        self.core.check_invariants()
        ops = self.core.operations()
        for r in self._reqs.values():
            for s in r.stores:
                missing = [o for o in s.op_ids if o not in ops]
                if missing:
                    raise KvtierError(f"request {r.req_id!r}: store ops {missing} are not in flight")
            for ld in r.loads:
                if (ld.pin is not None and ld.pin.released) or any(lk.released for lk in ld.locks):
                    raise KvtierError(f"request {r.req_id!r}: a load's pin or lock was released early")
        orphans = [n.node_id for n in self.core.nodes() if n.state == "device"]
        if orphans:
            raise KvtierError(f"nodes {orphans[:8]} hold only a staging copy (no host copy, no writeback)")


class KvtierOffloadingSpec(OffloadingSpec):  # type: ignore[misc, unused-ignore]
    """The spec vLLM instantiates from ``kv_connector_extra_config``.

    Extra config keys:
        ``cpu_bytes_to_use`` (int, bytes): host budget. Capacity in chunks = budget //
            (bytes of one chunk of one KV cache group x workers); vLLM's own CPU spec
            divides by all groups' bytes per key instead (vLLM #56871).
        ``num_host_chunks`` (int): capacity in chunks directly (overrides the budget).
        ``kvtier_backend`` (str): the worker's transfer backend (default ``"auto"``).
        ``store_threshold``, ``max_tracker_size`` (int): as vLLM's CPU spec reads them
            (a threshold below 2 stores on the first offer).
        ``kvtier_eviction`` (str): the host eviction policy (``"lru"``, ``"lru2"``).
        ``kvtier_chain`` (bool): chain a store's run under its stored parent chunk
            (:class:`KvtierOffloadingManager`'s ``chain``).

    Raises:
        ConfigError: neither key given, or a capacity below one chunk.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        groups = tuple(config.groups)
        n_groups = max(1, len(groups))
        world = max(1, int(config.parallel.world_size))
        chunks = self.extra_config.get("num_host_chunks")
        if chunks is None:
            budget = self.extra_config.get("cpu_bytes_to_use")
            if not budget:
                raise ConfigError("kvtier: kv_connector_extra_config needs cpu_bytes_to_use (bytes) "
                                  "or num_host_chunks")
            per_key = max(1, int(config.worker_kv_bytes_per_block) // n_groups) * world * self.blocks_per_chunk
            chunks = int(budget) // per_key
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"kvtier: host capacity must be at least one chunk, got {chunks!r}")
        self.num_chunks = chunks
        self.tokens_per_chunk = {g.group_id: g.tokens_per_block * self.blocks_per_chunk for g in groups
                                 if g.sliding_window_size_in_chunks is None}
        self.sparse_groups = {g.group_id for g in groups if g.sliding_window_size_in_chunks is not None}
        self.backend = str(self.extra_config.get("kvtier_backend", "auto"))
        self.store_threshold = max(1, int(self.extra_config.get("store_threshold", 0)))
        self.max_tracker_size = int(self.extra_config.get("max_tracker_size", 64_000))
        self.eviction = str(self.extra_config.get("kvtier_eviction", "lru"))
        self.chain = bool(self.extra_config.get("kvtier_chain", True))
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(
                self.num_chunks, tokens_per_chunk=self.tokens_per_chunk,
                sliding_window_groups=self.sparse_groups,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=self.store_threshold, max_tracker_size=self.max_tracker_size,
                eviction=self.eviction, chain=self.chain)
        return self._manager

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(kv_caches, self.num_chunks, self.blocks_per_chunk,
                                                  backend=self.backend)
        return self._worker


def _slots(spec: Any) -> list[int]:
    """Host chunk slots of a ``CPULoadStoreSpec`` (``block_ids``: chunk indices)."""
    return [int(x) for x in spec.block_ids]


class KvtierOffloadingWorker(OffloadingWorker):  # type: ignore[misc, unused-ignore]
    """Moves offload chunks between vLLM's KV tensors and a host pool with kvtier's
    :class:`~kvtier.transfer.TransferEngine`.

    One engine per vLLM KV cache group, all sharing one host pool: host page ``s * b + i``
    is GPU block ``i`` of chunk slot ``s`` (``b`` = blocks per chunk); a page holds one
    block of every tensor the group uses (one kvtier "layer" per tensor reference, in
    vLLM's order), so a slot can hold a chunk of any group.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` (``tensors``: ``[num_blocks, ...]``
            tensors; ``group_data_refs``: per group, one reference per tensor it uses).
        num_chunks: host chunk slots.
        blocks_per_chunk: GPU blocks per offload chunk.
        backend: kvtier backend name (``"auto"``, ``"cpu"``, ``"fake-async"``, ``"torch"``,
            ``"numba"``).
        host_pin: pin the host pool (default: when CUDA is available).

    Raises:
        ConfigError: groups whose references differ in count or page bytes (a shared slot
            could not hold every group's chunk), or bad sizes.
    """

    def __init__(self, kv_caches: Any, num_chunks: int, blocks_per_chunk: int = 1, *,
                 backend: str = "auto", host_pin: bool | None = None) -> None:
        from kvtier.transfer import DevicePool, HostPool, TransferEngine

        refs = [list(r) for r in kv_caches.group_data_refs]
        if not refs or not refs[0]:
            raise ConfigError("kvtier worker: vLLM passed no KV cache groups")
        def rows(rs: list[Any]) -> list[int]:  # bytes of one block row (padding included)
            return [int(kv_caches.tensors[r.tensor_idx].tensor[0].nbytes) for r in rs]

        shape = rows(refs[0])
        for g, rs in enumerate(refs):
            if rows(rs) != shape:
                raise ConfigError(f"kvtier worker: KV cache group {g} uses pages of {rows(rs)} "
                                  f"bytes, group 0 uses {shape}; groups must match to share host slots")
        if len(set(shape)) != 1:
            raise ConfigError(f"kvtier worker: a group's tensors must share one page size, got {shape}")
        self.blocks_per_chunk = blocks_per_chunk
        layers = tuple(range(len(shape)))
        self.spec = CacheGroupSpec("blocks", Family.HISTORY, 1, 1, layers, (ComponentSpec("kv", shape[0]),))
        self.host = HostPool([self.spec], {"blocks": num_chunks * blocks_per_chunk}, pin=host_pin, reserve_bytes=0)
        self.engines: list[Any] = []
        for rs in refs:
            tensors = {}
            for layer, ref in enumerate(rs):
                tensors[("blocks", "kv", layer)] = kv_caches.tensors[ref.tensor_idx].tensor
            device = DevicePool.register([self.spec], tensors)
            self.engines.append(TransferEngine([self.spec], self.host, device, backend))
        self._jobs: dict[int, set[int]] = {}  # job id -> engines still to acknowledge
        self._ok: dict[int, bool] = {}
        self._layers: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._t0: dict[int, float] = {}

    def _submit(self, job_id: int, direction: Direction, host_pages: Sequence[int], gpu: Any) -> bool:
        sizes = list(gpu.group_sizes)
        blocks = [int(b) for b in gpu.block_ids]
        b = self.blocks_per_chunk
        starts = list(itertools.accumulate([0] + sizes))
        cursor = 0
        per_engine: dict[int, tuple[list[int], list[int]]] = {}
        for g, n in enumerate(sizes):
            if not n:
                continue
            gb = blocks[starts[g]:starts[g] + n]
            first = int(gpu.block_indices[g]) % b  # the first chunk may start mid-chunk
            pages: list[int] = []
            while len(pages) < n:
                slot = host_pages[cursor]
                cursor += 1
                pages.extend(slot * b + i for i in range(first, b))
                first = 0
            per_engine[g] = (pages[:n], gb)
        self._jobs[job_id] = set(per_engine)
        self._ok[job_id] = True
        self._layers[job_id] = -1
        self._bytes[job_id] = 0
        self._t0[job_id] = time.perf_counter()
        for g, (hp, gb) in per_engine.items():
            src, dst = (gb, hp) if direction is Direction.WRITEBACK else (hp, gb)
            eng = self.engines[g]
            cmd = TransferCommand(op_id=job_id, direction=direction,
                                  transfers=(GroupTransfer("blocks", tuple(src), tuple(dst)),),
                                  layers=self.spec.layers, request_id=None, node_ids=())
            eng.submit(cmd)
            eng.flush()
            self._bytes[job_id] += len(hp) * self.spec.components[0].page_bytes * len(self.spec.layers)
        if not per_engine:
            self._jobs[job_id] = set()
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, Direction.WRITEBACK, _slots(dst_spec), src_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, Direction.LOADBACK, _slots(src_spec), dst_spec)

    def _poll(self) -> None:
        for g, eng in enumerate(self.engines):
            for c in eng.poll_completions():
                if c.op_id not in self._jobs:
                    continue
                if c.layer is not None:
                    self._layers[c.op_id] = max(self._layers[c.op_id], c.layer)  # (per engine: lower bound below)
                    continue
                self._ok[c.op_id] = self._ok[c.op_id] and c.ok
                self._jobs[c.op_id].discard(g)

    def layers_done(self, job_id: int) -> int:
        """Highest layer index (vLLM tensor reference) complete for load ``job_id`` on
        some group's engine so far; -1 if none (layer-wise completion)."""
        self._poll()
        return self._layers.get(job_id, -1)

    def get_finished(self) -> list[TransferResult]:
        self._poll()
        out = []
        for job_id in [j for j, pending in self._jobs.items() if not pending]:
            del self._jobs[job_id]
            self._layers.pop(job_id, None)
            secs = time.perf_counter() - self._t0.pop(job_id)
            out.append(TransferResult(job_id=job_id, success=self._ok.pop(job_id),
                                      transfer_size=self._bytes.pop(job_id), transfer_time=secs))
        return out

    def wait(self, job_ids: set[int]) -> None:
        if any(j in self._jobs for j in job_ids):
            for eng in self.engines:
                eng.synchronize()

    def shutdown(self) -> None:
        for eng in self.engines:
            eng.synchronize()
