"""kvtier as vLLM's offloading manager, tested against vLLM 0.33's own code on CPU.

vLLM's ``OffloadingConnectorScheduler`` cannot be constructed here (its module imports
``vllm.config``, whose chain needs ``transformers``); the tests drive the manager through
vLLM's real ``KVCacheManager``, ``Request`` and block hasher with exactly that scheduler's
calls and order (``kvtier.adapters.vllm_kit.ConnectorDriver``, which cites the lines of
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`` per call), or
call the manager directly in that order where a test pins one sequence.
"""

import pytest
from vllm_guard import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvtier.adapters.vllm import KvtierOffloadingManager, KvtierOffloadingSpec, KvtierOffloadingWorker  # noqa: E402
from kvtier.adapters.vllm_kit import ConnectorDriver  # noqa: E402
from kvtier.adapters.vllm_machine import check_drained  # noqa: E402
from kvtier.fsm import ConfigError, KvtierError  # noqa: E402

pytestmark = pytest.mark.vllm

T = 16
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def keys(name: str, n: int, group: int = 0) -> list[bytes]:
    """A hash chain of n chunk keys (distinct per name), like vLLM's chained block hashes."""
    return [make_offload_key(f"{name}:{i}".encode().ljust(32, b"."), group) for i in range(n)]


def ctx(rid: str, ks: list[bytes], first: int = 0) -> ReqContext:
    c = ReqContext(req_id=rid)
    for i, k in enumerate(ks):
        c.set_offload_key_position(k, (first + i + 1) * T)
    return c


def manager(n: int, **kw: object) -> KvtierOffloadingManager:
    return KvtierOffloadingManager(n, tokens_per_chunk={0: T}, **kw)  # type: ignore[arg-type]


def store(m: KvtierOffloadingManager, c: ReqContext, ks: list[bytes], ok: bool = True) -> list[bytes]:
    out = m.prepare_store(ks, c)
    assert out is not None
    if out.keys_to_store:
        m.complete_store(out.keys_to_store, c, success=ok)
    return list(out.keys_to_store)


def config(groups: list[OffloadingGroupConfig], bytes_per_block: int, extra: dict[str, object]) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(groups), worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=False,
        extra_config=extra, engine_id="e0", model=OffloadingModelConfig("m", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=T, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


# ---------------------------------------------------------------------- plugging in
def test_vllm_factory_loads_the_spec_from_kv_connector_extra_config() -> None:
    extra = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.adapters.vllm",
             "cpu_bytes_to_use": 64 * 4096}
    cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert cls is KvtierOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(config([OffloadingGroupConfig(T, ("l0",), 0)], 4096, extra))
    assert spec.num_chunks == 64
    m = spec.get_manager()
    assert isinstance(m, OffloadingManager) and m.num_chunks == 64 and spec.get_manager() is m
    assert m.store_threshold == 1 and m.chain and m.core.eviction.name == "lru"
    extra.update(store_threshold=3, kvtier_eviction="lru2", kvtier_chain=False)
    m2 = OffloadingSpecFactory.create_spec(config([OffloadingGroupConfig(T, ("l0",), 0)], 4096, extra)).get_manager()
    assert m2.store_threshold == 3 and not m2.chain and m2.core.eviction.name == "lru2"


def test_spec_without_a_budget_names_the_missing_key() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        KvtierOffloadingSpec(config([OffloadingGroupConfig(T, ("l0",), 0)], 4096, {}))


def test_capacity_counts_keys_of_one_group_vllm_56871() -> None:
    # vLLM #56871: 8 groups of 1 KiB blocks (worker bytes per block: 8 KiB). vLLM's CPU spec
    # divides the budget by 8 KiB per key; a key holds one group's chunk (1 KiB).
    groups = [OffloadingGroupConfig(T, (f"l{g}",), g) for g in range(8)]
    spec = KvtierOffloadingSpec(config(groups, 8 * 1024, {"cpu_bytes_to_use": 1 << 20}))
    assert spec.num_chunks == (1 << 20) // 1024 == 1024


