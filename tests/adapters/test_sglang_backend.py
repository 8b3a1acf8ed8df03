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
