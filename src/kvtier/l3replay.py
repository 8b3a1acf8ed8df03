"""Multi-instance replay with a shared L3 store: N kvtier instances behind a router.

Each instance has its own device and host tiers (a :class:`kvtier.tiered.TieredCache`, the
reference scheduler and a real-bytes executor whose host pool the store reads and fills).
With ``--l3 URL`` every instance also runs an :class:`kvtier.fsm.l3.L3Tier` over one
shared store (``redis://`` or ``mooncake://``) through a
:class:`kvtier.transfer.store.StoreDriver`. Requests are routed round-robin or by
conversation (the trace's first two block hashes: requests of one conversation share
them) and served one at a time in arrival order: the instance prefetches from L3 (exists,
then get into reserved host pages, waiting at most the deadline), runs the request through
its scheduler (an L3 hit then loads back like any host hit, and every hit page is checked
against its fingerprint), then offers the prefix to L3 under the write policy.

Three configurations of the same trace: ``N x (device+host)`` without L3, the same with
L3, and one cache with all their capacity. Outputs: hit tokens by tier (device, host, L3)
per instance and in aggregate, and the share of the hit rate routing lost that L3
recovered: ``(hit(L3) - hit(no L3)) / (hit(single) - hit(no L3))``.

Run: ``python -m kvtier.l3replay --instances 4 --l3 redis://127.0.0.1:6379`` (see
``--help``). Decode is cut to one output token per request: only prompt units are ever
shared, and the hit-rate comparison is the measure; every configuration gets the same cut.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.fsm import units_to_pages
from kvtier.fsm.l3 import L3Options, L3Stats
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.presets import preset

from .fingerprint import BytesExecutor, scaled_layout
from .scheduler import ReferenceScheduler, SchedRequest
from .tiered import TieredCache
from .trace import load_trace

__all__ = ["InstanceResult", "Instance", "run_configuration", "main"]


@dataclass
class InstanceResult:
    """One instance's (or the aggregate's) counts.

    Attributes:
        name: ``i0`` .. or ``all``.
        requests, prompt_tokens: served.
        hit_tokens: prefix-hit tokens in total; ``device_hit_tokens``, ``host_hit_tokens``
            (host copies this instance wrote) and ``l3_hit_tokens`` (host copies an L3 get
            brought) split it.
        l3_bytes_in, l3_bytes_out: bytes read from / written to the store.
        l3_get_seconds: backend seconds of exists and gets (the prefetch path).
        l3_wait_seconds: wall seconds requests waited for their prefetch.
        l3_failures: L3 keys not delivered or not stored, expired ops and backend errors.
        fingerprint_pages_checked: hit pages checked against their fingerprint.
    """

    name: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    l3_bytes_in: int = 0
    l3_bytes_out: int = 0
    l3_get_seconds: float = 0.0
    l3_wait_seconds: float = 0.0
    l3_failures: int = 0
    fingerprint_pages_checked: int = 0
    l3: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Executor(BytesExecutor):
    """The replay's executor with the unit keys read once per request (the fingerprint
    chain is extended page by page; re-reading the keys for every page is quadratic)."""

    def _prefix_hash(self, cache: TieredCache, rid: str, unit: int) -> int:
        chain = self._prefix.setdefault(rid, [])
        if len(chain) <= unit:
            keys = cache.unit_keys(rid)
            h = chain[-1] if chain else self.salt
            for u in range(len(chain), unit + 1):
                key = keys[u] if u < len(keys) else (rid, "u", u)
                h = hash((h, key)) & ((1 << 63) - 1)
                chain.append(h)
        return chain[unit]


class Instance:
    """One kvtier instance: cache, executor with real host bytes, scheduler, optional L3.

    Args:
        name: instance name.
        layout: the cache layout (history groups only when ``store_url`` is given).
        device_units, host_units: capacities in cache units.
        store_url: the shared store, or ``None`` for no L3.
        options: L3 options.
        byte_scale: page bytes divided by this for the real copies.
        seed: fingerprint salt (every instance must share it to read each other's pages).
        policy: the host tier's write policy (``write_through``: every prefix reaches the
            host, so the L3 policy ``host_write`` sees it).
    """

    def __init__(self, name: str, layout: CacheLayout, device_units: int, host_units: int,
                 store_url: str | None = None, options: L3Options | None = None, byte_scale: int = 1024,
                 seed: int = 0, policy: str = "write_through") -> None:
        self.name = name
        self.cache = TieredCache(layout, device_units, host_units, policy=policy,
                                 l3=(options or L3Options()) if store_url else None)
        self.executor = _Executor(scaled_layout(layout, byte_scale), units_to_pages(layout, device_units),
                                      units_to_pages(layout, host_units), "cpu", salt=seed)
        self.sched = ReferenceScheduler(self.cache, self.executor)
        self.result = InstanceResult(name)
        self.driver = None
        if store_url is not None:
            from kvtier.transfer.store import HostPageIO, StoreDriver, open_store

            assert self.cache.l3 is not None
            backend = open_store(store_url, timeout_s=self.cache.l3.options.deadline_s)
            io = HostPageIO.from_pool(self.executor.layout, self.executor.host)
            self.driver = StoreDriver(backend, io)

    def _pump(self) -> None:
        l3, drv = self.cache.l3, self.driver
        assert l3 is not None and drv is not None
        now = time.monotonic()
        for res in drv.poll():
            l3.complete(res, now)
        l3.expire(now, drv.cancel)
        drv.submit(l3.poll_commands())

    def serve(self, req: SchedRequest) -> None:
        """Prefetch from L3 (bounded by the deadline), run ``req`` to its end, offer to L3."""
        l3, drv = self.cache.l3, self.driver
        fetched = 0
        if l3 is not None and drv is not None:
            self._pump()
            t0 = time.monotonic()
            if l3.prefetch(req.request_id, req.units, t0):
                self._pump()
                while l3.prefetching(req.request_id):
                    drv.wait(0.05)
                    self._pump()
                fetched = l3.fetched_units(req.request_id)
                l3.forget(req.request_id)
            self.result.l3_wait_seconds += time.monotonic() - t0
        st = self.sched.stats
        dev0, host0 = st.device_hit_tokens, st.host_hit_tokens
        self.sched.run([req])
        dev, host = st.device_hit_tokens - dev0, st.host_hit_tokens - host0
        from_l3 = min(host, fetched * self.cache.layout.alignment)
        r = self.result
        r.requests += 1
        r.prompt_tokens += req.prompt_tokens
        r.device_hit_tokens += dev
        r.host_hit_tokens += host - from_l3
        r.l3_hit_tokens += from_l3
        r.hit_tokens += dev + host
        if l3 is not None:
            l3.offer(req.units, time.monotonic())
            self._pump()

    def flush(self) -> None:
        """Wait for the store operations in flight to end (at most the deadline)."""
        l3, drv = self.cache.l3, self.driver
        if l3 is not None and drv is not None:
            end = time.monotonic() + l3.options.deadline_s
            while l3.ops_in_flight() and time.monotonic() < end:
                drv.wait(0.05)
                self._pump()

    def close(self) -> None:
        """Wait for puts in flight (up to the deadline), stop the driver, record the counters."""
        l3, drv = self.cache.l3, self.driver
        if l3 is not None and drv is not None:
            self.flush()
            l3.expire(float("inf"), drv.cancel)
            drv.close()
            s: L3Stats = l3.stats
            self.result.l3 = asdict(s)
            self.result.l3_bytes_in, self.result.l3_bytes_out = s.bytes_in, s.bytes_out
            self.result.l3_get_seconds = s.get_seconds
            self.result.l3_failures = s.get_failed + s.put_failed + s.expired_ops + s.op_errors
            l3.check_invariants()
        self.cache.core.check_invariants()
        self.result.fingerprint_pages_checked = self.executor.pages_checked


def route(requests: Sequence[SchedRequest], hash_ids: Sequence[Sequence[int]], n: int, how: str) -> list[int]:
    """Instance index per request: ``rr`` (round-robin) or ``conversation`` (first two
    block hashes, so one conversation's turns meet on one instance)."""
    if how == "rr":
        return [i % n for i in range(len(requests))]
    if how == "conversation":
        return [hash(tuple(h[:2])) % n for h in hash_ids]
    raise ValueError(f"routing must be rr or conversation, got {how!r}")


def _sum(results: Sequence[InstanceResult]) -> InstanceResult:
    total = InstanceResult("all")
    for r in results:
        for f in ("requests", "prompt_tokens", "hit_tokens", "device_hit_tokens", "host_hit_tokens",
                  "l3_hit_tokens", "l3_bytes_in", "l3_bytes_out", "l3_get_seconds", "l3_wait_seconds",
                  "l3_failures", "fingerprint_pages_checked"):
            setattr(total, f, getattr(total, f) + getattr(r, f))
    return total


def run_configuration(requests: Sequence[SchedRequest], hash_ids: Sequence[Sequence[int]], layout: CacheLayout,
                      n: int, device_units: int, host_units: int, routing: str, store_url: str | None,
                      options: L3Options | None = None, byte_scale: int = 1024) -> list[InstanceResult]:
    """Serve ``requests`` on ``n`` instances; returns each instance's result then the aggregate."""
    insts = [Instance(f"i{i}", layout, device_units, host_units, store_url, options, byte_scale) for i in range(n)]
    where = route(requests, hash_ids, n, routing)
    try:
        for req, i in zip(requests, where):
            insts[i].serve(SchedRequest(req.request_id, req.arrival_s, req.prompt_tokens, 1, req.units))
    finally:
        for inst in insts:
            inst.close()
    out = [inst.result for inst in insts]
    return out + [_sum(out)]


def _requests(path: str | None, layout: CacheLayout, limit: int | None) -> tuple[list[SchedRequest], list[list[int]]]:
    from .replay import trace_requests

    trace = load_trace(path) if path else load_trace()
    reqs = trace_requests(trace, layout)
    ids = [list(r.hash_ids) for r in trace.requests]
    if limit is not None:
        reqs, ids = reqs[:limit], ids[:limit]
    return reqs, ids


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m kvtier.l3replay`` command; prints the table (and ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m kvtier.l3replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default: the bundled sample)")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--l3", default=None, metavar="URL", help="redis://HOST:PORT or mooncake://HOST:PORT")
    p.add_argument("--routing", choices=("rr", "conversation"), default="rr")
    p.add_argument("--device-tokens", type=int, default=32768, help="per instance")
    p.add_argument("--host-tokens", type=int, default=131072, help="per instance")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--layers", type=int, default=2, help="model layers of the llama-3-8b preset")
    p.add_argument("--byte-scale", type=int, default=1024)
    p.add_argument("--write-policy", default="host_write")
    p.add_argument("--prefetch-units", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=2.0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    layout = preset("llama-3-8b", num_layers=args.layers)
    a = layout.alignment
    reqs, ids = _requests(args.trace, layout, args.limit)
    dev, host, n = args.device_tokens // a, args.host_tokens // a, args.instances
    opts = L3Options(model="llama-3-8b", write_policy=args.write_policy, prefetch_units=args.prefetch_units,
                     deadline_s=args.deadline_s)
    if args.l3:
        from kvtier.transfer.store import open_store

        open_store(args.l3).close()  # fail early on a bad URL
    runs: dict[str, list[InstanceResult]] = {}
    t0 = time.perf_counter()
    runs["no-l3"] = run_configuration(reqs, ids, layout, n, dev, host, args.routing, None, None, args.byte_scale)
    if args.l3:
        runs["l3"] = run_configuration(reqs, ids, layout, n, dev, host, args.routing, args.l3, opts, args.byte_scale)
    runs["single"] = run_configuration(reqs, ids, layout, 1, dev * n, host * n, "rr", None, None, args.byte_scale)
    wall = time.perf_counter() - t0
    print(format_table(runs, n, args, len(reqs), wall))
    if args.json:
        doc = {k: [asdict(r) | {"hit_rate": r.hit_rate} for r in v] for k, v in runs.items()}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"setup": vars(args), "wall_s": wall, "runs": doc}, f, indent=1)
    return 0


