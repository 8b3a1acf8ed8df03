"""kvtier as vLLM's ``OffloadingManager``: the scheduler side (extra ``kvtier[vllm]``).

:class:`KvtierOffloadingManager` answers vLLM 0.33's connector
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) from kvtier's
core (:mod:`kvtier.adapters.vllm_chunks`). What a vLLM user can rely on, beyond vLLM's own
manager's contract (``tests/adapters/test_vllm_manager_contract.py`` runs vLLM's tests):

- a prefix never loses its head before its tail: full-attention chunks chain by token
  position (all full-attention groups interleaved: chunk ``i`` of every group before
  chunk ``i + 1``), and the host stays prefix-closed (``lru``: each chunk ranked by its own
  uses as vLLM's lru ranks it, a head with its tails: :mod:`kvtier.adapters.vllm_recency`);
- a call that is refused (``prepare_store`` returning ``None``) or that raises changes
  nothing stored;
- every misuse raises :class:`~kvtier.fsm.UsageError` naming the value.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # type: ignore[import-untyped, import-not-found, unused-ignore]

from kvtier.fsm import ConfigError, UsageError
from kvtier.fsm.node import HOST_VISIBLE, Node

from .vllm_chunks import GROUP, ChunkTier, node_keys
from .vllm_records import (ChainOrder, LoadRecord, OfferCounter, RequestRecord, StoreRecord, check_ctx, check_key,
                           check_keys, check_manager_args, check_records, short_hex)
from .vllm_stats import CONFIG_INFO_KEYS, manager_stats

__all__ = ["KvtierOffloadingManager"]

_HIT, _HIT_PENDING, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS

class KvtierOffloadingManager(OffloadingManager):  # type: ignore[misc, unused-ignore]
    """vLLM ``OffloadingManager`` whose host tier is kvtier's radix core.

    Args:
        num_chunks: host capacity in offload chunks (keys of one group each), >= 0
            (0: every store is refused).
        tokens_per_chunk: vLLM KV cache group id -> tokens per offload chunk, for the
            groups whose chunks chain (full attention). Keys of other groups, and keys
            whose request position is unknown, are stored as single-chunk nodes.
        sliding_window_groups: group ids stored as single-chunk nodes (sliding window,
            Mamba and other groups vLLM stores sparsely).
        enable_events: collect ``OffloadingEvent`` records for :meth:`take_events`.
        staging_chunks: pages of the core's nominal staging pool; default
            ``2 * num_chunks + 4096``.
        store_threshold: offers of a chunk before it is stored (vLLM's
            ``store_threshold``; 1: store on the first offer), counted in a
            least-recently-offered table of ``max_tracker_size`` keys.
        max_tracker_size: keys the offer counter tracks.
        eviction: the core's host eviction policy (``"lru"``, ``"lru_turns"``, ``"lru2"``).
        chain: hang a store's run of chunks under its stored parent chunk (``False``:
            every run is a tree of its own under the root).

    Raises:
        ConfigError: a negative capacity, a bad token count, threshold or tracker size, or
            an unknown eviction policy.
    """

    def __init__(self, num_chunks: int, *, tokens_per_chunk: Mapping[int, int] | None = None,
                 sliding_window_groups: Collection[int] = (), enable_events: bool = False,
                 staging_chunks: int | None = None, store_threshold: int = 1,
                 max_tracker_size: int = 64_000, eviction: str = "lru", chain: bool = True) -> None:
        check_manager_args(num_chunks, tokens_per_chunk, sliding_window_groups, enable_events, staging_chunks,
                           store_threshold, max_tracker_size, chain)
        tpc = dict(tokens_per_chunk or {})
        self.num_chunks = num_chunks
        sparse = frozenset(sliding_window_groups)
        self.order = ChainOrder({g: t for g, t in tpc.items() if g not in sparse})
        self._staging = staging_chunks if staging_chunks is not None else 2 * num_chunks + 4096
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.eviction = eviction
        self.chain = chain
        self.medium = Medium.CPU
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.refused_stores = 0
        self.rootless_chunks = 0
        self.evicted_chunks = 0
        self.stores_skipped = 0
        self._new_tier()

    def _new_tier(self) -> None:
        self.tier = ChunkTier(self.num_chunks, self._staging, self.eviction)
        self._reqs: dict[str, RequestRecord] = {}
        self._pending: dict[bytes, StoreRecord] = {}  # key being stored -> its store
        self._loading: Counter[bytes] = Counter()  # key -> loads in flight pinning it
        self._offers = OfferCounter(self.store_threshold, self.max_tracker_size) if self.store_threshold >= 2 else None
        self._batch_alloc: list[int] = []
        self._batch_skipped = 0

    @property
    def core(self) -> Any:
        """The :class:`~kvtier.fsm.CacheCore` holding the chunks (read it; never drive it)."""
        return self.tier.core

    @property
    def counts(self) -> OrderedDict[bytes, int] | None:
        """The store-threshold offer counter (key -> offers; vLLM's ``counts``), or None
        when ``store_threshold < 2``. Read-only by contract."""
        return self._offers.counts if self._offers is not None else None

    @property
    def stores_skipped_in_current_batch(self) -> int:
        """Chunks the store threshold skipped since the last :meth:`get_stats` (vLLM's name)."""
        return self._batch_skipped

    # ------------------------------------------------------------------ helpers
    def _req(self, ctx: ReqContext) -> RequestRecord:
        st = self._reqs.get(ctx.req_id)
        if st is None:
            st = self._reqs[ctx.req_id] = RequestRecord(ctx.req_id)
        return st

    def _held(self) -> Iterator[Node]:
        """Nodes the host must keep: pinned by loads in flight or being written."""
        for st in self._reqs.values():
            for ld in st.loads:
                if ld.pin is not None:
                    yield from ld.pin.nodes
        optable = self.tier.core.optable
        for op_id in {op for s in self._pending.values() for op in s.op_ids}:
            op = optable.get(op_id)
            if op is not None:
                yield from op.nodes

    def _event(self, keys: Sequence[bytes], removed: bool, metadata_only: bool = False) -> None:
        if self.events is not None and keys:
            self.events.append(OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=self.medium,
                                               removed=removed, metadata_only=metadata_only))

    def _maybe_drop(self, st: RequestRecord) -> None:
        if st.finished and not st.stores and not st.loads:
            self._reqs.pop(st.req_id, None)

    # ------------------------------------------------------------------ vLLM API
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._req(check_ctx(req_context, "on_new_request"))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT: the chunk's host copy is acknowledged; HIT_PENDING: it is being stored;
        MISS otherwise. RETRY is never returned (the host index answers at once).

        Raises:
            UsageError: ``key`` is not an OffloadKey, or ``req_context`` not a ReqContext.
        """
        ctx = req_context if type(req_context) is ReqContext else check_ctx(req_context, "lookup")
        k: bytes = key if type(key) is bytes and len(key) >= 4 else check_key(key, "lookup")
        n = self.tier.resolve(k)
        state = n.state if n is not None else None
        out = _HIT if state in HOST_VISIBLE else _HIT_PENDING if state == "writing" else _MISS
        if out is not _MISS and (st := self._reqs.get(ctx.req_id)) is not None:  # (vLLM announced it)
            self.order.coord(k, ctx, st)
        return out

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-untyped, import-not-found, unused-ignore]

        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the host copies of ``keys`` and lock their nodes (stamping their use, a
        request's use with ``lru``) until :meth:`complete_load` with the same keys. The spec's slots are
        co-indexed with ``keys``.

        Raises:
            UsageError: bad keys (a key listed twice) or context, or a key without an
                acknowledged host copy (lookup did not say HIT). Nothing changes.
        """
        keys_ = check_keys(keys, "prepare_load", unique=True)
        ctx = check_ctx(req_context, "prepare_load")
        tier = self.tier
        nodes: list[Node] = []
        for key in keys_:
            n = tier.resolve(key)
            if n is None or n.state not in HOST_VISIBLE:
                raise UsageError(f"prepare_load: chunk {short_hex(key)} of request {ctx.req_id!r} has no acknowledged "
                                  f"host copy ({n.state if n is not None else 'not stored'})")
            nodes.append(n)
        if tier.own_use and tier.isolate(keys_, dict.fromkeys(nodes)) != list(dict.fromkeys(nodes)):
            nodes = [cast(Node, tier.resolve(k)) for k in keys_]  # (cut to the loaded chunks: their own uses)
        slots = [tier.host_slot(n, k) for n, k in zip(nodes, keys_)]
        st = self._req(ctx)
        by_key = dict(zip(keys_, nodes))
        order = list(dict.fromkeys(by_key[k] for k in self.order.tail_first(keys_, ctx, st)))
        pin = tier.core.pin(order, owner=st.req_id) if order else None
        locks = [tier.core.lock(n, owner=st.req_id) for n in order]
        if tier.own_use:  # (a lock stamps the core's clock on the path; the own use is the nodes')
            tier.use_by(st, order, self.order, ctx)
        if order:
            self.tier.stamp_heads(self.order, order[-1], st)
        st.loads.append(LoadRecord(frozenset(keys_), pin, locks))
        self._loading.update(keys_)
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Stamp the recency of ``keys`` (the last key stamped first, as vLLM's lru);
        keys not on the host are ignored.

        Raises:
            UsageError: bad keys or context.
        """
        keys_ = check_keys(keys, "touch", unique=False)
        ctx = check_ctx(req_context, "touch")
        if self.tier.own_use:
            self.tier.isolate(keys_)
        done: set[int] = set()
        for key in reversed(keys_):
            n = self.tier.resolve(key)
            if n is not None and n.node_id not in done:
                done.add(n.node_id)
                self.tier.stamp(n, ctx.req_id)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the pin and locks taken by the :meth:`prepare_load` of these keys.

        Raises:
            UsageError: bad keys or context, or no load of exactly these keys is in flight
                for the request (nothing changes).
        """
        want = frozenset(check_keys(keys, "complete_load", unique=False))
        ctx = check_ctx(req_context, "complete_load")
        st = self._reqs.get(ctx.req_id)
        load = next((x for x in st.loads if x.keys == want), None) if st else None
        if st is None or load is None:
            raise UsageError(f"complete_load: request {ctx.req_id!r} has no load of these {len(want)} chunks in "
                             "flight (complete each prepare_load with its own keys)")
        st.loads.remove(load)
        core = self.tier.core
        if load.pin is not None:
            core.release(load.pin)
        for lock in load.locks:
            core.unlock(lock)
        if load.locks and core.tree.has(load.locks[-1].node):
            self.tier.stamp_heads(self.order, load.locks[-1].node, st)
        self._loading.subtract(want)
        for k in want:
            if self._loading[k] <= 0:
                del self._loading[k]
        self._maybe_drop(st)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Start the writeback of the offered chunks that the host does not hold yet.

        Host room comes first: when short, host chunks are evicted exactly in the eviction
        order (a head after its tails, never one this offer holds or chains from);
        their keys are ``evicted_keys``. A full-attention run chains under its stored
        parent chunk; a run whose parent is not acknowledged on the host (still being
        written, or only in vLLM's GPU cache) is stored as a tree of its own and stays
        less recent than its head. With ``store_threshold >= 2``, only chunks offered
        that often are stored.

        Returns:
            The chunks to store and their host slots (co-indexed), or ``None`` when the
            host cannot make room (its chunks are pinned by loads or being written); a
            refusal evicts nothing and stores nothing.

        Raises:
            UsageError: bad keys (a key listed twice) or context; nothing changes.
        """
        return self._prepare_store(check_keys(keys, "prepare_store", unique=True),
                                   check_ctx(req_context, "prepare_store"))

    def _prepare_store(self, keys: list[bytes], ctx: ReqContext) -> PrepareStoreOutput | None:
        tier, order = self.tier, self.order
        st = self._req(ctx)
        eligible = self._offers.offer(keys) if self._offers is not None else None
        chained: list[tuple[tuple[int, int], bytes, int]] = []
        flat: list[bytes] = []
        reused: dict[int, Node] = {}
        skipped = 0
        prev: Node | None = None
        at = -1  # the previous key's place in prev.key
        resolve, coord, visible, index = tier.resolve, order.coord, HOST_VISIBLE, tier.index
        for i, key in enumerate(keys):
            if prev is not None and at + 1 < len(prev.key) and prev.key[at + 1] == key:
                at += 1  # the previous key's node goes on: nothing new (offers follow the prefix)
                continue
            n = resolve(key)
            if n is not None:
                at = len(n.key) - 1 - index[key][1]
                if n.state in visible:
                    if n is not prev:
                        reused[n.node_id] = n
                        if prev is not None and n.parent is not prev:
                            coord(keys[i - 1], ctx, st)  # a tree boundary inside the prefix: the
                            coord(key, ctx, st)  # request's order across it (stamp_heads)
                prev = n
                continue  # (being stored by another call: it becomes visible on its ack)
            prev = None
            if eligible is not None and key not in eligible:
                skipped += 1
                continue
            c = coord(key, ctx, st)
            if c is None:
                flat.append(key)
            else:
                chained.append((c, key, i))
        self.stores_skipped += skipped
        self._batch_skipped += skipped
        if keys:
            order.coord(keys[-1], ctx, st)  # the parent of the request's next store, likely
        if not chained and not flat:
            tier.stamp_offer(keys, reused.values(), (), (), st, (order, ctx))
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])
        need = len(chained) + len(flat)
        self._batch_alloc.append(need)  # refused calls count too, as vLLM's
        runs: list[list[tuple[tuple[int, int], bytes, int]]] = []
        for item in sorted(chained):
            if runs and order.follows(item[0], runs[-1][-1][0], st):
                runs[-1].append(item)
            else:
                runs.append([item])
        paths: list[tuple[bytes, ...]] = []
        parents: dict[int, Node] = {}
        for run in reversed(runs):  # the deepest run inserted (stamped) first
            pc = self._parent_coord(run[0], keys, ctx, st)
            pkey = st.seq.get(pc) if pc is not None else None
            parent = tier.resolve(pkey) if pkey is not None else None
            prefix: tuple[bytes, ...] = ()
            if parent is not None and pkey is not None and parent.state in HOST_VISIBLE and self.chain:
                prefix = tier.path_to(parent, pkey)
                parents[parent.node_id] = parent
            elif pc is not None:
                self.rootless_chunks += len(run)  # parent in vLLM's GPU cache, or still being written
            paths.append(prefix + tuple(k for _, k, _ in run))
        paths.extend((k,) for k in reversed(flat))  # the last offered goes first
        guarded = {**reused, **parents}
        if not tier.can_free(need, itertools.chain(guarded.values(), self._held())):
            tier.stamp_offer(keys, reused.values(), (), (), st, (order, ctx))
            self.refused_stores += 1
            return None
        pages: list[dict[str, list[int]]] = []
        for path in paths:  # staging before eviction: a refusal must change nothing stored
            pm = tier.stage(len(path))
            if pm is None:
                for got in pages:
                    tier.core.free_device(got)
                self.refused_stores += 1
                return None
            pages.append(pm)
        evicted = tier.make_room(need, guarded.values())
        self.evicted_chunks += len(evicted)
        self._event(evicted, removed=True)
        if not tier.own_use:
            tier.stamp_offer(keys, reused.values(), parents.values(), (), st)
        created, op_ids = tier.insert(paths, pages)
        if tier.own_use:
            tier.stamp_offer(keys, reused.values(), (), created, st, (order, ctx))
        slot = {k: s for n in created for k, s in zip(node_keys(n), n.pending[GROUP])}
        store = StoreRecord(frozenset(slot), op_ids, st.req_id)
        st.stores.append(store)
        for k in slot:
            self._pending[k] = store
        heads = {id(tier.top(n)): n for n in created}
        for n in heads.values():
            tier.stamp_heads(order, n, st)
        keys_to_store = [k for k in keys if k in slot]
        tier.sweep()
        return PrepareStoreOutput(keys_to_store=cast("list[OffloadKey]", keys_to_store),  # (a NewType of bytes)
                                  store_spec=CPULoadStoreSpec([slot[k] for k in keys_to_store]),
                                  evicted_keys=cast("list[OffloadKey]", evicted))

    def _parent_coord(self, first: tuple[tuple[int, int], bytes, int], keys: list[bytes], ctx: ReqContext,
                      st: RequestRecord) -> tuple[int, int] | None:
        """The chain position of a run's parent. The keys the offer holds before the run
        are read (their positions) only when the request has not shown the parent yet:
        the key just before, then (several groups) every earlier one."""
        order = self.order
        pc = order.pred(first[0], st)
        i = first[2]
        if pc is None and i > 0:
            order.coord(keys[i - 1], ctx, st)
            pc = order.pred(first[0], st)
            if pc is None and len(order.groups) > 1:
                for k in keys[:i - 1]:
                    order.coord(k, ctx, st)
                pc = order.pred(first[0], st)
        return pc

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Acknowledge (``success``) or fail the writebacks of the stores ``keys`` cover.

        ``keys`` may hold chunks the host already holds (vLLM's connector completes a
        store job with the keys it offered); every store it touches must be covered
        whole. A failed store's chunks are dropped: never visible.

        Raises:
            UsageError: bad keys, context or ``success`` (not a bool), a key neither being
                stored nor on the host, or keys covering part of one store; nothing changes.
        """
        if type(success) is not bool:
            raise UsageError(f"complete_store: success must be a bool, got {type(success).__name__} {success!r:.40}")
        keys_ = check_keys(keys, "complete_store", unique=False)
        check_ctx(req_context, "complete_store")
        stores: dict[int, StoreRecord] = {}
        for k in keys_:
            s = self._pending.get(k)
            if s is not None:
                stores[id(s)] = s
                continue
            n = self.tier.resolve(k)
            if n is None or n.state not in HOST_VISIBLE:
                raise UsageError(f"complete_store: chunk {short_hex(k)} has no store in flight and no acknowledged "
                                 "host copy")
        want = set(keys_)
        for s in stores.values():
            if not s.keys <= want:
                raise UsageError(f"complete_store: the keys cover {len(s.keys & want)} of the {len(s.keys)} chunks "
                                 f"of one store of request {s.req_id!r}; complete a prepare_store's chunks together")
        for s in stores.values():
            for k in s.keys:
                del self._pending[k]
            owner = self._reqs.get(s.req_id)
            if owner is not None:
                owner.stores.remove(s)
            self.tier.settle(s.op_ids, s.keys, success)
            if owner is not None:
                self._maybe_drop(owner)
        if self.events is not None:  # (per store settled, its keys in the caller's order)
            self._event([k for s in stores.values() for k in keys_ if k in s.keys], removed=not success,
                        metadata_only=not success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        st = self._reqs.get(check_ctx(req_context, "on_request_finished").req_id)
        if st is not None:
            st.finished = True
            if self.tier.own_use:
                self.tier.finish(st)
            self._maybe_drop(st)

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is None:
            return iter(())
        out, self.events = self.events, []
        return iter(out)

    def reset_cache(self) -> None:
        """Drop every chunk and every request's state (vLLM discards the jobs in flight:
        their completions never come)."""
        self._new_tier()

    def get_stats(self) -> Any:
        """vLLM's offloading stats (an ``OffloadingConnectorStats``;
        :mod:`kvtier.adapters.vllm_stats`): usage gauges (chunks held by active
        transfers), this batch's store sizes (refused ones too) and, with
        ``store_threshold >= 2``, the chunks skipped. The batch counters reset."""
        stats = manager_stats(self.num_chunks, len(self._pending), len(self._loading), self._batch_alloc,
                              self._batch_skipped if self._offers is not None else None)
        self._batch_alloc = []
        self._batch_skipped = 0
        return stats

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        """The labels of ``vllm:kv_offload_config_info`` (:data:`CONFIG_INFO_KEYS`)."""
        return [dict(zip(CONFIG_INFO_KEYS, (self.num_chunks, self.eviction)))]

    # ------------------------------------------------------------------ introspection
    def in_flight(self) -> int:
        """Stores and loads prepared and not yet completed, over all requests."""
        return sum(len(r.stores) + len(r.loads) for r in self._reqs.values())

    def tracked_requests(self) -> int:
        return len(self._reqs)

    def host_chunks_used(self) -> int:
        """Host chunks holding acknowledged or reserved copies."""
        return self.tier.used()

    def check_invariants(self) -> None:
        """The core's invariants, then the adapter's (:func:`~kvtier.adapters.vllm_records.check_records`).

        Raises:
            InvariantViolation: from the core.
            KvtierError: an adapter record disagrees with the core.
        """
        check_records(self.tier.core, self._reqs.values(), self._pending)
