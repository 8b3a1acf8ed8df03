"""kvtier's vLLM offloading manager called directly, in the order vLLM's connector calls it:
two-phase stores, loads, exact eviction, and the contract a vLLM user relies on (a refused
or rejected call changes nothing stored; a prefix loses its tail before its head)."""

import pytest
from vllm_guard import require_vllm

require_vllm()

from kvtier.adapters import vllm_stubs  # noqa: E402

vllm_stubs.install()

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics  # noqa: E402

from kvtier.adapters.vllm import KvtierOffloadingManager  # noqa: E402
from kvtier.adapters.vllm_machine import check_drained  # noqa: E402
from kvtier.fsm import ConfigError, KvtierError, UsageError  # noqa: E402

pytestmark = pytest.mark.vllm

T = 16
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def keys(name: str, n: int, group: int = 0) -> list[bytes]:
    """A hash chain of n chunk keys (distinct per name), like vLLM's chained block hashes."""
    return [make_offload_key(f"{name}:{i}".encode().ljust(32, b"."), group) for i in range(n)]


def ctx(rid: str, ks: list[bytes] = (), first: int = 0) -> ReqContext:
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


def looks(m: KvtierOffloadingManager, ks: list[bytes]) -> list[LookupResult]:
    return [m.lookup(k, ReqContext(req_id="probe")) for k in ks]


def gauges(m: KvtierOffloadingManager) -> tuple[float, float, float]:
    _, values = m.get_stats().metric_sections()
    return tuple(values[name][()] for name in (CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
                                               CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC,
                                               CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC))


# ---------------------------------------------------------------------- two-phase stores
def test_a_store_is_invisible_until_acknowledged_and_a_failed_one_frees_its_slots() -> None:
    m = manager(8)
    ks = keys("a", 3)
    c = ctx("r", ks)
    out = m.prepare_store(ks, c)
    assert out is not None and out.keys_to_store == ks
    assert sorted(int(x) for x in out.store_spec.block_ids) == [0, 1, 2]
    assert looks(m, ks) == [PENDING] * 3
    assert m.host_chunks_used() == 3
    m.complete_store(ks, c, success=False)
    assert looks(m, ks) == [MISS] * 3
    assert m.host_chunks_used() == 0 and m.core.stats.writeback_failures == 1
    assert store(m, c, ks) == ks
    assert looks(m, ks) == [HIT] * 3
    assert store(m, c, ks) == []  # already on the host: nothing to store
    m.on_request_finished(c)
    check_drained(m)


def test_a_completion_may_cover_chunks_already_stored() -> None:
    # vLLM's connector completes a store job with the keys it offered
    m = manager(4)
    a = keys("a", 2)
    c = ctx("r", a)
    assert store(m, c, a[:1]) == a[:1]
    out = m.prepare_store(a, c)
    assert out is not None and out.keys_to_store == a[1:]
    m.complete_store(a, c)
    assert looks(m, a) == [HIT, HIT]
    assert m.in_flight() == 0 and m.get_stats().reduce()[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC] == 0.0
    m.on_request_finished(c)
    check_drained(m)


def test_a_completion_covering_part_of_a_store_raises_and_changes_nothing() -> None:
    m = manager(4)
    ks, whole = keys("a", 2), keys("w", 1)
    c, cw = ctx("r", ks), ctx("rw", whole)
    assert m.prepare_store(whole, cw) is not None and m.prepare_store(ks, c) is not None
    # one store covered whole, the other in part: neither is settled
    with pytest.raises(UsageError, match="cover 1 of the 2 chunks"):
        m.complete_store(whole + ks[:1], c)
    assert looks(m, whole + ks) == [PENDING] * 3
    m.complete_store(ks, c)
    assert looks(m, whole + ks) == [PENDING, HIT, HIT]
    m.complete_store(whole, cw)
    assert looks(m, whole) == [HIT]


def test_a_chain_continues_from_its_parent_chunk_and_an_orphan_hangs_from_the_root() -> None:
    m = manager(8)
    ks = keys("a", 4)
    c = ctx("r", ks)
    store(m, c, ks[:2])
    assert store(m, c, ks[2:]) == ks[2:]  # parent chunk 1 known from the request's positions
    (node,) = {m.tier.resolve(k) for k in ks[2:]}
    assert node is not None and node.depth == 4
    orphan = keys("b", 3)
    c2 = ctx("r2", orphan)
    c2.set_offload_key_position(orphan[1], 2 * T)
    m.lookup(orphan[1], c2)  # (a MISS: chunk 1 of b may be in vLLM's GPU cache only)
    assert store(m, c2, orphan[2:]) == orphan[2:]
    n2 = m.tier.resolve(orphan[2])
    assert n2 is not None and n2.depth == 1 and m.lookup(orphan[2], c2) is HIT


