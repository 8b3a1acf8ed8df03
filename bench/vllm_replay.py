"""Hit rate and scheduler-side time of kvtier's vLLM offloading manager against vLLM's own
CPUOffloadingManager (lru, arc), on the Mooncake conversation trace, through vLLM's real
KVCacheManager with the connector scheduler's call order (kvtier.adapters.vllm_kit).

Metadata only (no bytes), one request at a time, prompt only, instant transfers, 512-token
blocks = offload chunks, as the peers' replays in bench/RESULTS.md. Needs kvtier[vllm].

The managers run in lockstep: each request goes through every manager (each with its own
KVCacheManager) before the next request, in an order that rotates per request, so their
times are measured under the same machine load and their ratios compare within one run.
Block hashes are computed once per request and shared (``hash us`` is that one hashing).

    python bench/vllm_replay.py TRACE [--limit N] [--device 4000] [--host-ratio 2 8]
        [--eviction lru] [--json OUT]

Prints one Markdown table row per (manager, host size) and the ratios kvtier / vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from kvtier.adapters.vllm import KvtierOffloadingManager
from kvtier.adapters.vllm_kit import Replayer, SharedHasher
from kvtier.replay.trace import load_trace
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # after vllm_kit (its stubs)

MANAGERS = ("kvtier", "vLLM lru", "vLLM arc")


def run_ratio(recs: list[Any], device: int, ratio: int, eviction: str, every: int) -> list[dict[str, Any]]:
    host = device * ratio
    hasher = SharedHasher(len(MANAGERS))
    makers = {
        "kvtier": lambda: KvtierOffloadingManager(host, tokens_per_chunk={0: 512}, eviction=eviction),
        "vLLM lru": lambda: CPUOffloadingManager(num_chunks=host, cache_policy="lru"),
        "vLLM arc": lambda: CPUOffloadingManager(num_chunks=host, cache_policy="arc"),
    }
    players = [Replayer(makers[m](), device, block_hasher=hasher) for m in MANAGERS]
    t0 = time.perf_counter()
    loads = []
    for i, rec in enumerate(recs):
        k = i % len(players)
        for p in players[k:] + players[:k]:
            p.step(str(i), rec)
        if every and (i + 1) % every == 0:
            loads.append(os.getloadavg()[0])
            print(f"x{ratio}: {i + 1} requests, {time.perf_counter() - t0:.0f} s, "
                  + ", ".join(f"{m} {100 * p.result()['total_hit']:.2f} %" for m, p in zip(MANAGERS, players)),
                  file=sys.stderr, flush=True)
    rows = []
    for m, p in zip(MANAGERS, players):
        r = p.result()
        r.update(manager=m, host_ratio=ratio, host_chunks=host, hash_us=hasher.hash_s / max(1, len(recs)) * 1e6,
                 wall_s=time.perf_counter() - t0, load=max(loads, default=os.getloadavg()[0]),
                 eviction=eviction if m == "kvtier" else None)
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", type=int, default=4000)
    ap.add_argument("--host-ratio", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--eviction", default="lru", help="kvtier's host eviction policy (lru, lru2)")
    ap.add_argument("--progress", type=int, default=1000, help="print progress every N requests (0: never)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    recs = load_trace(a.trace, limit=a.limit).requests
    print(f"{len(recs)} requests, device {a.device} blocks of 512 tokens; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores ({platform.processor() or platform.machine()})",
          file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for ratio in a.host_ratio:
        for r in run_ratio(recs, a.device, ratio, a.eviction, a.progress):
            rows.append(r)
            print(f"| {r['manager']} | x{ratio} ({r['host_chunks']:,}) | {100 * r['device_hit']:.2f} % | "
                  f"{100 * r['host_hit']:.2f} % | {100 * r['total_hit']:.2f} % | {r['manager_us']:.0f} | "
                  f"{r['kvm_us']:.0f} | {r['hash_us']:.0f} | {r['refused_stores']} |", flush=True)
    for ratio in a.host_ratio:
        k = next(r for r in rows if r["manager"] == "kvtier" and r["host_ratio"] == ratio)
        for other in MANAGERS[1:]:
            o = next(r for r in rows if r["manager"] == other and r["host_ratio"] == ratio)
            print(f"x{ratio}: kvtier / {other}: hit {k['total_hit'] / o['total_hit']:.4f} "
                  f"({100 * (k['total_hit'] - o['total_hit']):+.2f} points), "
                  f"manager time {k['manager_us'] / o['manager_us']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
