"""Multi-instance replay with a shared L3 store: N kvtier instances behind a router.

Each instance has its own device and host tiers (a :class:`kvtier.tiered.TieredCache`, the
reference scheduler and a real-bytes executor whose host pool the store reads and fills).
With a store URL every instance also runs an :class:`kvtier.fsm.l3.L3Tier` over one shared
store (``redis://`` or ``mooncake://``, through :func:`kvtier.transfer.store.open_store`)
and a :class:`kvtier.transfer.store.StoreDriver`. Requests are routed
(:mod:`kvtier.replay.router`: round-robin, or by conversation) and served one at a time in
arrival order: the instance prefetches from L3 (exists, then get into reserved host pages,
waiting at most the deadline), runs the request through its scheduler (an L3 hit then
loads back like any host hit, and every hit page is checked against its fingerprint), then
offers the prefix to L3 under the write policy.

Three configurations of the same trace in one run (:func:`run_multi`): ``N x
(device+host)`` without L3, the same with L3, and one cache with all their capacity.
Outputs (:class:`MultiReport`): hit tokens by tier (device, host, L3) per instance and in
aggregate, the share of the hit rate routing lost that L3 recovered,
``(hit(L3) - hit(no L3)) / (hit(single) - hit(no L3))``, the prefetch cost (bytes and
seconds per L3 hit token) and the time of requests whose hit came from the device alone,
with and without L3.

One instance is :class:`~kvtier.replay.l3instance.Instance`. Front ends: ``kvtier replay
--instances N [--l3 URL]`` (:mod:`kvtier.replay.command`) and ``python -m
kvtier.replay.l3replay`` (the older options, kept as an alias). Decode is cut to one
output token per request: only prompt units are ever shared, and the hit-rate comparison
is the measure; every configuration gets the same cut.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvtier.fsm.l3 import L3Options
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.presets import preset

from ..scheduler import SchedRequest
from .fingerprint import scaled_layout
from .l3instance import Instance, InstanceResult
from .router import route as route_requests
from .trace import Trace, load_trace

__all__ = ["InstanceResult", "Instance", "MultiSetup", "MultiReport", "run_configuration", "run_multi",
           "recovered", "format_report", "report_json", "object_bytes", "main"]

Progress = Callable[[str, int], Callable[[int], Any] | None]


_SUMMED = ("requests", "prompt_tokens", "hit_tokens", "device_hit_tokens", "host_hit_tokens", "l3_hit_tokens",
           "l3_bytes_in", "l3_bytes_out", "l3_get_seconds", "l3_wait_seconds", "l3_asked", "l3_failures",
           "fingerprint_pages_checked", "device_only_requests", "device_only_seconds",
           "device_only_prefetch_seconds", "device_only_asked")


def _sum(results: Sequence[InstanceResult]) -> InstanceResult:
    total = InstanceResult("all")
    for r in results:
        for f in _SUMMED:
            setattr(total, f, getattr(total, f) + getattr(r, f))
        total.device_only_times.extend(r.device_only_times)
        total.device_only_sched_times.extend(r.device_only_sched_times)
        total.device_only_prefetch_times.extend(r.device_only_prefetch_times)
        for k, v in r.l3.items():
            if isinstance(v, (int, float)):
                total.l3[k] = total.l3.get(k, 0) + v
    return total


def route(requests: Sequence[SchedRequest], hash_ids: Sequence[Sequence[int]], n: int, how: str) -> list[int]:
    """Instance index per request (kept for older callers): ``rr`` / ``round-robin``, or
    ``conversation`` (:func:`kvtier.replay.router.route` over the hash-id chains)."""
    from .trace import TraceRequest

    trs = [TraceRequest(i, r.arrival_s, r.prompt_tokens, 1, tuple(h)) for i, (r, h) in enumerate(zip(requests, hash_ids))]
    return route_requests(trs, n, "round-robin" if how == "rr" else how)


def run_configuration(requests: Sequence[SchedRequest], hash_ids: Sequence[Sequence[int]] | Sequence[int],
                      layout: CacheLayout, n: int, device_units: int, host_units: int, routing: str,
                      store_url: str | None, options: L3Options | None = None, byte_scale: int = 1024,
                      progress: Callable[[int], Any] | None = None, **instance_kw: Any) -> list[InstanceResult]:
    """Serve ``requests`` on ``n`` instances; returns each instance's result then the aggregate.

    ``hash_ids`` is either each request's hash ids (routed by ``routing``: ``rr`` or
    ``conversation``) or, when its items are ints, each request's instance index already."""
    insts = [Instance(f"i{i}", layout, device_units, host_units, store_url, options, byte_scale, **instance_kw)
             for i in range(n)]
    if hash_ids and isinstance(hash_ids[0], int):
        where = [int(i) % n for i in hash_ids]  # type: ignore[arg-type]
    else:
        where = route(requests, hash_ids, n, routing)  # type: ignore[arg-type]
    try:
        for k, (req, i) in enumerate(zip(requests, where)):
            insts[i].serve(SchedRequest(req.request_id, req.arrival_s, req.prompt_tokens, 1, req.units))
            if progress is not None and (k + 1) % 100 == 0:
                progress(100)
        if progress is not None and len(requests) % 100:
            progress(len(requests) % 100)
    finally:
        for inst in insts:
            inst.close()
    out = [inst.result for inst in insts]
    return out + [_sum(out)]