def test_a_run_is_stored_while_its_parent_chunk_is_still_being_written() -> None:
    # chunked prefill with late acks: the tail's parent is still being written when the
    # tail is offered; refusing it would lose the tail (vLLM stops retrying at the finish)
    m = manager(6)
    ks = keys("a", 4)
    c = ctx("r", ks)
    head = m.prepare_store(ks[:2], c)
    tail = m.prepare_store(ks[2:], c)
    assert head is not None and tail is not None and tail.keys_to_store == ks[2:]
    m.complete_store(ks[2:], c)  # acks out of order
    m.complete_store(ks[:2], c)
    assert looks(m, ks) == [HIT] * 4
    out = m.prepare_store(keys("x", 4), ctx("x"))  # 2 free: 2 evicted, tail first
    assert out is not None and sorted(out.evicted_keys) == sorted(ks[2:])
    assert looks(m, ks) == [HIT, HIT, MISS, MISS]
    m.check_invariants()


# ---------------------------------------------------------------------- refusals
def test_a_refused_store_changes_nothing_stored() -> None:
    m = manager(4, enable_events=True)
    a = keys("a", 2)
    b = keys("b", 2)
    store(m, ctx("ra", a), a)
    assert m.prepare_store(b, ctx("rb", b)) is not None  # in flight: not evictable
    list(m.take_events())
    c = keys("c", 3)
    assert m.prepare_store(c, ctx("rc", c)) is None  # 2 evictable < 3
    assert looks(m, a) == [HIT, HIT] and looks(m, b) == [PENDING, PENDING] and looks(m, c) == [MISS] * 3
    assert m.host_chunks_used() == 4 and list(m.take_events()) == [] and m.evicted_chunks == 0
    m.check_invariants()


def test_a_store_is_refused_when_a_pinned_tail_keeps_its_prefix() -> None:
    # the room check counts the chunks above a pinned one as kept (eviction takes leaves)
    m = manager(4)
    a = keys("a", 3)
    ca = ctx("ra", a)
    store(m, ca, a)
    m.prepare_load(a[2:], ca)  # pins the tail: its prefix cannot go either
    assert m.prepare_store(keys("b", 2), ctx("rb")) is None
    assert looks(m, a) == [HIT] * 3
    m.complete_load(a[2:], ca)
    assert m.prepare_store(keys("b", 2), ctx("rb")) is not None


# ---------------------------------------------------------------------- eviction order
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
    assert store(m, cc, c) == c  # evicted b, the unpinned chain
    assert looks(m, b) == [MISS, MISS] and looks(m, a) == [HIT, HIT]
    d = keys("d", 3)
    assert m.prepare_store(d, ctx("rd", d)) is None  # a pinned, c evictable: 2 < 3
    assert looks(m, c) == [HIT, HIT]  # the refusal evicted nothing
    m.complete_load(a, ca)
    for r in (ca, cb, cc, ctx("rd")):
        m.on_request_finished(r)
    check_drained(m)


def test_eviction_keeps_a_shared_prefix_while_its_tails_go() -> None:
    m = manager(6)
    sys_prompt = keys("sys", 2)
    tails = []
    for i in range(4):  # each request: the shared 2 chunks + 2 own chunks
        own = keys(f"t{i}", 2)
        tails.append(own)
        store(m, ctx(f"r{i}", sys_prompt + own), sys_prompt + own)
    assert looks(m, sys_prompt) == [HIT, HIT]
    assert looks(m, tails[-1]) == [HIT, HIT]
    assert looks(m, tails[0]) == [MISS, MISS]


def _gpu_served_head(m: KvtierOffloadingManager) -> tuple[list[bytes], list[bytes]]:
    """r1 stores a0 a1 (one node), r2 stores b0 b1, then r3, whose GPU prefix hit is a0,
    loads a1 and stores a2 below it: a0 is not used again (vLLM never asks for it)."""
    a, b = keys("a", 3), keys("b", 2)
    for rid, ks in (("r1", a[:2]), ("r2", b)):
        c = ctx(rid, ks)
        store(m, c, ks)
        m.on_request_finished(c)
    c3 = ctx("r3", a[1:], first=1)
    assert m.lookup(a[1], c3) is HIT
    m.prepare_load(a[1:2], c3)
    m.complete_load(a[1:2], c3)
    assert store(m, c3, a[1:]) == a[2:]
    m.on_request_finished(c3)
    return a, b