# ---------------------------------------------------------------------- two-phase stores
def test_a_store_is_invisible_until_acknowledged_and_a_failed_one_frees_its_slots() -> None:
    m = manager(8)
    ks = keys("a", 3)
    c = ctx("r", ks)
    out = m.prepare_store(ks, c)
    assert out is not None and out.keys_to_store == ks
    assert sorted(int(x) for x in out.store_spec.block_ids) == [0, 1, 2]
    assert [m.lookup(k, c) for k in ks] == [PENDING] * 3
    assert m.host_chunks_used() == 3
    m.complete_store(ks, c, success=False)
    assert [m.lookup(k, c) for k in ks] == [MISS] * 3
    assert m.host_chunks_used() == 0 and m.core.stats.writeback_failures == 1
    assert store(m, c, ks) == ks
    assert [m.lookup(k, c) for k in ks] == [HIT] * 3
    assert store(m, c, ks) == []  # already on the host: nothing to store
    m.on_request_finished(c)
    check_drained(m)


def test_complete_store_of_unknown_keys_raises_and_changes_nothing() -> None:
    m = manager(4)
    ks = keys("a", 2)
    c = ctx("r", ks)
    out = m.prepare_store(ks, c)
    assert out is not None
    with pytest.raises(KvtierError, match="no store of these 1 chunks"):
        m.complete_store(ks[:1], c)
    assert [m.lookup(k, c) for k in ks] == [PENDING] * 2
    m.complete_store(ks, c)
    assert [m.lookup(k, c) for k in ks] == [HIT] * 2


def test_a_chain_continues_from_its_parent_chunk_and_an_orphan_hangs_from_the_root() -> None:
    m = manager(8)
    ks = keys("a", 4)
    c = ctx("r", ks)
    store(m, c, ks[:2])
    assert store(m, c, ks[2:]) == ks[2:]  # parent chunk 1 known from the request's positions
    (node,) = {m._resolve(k) for k in ks[2:]}
    assert node is not None and node.depth == 4
    orphan = keys("b", 3)
    c2 = ctx("r2", orphan)
    # chunk 1 of b is not on the host (vLLM's GPU cache may hold it): stored from the root
    assert store(m, c2, orphan[2:]) == orphan[2:]
    n2 = m._resolve(orphan[2])
    assert m.rootless_chunks == 1 and n2 is not None and n2.depth == 1 and m.lookup(orphan[2], c2) is HIT


def test_a_store_behind_a_parent_still_writing_is_retried() -> None:
    m = manager(8)
    ks = keys("a", 4)
    c = ctx("r", ks)
    out = m.prepare_store(ks[:2], c)
    assert out is not None
    assert m.prepare_store(ks[2:], c) is None  # vLLM retries next step
    m.complete_store(ks[:2], c)
    assert store(m, c, ks[2:]) == ks[2:]


# ---------------------------------------------------------------------- loads and eviction
def test_loads_pin_their_sources_and_eviction_takes_unpinned_leaves_lru_first() -> None:
    m = manager(4)
    a, b = keys("a", 2), keys("b", 2)
    ca, cb = ctx("ra", a), ctx("rb", b)
    store(m, ca, a)
    store(m, cb, b)
    spec = m.prepare_load(a, ca)  # pins a (stored first: the LRU victim otherwise)
    assert isinstance(spec, CPULoadStoreSpec) and len(spec.block_ids) == 2
    c = keys("c", 2)
    cc = ctx("rc", c)
    assert store(m, cc, c) == c  # evicted b, the unpinned chain, leaf first
    assert [m.lookup(k, cb) for k in b] == [MISS, MISS]
    assert [m.lookup(k, ca) for k in a] == [HIT, HIT]
    d = keys("d", 3)
    assert m.prepare_store(d, ctx("rd", d)) is None  # a pinned, c newest-but-unpinned: 2 < 3 free
    assert [m.lookup(k, ca) for k in a] == [HIT, HIT]
    # c was evicted on the way (vLLM counts first and evicts nothing); the next store reports it
    assert [m.lookup(k, cc) for k in c] == [MISS, MISS]
    e = keys("e", 1)
    ce = ctx("re", e)
    out = m.prepare_store(e, ce)
    assert out is not None and out.keys_to_store == e and sorted(out.evicted_keys) == sorted(c)
    m.complete_store(e, ce)
    m.on_request_finished(ce)
    m.complete_load(a, ca)
    for r in (ca, cb, cc):
        m.on_request_finished(r)
    m.on_request_finished(ctx("rd", d))
    check_drained(m)