@dataclass(frozen=True)
class MultiSetup:
    """One multi-instance replay.

    Attributes:
        instances: engine instances (>= 1).
        router: ``round-robin`` or ``conversation`` (:data:`kvtier.replay.router.ROUTERS`).
        device_units, host_units: per instance, in cache units; the single cache gets
            ``instances`` times both.
        store_url: the shared store (``None``: no L3 configuration is run).
        l3: the L3 options (its ``model`` is made unique per run by :func:`run_multi`
            unless ``fresh_namespace`` is false, so objects an earlier run left in the store
            are never read).
        byte_scale: page bytes divided by this for the real copies (>= 64 B per page kept).
        seed: fingerprint salt. policy, eviction, exclusive: each cache's options.
        fresh_namespace: see ``l3``.
    """

    instances: int
    router: str = "round-robin"
    device_units: int = 1000
    host_units: int = 8000
    store_url: str | None = None
    l3: L3Options = L3Options()
    byte_scale: int = 1024
    seed: int = 0
    policy: str = "write_through"
    eviction: str = "lru"
    exclusive: bool = False
    fresh_namespace: bool = True


@dataclass
class MultiReport:
    """What :func:`run_multi` measured.

    Attributes:
        setup: the setup (with the L3 namespace actually used).
        runs: ``no-l3``, ``l3`` (only with a store) and ``single``: each instance's result
            then the aggregate (``single`` has one instance).
        seconds: wall seconds per configuration.
        requests: requests replayed; layout: the cache layout.
        object_bytes: bytes of one store object at the run's byte scale and at full
            geometry (:func:`object_bytes`).
        store: what the store reported after the L3 run (Redis: INFO fields; else empty).
    """

    setup: MultiSetup
    runs: dict[str, list[InstanceResult]]
    seconds: dict[str, float]
    requests: int
    layout: CacheLayout
    object_bytes: tuple[int, int]
    store: dict[str, Any] = field(default_factory=dict)


def object_bytes(layout: CacheLayout, byte_scale: int) -> tuple[int, int]:
    """Payload bytes of one L3 object (one cache unit of every history group) as moved at
    ``byte_scale`` and at full geometry (byte scale 1)."""
    def size(lay: CacheLayout) -> int:
        return sum(lay.pages_per_unit(g) * c.page_bytes * len(g.layers) for g in lay.history_groups
                   for c in g.components)
    return size(scaled_layout(layout, byte_scale)), size(layout)