def test_a_head_the_gpu_serves_ages_and_goes_with_its_tails_before_a_run_used_later() -> None:
    # vLLM's lru ranks each chunk by its own uses: a0 is its oldest chunk. kvtier's host
    # stays prefix-closed, so a0's tails go first (deepest first), then a0; b, used after
    # a0, stays (the core's path-stamped lru kept a0 as recent as a2 and evicted b)
    m = manager(5)
    a, b = _gpu_served_head(m)
    assert [n.key for n in map(m.tier.resolve, a)] == [(a[0],), (a[1],), (a[2],)]  # the load cut a0 off a1
    out = m.prepare_store(keys("c", 1), ctx("rc"))
    assert out is not None and out.evicted_keys == [a[2]]
    out = m.prepare_store(keys("d", 2), ctx("rd"))
    assert out is not None and out.evicted_keys == [a[1], a[0]]
    assert looks(m, b) == [HIT, HIT] and looks(m, a) == [MISS] * 3
    m.check_invariants()


def test_a_pinned_tail_keeps_its_head_and_the_head_goes_next_once_released() -> None:
    m = manager(5)
    a, b = _gpu_served_head(m)
    c = ctx("r4", a[1:], first=1)
    m.prepare_load(a[1:], c)  # pins a1 a2 (now more recent than b): a0 cannot go
    out = m.prepare_store(keys("c", 1), ctx("rc"))
    assert out is not None and out.evicted_keys == [b[1]]
    m.complete_load(a[1:], c)
    m.on_request_finished(c)
    out = m.prepare_store(keys("d", 1), ctx("rd"))  # a0 is still the oldest: a tail of it goes
    assert out is not None and out.evicted_keys == [a[2]]
    assert looks(m, [b[0], a[0], a[1]]) == [HIT, HIT, HIT]
    m.check_invariants()


def test_a_running_request_ranks_its_chunks_by_token_position_tails_first() -> None:
    # vLLM's lru: the chunks a running request stored, in any order, go tail first
    m = manager(3)
    h, mid, t = keys("a", 3)
    c = ctx("r", [h, mid, t])
    for k in (h, t, mid):  # t is stored before its parent: a tree of its own
        store(m, c, [k])
    out = m.prepare_store(keys("x", 1), ctx("x"))
    assert out is not None and out.evicted_keys == [t]


def test_a_finished_request_becomes_more_recent_than_one_still_running() -> None:
    # vLLM's lru ranks a request at its first use and commits new ranks when it finishes
    m = manager(2)
    a, b = keys("a", 1), keys("b", 1)
    ca, cb = ctx("ra", a), ctx("rb", b)
    store(m, ca, a)
    store(m, cb, b)  # rb is ranked after ra
    m.on_request_finished(ca)  # ra's chunks now rank above rb's, still running
    out = m.prepare_store(keys("x", 1), ctx("x"))
    assert out is not None and out.evicted_keys == b
    assert looks(m, a) == [HIT]


def test_check_invariants_finds_a_host_chunk_the_eviction_order_lost() -> None:
    m = manager(4)
    a = keys("a", 2)
    store(m, ctx("r", a), a)
    m.check_invariants()
    node = m.tier.resolve(a[0])
    assert node is not None
    del m.tier.victims._at[node.node_id]  # (a corruption: the node is no longer an eviction candidate)
    with pytest.raises(KvtierError, match="have no heap entry"):
        m.check_invariants()


def test_two_full_attention_groups_evict_both_tails_first() -> None:
    # one radix path per prefix across groups: chunk i of every group before chunk i + 1
    m = KvtierOffloadingManager(4, tokens_per_chunk={0: T, 1: T})
    h0, t0 = keys("g0", 2, group=0)
    h1, t1 = keys("g1", 2, group=1)
    c = ReqContext(req_id="r")
    for k, pos in ((h0, T), (t0, 2 * T), (h1, T), (t1, 2 * T)):
        c.set_offload_key_position(k, pos)
    store(m, c, [h0, t0, h1, t1])
    out = m.prepare_store(keys("x", 2), ctx("x"))
    assert out is not None and sorted(out.evicted_keys) == sorted([t0, t1])
    assert looks(m, [h0, h1, t0, t1]) == [HIT, HIT, MISS, MISS]


