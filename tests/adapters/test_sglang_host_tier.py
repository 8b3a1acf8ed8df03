"""kvtier's SGLang cache on real SGLang pools: the host tier, write_back eviction, loadback
into fresh KV pool indices with the bytes moved (KVPoolCopier), locks, sizes and misuse."""

import pytest
from sglang_guard import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from kvtier.adapters.sglang import KvtierRadixCache  # noqa: E402
from kvtier.adapters.sglang_pages import KVPoolCopier  # noqa: E402
from kvtier.fsm import ConfigError, UsageError  # noqa: E402

pytestmark = pytest.mark.sglang


def build(policy, device=16, host=64, page_size=1):
    rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=device, page_size=page_size, dtype=torch.float32, head_num=1, head_dim=2,
                          layer_num=2, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=device, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page_size,
                             disable=False)
    cache = KvtierRadixCache(params, host_pages=host, write_policy=policy,
                             executor=KVPoolCopier(kv, host, page_size), num_layers=2)
    return cache, kv, alloc


def fill(kv, idx):
    for layer in range(2):
        kv.k_buffer[layer][idx] = torch.arange(2 * len(idx), dtype=torch.float32).reshape(-1, 1, 2) + 100 * layer
        kv.v_buffer[layer][idx] = -kv.k_buffer[layer][idx]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefix_loads_back_with_its_bytes_into_new_indices(policy):
    cache, kv, alloc = build(policy)
    idx = alloc.alloc(6)
    fill(kv, idx)
    want_k = [kv.k_buffer[layer][idx].clone() for layer in range(2)]
    assert cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6]), value=idx)).prefix_len == 0
    cache.check_hicache_events()
    assert alloc.available_size() == 10 and cache.total_size() == 6
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6
    assert alloc.available_size() == 16 and cache.total_size() == 0 and cache.host_size() == 6
    kv.k_buffer[0][idx] = 0.0  # the freed slots are reused by someone else
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7])))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 6)
    assert cache.load_back(m.best_match_node)
    cache.ready_to_load_host_cache()
    cache.loading_check()
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7])))
    assert (m.device_prefix_len, m.host_hit_length) == (6, 0)
    new = cache.path_device_indices(m.last_device_node)
    assert alloc.available_size() == 10
    for layer in range(2):
        torch.testing.assert_close(kv.k_buffer[layer][new], want_k[layer])
    assert not cache.has_pending_cache_operations()
    cache.core.check_invariants()


def test_locked_prefix_is_not_evicted_and_dec_lock_ref_twice_raises():
    cache, kv, alloc = build("write_through")
    idx = alloc.alloc(4)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=idx))
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 0)
    assert cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 0
    cache.dec_lock_ref(node)
    with pytest.raises(UsageError, match="holds no lock"):
        cache.dec_lock_ref(node)
    assert cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4


def test_insert_over_a_cached_prefix_reports_it_and_keeps_the_tree_copy():
    cache, kv, alloc = build("write_through", host=0)
    first = alloc.alloc(3)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=first))
    second = alloc.alloc(5)
    res = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=second))
    assert res.prefix_len == 3  # the caller frees second[:3], as with SGLang's tree
    alloc.free(second[:3])
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5])))
    assert cache.path_device_indices(m.last_device_node).tolist() == first.tolist() + second[3:].tolist()
    assert cache.load_back(m.last_device_node) is False  # no host tier


def test_a_write_back_evict_writes_a_chain_level_by_level_and_frees_it_in_one_call():
    """Under write_back a device leaf is written back (its parent first) before it is
    demoted. Where the host cannot take the whole tree in one operation, the chain goes a
    level a round; evict keeps going while copies move, so one call frees the demand, as
    HiCache's evict does (the 5-token leaf does not fit beside the rest and is dropped)."""
    cache, kv, alloc = build("write_back", device=16, host=6)
    a = alloc.alloc(2)
    cache.insert(InsertParams(key=RadixKey([1, 2]), value=a))
    b = alloc.alloc(6)
    value = torch.cat([a[:1], b[1:]])
    assert cache.insert(InsertParams(key=RadixKey([1, 3, 4, 5, 6, 7]), value=value)).prefix_len == 1
    alloc.free(b[:1])
    assert (alloc.available_size(), cache.total_size()) == (9, 7)
    assert cache.evict(EvictParams(num_tokens=16)).num_tokens_evicted == 7
    assert (alloc.available_size(), cache.total_size(), cache.host_size()) == (16, 0, 2)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 2)


