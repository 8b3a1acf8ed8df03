"""Hit rate and scheduler-side time of kvtier's vLLM offloading manager against vLLM's own
CPUOffloadingManager (lru, arc), on the Mooncake conversation trace, through vLLM's real
KVCacheManager with the connector scheduler's call order (kvtier.adapters.vllm_kit).

Metadata only (no bytes), one request at a time, prompt only, instant transfers, 512-token
blocks = offload chunks, as the peers' replays in bench/RESULTS.md. Needs kvtier[vllm].

    python bench/vllm_replay.py TRACE [--limit N] [--device 4000] [--host-ratio 2 8] [--json OUT]

Prints one Markdown table row per (manager, host size) and the ratios kvtier / vLLM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from kvtier.adapters.vllm import KvtierOffloadingManager
from kvtier.adapters.vllm_kit import replay
from kvtier.trace import load_trace
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # after vllm_kit (its stubs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", type=int, default=4000)
    ap.add_argument("--host-ratio", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    recs = load_trace(a.trace, limit=a.limit).requests
    rows = []
    print(f"{len(recs)} requests, device {a.device} blocks of 512 tokens; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores ({platform.processor() or platform.machine()})",
          file=sys.stderr)
    for ratio in a.host_ratio:
        host = a.device * ratio
        makers = {
            "kvtier": lambda: KvtierOffloadingManager(host, tokens_per_chunk={0: 512}),
            "vLLM lru": lambda: CPUOffloadingManager(num_chunks=host, cache_policy="lru"),
            "vLLM arc": lambda: CPUOffloadingManager(num_chunks=host, cache_policy="arc"),
        }
        for name, mk in makers.items():
            t = time.perf_counter()
            r = replay(recs, mk, a.device)
            r.update(manager=name, host_ratio=ratio, host_chunks=host, wall_s=time.perf_counter() - t,
                     load=os.getloadavg()[0])
            rows.append(r)
            print(f"| {name} | x{ratio} ({host:,}) | {100 * r['device_hit']:.2f} % | {100 * r['host_hit']:.2f} % | "
                  f"{100 * r['total_hit']:.2f} % | {r['manager_us']:.0f} | {r['kvm_us']:.0f} | {r['hash_us']:.0f} | "
                  f"{r['refused_stores']} |", flush=True)
    for ratio in a.host_ratio:
        k = next(r for r in rows if r["manager"] == "kvtier" and r["host_ratio"] == ratio)
        for other in ("vLLM lru", "vLLM arc"):
            o = next(r for r in rows if r["manager"] == other and r["host_ratio"] == ratio)
            print(f"x{ratio}: kvtier / {other}: hit {k['total_hit'] / o['total_hit']:.4f}, "
                  f"manager time {k['manager_us'] / o['manager_us']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