def test_keys_without_positions_lose_their_tail_first() -> None:
    # keys offered in one call without token positions are taken in offer order, head first
    m = manager(3)
    a = keys("a", 3)
    store(m, ReqContext(req_id="r"), a)
    out = m.prepare_store(keys("x", 1), ReqContext(req_id="x"))
    assert out is not None and out.evicted_keys == [a[2]]
    assert looks(m, a) == [HIT, HIT, MISS]


def test_eviction_is_exact_and_reports_the_evicted_keys_and_removal_events() -> None:
    m = manager(4, enable_events=True)
    a = keys("a", 4)
    ca = ctx("ra", a)
    assert store(m, ca, a) == a  # one node of 4 chunks
    b = keys("b", 1)
    out = m.prepare_store(b, ctx("rb", b))
    assert out is not None and out.keys_to_store == b
    assert out.evicted_keys == [a[3]]  # the leaf is split: only its deepest chunk goes
    assert looks(m, a) == [HIT, HIT, HIT, MISS]
    m.complete_store(b, ctx("rb", b))
    events = list(m.take_events())
    assert [(sorted(e.keys), e.removed) for e in events] == [(sorted(a), False), ([a[3]], True), (b, False)]
    assert list(m.take_events()) == []
    assert m.evicted_chunks == 1 and m.host_chunks_used() == 4
    m.check_invariants()  # (no chunk is left with only a staging copy)


def test_acknowledged_chunks_stay_backed_and_a_store_touches_only_its_new_node() -> None:
    m = manager(64)
    sys_prompt = keys("sys", 2)
    store(m, ctx("s", sys_prompt), sys_prompt)
    for i in range(6):
        ks = sys_prompt + keys(f"t{i}", 2)
        c = ctx(f"r{i}", ks)
        before = m.core.stats.triggers
        assert store(m, c, ks) == ks[2:]
        # create, submit, ack of the one new node: the prefix is neither republished nor demoted
        assert m.core.stats.triggers - before == 3
    hub = m.tier.resolve(sys_prompt[0])
    assert hub is not None and hub.state == "backed" and len(hub.children) == 6


# ---------------------------------------------------------------------- stats
def test_usage_gauges_count_chunks_held_by_transfers() -> None:
    m = manager(4)
    a, b = keys("a", 2), keys("b", 1)
    ca = ctx("ra", a)
    store(m, ca, a)
    assert gauges(m) == (0.0, 0.0, 0.0)  # acknowledged chunks are idle: not "used"
    m.prepare_load(a, ca)
    assert m.prepare_store(b, ctx("rb", b)) is not None
    assert gauges(m) == (0.75, 0.25, 0.5)
    m.complete_load(a, ca)
    m.complete_store(b, ctx("rb", b))
    assert gauges(m) == (0.0, 0.0, 0.0)
    assert gauges(KvtierOffloadingManager(0)) == (0.0, 0.0, 0.0)


def test_a_refused_store_counts_in_the_allocation_size_histogram() -> None:
    m = manager(1)
    assert m.prepare_store(keys("a", 1), ctx("ra")) is not None
    m.get_stats()
    assert m.prepare_store(keys("b", 1), ctx("rb")) is None
    reduced = m.get_stats().reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 1
    assert m.refused_stores == 1


def test_store_threshold_stores_a_chunk_on_its_second_offer_and_get_stats_reports() -> None:
    m = manager(8, store_threshold=2)
    ks = keys("a", 3)
    c = ctx("r", ks)
    out = m.prepare_store(ks, c)
    assert out is not None and out.keys_to_store == []  # first offer: counted, not stored
    assert store(m, c, ks) == ks
    _, values = m.get_stats().metric_sections()
    assert values[CPUOffloadingMetrics.STORES_SKIPPED][()] == 3
    assert values[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE][()] == [3]
    _, values = m.get_stats().metric_sections()  # the batch counters reset
    assert values[CPUOffloadingMetrics.STORES_SKIPPED][()] == 0
    with pytest.raises(ConfigError, match="store_threshold"):
        manager(8, store_threshold=0)