def test_bad_configuration_is_refused():
    with pytest.raises(ConfigError, match="write_policy"):
        KvtierRadixCache.create_simulated(write_policy="sometimes")
    with pytest.raises(ConfigError, match="eviction"):
        KvtierRadixCache.create_simulated(eviction="mru")
    with pytest.raises(ConfigError, match="KV events"):
        KvtierRadixCache.create_simulated(enable_kv_cache_events=True)
    with pytest.raises(UsageError, match="RadixKey"):
        KvtierRadixCache.create_simulated().match_prefix(MatchPrefixParams(key=[1, 2]))


@pytest.mark.parametrize("kwargs", [{"page_size": "4"}, {"page_size": 2.0}, {"page_size": True}, {"page_size": 0},
                                    {"num_layers": "8"}, {"device_pages": 0}, {"write_threshold": 1.5}])
def test_a_size_that_is_not_a_positive_int_is_refused_by_name(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ConfigError, match=f"{name} must be a positive int, got {value!r}"):
        KvtierRadixCache.create_simulated(**kwargs)


def test_numpy_integer_sizes_are_taken_as_ints():
    import numpy as np

    cache = KvtierRadixCache.create_simulated(page_size=np.int64(2), num_layers=np.int32(4))
    assert (cache.page_size, type(cache.page_size), cache.num_layers) == (2, int, 4)


def _to_host(cache, alloc, tokens):
    cache.insert(InsertParams(key=RadixKey(tokens), value=alloc.alloc(len(tokens))))
    cache.check_hicache_events()
    assert cache.evict(EvictParams(num_tokens=len(tokens))).num_tokens_evicted == len(tokens)


def _load(cache, tokens):
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert cache.load_back(m.best_match_node)
    cache.ready_to_load_host_cache()
    cache.loading_check()
    return m


def test_write_back_host_eviction_takes_a_passed_by_leaf_under_a_loaded_duplicate_before_older_copies():
    cache, kv, alloc = build("write_back")
    assert cache.exclusive  # write_back's default
    _to_host(cache, alloc, [7, 8])  # the oldest host copy
    _to_host(cache, alloc, [1, 2, 3, 4])  # a previous turn
    assert cache.host_size() == 6
    m = _load(cache, [1, 2, 3, 9])  # the next turn diverges at its last page: [4] stays on the host
    assert m.host_hit_length == 3 and cache.total_size() == 3
    freed = cache.core.evict_host({"kv": 4})
    assert freed == {"kv": 4}  # [4], then the duplicate copy of [1, 2, 3] it held
    assert cache.host_size() == 2
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([7, 8])))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 2)  # the older copy kept
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4])))
    assert (m.device_prefix_len, m.host_hit_length) == (3, 0)
    cache.core.check_invariants()


def test_load_back_keeps_its_host_copies_through_the_eviction_that_makes_room():
    cache, kv, alloc = build("write_back", device=4, host=4)
    _to_host(cache, alloc, [1, 2, 3])
    idx = alloc.alloc(4)  # the device full of one unpublished request
    cache.insert(InsertParams(key=RadixKey([5, 6, 7, 8]), value=idx))
    # loading [1, 2, 3] back evicts [5, 6, 7, 8]: under write_back it is written to the
    # full host first, which must not take the copies being loaded
    m = _load(cache, [1, 2, 3, 4])
    assert m.host_hit_length == 3
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3])))
    assert m.device_prefix_len == 3
    cache.core.check_invariants()


def test_evict_rounds_a_token_demand_up_to_whole_pages():
    # SGLang asks for the tokens its allocator is short of; with pages of 2 tokens a demand of 3
    # must free two pages (4 tokens), or the allocation that asked still fails
    cache, kv, alloc = build("write_through", page_size=2)
    idx = alloc.alloc(6)
    assert cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6]), value=idx)).prefix_len == 0
    cache.check_hicache_events()
    assert cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 4
    assert cache.total_size() == 2 and alloc.available_size() == 14
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 2
    assert cache.total_size() == 0 and cache.host_size() == 6
    cache.core.check_invariants()


@pytest.mark.parametrize("node, quota, fragment", [
    (None, None, "load_back: node must be a node of this cache (match_prefix's), got None"),
    (5, None, "load_back: node must be a node of this cache (match_prefix's), got 5"),
    ("leaf", "x", "load_back: mem_quota must be None or an int (tokens), got 'x'"),
    ("leaf", 2.5, "load_back: mem_quota must be None or an int (tokens), got 2.5"),
])
def test_load_back_of_something_not_a_node_or_a_bad_quota_names_it_and_changes_nothing(node, quota, fragment):
    cache = KvtierRadixCache.create_simulated(host_pages=16)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=torch.tensor([10, 11, 12, 13])))
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node
    pending = cache.has_pending_cache_operations()  # the insert's write-through
    with pytest.raises(UsageError) as info:
        cache.load_back(leaf if node == "leaf" else node, quota)
    assert fragment in str(info.value)
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (4, 0, 4)
    assert cache.has_pending_cache_operations() == pending