def _store_info(url: str) -> dict[str, Any]:
    """Redis's own account of the store (memory, evictions, keys; :func:`run_multi` reports
    the counters' change over the L3 run); ``{}`` for other stores, the error when the
    server cannot be asked."""
    if not url.startswith("redis://"):
        return {}
    try:
        import redis  # type: ignore[import-untyped, import-not-found, unused-ignore]

        c = redis.Redis.from_url(url, socket_timeout=5)
        info = c.info()
        keys = sum(int(v.get("keys", 0)) for k, v in info.items() if k.startswith("db") and isinstance(v, dict))
        out = {k: info.get(k) for k in ("redis_version", "used_memory", "maxmemory", "maxmemory_policy",
                                         "evicted_keys", "keyspace_hits", "keyspace_misses")}
        out["keys"] = keys
        c.close()
        return out
    except Exception as exc:  # a report, not a check: say why it is missing
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_multi(requests: Sequence[SchedRequest], where: Sequence[int], layout: CacheLayout, setup: MultiSetup,
              progress: Progress | None = None) -> MultiReport:
    """Run the three configurations (no L3, L3 when ``setup.store_url``, one cache with all
    the capacity) on ``requests`` routed to instances ``where`` (:func:`kvtier.replay.router.route`).

    Raises:
        kvtier.fsm.ConfigError: a bad setup (store URL, L3 options, a layout with
            continuation-state groups and a store).
        kvtier.fsm.InvariantViolation, kvtier.replay.fingerprint.FingerprintMismatch: a check failed.
    """
    if len(where) != len(requests):
        raise ValueError(f"where has {len(where)} entries for {len(requests)} requests")
    opts = setup.l3
    if setup.store_url is not None and setup.fresh_namespace:
        opts = replace(opts, model=f"{opts.model}@run-{uuid.uuid4().hex[:12]}")
        setup = replace(setup, l3=opts)
    kw = {"seed": setup.seed, "policy": setup.policy, "eviction": setup.eviction, "exclusive": setup.exclusive}
    n = setup.instances
    plan: list[tuple[str, int, int, int, str | None, list[int]]] = [
        ("no-l3", n, setup.device_units, setup.host_units, None, list(where))]
    if setup.store_url is not None:
        plan.append(("l3", n, setup.device_units, setup.host_units, setup.store_url, list(where)))
    plan.append(("single", 1, setup.device_units * n, setup.host_units * n, None, [0] * len(requests)))
    runs: dict[str, list[InstanceResult]] = {}
    seconds: dict[str, float] = {}
    store: dict[str, Any] = {}
    for name, k, dev, host, url, placed in plan:
        bar = progress(name, len(requests)) if progress is not None else None
        before = _store_info(url) if url is not None else {}
        t0 = time.perf_counter()
        runs[name] = run_configuration(requests, placed, layout, k, dev, host, setup.router, url,
                                       opts if url else None, setup.byte_scale, progress=bar, **kw)
        seconds[name] = time.perf_counter() - t0
        if url is not None:
            store = _store_info(url)
            for counter in ("evicted_keys", "keyspace_hits", "keyspace_misses"):  # counted from the server's start
                if isinstance(store.get(counter), int) and isinstance(before.get(counter), int):
                    store[counter] -= before[counter]
    return MultiReport(setup, runs, seconds, len(requests), layout, object_bytes(layout, setup.byte_scale), store)


def recovered(runs: dict[str, list[InstanceResult]]) -> float | None:
    """Share of the hit rate routing lost that L3 recovered (``None`` without an L3 run or loss)."""
    if "l3" not in runs:
        return None
    lost = runs["single"][-1].hit_tokens - runs["no-l3"][-1].hit_tokens
    if lost <= 0:
        return None
    return (runs["l3"][-1].hit_tokens - runs["no-l3"][-1].hit_tokens) / lost


def _us(seconds: float, count: int) -> str:
    return f"{seconds / count * 1e6:,.0f} us" if count else "-"


def _median_us(times: Sequence[float]) -> str:
    return f"{statistics.median(times) * 1e6:,.0f} us" if times else "-"


