"""Drive an ``OffloadingManager`` through vLLM's own ``KVCacheManager`` with the calls and
order of vLLM 0.33's ``OffloadingConnectorScheduler`` (extras ``vllm`` and ``testing``).

vLLM's ``OffloadingConnectorScheduler``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) imports
``vllm.config``, whose import chain needs ``zmq`` and ``transformers``; it cannot be
constructed with the small CPU install (``kvtier[vllm]``). :class:`ConnectorDriver` makes
exactly its manager calls, in its order, against the real ``KVCacheManager``,
``Request`` and block hasher; each method cites the lines of that file (vLLM 0.33.0
wheel) it follows. Simplifications, stated: one GPU block per offload chunk
(``blocks_per_chunk=1``), no partial-tail, EAGLE or sync-load paths, and a
sliding-window lookup/store rule that keeps vLLM's shape (the window of chunks before the
hit boundary, scanned from the end) without its retention-interval masks.

:func:`replay` runs a Mooncake trace through it (metadata only, one request at a time,
instant transfers), as the peers' replays did (``bench/vllm_replay.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from . import vllm_stubs

vllm_stubs.install()

from vllm.sampling_params import SamplingParams  # type: ignore[import-untyped, import-not-found, unused-ignore]
from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-untyped, import-not-found, unused-ignore]
from vllm.v1.core import kv_cache_utils  # type: ignore[import-untyped, import-not-found, unused-ignore]
from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-untyped, import-not-found, unused-ignore]
from vllm.v1.kv_cache_interface import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # type: ignore[import-untyped, import-not-found, unused-ignore]
from vllm.v1.request import Request  # type: ignore[import-untyped, import-not-found, unused-ignore]

__all__ = ["ConnectorDriver", "DriverRequest", "Job", "Replayer", "SharedHasher", "replay"]

_HASHER: dict[tuple[str, int], Any] = {}


def _hasher(name: str, block_tokens: int) -> Any:
    if (name, block_tokens) not in _HASHER:
        fn = get_hash_fn_by_name(name)
        kv_cache_utils.init_none_hash(fn)
        _HASHER[(name, block_tokens)] = kv_cache_utils.get_request_block_hasher(block_tokens, fn)
    return _HASHER[(name, block_tokens)]


@dataclass
class Job:
    """One transfer job the connector handed to the workers."""

    job_id: int
    req_id: str
    keys: frozenset[bytes]
    is_store: bool


@dataclass
class DriverRequest:
    req: Any
    ctx: Any
    keys: list[list[bytes]]  # per group, per chunk
    status: str = "waiting"  # waiting, running, preempted, finished
    computed: int = 0
    next_stored: int = 0
    jobs: set[int] = field(default_factory=set)
    external: int = 0
    local: int = 0


class ConnectorDriver:
    """vLLM's connector-scheduler call order around a manager and a real KVCacheManager.

    Args:
        manager: any vLLM ``OffloadingManager`` (kvtier's or vLLM's own).
        device_blocks: GPU blocks of the ``KVCacheManager`` (plus vLLM's null block).
        block_tokens: tokens per block (= per offload chunk).
        groups: per KV cache group, ``None`` (full attention) or the sliding window in
            tokens.
        hash_name: vLLM's block hash function (``"sha256"`` by default, as in vLLM).
        max_model_len: longest request in tokens.
        block_hasher: vLLM's request block hasher to use instead (for example one shared
            by several drivers replaying the same requests).
    """

    def __init__(self, manager: Any, device_blocks: int, block_tokens: int = 16,
                 groups: Sequence[int | None] = (None,), hash_name: str = "sha256",
                 max_model_len: int = 1 << 20, block_hasher: Callable[[Any], Any] | None = None) -> None:
        self.manager = manager
        self.T = block_tokens
        self.groups = list(groups)
        specs = []
        for i, w in enumerate(self.groups):
            if w is None:
                spec: Any = FullAttentionSpec(block_size=block_tokens, num_kv_heads=1, head_size=1,
                                              dtype=torch.float32)
            else:
                spec = SlidingWindowSpec(block_size=block_tokens, num_kv_heads=1, head_size=1,
                                         dtype=torch.float32, sliding_window=w)
            specs.append(KVCacheGroupSpec([f"layer.{i}"], spec))
        cfg = KVCacheConfig(num_blocks=device_blocks + 1, kv_cache_tensors=[], kv_cache_groups=specs)
        self.kvm = KVCacheManager(cfg, max_model_len=max_model_len, scheduler_block_size=block_tokens,
                                  hash_block_size=block_tokens, enable_caching=True)
        self.hasher = block_hasher if block_hasher is not None else _hasher(hash_name, block_tokens)
        self.sp = SamplingParams(max_tokens=1)
        self.reqs: dict[str, DriverRequest] = {}
        self.jobs: dict[int, Job] = {}
        self._job_ids = 0
        self.manager_s = 0.0
        self.kvm_s = 0.0
        self.hash_s = 0.0
        self.refused_stores = 0

    # -------------------------------------------------------------- helpers
    def _m(self, name: str, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return getattr(self.manager, name)(*args, **kw)
        finally:
            self.manager_s += time.perf_counter() - t

    def _window(self, g: int) -> int | None:
        w = self.groups[g]
        return None if w is None else -(-(w - 1) // self.T)  # chunks a lookup at a boundary needs

    def _update_keys(self, r: DriverRequest) -> None:
        """RequestOffloadState.update_offload_keys (scheduler.py:412-429)."""
        for g, keys in enumerate(r.keys):
            for h in r.req.block_hashes[len(keys):]:
                k = make_offload_key(h, g)
                keys.append(k)
                r.ctx.set_offload_key_position(k, len(keys) * self.T)

    def _job(self, r: DriverRequest, keys: Iterable[bytes], is_store: bool) -> Job:
        job = Job(self._job_ids, r.req.request_id, frozenset(keys), is_store)
        self._job_ids += 1
        self.jobs[job.job_id] = job
        r.jobs.add(job.job_id)
        return job

    # -------------------------------------------------------------- requests
    def add(self, req_id: str, prompt: Sequence[int]) -> DriverRequest:
        """Scheduler.add_request -> connector on_new_request (scheduler.py:1197-1208)."""
        t = time.perf_counter()
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=self.sp,
                      pooling_params=None, block_hasher=self.hasher)
        self.hash_s += time.perf_counter() - t
        r = DriverRequest(req, ReqContext(req_id=req_id), [[] for _ in self.groups])
        self._m("on_new_request", r.ctx)
        self.reqs[req_id] = r
        return r

    def _lookup(self, r: DriverRequest, local_chunks: int) -> int | None:
        """_lookup_complete_chunks (scheduler.py:849-1054): full-attention groups by prefix
        (_maximal_prefix_lookup, 773-803: HIT/HIT_PENDING count, HIT_PENDING defers, MISS
        stops), then sliding-window groups from the end (_sliding_window_lookup, 805-847);
        returns hit chunks beyond the GPU hit, or None to defer."""
        n = len(r.keys[0])
        end = n
        defer = False
        for g, w in enumerate(self.groups):
            if w is not None:
                continue
            hits = 0
            for k in r.keys[g][local_chunks:end]:
                res = self._m("lookup", k, r.ctx)
                if res is LookupResult.MISS:
                    break
                if res is not LookupResult.HIT:
                    defer = True
                hits += 1
            end = min(end, local_chunks + hits)
        for g, w in enumerate(self.groups):
            win = self._window(g)
            if win is None or end <= local_chunks:
                continue
            run = 0
            found = local_chunks
            pending = False
            for i in range(end - 1, local_chunks - 1, -1):
                res = self._m("lookup", r.keys[g][i], r.ctx)
                if res is LookupResult.MISS:
                    run, pending = 0, False
                else:
                    run += 1
                    pending |= res is not LookupResult.HIT
                if run == win:
                    found = i + win
                    break
            defer |= pending
            end = found if run == win else local_chunks
        if defer:
            return None
        return max(0, end - local_chunks)

    def admit(self, req_id: str) -> str:
        """Scheduler admission of a waiting or preempted request:
        get_num_new_matched_tokens (scheduler.py:1210-1277), KVCacheManager.allocate_slots,
        update_state_after_alloc (1351-1500). Returns ``"running"``, ``"loading"``,
        ``"delayed"`` (the connector returned None) or ``"no-room"``."""
        r = self.reqs[req_id]
        assert r.status in ("waiting", "preempted"), r.status
        r.next_stored = 0  # restarting at token 0 (scheduler.py:1239-1243)
        if r.jobs:  # in-flight transfers delay the request (scheduler.py:1244-1249)
            return "delayed"
        self._update_keys(r)
        t = time.perf_counter()
        blocks, n_local, _ = self.kvm.get_computed_blocks(r.req)
        self.kvm_s += time.perf_counter() - t
        hit = self._lookup(r, n_local // self.T)
        if hit is None:
            return "delayed"
        num_tokens = r.req.num_tokens
        n_ext = hit * self.T
        if n_local + n_ext >= num_tokens:
            n_ext = num_tokens - n_local - 1  # the last token is always computed
        t = time.perf_counter()
        new = self.kvm.allocate_slots(r.req, num_new_tokens=num_tokens - n_local - n_ext,
                                      num_new_computed_tokens=n_local, new_computed_blocks=blocks,
                                      num_external_computed_tokens=n_ext)
        self.kvm_s += time.perf_counter() - t
        if new is None:
            return "no-room"
        r.local, r.external = n_local, n_ext
        r.status = "running"
        r.computed = n_local + n_ext
        if n_ext > 0:
            first, last = n_local // self.T, -(-(n_local + n_ext) // self.T)
            keys: list[bytes] = []
            for g in range(len(self.groups)):
                win = self._window(g)
                lo = first if win is None else max(first, last - win)
                keys.extend(r.keys[g][lo:last])
            self._m("prepare_load", keys, r.ctx)  # scheduler.py:1474
            self._job(r, keys, is_store=False)
            r.next_stored = last  # CHUNK_LEVEL: hit chunks are not offered (scheduler.py:1467-1468)
            return "loading"
        return "running"

    def _store(self, r: DriverRequest, upto_tokens: int) -> None:
        """_build_store_jobs for one request (scheduler.py:1815-2100): offer the full chunks
        from next_stored_chunk_idx (sliding-window groups: only the window before the end),
        prepare_store (1988); None -> retried next step (1991-1997); no keys to store ->
        advance (1999-2001); else a store job and advance."""
        self._update_keys(r)
        end = min(upto_tokens, r.req.num_prompt_tokens) // self.T  # offload_prompt_only (762-771)
        end = min(end, len(r.keys[0]))
        if end <= r.next_stored:
            return
        offer: list[bytes] = []
        for g in range(len(self.groups)):
            win = self._window(g)
            lo = r.next_stored if win is None else max(r.next_stored, end - win)
            offer.extend(r.keys[g][lo:end])
        out = self._m("prepare_store", offer, r.ctx)
        if out is None:
            self.refused_stores += 1
            return
        r.next_stored = end
        if out.keys_to_store:
            self._job(r, out.keys_to_store, is_store=True)

    def compute(self, req_id: str, tokens: int | None = None) -> int:
        """One scheduler step of a running request (``tokens`` of prefill, default the
        rest of its prompt), then build_connector_meta's store jobs for it. A request
        with a load in flight is not scheduled (it waits for its KV). Returns tokens done."""
        r = self.reqs[req_id]
        if r.status != "running" or any(not self.jobs[j].is_store for j in r.jobs):
            return 0
        left = r.req.num_tokens - r.computed
        n = left if tokens is None else max(0, min(tokens, left))
        r.computed += n
        self._store(r, r.computed)
        return int(n)

    def finish(self, req_id: str, aborted: bool = False) -> None:
        """request_finished (scheduler.py:2336-2376) and KVCacheManager.free, then the next
        build_connector_meta: stores of the finished request's last chunks (aborted:
        only computed tokens, 1830-1831) and on_request_finished (2176-2185). An aborted
        request that never reached the connector state (queued and untracked) gets
        on_new_request + on_request_finished (2349-2359)."""
        r = self.reqs[req_id]
        if r.status == "running":
            if not aborted:
                self._store(r, r.computed)
            t = time.perf_counter()
            self.kvm.free(r.req)
            self.kvm_s += time.perf_counter() - t
        r.status = "finished"
        self._m("on_request_finished", r.ctx)
        if not r.jobs:
            del self.reqs[req_id]

    def abort_untracked(self, req_id: str, prompt: Sequence[int]) -> None:
        """A request aborted before the connector ever saw it (scheduler.py:2349-2359)."""
        ctx = ReqContext(req_id=req_id)
        self._m("on_new_request", ctx)
        self._m("on_request_finished", ctx)

    def preempt(self, req_id: str) -> None:
        """Preemption: the scheduler frees the request's GPU blocks; its in-flight store
        jobs are flushed (waited for) by the workers (scheduler.py:2136-2150); it is
        re-admitted later from token 0."""
        r = self.reqs[req_id]
        assert r.status == "running"
        t = time.perf_counter()
        self.kvm.free(r.req)
        self.kvm_s += time.perf_counter() - t
        r.status = "preempted"
        r.computed = 0

    def complete(self, job_id: int, ok: bool = True) -> None:
        """update_connector_output (scheduler.py:2229-2305): complete_store / complete_load
        once every worker reported the job; a failed store is reported with
        ``success=False`` (vLLM's tiering manager passes it; its CPU worker asserts)."""
        job = self.jobs.pop(job_id)
        r = self.reqs[job.req_id]
        if job.is_store:
            if ok:
                self._m("complete_store", set(job.keys), r.ctx)
            else:
                self._m("complete_store", set(job.keys), r.ctx, success=False)
        else:
            self._m("complete_load", set(job.keys), r.ctx)
            if not ok:  # the loaded KV is unusable: the request recomputes it
                r.computed = r.local
        r.jobs.discard(job_id)
        if r.status == "finished" and not r.jobs:
            del self.reqs[job.req_id]

    def drain(self) -> None:
        """Complete every job in flight (successfully) and finish every request."""
        for j in sorted(self.jobs):
            self.complete(j)
        for rid in list(self.reqs):
            if self.reqs[rid].status != "finished":
                self.finish(rid, aborted=True)
        for j in sorted(self.jobs):
            self.complete(j)


def prompt_for(hash_ids: Sequence[int], input_length: int, block_tokens: int) -> list[int]:
    """Synthetic token ids for a Mooncake trace record: block ``h`` holds tokens
    ``h * block_tokens ...`` (equal ids give equal vLLM block hashes)."""
    sizes = [block_tokens] * (len(hash_ids) - 1) + [input_length - block_tokens * (len(hash_ids) - 1)]
    return list(chain.from_iterable(range(h * block_tokens, h * block_tokens + n) for h, n in zip(hash_ids, sizes)))


class SharedHasher:
    """vLLM's block hasher, computed once for drivers that replay the same requests.

    The first driver to build request ``r`` hashes it (timed in :attr:`hash_s`); the
    other ``users - 1`` get the same hashes (block hashes depend only on the tokens).
    """

    def __init__(self, users: int, hash_name: str = "sha256", block_tokens: int = 512) -> None:
        self.inner = _hasher(hash_name, block_tokens)
        self.users = users
        self.hash_s = 0.0
        self._memo: dict[tuple[str, int], tuple[Any, int]] = {}

    def __call__(self, req: Any) -> Any:
        key = (req.request_id, len(req.block_hashes))
        got = self._memo.pop(key, None)
        if got is None:
            t = time.perf_counter()
            hashes = self.inner(req)
            self.hash_s += time.perf_counter() - t
            got = (hashes, self.users)
        hashes, left = got
        if left > 1:
            self._memo[key] = (hashes, left - 1)
        return list(hashes)


class Replayer:
    """One manager's replay of trace records, one request at a time (see :func:`replay`);
    :meth:`step` runs one record, :meth:`result` sums up."""

    def __init__(self, manager: Any, device_blocks: int, block_tokens: int = 512,
                 block_hasher: Callable[[Any], Any] | None = None) -> None:
        self.d = ConnectorDriver(manager, device_blocks, block_tokens, max_model_len=block_tokens * 1024,
                                 block_hasher=block_hasher)
        self.block_tokens = block_tokens
        self.total = self.dev = self.host = self.n = self.not_admitted = 0

    def step(self, rid: str, rec: Any) -> None:
        d = self.d
        d.add(rid, prompt_for(rec.hash_ids, rec.input_length, self.block_tokens))
        self.total += rec.input_length
        state = d.admit(rid)
        self.n += 1
        if state in ("no-room", "delayed"):
            self.not_admitted += 1
            d.finish(rid, aborted=True)
            return
        r = d.reqs[rid]
        self.dev += r.local
        self.host += r.external
        for j in sorted(r.jobs):
            d.complete(j)
        d.compute(rid)
        for j in sorted(r.jobs):
            d.complete(j)
        d.finish(rid)
        for j in sorted(d.jobs):
            d.complete(j)

    def result(self) -> dict[str, Any]:
        d, n, total = self.d, max(1, self.n), max(1, self.total)
        return {
            "requests": self.n, "prompt_tokens": self.total, "device_hit": self.dev / total,
            "host_hit": self.host / total, "total_hit": (self.dev + self.host) / total,
            "manager_us": d.manager_s / n * 1e6, "kvm_us": d.kvm_s / n * 1e6, "hash_us": d.hash_s / n * 1e6,
            "not_admitted": self.not_admitted, "refused_stores": d.refused_stores,
        }


def replay(records: Iterable[Any], make_manager: Callable[[], Any], device_blocks: int,
           block_tokens: int = 512, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Replay trace records (``hash_ids``, ``input_length``) one request at a time, prompt
    only, instant transfers, through a :class:`ConnectorDriver`.

    Returns:
        ``prompt_tokens``, ``device_hit`` / ``host_hit`` / ``total_hit`` (fractions of
        prompt tokens), ``manager_us`` / ``kvm_us`` / ``hash_us`` (per request), counts.
    """
    rp = Replayer(make_manager(), device_blocks, block_tokens)
    for i, rec in enumerate(records):
        rp.step(str(i), rec)
        if progress is not None:
            progress(i)
    return rp.result()
