"""Hit rate and scheduler-side time of kvtier's vLLM offloading manager against vLLM's own
CPUOffloadingManager, side by side in one run, on the Mooncake conversation trace, inside
vLLM 0.33's real OffloadingConnectorScheduler and KVCacheManager (kvtier.adapters.vllm_kit).

Metadata only (no bytes), one request at a time, prompt only, instant transfers, 512-token
blocks = offload chunks. Each manager is configured as a vLLM user configures it
(kv_connector_extra_config through vLLM's OffloadingSpecFactory: kvtier's spec, or vLLM's
CPU spec with eviction_policy lru / arc). The managers run in lockstep: each request goes
through every manager (each with its own connector and KVCacheManager) before the next
request, in an order that rotates per request, so their times are measured under the same
machine load and their ratios compare within one run. Block hashes are computed once per
request and shared. Scheduler-side time: the time spent in the manager's calls. Python's
cyclic garbage collector runs between requests, outside every manager's timed calls (a
collection's pause would otherwise land on whichever call happens to trigger it); the
objects built before the replay are frozen out of it (gc.freeze, as vLLM's engine core does
after start-up).

    python bench/vllm_replay.py TRACE [--limit N] [--device 4000] [--host-ratio 2 8]
        [--arc] [--eviction lru [lru_turns ...]] [--audit] [--json OUT]

Prints one Markdown table row per (manager, host size) and the ratios kvtier / vLLM.

``--audit`` also sorts vLLM lru's host hits by the shape of its host set at the load
(:class:`OrphanAudit`): whether every chunk before a loaded chunk in its request was on the
host (a prefix-closed host tier, such as kvtier's, can make that hit), or whether some
were not (the tail's head was evicted from the host while the tail stayed; the GPU cache
held the head, or the head was stored again by a later request), and compares per request
with kvtier's host hits. The audit's bookkeeping runs inside vLLM lru's timed calls: read
no times from an audited run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from typing import Any

from kvtier.adapters.vllm_config import kvtier_extra_config
from kvtier.adapters.vllm_kit import Replayer, SharedHasher, cpu_extra_config
from kvtier.replay.trace import load_trace

BLOCK = 512
GC_EVERY = 50  # requests between young-generation garbage collections (untimed)
FULL_GC_EVERY = 2000  # requests between full ones


class OrphanAudit:
    """A manager, forwarded, that counts the chunks it stores (``stored``; ``stored_again``:
    chunks it had stored before and evicted) and, with ``classify`` (vLLM's CPU manager
    only), sorts each chunk it loads: ``closed`` (every earlier chunk of the request on the
    host at the load: a prefix-closed host tier can make that hit) or ``orphan`` (some
    earlier chunk not on the host; ``gpu_head``: that chunk in the request's GPU prefix hit);
    ``ever_orphaned``: an earlier chunk was evicted after this one was stored (the chunk was a
    tail without its head for a while), ``rereached``: of those, the ones ``closed`` at the
    load (the head was stored again). Counts are chunks."""

    def __init__(self, inner: Any, classify: bool = True) -> None:
        self.inner = inner
        self.classify = classify  # False: count stores only (any manager)
        self.now = 0  # the request index (set by the replay loop)
        self.tick = 0  # prepare_store calls: evictions at 2 * tick, stores at 2 * tick + 1
        self.stored: dict[bytes, int] = {}  # key -> time of its last store
        self.evicted: dict[bytes, int] = {}  # key -> time of its last eviction
        self.counts = {"stored": 0, "stored_again": 0}
        if classify:
            self.counts.update(loaded=0, closed=0, orphan=0, gpu_head=0, ever_orphaned=0, rereached=0)
        self.req_loaded: dict[str, list[int]] = {}  # request -> [closed, orphan] chunks loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        out = self.inner.prepare_store(keys, req_context)
        if out is not None:
            self.tick += 1
            for k in out.evicted_keys:
                self.evicted[k] = 2 * self.tick
            for k in out.keys_to_store:
                self.counts["stored"] += 1
                if k in self.stored:
                    self.counts["stored_again"] += 1  # (a chunk this manager had stored and evicted)
                self.stored[k] = 2 * self.tick + 1
        return out

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        if not self.classify:
            return self.inner.prepare_load(keys, req_context)
        host = self.inner._policy.chunks
        pos = req_context._offload_key_positions
        order = sorted(pos, key=pos.__getitem__)
        at = {k: i for i, k in enumerate(order)}
        first = min(at[k] for k in keys)  # the request's GPU prefix hit ends here
        missing = -1  # the last earlier chunk not on the host, scanning head to tail
        last_evict = -1  # the latest eviction of an earlier chunk
        got = self.req_loaded.setdefault(req_context.req_id, [0, 0])
        want = set(keys)
        for i, k in enumerate(order):
            if k in want:
                self.counts["loaded"] += 1
                if missing < 0:
                    self.counts["closed"] += 1
                    got[0] += 1
                else:
                    self.counts["orphan"] += 1
                    got[1] += 1
                    if missing < first:
                        self.counts["gpu_head"] += 1
                if last_evict > self.stored.get(k, -1):
                    self.counts["ever_orphaned"] += 1
                    if missing < 0:
                        self.counts["rereached"] += 1
            if k not in host:
                missing = i
            last_evict = max(last_evict, self.evicted.get(k, -1))
        return self.inner.prepare_load(keys, req_context)


def managers(host: int, evictions: list[str], arc: bool) -> dict[str, dict[str, Any]]:
    out = {f"kvtier ({e})": kvtier_extra_config(num_host_chunks=host, kvtier_eviction=e) for e in evictions}
    out["vLLM lru"] = {**cpu_extra_config(host, BLOCK), "eviction_policy": "lru"}
    if arc:
        out["vLLM arc"] = {**cpu_extra_config(host, BLOCK), "eviction_policy": "arc"}
    return out


def run_ratio(recs: list[Any], device: int, ratio: int, evictions: list[str], arc: bool,
              every: int, audit: bool = False) -> list[dict[str, Any]]:
    host = device * ratio
    configs = managers(host, evictions, arc)
    hasher = SharedHasher(len(configs), block_tokens=BLOCK)
    players = {name: Replayer(extra, device, BLOCK, hasher=hasher) for name, extra in configs.items()}
    for name, p in players.items():
        got = p.engine.manager
        assert (type(got).__name__ == "KvtierOffloadingManager") == name.startswith("kvtier"), (name, got)
        assert getattr(got, "num_chunks", getattr(got, "_num_chunks", None)) == host, (name, host)
    order = list(players.values())
    auditor = None
    if audit:
        probe = players["vLLM lru"].engine.probe
        auditor = probe.inner = OrphanAudit(probe.inner)
        counters = {m: OrphanAudit(p.engine.probe.inner, classify=False) for m, p in players.items()
                    if m.startswith("kvtier")}
        for m, c in counters.items():
            players[m].engine.probe.inner = c
        diff = {m: [0, 0] for m in players if m.startswith("kvtier")}  # requests, chunks where lru hit more
        diff_kinds = {m: [0, 0] for m in players if m.startswith("kvtier")}  # of those chunks: closed, orphan
    gc.collect()
    gc.freeze()
    gc.disable()
    t0 = time.perf_counter()
    loads = []
    for i, rec in enumerate(recs):
        k = i % len(order)
        if auditor is not None:
            auditor.now = i
            before = {m: p.host for m, p in players.items()}
        for p in order[k:] + order[:k]:
            p.step(str(i), rec)
        if auditor is not None:
            lru = players["vLLM lru"].host - before["vLLM lru"]
            for m in diff:
                kv = players[m].host - before[m]
                if lru > kv:
                    diff[m][0] += 1
                    diff[m][1] += (lru - kv) // BLOCK
                    c, o = auditor.req_loaded.get(str(i), [0, 0])
                    diff_kinds[m][0] += c
                    diff_kinds[m][1] += o
            auditor.req_loaded.pop(str(i), None)
        if i % GC_EVERY == GC_EVERY - 1:
            gc.collect(1 if i % FULL_GC_EVERY != FULL_GC_EVERY - 1 else 2)
        if every and (i + 1) % every == 0:
            loads.append(os.getloadavg()[0])
            print(f"x{ratio}: {i + 1} requests, {time.perf_counter() - t0:.0f} s, "
                  + ", ".join(f"{m} {100 * p.result()['total_hit']:.3f} %" for m, p in players.items()),
                  file=sys.stderr, flush=True)
    gc.enable()
    gc.unfreeze()
    rows = []
    for m, p in players.items():
        r = p.result()
        r.update(manager=m, host_ratio=ratio, host_chunks=host, hash_us=hasher.hash_s / max(1, len(recs)) * 1e6,
                 wall_s=time.perf_counter() - t0, load=max(loads, default=os.getloadavg()[0]))
        if auditor is not None:
            r["audit"] = dict(auditor.counts) if m == "vLLM lru" else None
            if m in diff:
                r["audit"] = {**counters[m].counts,
                              "requests_lru_hits_more": diff[m][0], "chunks_lru_hits_more": diff[m][1],
                              "their_lru_loads_closed": diff_kinds[m][0], "their_lru_loads_orphan": diff_kinds[m][1]}
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", type=int, default=4000)
    ap.add_argument("--host-ratio", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--eviction", nargs="+", default=["lru"],
                    help="kvtier's host eviction policies, each a manager of its own (lru, lru2, lru_turns)")
    ap.add_argument("--arc", action="store_true", help="also run vLLM's arc policy")
    ap.add_argument("--progress", type=int, default=1000, help="print progress every N requests (0: never)")
    ap.add_argument("--audit", action="store_true",
                    help="sort vLLM lru's host hits by the host set's shape at the load (OrphanAudit; no times)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    recs = load_trace(a.trace, limit=a.limit).requests
    print(f"{len(recs)} requests, device {a.device} blocks of {BLOCK} tokens; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores ({platform.processor() or platform.machine()})",
          file=sys.stderr)
    rows: list[dict[str, Any]] = []
    print("| manager | host chunks | device hit | host hit | total hit | manager us / request | "
          "KVCacheManager us / request | hashing us / request | stores refused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for ratio in a.host_ratio:
        for r in run_ratio(recs, a.device, ratio, a.eviction, a.arc, a.progress, a.audit):
            rows.append(r)
            print(f"| {r['manager']} | x{ratio} ({r['host_chunks']:,}) | {100 * r['device_hit']:.2f} % | "
                  f"{100 * r['host_hit']:.2f} % | {100 * r['total_hit']:.2f} % | {r['manager_us']:.0f} | "
                  f"{r['kvm_us']:.0f} | {r['hash_us']:.0f} | {r['refused_stores']} |", flush=True)
    for ratio in a.host_ratio:
        for k in (r for r in rows if r["manager"].startswith("kvtier") and r["host_ratio"] == ratio):
            for o in (r for r in rows if not r["manager"].startswith("kvtier") and r["host_ratio"] == ratio):
                print(f"x{ratio}: {k['manager']} / {o['manager']}: hit {k['total_hit'] / o['total_hit']:.4f} "
                      f"({100 * (k['total_hit'] - o['total_hit']):+.2f} points), "
                      f"manager time {k['manager_us'] / o['manager_us']:.2f}")
    for r in rows:
        if r.get("audit"):
            print(f"x{r['host_ratio']}: {r['manager']} audit: "
                  + ", ".join(f"{k} {v:,}" for k, v in r["audit"].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
