"""The ``kvtier`` radix-cache backend: kvtier's plugin entry point registers it with SGLang's
registry, and its factory builds the cache from SGLang's ``TreeCacheBuildContext`` sized by
the server's HiCache flags."""

import importlib.metadata
import types

import pytest
from sglang_guard import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.registry import get_radix_cache_factory  # noqa: E402

from kvtier.adapters.sglang import KvtierRadixCache, register  # noqa: E402

pytestmark = pytest.mark.sglang


def test_the_plugin_entry_point_names_register():
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kvtier"]
    assert [ep.value for ep in eps] == ["kvtier.adapters.sglang:register"]
    assert eps[0].load() is register


def test_register_adds_the_backend_once_and_its_factory_sizes_the_host_tier():
    register()
    register()  # idempotent: SGLang's registry refuses a duplicate name
    factory = get_radix_cache_factory("kvtier")
    assert factory is not None
    kv = MHATokenToKVPool(size=100, page_size=1, dtype=torch.float32, head_num=1, head_dim=1, layer_num=2,
                          device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=100, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1, disable=False)
    server = types.SimpleNamespace(hicache_size=0, hicache_ratio=2.0, hicache_write_policy="write_back")
    ctx = types.SimpleNamespace(server_args=server, params=params, model_config=types.SimpleNamespace(num_hidden_layers=2))
    cache = factory(ctx)
    assert isinstance(cache, KvtierRadixCache)
    assert (cache.host_pages, cache.write_policy, cache.num_layers) == (200, "write_back", 2)
    device_only = factory(types.SimpleNamespace(server_args=types.SimpleNamespace(hicache_size=0, hicache_ratio=0),
                                                params=params, model_config=None))
    assert device_only.host_pages is None and not device_only.core.has_host


# ---------------------------------------------------------------------- bad calls at the boundary
def _filled() -> tuple[KvtierRadixCache, object]:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = KvtierRadixCache.create_simulated()
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=torch.tensor([10, 11, 12, 13])))
    return cache, cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node


def _sizes(cache: KvtierRadixCache) -> tuple[int, int, int]:
    return cache.evictable_size(), cache.protected_size(), cache.total_size()


@pytest.mark.parametrize("value, fragment", [
    (torch.tensor([20.0, 21.0]), "must hold integer KV indices, got a tensor of torch.float32"),
    (torch.tensor([True, False]), "must be 1-D integer KV indices, got shape (2,) of bool"),
    (torch.tensor([[20, 21]]), "must be 1-D integer KV indices, got shape (1, 2) of int64"),
    (torch.tensor([20, -1]), "KV indices must be >= 0, got -1"),
    (["a", "b"], "must be 1-D integer KV indices"),
    ([20], "value has 1 KV indices for a key of 2 tokens"),
])
def test_insert_with_kv_indices_of_the_wrong_dtype_shape_or_length_changes_nothing(value: object,
                                                                                 fragment: str) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvtier.fsm import UsageError

    cache, _ = _filled()
    before = _sizes(cache)
    with pytest.raises(UsageError) as info:
        cache.insert(InsertParams(key=RadixKey([7, 8]), value=value))
    assert fragment in str(info.value)
    assert _sizes(cache) == before == (4, 0, 4)
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([7, 8]))).device_prefix_len == 0
    cache.insert(InsertParams(key=RadixKey([7, 8]), value=torch.tensor([20, 21], dtype=torch.int32)))
    assert _sizes(cache) == (6, 0, 6)


@pytest.mark.parametrize("num", [2.5, float("nan"), float("inf"), "5", True, None])
def test_evict_of_a_non_integer_token_count_names_it_and_frees_nothing(num: object) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kvtier.fsm import UsageError

    cache, _ = _filled()
    with pytest.raises(UsageError, match=r"evict: num_tokens must be an int \(device tokens to free\), got "):
        cache.evict(EvictParams(num_tokens=num))
    assert _sizes(cache) == (4, 0, 4)
    assert cache.evict(EvictParams(num_tokens=-5)).num_tokens_evicted == 0
    import numpy as np

    assert cache.evict(EvictParams(num_tokens=np.int64(10**18))).num_tokens_evicted == 4 and _sizes(cache) == (0, 0, 0)


@pytest.mark.parametrize("method", ["inc_lock_ref", "dec_lock_ref"])
@pytest.mark.parametrize("node", [None, 3, "node"])
def test_lock_calls_on_something_not_a_node_name_it_and_change_nothing(method: str, node: object) -> None:
    from kvtier.fsm import UsageError

    cache, _ = _filled()
    with pytest.raises(UsageError, match=rf"{method}: node must be a node of this cache \(match_prefix's\), got "):
        getattr(cache, method)(node)
    assert _sizes(cache) == (4, 0, 4)
    with pytest.raises(UsageError, match="path_device_indices: node must be a node of this cache, got "):
        cache.path_device_indices(node)


def test_dec_lock_ref_on_a_node_never_locked_or_twice_raises_and_changes_nothing() -> None:
    from kvtier.fsm import UsageError

    cache, node = _filled()
    with pytest.raises(UsageError, match="holds no lock of this cache"):
        cache.dec_lock_ref(node)
    cache.inc_lock_ref(node)
    assert _sizes(cache) == (0, 4, 4)
    cache.dec_lock_ref(node)
    with pytest.raises(UsageError, match="holds no lock of this cache"):
        cache.dec_lock_ref(node)
    assert _sizes(cache) == (4, 0, 4)


def test_dec_lock_ref_with_another_caches_node_of_the_same_id_raises_and_keeps_this_caches_lock() -> None:
    """Node ids start at 1 in every cache: an engine that runs two trees (one per model or
    per data-parallel rank) and passes the wrong one's node must not release this cache's lock."""
    from kvtier.fsm import UsageError

    cache, node = _filled()
    other, other_node = _filled()
    assert other_node.node_id == node.node_id
    cache.inc_lock_ref(node)
    other.inc_lock_ref(other_node)
    with pytest.raises(UsageError, match="holds no lock of this cache"):
        cache.dec_lock_ref(other_node)
    assert _sizes(cache) == (0, 4, 4) and node.lock_ref == 1
    cache.dec_lock_ref(node)
    other.dec_lock_ref(other_node)
    assert _sizes(cache) == (4, 0, 4) and _sizes(other) == (4, 0, 4)
