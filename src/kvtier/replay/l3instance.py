"""One instance of the multi-instance replay (:mod:`kvtier.replay.l3replay`): its cache, its
real-bytes executor, its scheduler and, with a store URL, its L3 tier and store lanes; and
the counts it keeps (:class:`InstanceResult`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.fsm import units_to_pages
from kvtier.fsm.l3 import L3Options, L3Stats, StoreCommand, StoreOp, StoreResult
from kvtier.fsm.layout import CacheLayout

from ..scheduler import ReferenceScheduler, SchedRequest
from ..tiered import TieredCache
from .fingerprint import BytesExecutor, scaled_layout

__all__ = ["InstanceResult", "Instance"]


@dataclass
class InstanceResult:
    """One instance's (or the aggregate's) counts.

    Attributes:
        name: ``i0`` .. or ``all``.
        requests, prompt_tokens: served.
        hit_tokens: prefix-hit tokens in total; ``device_hit_tokens``, ``host_hit_tokens``
            (host copies this instance wrote) and ``l3_hit_tokens`` (host copies an L3 get
            brought) split it.
        l3_bytes_in, l3_bytes_out: (scaled) bytes read from / written to the store.
        l3_get_seconds: backend seconds of exists and gets (the prefetch path).
        l3_wait_seconds: wall seconds requests waited for their prefetch.
        l3_asked: requests whose prefetch asked the store (a batch exists).
        l3_failures: L3 keys not delivered or not stored, expired ops and backend errors.
        fingerprint_pages_checked: hit pages checked against their fingerprint.
        device_only_requests: requests whose whole hit came from the device (hit > 0, no
            host or L3 tokens); ``device_only_seconds`` their serve wall time (prefetch,
            scheduler, offer), ``device_only_prefetch_seconds`` the part spent on the L3
            prefetch, ``device_only_asked`` how many of them asked the store.
        l3: the instance's :class:`kvtier.fsm.l3.L3Stats` as a dict (L3 run only).
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
    l3_asked: int = 0
    l3_failures: int = 0
    fingerprint_pages_checked: int = 0
    device_only_requests: int = 0
    device_only_seconds: float = 0.0
    device_only_prefetch_seconds: float = 0.0
    device_only_asked: int = 0
    l3: dict[str, Any] = field(default_factory=dict)
    device_only_times: list[float] = field(default_factory=list, repr=False)
    device_only_sched_times: list[float] = field(default_factory=list, repr=False)
    device_only_prefetch_times: list[float] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (per-request times summarised as their median, in seconds)."""
        d = asdict(self)
        times, sched = d.pop("device_only_times"), d.pop("device_only_sched_times")
        asked = d.pop("device_only_prefetch_times")
        d["device_only_asked_median_prefetch_seconds"] = statistics.median(asked) if asked else 0.0
        d["hit_rate"] = self.hit_rate
        d["device_only_median_seconds"] = statistics.median(times) if times else 0.0
        d["device_only_median_scheduler_cpu_seconds"] = statistics.median(sched) if sched else 0.0
        return d


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


class _Lanes:
    """Two :class:`~kvtier.transfer.store.StoreDriver` threads over two connections to one
    store: the prefetch lane (exists, get) and the write lane (put, remove), so a request's
    prefetch never queues behind the puts of the request before it (a driver runs its
    commands in submission order)."""

    def __init__(self, url: str, timeout_s: float, io: Any) -> None:
        from kvtier.transfer.store import StoreDriver, open_store

        self.fetch = StoreDriver(open_store(url, timeout_s=timeout_s), io)
        self.write = StoreDriver(open_store(url, timeout_s=timeout_s), io)

    def submit(self, commands: Sequence[StoreCommand]) -> None:
        self.fetch.submit([c for c in commands if c.kind in (StoreOp.EXISTS, StoreOp.GET)])
        self.write.submit([c for c in commands if c.kind not in (StoreOp.EXISTS, StoreOp.GET)])

    def poll(self) -> list[StoreResult]:
        out: list[StoreResult] = self.fetch.poll()
        out.extend(self.write.poll())
        return out

    def wait(self, timeout_s: float) -> bool:
        """Wait on the prefetch lane (what a waiting request needs)."""
        return bool(self.fetch.wait(timeout_s))

    def cancel(self, op_id: int) -> None:
        self.fetch.cancel(op_id)
        self.write.cancel(op_id)

    def close(self) -> None:
        self.fetch.close()
        self.write.close()


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
        eviction, exclusive: the core's eviction policy and exclusive host tier.
        clock: the L3 tier's clock in seconds (its deadlines and leases), default
            ``time.monotonic``; a test gives a clock it controls, so that no deadline depends
            on the machine's speed or load.
        settle_puts: after each request's offer, wait until its puts have ended, so the next
            request (on any instance) sees them: with a clock that does not run out, the
            replay's counts are then the same on every run. Off by default: a real fleet
            does not wait.
    """

    def __init__(self, name: str, layout: CacheLayout, device_units: int, host_units: int,
                 store_url: str | None = None, options: L3Options | None = None, byte_scale: int = 1024,
                 seed: int = 0, policy: str = "write_through", eviction: str = "lru", exclusive: bool = False,
                 clock: Callable[[], float] = time.monotonic, settle_puts: bool = False) -> None:
        self.name = name
        self.clock = clock
        self.settle_puts = settle_puts
        self.cache = TieredCache(layout, device_units, host_units, policy=policy, eviction=eviction,
                                 exclusive=exclusive, l3=(options or L3Options()) if store_url else None)
        self.executor = _Executor(scaled_layout(layout, byte_scale), units_to_pages(layout, device_units),
                                  units_to_pages(layout, host_units), "cpu", salt=seed)
        self.sched = ReferenceScheduler(self.cache, self.executor)
        self.result = InstanceResult(name)
        self.driver = None
        if store_url is not None:
            from kvtier.transfer.store import HostPageIO

            assert self.cache.l3 is not None
            io = HostPageIO.from_pool(self.executor.layout, self.executor.host)
            self.driver = _Lanes(store_url, self.cache.l3.options.deadline_s, io)

    def _pump(self) -> None:
        l3, drv = self.cache.l3, self.driver
        assert l3 is not None and drv is not None
        now = self.clock()
        for res in drv.poll():
            l3.complete(res, now)
        l3.expire(now, drv.cancel)
        drv.submit(l3.poll_commands())

    def serve(self, req: SchedRequest) -> None:
        """Prefetch from L3 (bounded by the deadline), run ``req`` to its end, offer to L3."""
        l3, drv = self.cache.l3, self.driver
        fetched = 0
        asked = False
        t0 = time.perf_counter()
        if l3 is not None and drv is not None:
            self._pump()
            if l3.prefetch(req.request_id, req.units, self.clock()):
                asked = True
                self._pump()
                while l3.prefetching(req.request_id):
                    drv.wait(0.05)
                    self._pump()
                fetched = l3.fetched_units(req.request_id)
                l3.forget(req.request_id)
        t_prefetch = time.perf_counter() - t0
        self.result.l3_wait_seconds += t_prefetch
        st = self.sched.stats
        dev0, host0 = st.device_hit_tokens, st.host_hit_tokens
        c1 = time.thread_time()
        self.sched.run([req])
        t_run = time.thread_time() - c1  # this thread's CPU: other processes' load stays out
        dev, host = st.device_hit_tokens - dev0, st.host_hit_tokens - host0
        from_l3 = min(host, fetched * self.cache.layout.alignment)
        r = self.result
        r.requests += 1
        r.prompt_tokens += req.prompt_tokens
        r.device_hit_tokens += dev
        r.host_hit_tokens += host - from_l3
        r.l3_hit_tokens += from_l3
        r.hit_tokens += dev + host
        r.l3_asked += asked
        if l3 is not None:
            l3.offer(req.units, self.clock())
            self._pump()
            if self.settle_puts:
                self.flush()
        if dev > 0 and host == 0:
            took = time.perf_counter() - t0
            r.device_only_requests += 1
            r.device_only_seconds += took
            r.device_only_prefetch_seconds += t_prefetch
            r.device_only_asked += asked
            r.device_only_times.append(took)
            r.device_only_sched_times.append(t_run)
            if asked:
                r.device_only_prefetch_times.append(t_prefetch)

    def flush(self) -> None:
        """Wait for the store operations in flight to end (at most the deadline, in wall time:
        a bound against a store that never answers, whatever :attr:`clock` says)."""
        l3, drv = self.cache.l3, self.driver
        if l3 is not None and drv is not None:
            end = time.monotonic() + l3.options.deadline_s
            while l3.ops_in_flight() and time.monotonic() < end:
                drv.write.wait(0.01)
                drv.wait(0.01)
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