# ---------------------------------------------------------------------- bad calls
def _state(m: KvtierOffloadingManager, probe: list[bytes]) -> tuple[object, ...]:
    m.check_invariants()
    return (m.tracked_requests(), m.in_flight(), m.host_chunks_used(), tuple(looks(m, probe)),
            m.core.stats.triggers, len(m.core.nodes()))


BAD_CALLS = {
    "a key listed twice": lambda m, a, b: m.prepare_store([b[0], b[1], b[0]], ctx("bad", b)),
    "success not a bool": lambda m, a, b: m.complete_store(b, ctx("rb", b), success="yes"),
    "load of chunks never stored": lambda m, a, b: m.prepare_load(keys("never", 2), ctx("bad")),
    "load of a chunk being stored": lambda m, a, b: m.prepare_load(b, ctx("bad")),
    "store of keys that are not bytes": lambda m, a, b: m.prepare_store([1, 2], ctx("bad")),
    "store of a bytes object, not a collection": lambda m, a, b: m.prepare_store(b[0], ctx("bad")),
    "lookup of an int": lambda m, a, b: m.lookup(12345, ctx("bad")),
    "lookup of a key shorter than its group index": lambda m, a, b: m.lookup(b"abc", ctx("bad")),
    "lookup of a str key": lambda m, a, b: m.lookup("key-0001", ctx("bad")),
    "store with one key shorter than its group index": lambda m, a, b: m.prepare_store([*keys("c", 2), b"ab"],
                                                                                        ctx("bad")),
    "store with one str key among bytes keys": lambda m, a, b: m.prepare_store([*keys("c", 2), "key-0001"],
                                                                                 ctx("bad")),
    "completion with one key shorter than its group index": lambda m, a, b: m.complete_store([*b, b"ab"],
                                                                                              ctx("rb", b)),
    "lookup without a ReqContext": lambda m, a, b: m.lookup(a[0], "r"),
    "completion of a load never prepared": lambda m, a, b: m.complete_load(a, ctx("bad")),
    "completion of keys never stored": lambda m, a, b: m.complete_store(keys("never", 1), ctx("bad")),
    "touch of keys that are not bytes": lambda m, a, b: m.touch(["k"], ctx("bad")),
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
def test_a_bad_call_raises_a_usage_error_and_changes_nothing(call: str) -> None:
    m = manager(8)
    a, b = keys("a", 2), keys("b", 2)
    store(m, ctx("ra", a), a)
    assert m.prepare_store(b, ctx("rb", b)) is not None  # in flight
    before = _state(m, a + b)
    with pytest.raises(UsageError):
        BAD_CALLS[call](m, a, b)
    assert _state(m, a + b) == before
    m.complete_store(b, ctx("rb", b))  # the store in flight is still completable
    assert looks(m, b) == [HIT, HIT]
    assert m.prepare_store(keys("c", 2), ctx("rc")) is not None


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tokens_per_chunk": 16}, "tokens_per_chunk must be a mapping of group id to tokens, got 16"),
    ({"tokens_per_chunk": {0: "16"}}, "tokens_per_chunk[0] must be an int >= 1, got '16'"),
    ({"sliding_window_groups": 1}, "sliding_window_groups must be a collection of int group ids, got 1"),
    ({"sliding_window_groups": "01"}, "sliding_window_groups must be a collection of int group ids, got '01'"),
    ({"sliding_window_groups": [None]}, "sliding_window_groups must be a collection of int group ids, got [None]"),
    ({"enable_events": "yes"}, "enable_events must be a bool, got 'yes'"),
    ({"chain": 1}, "chain must be a bool, got 1"),
    ({"staging_chunks": -1}, "staging_chunks must be None or an int >= 0, got -1"),
    ({"staging_chunks": 2.0}, "staging_chunks must be None or an int >= 0, got 2.0"),
    ({"max_tracker_size": True}, "max_tracker_size must be an int >= 1, got True"),
    ({"eviction": 3}, "eviction policy must be one of"),
])
def test_bad_constructor_arguments_raise_config_errors_naming_them(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        KvtierOffloadingManager(8, **kwargs)
    assert fragment in str(info.value)


def test_zero_host_chunks_refuse_every_store() -> None:
    m = KvtierOffloadingManager(0)
    assert m.prepare_store(keys("a", 1), ctx("r")) is None
    with pytest.raises(ConfigError, match="num_chunks"):
        KvtierOffloadingManager(-1)
