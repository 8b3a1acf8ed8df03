"""kvtier's SGLang prefix cache beside SGLang's own HiCache, in one run, on the whole conversation trace.

    python bench/sglang_replay.py [TRACE] [--limit N] [--device 4000] [--ratios 8 2] [--record]

Both caches get the same SGLang pools (``ReqToTokenPool``, a 1-head/1-dim
``MHATokenToKVPool`` of ``device`` slots, its ``TokenToKVPoolAllocator``; one slot = one
512-token trace block, ``page_size=1``) and the same calls, in the order SGLang's scheduler
makes them per request (the peers' harness order): ``match_prefix -> [load_back(best_match_node)
-> ready_to_load_host_cache -> loading_check] -> lock -> [evict] -> alloc ->
path_device_indices -> insert(prev_prefix_len) -> unlock -> check_hicache_events``.

- SGLang: ``UnifiedRadixCache`` + ``init_hicache`` (host pool ``ratio x device``, SGLang's sizing),
  ``write_through`` and ``write_back``, ``hicache_io_backend=direct``,
  ``hicache_mem_layout=layer_first``, ``load_back_threshold=1``; its data path on a CPU torch is
  stubbed (cudaHostRegister, the direct copy kernels, ``torch.cpu.Stream.synchronize``: no bytes;
  its free-host-memory check, which keeps 10 GB aside, for pools of a few KB).
- kvtier: :class:`kvtier.adapters.sglang.KvtierRadixCache` with the same host pages and
  write policy, metadata-only transfers (:class:`~kvtier.adapters.sglang_pages.InstantCompletions`).

Hit rate is token-weighted (device + loaded host blocks over prompt tokens); the time is the
wall time inside the caches' calls (the allocator's ``alloc`` included for both).
SGLang is loaded as the sglang-marked tests load it (tests/sglang_guard.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from array import array
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from harness import provenance, record_section  # noqa: E402

TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 512


def load(path: Path, limit: int | None) -> list[tuple[tuple[int, ...], list[int]]]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            ids = tuple(row["hash_ids"])
            n = len(ids)
            out.append((ids, [BLOCK] * (n - 1) + [row["input_length"] - BLOCK * (n - 1)]))
    return out


def pools(device: int, ratio: float, policy: str):  # type: ignore[no-untyped-def]
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    sa = ServerArgs(model_path="dummy", page_size=1, device="cpu", hicache_ratio=ratio or None,
                    hicache_write_policy=policy, hicache_io_backend="direct", hicache_mem_layout="layer_first")
    set_global_server_args_for_scheduler(sa)
    rtp = ReqToTokenPool(size=4, max_context_len=512, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=device, page_size=1, dtype=torch.float32, head_num=1, head_dim=1, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=device, dtype=torch.float32, device="cpu", kvcache=kv, need_sort=False)
    params = CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1, disable=False,
                             tree_components=(ComponentType.FULL,), eviction_policy="lru")
    return sa, params, alloc


def stub_data_path() -> None:
    import torch

    import sglang.srt.mem_cache.pool_host.base as host_base
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as host_mha

    host_common._cuda_host_register = lambda buffer, granularity=None: None
    host_base.host_memory_budget_bytes = lambda requested: requested  # its pools here hold a few KB
    for name in ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"):
        setattr(host_mha, name, lambda *a, **k: None)
    torch.cpu.Stream.synchronize = lambda self: None


def replay(reqs, cache, alloc, cc=None) -> dict:  # type: ignore[no-untyped-def]
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    spent = 0.0
    clock = time.perf_counter
    total = dev_tok = host_tok = overflow = 0
    for ids, sizes in reqs:
        total += sum(sizes)
        key = RadixKey(array("q", ids))
        t0 = clock()
        m = cache.match_prefix(MatchPrefixParams(key=key))
        dev, host, node, loaded = m.device_prefix_len, m.host_hit_length, m.last_device_node, 0
        if host > 0 and cache.load_back(m.best_match_node):
            cache.ready_to_load_host_cache()
            if cc is not None:
                spent += clock() - t0
                for ack in list(cc.ack_load_queue):
                    ack.finish_event.synchronize()  # instant transfer (outside the timed calls)
                t0 = clock()
            cache.loading_check()
            node, loaded = m.best_match_node, host
        lock = cache.lock(node)
        need = len(ids) - dev - loaded
        avail = alloc.available_size()
        if avail < need:
            cache.evict(EvictParams(num_tokens=need - avail))
        new = alloc.alloc(need)
        if new is None:
            cache.unlock(lock)
            spent += clock() - t0
            overflow += 1
            continue
        prefix = cache.path_device_indices(node)
        cache.insert(InsertParams(key=key, value=torch.cat([prefix, new]), prev_prefix_len=dev + loaded))
        cache.unlock(lock)
        cache.check_hicache_events()
        spent += clock() - t0
        dev_tok += sum(sizes[:dev])
        host_tok += sum(sizes[dev:dev + loaded])
    return {"hit": (dev_tok + host_tok) / total, "device_hit": dev_tok / total, "host_hit": host_tok / total,
            "us_per_request": spent / len(reqs) * 1e6, "overflow": overflow}


def run(reqs, device: int, ratio: float, policy: str, evictions: list[str]):  # type: ignore[no-untyped-def]
    """HiCache, then kvtier with each eviction policy, on fresh pools of the same size."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from kvtier.adapters.sglang import KvtierRadixCache

    sa, params, alloc = pools(device, ratio, policy)
    sg = UnifiedRadixCache(params=params)
    sg.init_hicache(sa, params)
    sg.load_back_threshold = 1
    host = int(sg.cache_controller.mem_pool_host.size)
    theirs = replay(reqs, sg, alloc, sg.cache_controller)
    sg.release_host_resources()
    ours = {}
    for eviction in evictions:
        sa, params, alloc = pools(device, 0, policy)
        kv = KvtierRadixCache(params, host_pages=host, write_policy=policy, eviction=eviction)
        ours[eviction] = replay(reqs, kv, alloc)
        kv.core.check_invariants()
    return ours, theirs, host


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=TRACE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", type=int, nargs="+", default=[4000])
    ap.add_argument("--ratios", type=float, nargs="+", default=[8, 2])
    ap.add_argument("--eviction", nargs="+", default=["lru", "lru_turns"], help="kvtier's eviction policies")
    ap.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    a = ap.parse_args(argv)
    os.environ.setdefault("KVTIER_REQUIRE_SGLANG", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from sglang_guard import require_sglang

    require_sglang()
    stub_data_path()
    reqs = load(a.trace, a.limit)
    rows = ["| device | host | write policy | kvtier eviction | kvtier hit | HiCache hit | kvtier us/req | "
            "HiCache us/req | time kvtier / HiCache |", "|---|---|---|---|---|---|---|---|---|"]
    for dev in a.device:
        for ratio in a.ratios:
            for policy in ("write_through", "write_back"):
                ours, theirs, host = run(reqs, dev, ratio, policy, a.eviction)
                for eviction, r in ours.items():
                    rows.append(f"| {dev} | {host} (x{ratio:g}) | {policy} | {eviction} | {r['hit']:.2%} | "
                                f"{theirs['hit']:.2%} | {r['us_per_request']:.0f} | {theirs['us_per_request']:.0f} | "
                                f"{r['us_per_request'] / theirs['us_per_request']:.2f}x |")
                    print(rows[-1], flush=True)
    body = "\n".join([f"{len(reqs):,} requests of {a.trace.name}; one slot = one 512-token block; "
                      "the same SGLang pools and calls for both (bench/sglang_replay.py's docstring).", "",
                      *rows, "", provenance(sys.argv)])
    print(body)
    if a.record:
        record_section(HERE / "RESULTS.md", "sglang-replay", "kvtier inside SGLang beside HiCache (one run)", body)


if __name__ == "__main__":
    main()