def recovered(runs: dict[str, list[InstanceResult]]) -> float | None:
    """Share of the hit rate routing lost that L3 recovered (``None`` without an L3 run or loss)."""
    if "l3" not in runs:
        return None
    lost = runs["single"][-1].hit_tokens - runs["no-l3"][-1].hit_tokens
    if lost <= 0:
        return None
    return (runs["l3"][-1].hit_tokens - runs["no-l3"][-1].hit_tokens) / lost


def format_table(runs: dict[str, list[InstanceResult]], n: int, args: argparse.Namespace, requests: int,
                 wall: float) -> str:
    """The Markdown table: one row per instance and configuration, plus aggregates."""
    lines = ["| configuration | instance | requests | hit rate | device hit | host hit | L3 hit | L3 bytes in / out "
             "| L3 get s | L3 failures | pages checked |", "|" + " --- |" * 11]
    names = {"no-l3": f"{n} x (dev+host), no L3", "l3": f"{n} x (dev+host) + L3 {args.l3}",
             "single": "1 cache, all capacity"}
    for key, res in runs.items():
        for r in res:
            if key == "single" and r.name != "all":
                continue
            lines.append(f"| {names[key]} | {r.name} | {r.requests:,} | {r.hit_rate:.2%} | {r.device_hit_tokens:,} | "
                         f"{r.host_hit_tokens:,} | {r.l3_hit_tokens:,} | {r.l3_bytes_in:,} / {r.l3_bytes_out:,} | "
                         f"{r.l3_get_seconds:.3f} | {r.l3_failures:,} | {r.fingerprint_pages_checked:,} |")
    rec = recovered(runs)
    notes = [f"{requests:,} requests, routing {args.routing}, per instance {args.device_tokens:,} device + "
             f"{args.host_tokens:,} host tokens, llama-3-8b with {args.layers} layers, byte scale {args.byte_scale}, "
             f"write policy {args.write_policy}; wall {wall:.1f} s"]
    if rec is not None:
        notes.append(f"L3 recovered {rec:.1%} of the hit tokens routing lost against the single cache")
    if "l3" in runs:
        agg = runs["l3"][-1]
        if agg.l3_hit_tokens:
            notes.append(f"prefetch cost per L3 hit token: {agg.l3_bytes_in / agg.l3_hit_tokens:,.1f} B (scaled) "
                         f"and {agg.l3_get_seconds / agg.l3_hit_tokens * 1e6:,.2f} us backend, "
                         f"{agg.l3_wait_seconds / agg.l3_hit_tokens * 1e6:,.2f} us waited")
    return "\n".join(lines + [""] + notes)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