def test_eviction_keeps_a_shared_prefix_while_its_tails_go() -> None:
    m = manager(6)
    sys_prompt = keys("sys", 2)
    tails = []
    for i in range(4):  # each request: the shared 2 chunks + 2 own chunks
        own = keys(f"t{i}", 2)
        ks = sys_prompt + own
        tails.append(own)
        store(m, ctx(f"r{i}", ks), ks)
    c = ctx("x", sys_prompt)
    assert [m.lookup(k, c) for k in sys_prompt] == [HIT, HIT]
    assert [m.lookup(k, c) for k in tails[-1]] == [HIT, HIT]
    assert [m.lookup(k, c) for k in tails[0]] == [MISS, MISS]


def test_prepare_load_of_a_chunk_still_writing_raises() -> None:
    m = manager(4)
    ks = keys("a", 1)
    c = ctx("r", ks)
    m.prepare_store(ks, c)
    with pytest.raises(KvtierError, match="no acknowledged host copy"):
        m.prepare_load(ks, c)


# ---------------------------------------------------------------------- through vLLM's KVCacheManager
def prompt(blocks: list[int], tail: int = 5) -> list[int]:
    return [t for b in blocks for t in range(b * T, b * T + T)] + list(range(3, 3 + tail))


def run(d: ConnectorDriver, rid: str, p: list[int]) -> tuple[int, int]:
    d.add(rid, p)
    state = d.admit(rid)
    assert state in ("running", "loading"), state
    r = d.reqs[rid]
    out = (r.local, r.external)
    for j in sorted(r.jobs):
        d.complete(j)
    d.compute(rid)
    for j in sorted(r.jobs):
        d.complete(j)
    d.finish(rid)
    for j in sorted(d.jobs):
        d.complete(j)
    return out


def test_vllm_kv_cache_manager_gets_host_hits_after_gpu_eviction() -> None:
    m = manager(64)
    d = ConnectorDriver(m, device_blocks=8, block_tokens=T)
    assert run(d, "a", prompt([1, 2, 3, 4])) == (0, 0)
    assert run(d, "b", prompt([1, 2, 3, 4])) == (4 * T, 0)  # GPU prefix cache hit
    assert run(d, "c", prompt([9, 10, 11, 12, 13, 14])) == (0, 0)  # pushes a/b out of 8 GPU blocks
    local, ext = run(d, "d", prompt([1, 2, 3, 4, 5]))
    assert local + ext == 4 * T and ext >= 3 * T  # the shared prefix loaded back from the host
    assert m.core.stats.writebacks >= 3
    check_drained(m)


def test_vllm_own_cpu_manager_and_kvtier_agree_on_a_simple_sequence() -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    seqs = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 10, 11, 12, 13, 14], [1, 2, 3, 4, 5], [9, 10, 20]]
    got = []
    for mk in (lambda: manager(64), lambda: CPUOffloadingManager(num_chunks=64, cache_policy="lru")):
        d = ConnectorDriver(mk(), device_blocks=8, block_tokens=T)
        got.append([run(d, str(i), prompt(s)) for i, s in enumerate(seqs)])
    assert got[0] == got[1]


