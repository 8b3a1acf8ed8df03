"""kvtier's SGLang cache driven through SGLang's own scheduler-side code on CPU, with real
``Req`` objects: the schedule policy's longest-prefix ordering (``SchedulePolicy.calc_priority``
-> ``match_kv_cache``), admission (``Req.init_next_round_input``), chunked prefill
(``checkpoint_kv_cache``), finish and retract (``release_kv_cache``). SGLang's ``RadixCache``
on the same pools is the control.

Where it stops: allocation for an extend (``ScheduleBatch.prepare_for_extend``) and the
forward pass need SGLang's model runner and its Triton / CUDA kernels; the test allocates the
row and the KV indices the way ``alloc_for_extend`` does (``ReqToTokenPool.alloc``,
``TokenToKVPoolAllocator.alloc``, ``ReqToTokenPool.write``), and no KV is computed.
"""

from array import array

import pytest
from sglang_guard import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from kvtier.adapters.sglang import KvtierRadixCache  # noqa: E402

pytestmark = pytest.mark.sglang

POOL = 64


@pytest.fixture(params=["sglang", "kvtier"])
def setup(request):
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1, device="cpu"))
    rtp = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32, head_num=1, head_dim=1, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=POOL, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1, disable=False)
    cache = RadixCache(params) if request.param == "sglang" else KvtierRadixCache(params, host_pages=4 * POOL)
    return cache, rtp, alloc


def new_req(rid, ids, max_new=4):
    req = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=max_new))
    return req


def admit(req, cache, rtp, alloc, upto=None):
    """What the scheduler does between matching and the forward pass of one extend."""
    req.init_next_round_input(cache)
    req.lock = cache.lock(req.last_node)
    if not req.kv.holds_kv:
        assert rtp.alloc([req]) is not None
    total = len(req.full_untruncated_fill_ids) if upto is None else upto
    have = req.kv.kv_allocated_len or req.prefix_len
    prefix = cache.prefix_device_indices(req) if req.kv.kv_allocated_len == 0 else torch.empty(0, dtype=torch.int64)
    new = alloc.alloc(total - have)
    assert new is not None
    rtp.write((req.kv.req_pool_idx, slice(have - len(prefix), total)), torch.cat([prefix, new]).to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = total
    req.extend_end = total
    return new


def finish(req, cache):
    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, cache, checkpoint=True)


def test_lpm_orders_by_cached_prefix_and_finish_publishes(setup):
    cache, rtp, alloc = setup
    first = new_req("a", list(range(1, 21)))
    admit(first, cache, rtp, alloc)
    finish(first, cache)
    assert alloc.available_size() == POOL - 20 and cache.evictable_size() == 20
    cold, warm = new_req("cold", list(range(100, 130))), new_req("warm", list(range(1, 16)) + [99, 98])
    queue = [cold, warm]
    SchedulePolicy("lpm", cache, False, False, False).calc_priority(queue)
    assert [r.rid for r in queue] == ["warm", "cold"]
    assert (warm.prefix_len, cold.prefix_len) == (15, 0)
    admit(warm, cache, rtp, alloc)
    assert cache.protected_size() == 15
    finish(warm, cache)
    assert cache.protected_size() == 0 and cache.evictable_size() == 22
    assert alloc.available_size() == POOL - 22


def test_chunked_prefill_checkpoints_then_finishes(setup):
    cache, rtp, alloc = setup
    req = new_req("c", list(range(1, 41)))
    admit(req, cache, rtp, alloc, upto=16)
    checkpoint_kv_cache(req, cache)  # cache_unfinished_req of SGLang's chunked prefill
    assert req.kv.cache_protected_len == 16 and cache.protected_size() == 16
    other = new_req("o", list(range(1, 11)))
    other.init_next_round_input(cache)
    assert other.prefix_len == 9  # the chunk is shared at once (SGLang leaves one token to compute)
    new = alloc.alloc(24)
    rtp.write((req.kv.req_pool_idx, slice(16, 40)), new.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = 40
    finish(req, cache)
    assert cache.protected_size() == 0 and cache.evictable_size() == 40
    assert alloc.available_size() == POOL - 40


def test_retract_keeps_the_computed_prefix_and_frees_the_row(setup):
    cache, rtp, alloc = setup
    req = new_req("r", list(range(1, 31)))
    admit(req, cache, rtp, alloc)
    release_kv_cache(req, cache, checkpoint=True)  # retract: the tree keeps what was computed
    assert not req.kv.holds_kv and cache.protected_size() == 0
    again = new_req("r2", list(range(1, 31)))
    again.init_next_round_input(cache)
    assert again.prefix_len == 29  # (SGLang leaves one token to compute)
    cache.evict(cache_evict_params(30))
    assert alloc.available_size() == POOL


def cache_evict_params(n):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return EvictParams(num_tokens=n)


def test_a_second_finish_or_a_checkpoint_after_finish_is_refused_and_changes_nothing(setup):
    # SGLang's release_kv_cache / checkpoint_kv_cache refuse both before calling the cache
    cache, rtp, alloc = setup
    req = new_req("a", list(range(1, 21)))
    admit(req, cache, rtp, alloc)
    finish(req, cache)
    sizes = (alloc.available_size(), cache.evictable_size(), cache.protected_size())
    assert sizes == (POOL - 20, 20, 0)
    with pytest.raises(AssertionError, match="freeing before alloc"):
        finish(req, cache)
    with pytest.raises(AssertionError, match="checkpointing finished request a"):
        checkpoint_kv_cache(req, cache)
    assert (alloc.available_size(), cache.evictable_size(), cache.protected_size()) == sizes