def format_report(rep: MultiReport) -> str:
    """The Markdown table (one row per instance and configuration, the aggregates) and the
    summary lines: recovery, prefetch cost, device-only hits with and without L3."""
    s, n = rep.setup, rep.setup.instances
    lines = ["| configuration | instance | requests | hit rate | device hit tokens | host hit tokens | L3 hit tokens "
             "| L3 bytes in / out | L3 failures | pages checked |", "|" + " --- |" * 10]
    names = {"no-l3": f"{n} x (device+host), no L3", "l3": f"{n} x (device+host) + L3",
             "single": "1 cache, all capacity"}
    for key, res in rep.runs.items():
        for r in res:
            if key == "single" and r.name != "all":
                continue
            name = r.name if r.name != "all" else "**all**"
            lines.append(f"| {names[key]} | {name} | {r.requests:,} | {r.hit_rate:.2%} | {r.device_hit_tokens:,} | "
                         f"{r.host_hit_tokens:,} | {r.l3_hit_tokens:,} | {r.l3_bytes_in:,} / {r.l3_bytes_out:,} | "
                         f"{r.l3_failures:,} | {r.fingerprint_pages_checked:,} |")
    a = rep.layout.alignment
    scaled, full = rep.object_bytes
    notes = [f"{rep.requests:,} requests routed {s.router} over {n} instances, each {s.device_units * a:,} device + "
             f"{s.host_units * a:,} host tokens (the single cache: {n}x both); preset {rep.layout.name}, "
             f"{rep.layout.num_layers} layers, {a}-token units; host policy {s.policy}, eviction {s.eviction}"
             f"{', exclusive host' if s.exclusive else ''}; byte scale {s.byte_scale} (a store object: {scaled:,} B "
             f"moved, {full:,} B at full geometry)"]
    if s.store_url is not None:
        notes.append(f"L3: {s.store_url}, write policy {s.l3.write_policy}, prefetch up to {s.l3.prefetch_units} "
                     f"units, deadline {s.l3.deadline_s:g} s, read lease {s.l3.lease_s:g} s, hint {s.l3.hint_size:,} keys, key namespace {s.l3.model!r}")
    if rep.store and "error" not in rep.store:
        st = rep.store
        notes.append(f"store after the L3 run: {st.get('keys', 0):,} objects, used memory {st.get('used_memory', 0):,} B"
                     f" of maxmemory {st.get('maxmemory', 0):,} B ({st.get('maxmemory_policy')}), evicted "
                     f"{st.get('evicted_keys', 0):,} objects on its own")
    elif rep.store:
        notes.append(f"store info unavailable: {rep.store['error']}")
    notes.append("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in rep.seconds.items()))
    rec = recovered(rep.runs)
    if "l3" in rep.runs:
        no, l3, one = rep.runs["no-l3"][-1], rep.runs["l3"][-1], rep.runs["single"][-1]
        if rec is not None:
            notes.append(f"**L3 recovered {rec:.1%} of the hit rate routing lost against the single cache**: "
                         f"({l3.hit_rate:.2%} - {no.hit_rate:.2%}) / ({one.hit_rate:.2%} - {no.hit_rate:.2%})")
        else:
            notes.append(f"routing lost no hit rate against the single cache ({no.hit_rate:.2%} vs "
                         f"{one.hit_rate:.2%}); L3: {l3.hit_rate:.2%}")
        if l3.l3_hit_tokens:
            per = l3.l3_hit_tokens
            notes.append(f"prefetch cost per L3 hit token: {l3.l3_bytes_in / per:,.1f} B read ({l3.l3_bytes_in / per * full / scaled:,.0f} B "
                         f"at full geometry), {l3.l3_get_seconds / per * 1e6:,.2f} us of store time (exists + get), "
                         f"{l3.l3_wait_seconds / per * 1e6:,.2f} us waited by requests; {l3.l3_asked:,} of "
                         f"{l3.requests:,} requests asked the store")
        notes.append(f"device-only hits (hit > 0, all from the device), per request: without L3 "
                     f"{no.device_only_requests:,} requests, scheduler CPU median {_median_us(no.device_only_sched_times)}, "
                     f"whole serve wall median {_median_us(no.device_only_times)}; with L3 {l3.device_only_requests:,} "
                     f"requests, scheduler CPU median {_median_us(l3.device_only_sched_times)}, whole serve wall median "
                     f"{_median_us(l3.device_only_times)}, of which the L3 prefetch wall mean "
                     f"{_us(l3.device_only_prefetch_seconds, l3.device_only_requests)} "
                     f"({l3.device_only_asked:,} of them asked the store, their prompt going on past the device "
                     f"hit: prefetch wall median {_median_us(l3.device_only_prefetch_times)} for those)")
    return "\n".join(lines + [""] + ["- " + x for x in notes])


def report_json(rep: MultiReport) -> dict[str, Any]:
    """The ``--json`` document: setup, per configuration each instance and the aggregate,
    recovery, object bytes, store info, wall seconds."""
    setup = asdict(rep.setup)
    return {"setup": setup, "requests": rep.requests, "preset": rep.layout.name, "layers": rep.layout.num_layers,
            "alignment_tokens": rep.layout.alignment, "object_bytes_moved": rep.object_bytes[0],
            "object_bytes_full": rep.object_bytes[1], "seconds": rep.seconds, "store": rep.store,
            "recovered": recovered(rep.runs),
            "runs": {k: [r.as_dict() for r in v] for k, v in rep.runs.items()}}


def load_requests(trace: Trace, layout: CacheLayout) -> list[SchedRequest]:
    """The trace's requests as scheduler requests (unit keys from the hash ids)."""
    from .replay import trace_requests

    return trace_requests(trace, layout)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m kvtier.replay.l3replay`` command (an alias of ``kvtier replay --instances``
    with the older option names); prints the table (and writes ``--json PATH``)."""
    p = argparse.ArgumentParser(prog="python -m kvtier.replay.l3replay", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default: the bundled sample)")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--l3", default=None, metavar="URL", help="redis://HOST:PORT or mooncake://HOST:PORT")
    p.add_argument("--routing", choices=("rr", "round-robin", "conversation"), default="rr")
    p.add_argument("--device-tokens", type=int, default=512000, help="per instance")
    p.add_argument("--host-tokens", type=int, default=4096000, help="per instance")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--layers", type=int, default=2, help="model layers of the llama-3-8b preset")
    p.add_argument("--page-tokens", type=int, default=512, help="tokens per page (one trace block by default)")
    p.add_argument("--byte-scale", type=int, default=1024)
    p.add_argument("--write-policy", default="host_write")
    p.add_argument("--prefetch-units", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=2.0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    _one_thread()
    layout = preset("llama-3-8b", num_layers=args.layers, page_tokens=args.page_tokens)
    a = layout.alignment
    trace = load_trace(args.trace, limit=args.limit)
    router = "round-robin" if args.routing == "rr" else args.routing
    opts = L3Options(model="llama-3-8b", write_policy=args.write_policy, prefetch_units=args.prefetch_units,
                     deadline_s=args.deadline_s)
    if args.l3:
        from kvtier.transfer.store import open_store

        store = open_store(args.l3)  # fail early on a bad URL
        opts = replace(opts, lease_s=float(store.lease_s))  # the store's read leases are honoured
        store.close()
    setup = MultiSetup(args.instances, router, args.device_tokens // a, args.host_tokens // a, args.l3, opts,
                       args.byte_scale)
    rep = run_multi(load_requests(trace, layout), route_requests(trace.requests, args.instances, router,
                                                                 trace.block_tokens), layout, setup)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report_json(rep), f, indent=1)
    return 0


def _one_thread() -> None:
    """One torch thread: the replay's small indexed copies run one after the other on this
    thread, and intra-op threads only spin (a 1,500-request slice ran 2.5x faster with one)."""
    import torch

    torch.set_num_threads(1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