def test_hybrid_full_attention_and_sliding_window_groups() -> None:
    # vLLM #43884 / #50454 (assertions on hybrid models): keys of both groups, sliding
    # window chunks stored and looked up from the end of the hit
    m = KvtierOffloadingManager(64, tokens_per_chunk={0: T}, sliding_window_groups={1})
    d = ConnectorDriver(m, device_blocks=16, block_tokens=T, groups=(None, 2 * T))
    assert run(d, "a", prompt([1, 2, 3, 4, 5])) == (0, 0)
    run(d, "fill", prompt(list(range(30, 37))))
    local, ext = run(d, "b", prompt([1, 2, 3, 4, 5, 6]))
    assert local == 0 and ext == 5 * T
    sw = [n for n in m.core.nodes() if n.depth == 1 and n.key[0][-4:] == (1).to_bytes(4, "big")]
    assert sw, "sliding-window chunks are stored as single-chunk nodes"
    check_drained(m)


# ---------------------------------------------------------------------- regressions (vLLM issues)
def test_abort_of_a_queued_request_vllm_49118() -> None:
    m = manager(16)
    d = ConnectorDriver(m, device_blocks=8, block_tokens=T)
    d.add("q", prompt([1, 2, 3]))
    d.finish("q", aborted=True)  # never scheduled: on_new_request then on_request_finished only
    d.abort_untracked("u", prompt([1]))
    assert m.tracked_requests() == 0
    assert run(d, "after", prompt([1, 2, 3])) == (0, 0)
    check_drained(m)


def test_preempted_request_readmitted_while_its_store_is_in_flight_vllm_46014() -> None:
    m = manager(32)
    d = ConnectorDriver(m, device_blocks=8, block_tokens=T)
    d.add("p", prompt([1, 2, 3, 4]))
    assert d.admit("p") == "running"
    d.compute("p", 2 * T)  # a store of chunks 0-1 in flight
    (job,) = d.reqs["p"].jobs
    d.preempt("p")
    assert d.admit("p") == "delayed"  # in-flight transfers delay re-admission (scheduler.py:1244-1249)
    d.complete(job)
    d.add("other", prompt([50, 51, 52, 53, 54, 55, 56]))  # evicts p's GPU blocks
    assert d.admit("other") == "running"
    d.compute("other")
    d.finish("other")
    for j in sorted(d.jobs):
        d.complete(j)
    assert d.admit("p") == "loading"  # re-admitted: chunks 0-1 come back from the host
    assert d.reqs["p"].external == 2 * T
    d.drain()
    check_drained(m)


def test_eviction_is_exact_and_reports_the_evicted_keys_and_removal_events() -> None:
    m = manager(4, enable_events=True)
    a = keys("a", 4)
    ca = ctx("ra", a)
    assert store(m, ca, a) == a  # one node of 4 chunks
    b = keys("b", 1)
    out = m.prepare_store(b, ctx("rb", b))
    assert out is not None and out.keys_to_store == b
    assert out.evicted_keys == [a[3]]  # the leaf is split: only its deepest chunk goes
    assert [m.lookup(k, ca) for k in a] == [HIT, HIT, HIT, MISS]
    m.complete_store(b, ctx("rb", b))
    events = list(m.take_events())
    assert [(sorted(e.keys), e.removed) for e in events] == [
        (sorted(a), False), ([a[3]], True), (b, False)]
    assert list(m.take_events()) == []
    assert m.evicted_chunks == 1 and m.host_chunks_used() == 4
    m.check_invariants()  # (no chunk is left with only a staging copy)
    assert not [n for n in m.core.nodes() if n.state == "device"]


def test_acknowledged_chunks_stay_backed_and_a_store_touches_only_its_new_node() -> None:
    m = manager(64)
    sys_prompt = keys("sys", 2)
    store(m, ctx("s", sys_prompt), sys_prompt)
    for i in range(6):
        ks = sys_prompt + keys(f"t{i}", 2)
        c = ctx(f"r{i}", ks)
        before = m.core.stats.triggers
        assert store(m, c, ks) == ks[2:]
        # create, submit, ack of the one new node: the shared prefix is neither
        # republished nor demoted
        assert m.core.stats.triggers - before == 3
    hub = m._resolve(sys_prompt[0])
    assert hub is not None and hub.state == "backed" and len(hub.children) == 6


def test_store_threshold_stores_a_chunk_on_its_second_offer_and_get_stats_reports() -> None:
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

    m = manager(8, store_threshold=2)
    ks = keys("a", 3)
    c = ctx("r", ks)
    out = m.prepare_store(ks, c)
    assert out is not None and out.keys_to_store == []  # first offer: counted, not stored
    assert store(m, c, ks) == ks
    _, values = m.get_stats().metric_sections()
    assert values[CPUOffloadingMetrics.STORES_SKIPPED][()] == 3
    assert values[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC][()] == 3 / 8
    assert values[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC][()] == 0.0
    assert values[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE][()] == [3]
    _, values = m.get_stats().metric_sections()  # the batch counters reset
    assert values[CPUOffloadingMetrics.STORES_SKIPPED][()] == 0
    with pytest.raises(ConfigError, match="store_threshold"):
        manager(8, store_threshold=0)


def test_failed_store_and_failed_load_leave_nothing_behind() -> None:
    m = manager(32)
    d = ConnectorDriver(m, device_blocks=8, block_tokens=T)
    d.add("a", prompt([1, 2, 3]))
    d.admit("a")
    d.compute("a")
    (job,) = d.reqs["a"].jobs
    d.complete(job, ok=False)
    d.finish("a")
    assert m.host_chunks_used() == 0
    run(d, "b", prompt([1, 2, 3]))
    run(d, "c", prompt([9, 10, 11, 12, 13, 14, 15]))
    d.add("d", prompt([1, 2, 3]))
    assert d.admit("d") == "loading"
    (job,) = d.reqs["d"].jobs
    d.complete(job, ok=False)  # a failed load: complete_load releases the pin; the request recomputes
    assert d.reqs["d"].computed == 0
    d.drain()
    check_drained(m)


# ---------------------------------------------------------------------- worker side
def test_worker_moves_bytes_with_the_transfer_engine_and_reports_layers() -> None:
    blocks, page = 8, 64
    tensors = [torch.randint(0, 255, (blocks, page), dtype=torch.uint8).to(torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
    w = KvtierOffloadingWorker(caches, num_chunks=4, blocks_per_chunk=1, backend="cpu", host_pin=False)
    before = [t[[2, 5]].clone() for t in tensors]
    assert w.submit_store(7, GPULoadStoreSpec([2, 5], group_sizes=[2], block_indices=[0]), CPULoadStoreSpec([3, 0]))
    w.wait({7})
    (res,) = w.get_finished()
    assert res.job_id == 7 and res.success and res.transfer_size == 2 * 2 * page
    for t in tensors:
        t[[2, 5]] = 0
    assert w.submit_load(8, CPULoadStoreSpec([3, 0]), GPULoadStoreSpec([6, 1], group_sizes=[2], block_indices=[0]))
    w.wait({8})
    assert w.layers_done(8) in (-1, 1)
    (res,) = w.get_finished()
    assert res.job_id == 8 and res.success
    for t, b in zip(tensors, before):
        assert torch.equal(t[[6, 1]], b)


def test_worker_refuses_groups_that_cannot_share_host_slots() -> None:
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(torch.zeros(4, 64, dtype=torch.int8), 64),
                 CanonicalKVCacheTensor(torch.zeros(4, 32, dtype=torch.int8), 32)],
        group_data_refs=[[CanonicalKVCacheRef(0, 64)], [CanonicalKVCacheRef(1, 32)]])
    with pytest.raises(ConfigError, match="groups must match"):
        KvtierOffloadingWorker(caches, num_chunks=2, backend="cpu", host_pin=False)
