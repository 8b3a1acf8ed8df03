"""Prometheus metrics for kvtier (the ``metrics`` extra: ``pip install 'kvtier[metrics]'``).

:class:`KvtierCollector` is a ``prometheus_client`` custom collector: it reads the facade's
statistics (:meth:`TieredCache.stats`, the pools' occupancy, operations in flight, the
tree's pinned and locked pages) and a transfer engine's (:meth:`TransferEngine.stats`)
at scrape time, so nothing is added to the cache's hot path. Every series of the table
below is exported on every scrape, zeros included (every label combination exists from
the start: a series that never appears reads as "no data", not as zero).

Names follow vLLM and SGLang (``vllm:``, ``sglang:``): the ``kvtier:`` prefix, counters
with ``_total`` on exposition, attribution by label (as vLLM's
``prompt_tokens_cached_by_source{source=...}``). Labels: ``tier`` (device, host),
``group`` (cache group), ``direction`` (writeback = D2H, loadback = H2D), ``outcome``
(ok, failed, deadline), ``source`` (device, host), ``reason`` (abort reason), ``state``
(request lifecycle state).

The label set is bounded: ``reason`` takes kvtier's own abort reasons
(:data:`kvtier.fsm.request.counters.KNOWN_ABORT_REASONS`), the first :data:`MAX_ABORT_REASONS` other
reasons in the order they first occurred, and ``other`` for every later one (an engine's
reason spelled ``other`` counts there too); a label value is cut to :data:`MAX_LABEL_CHARS`
characters and anything UTF-8 cannot encode (a lone surrogate) is written as a backslash
escape, label values that then coincide adding up.

==================================================  =======  ==========================================
name                                                type     what
==================================================  =======  ==========================================
kvtier:prompt_tokens_total                          counter  prompt tokens of admitted requests
kvtier:prompt_tokens_cached_total{source}           counter  prefix-hit tokens by where they were
kvtier:requests_admitted_total                      counter  admissions
kvtier:requests_resumed_total                       counter  retracted requests re-admitted
kvtier:retractions_total                            counter  requests preempted
kvtier:aborts_total{reason}                         counter  requests ended aborted, by reason
kvtier:operations_total{direction,outcome}          counter  transfer operations that ended
kvtier:transfer_bytes_total{direction}              counter  bytes the transfer engine copied
kvtier:transfer_seconds_total{direction}            counter  timed copy seconds of the engine
kvtier:transfer_pages_total{direction}              counter  pages the core moved (ops issued)
kvtier:evictions_total{tier}                        counter  nodes evicted from a tier
kvtier:demotions_total                              counter  device copies released (host kept)
kvtier:host_drops_total                             counter  host copies shed (device kept)
kvtier:joined_loadbacks_total                       counter  admissions that joined a loadback
kvtier:late_completions_absorbed_total              counter  completions after a deadline
kvtier:lifecycle_transitions_total                  counter  node lifecycle triggers
kvtier:invariant_checks_total                       counter  check_invariants() calls
kvtier:invariant_check_failures_total               counter  of which raised
kvtier:pages_used{tier,group}                       gauge    pool pages in use
kvtier:pages_free{tier,group}                       gauge    pool pages free
kvtier:pages_pinned{group}                          gauge    host pages pinned by loadbacks
kvtier:pages_locked{group}                          gauge    device pages locked by running requests
kvtier:operations_in_flight{direction}              gauge    operations issued and not settled
kvtier:requests{state}                              gauge    requests tracked, by lifecycle state
==================================================  =======  ==========================================

Serving::

    from kvtier.metrics import KvtierCollector, serve
    collector = KvtierCollector(cache, engine)      # engine optional
    server = serve(collector, port=9400)             # http://127.0.0.1:9400/metrics
    with collector.driving():                        # on the thread that drives the cache
        while serving:
            ...                                      # one scheduler step
            collector.step()                         # between steps: hands a waiting scrape its snapshot
    server.close()

or register the collector in an engine's own registry (``registry.register(collector)``).

Consistency: while a thread drives the cache inside :meth:`KvtierCollector.driving`, a scrape
never reads the cache itself: it asks for a snapshot and waits (at most ``snapshot_wait_s``)
for the driving thread's next :meth:`~KvtierCollector.step`, which reads every value at one
point between two steps into immutable tuples (an attribute test per step when no scrape
waits; the driving thread never waits for a scrape). Outside :meth:`~KvtierCollector.driving`
a scrape reads the cache on the server's thread: right before or after a run, or when the
engine calls into the cache from that thread only.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server  # type: ignore[import-not-found,unused-ignore]
from prometheus_client.core import (  # type: ignore[import-not-found,unused-ignore]
    CounterMetricFamily,
    GaugeMetricFamily,
)
from prometheus_client.registry import Collector  # type: ignore[import-not-found,unused-ignore]

from kvtier.fsm import ConfigError, Direction
from kvtier.fsm.checks import finite
from kvtier.fsm.request.counters import KNOWN_ABORT_REASONS, OUTCOMES
from kvtier.fsm.lifecycle.spec import load_spec

from .tiered import TieredCache

__all__ = ["MAX_ABORT_REASONS", "MAX_LABEL_CHARS", "PREFIX", "KvtierCollector", "MetricsServer", "serve"]

#: Every series' name starts with this.
PREFIX = "kvtier:"
#: Abort reasons besides kvtier's own exported under their own ``reason`` label (the first
#: ones to occur); later ones are counted under ``reason="other"``.
MAX_ABORT_REASONS = 16
#: Longest label value exported, in characters (longer ones are cut).
MAX_LABEL_CHARS = 128
_OTHER = "other"
_TIERS = ("device", "host")
_DIRECTIONS = tuple(d.value for d in Direction)
#: request lifecycle states, from the spec (spec/lifecycle.toml)
_REQUEST_STATES = tuple(load_spec().request.state_names)


def _label(value: str) -> str:
    """``value`` as a label value UTF-8 can encode, at most :data:`MAX_LABEL_CHARS` long."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")[:MAX_LABEL_CHARS]


def _abort_rows(aborts: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """The ``reason`` rows: kvtier's reasons (zeros included), the first
    :data:`MAX_ABORT_REASONS` others in the order they occurred, then ``other``."""
    rows = dict.fromkeys(KNOWN_ABORT_REASONS + (_OTHER,), 0)
    own = 0
    for reason, n in aborts.items():  # insertion order: the order the reasons first occurred
        if reason not in KNOWN_ABORT_REASONS:
            own += reason != _OTHER
            if reason == _OTHER or own > MAX_ABORT_REASONS:
                reason = _OTHER
        rows[reason] = rows.get(reason, 0) + n
    return tuple(rows.items())


@dataclass(frozen=True)
class _Snapshot:
    """Every exported value, read at one point (plain numbers and tuples)."""

    scalars: tuple[tuple[str, float], ...]
    aborts: tuple[tuple[str, int], ...]
    settled: tuple[tuple[str, float], ...]
    engine: tuple[tuple[str, float, float], ...]  # direction, bytes, seconds
    pools: tuple[tuple[str, str, int, int], ...]  # tier, group, used, free
    pinned: tuple[tuple[str, int], ...]
    locked: tuple[tuple[str, int], ...]
    in_flight: tuple[tuple[str, int], ...]
    states: tuple[tuple[str, int], ...]


def _number(value: object, what: str) -> float:
    """A counter value of the engine's: a finite number >= 0 (numpy scalars too), as a plain
    int or float."""
    if not isinstance(value, bool) and isinstance(value, numbers.Real) and finite(value) and float(value) >= 0:
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    raise ConfigError(f"KvtierCollector: {what} must be a finite number >= 0, got {value!r}")


def _engine_rows(engine: Any) -> tuple[tuple[str, float, float], ...]:
    if engine is None:
        return tuple((d, 0, 0.0) for d in _DIRECTIONS)
    stats = engine.stats()
    cum = stats.get("cumulative", {}) if isinstance(stats, dict) else None
    if not isinstance(cum, dict) or not all(isinstance(cum.get(d, {}), dict) for d in _DIRECTIONS):
        raise ConfigError(f"KvtierCollector: engine.stats() must return TransferEngine.stats()'s dict "
                          f"(a 'cumulative' dict per direction), got {stats!r:.200}")
    return tuple((d, _number(cum.get(d, {}).get("bytes", 0), f"engine {d} bytes"),
                  _number(cum.get(d, {}).get("seconds", 0.0), f"engine {d} seconds")) for d in _DIRECTIONS)


def _read(cache: TieredCache | None, engine: Any) -> _Snapshot:
    """Read every value of ``cache`` and ``engine`` (on a thread where they do not change)."""
    stats: dict[str, Any] = cache.stats() if cache is not None else {}
    fac: dict[str, Any] = stats.get("facade", {})
    groups = [g.name for g in cache.layout.groups] if cache is not None else []
    scalars = {k: fac.get(k, 0) for k in ("prompt_tokens", "hit_tokens_device", "hit_tokens_host", "admissions",
                                          "resumptions", "retractions", "invariant_checks", "invariant_failures")}
    scalars.update({k: stats.get(k, 0) for k in (
        "pages_written", "pages_loaded", "device_evictions", "host_evictions", "demotions", "host_drops",
        "joined_loadbacks", "absorbed_late_completions", "triggers")})
    pools: list[tuple[str, str, int, int]] = []
    pinned = dict.fromkeys(groups, 0)
    locked = dict.fromkeys(groups, 0)
    in_flight = dict.fromkeys(_DIRECTIONS, 0)
    states = dict.fromkeys(_REQUEST_STATES, 0)
    if cache is not None:
        core = cache.core
        tiers = {"device": core.device, "host": core.host or {}}
        for tier in _TIERS:
            for g in groups:
                alloc = tiers[tier].get(g)
                pools.append((tier, g, alloc.used if alloc is not None else 0, alloc.free if alloc is not None else 0))
        for n in core.nodes():
            if n.host_pin:
                for pm in (n.host, n.host_ckpt):
                    for g, p in pm.items():
                        pinned[g] += len(p)
            if n.lock_ref:
                for pm in (n.dev, n.dev_ckpt):
                    for g, p in pm.items():
                        locked[g] += len(p)
        for d in Direction:
            in_flight[d.value] = core.ops_in_flight(d)
        for view in cache.requests():
            states[view.state] = states.get(view.state, 0) + 1
    settled = fac.get("settled", {})
    return _Snapshot(tuple(scalars.items()), _abort_rows(fac.get("aborts", {})),
                     tuple((f"{d}/{o}", settled.get(f"{d}/{o}", 0)) for d in _DIRECTIONS for o in OUTCOMES),
                     _engine_rows(engine), tuple(pools), tuple(pinned.items()), tuple(locked.items()),
                     tuple(in_flight.items()), tuple(states.items()))


class KvtierCollector(Collector):  # type: ignore[misc,unused-ignore]
    """Scrape-time collector of one cache (and optionally its transfer engine).

    Args:
        cache: a :class:`~kvtier.tiered.TieredCache`, or ``None`` (zeros exported until
            one is set: assign :attr:`cache` and :attr:`engine` to switch, e.g. per run).
        engine: anything with a ``stats()`` method returning :meth:`TransferEngine.stats`'s
            dict (its ``cumulative`` part is read), or ``None``.
        snapshot_wait_s: how long a scrape waits for the driving thread's snapshot (a
            finite number of seconds > 0; see :meth:`driving`); past it the scrape serves
            the last snapshot taken.

    Raises:
        ConfigError: ``cache`` not a TieredCache or ``None``, ``engine`` without a
            ``stats()`` method, a bad ``snapshot_wait_s`` (also when assigned later); at
            scrape time, an ``engine.stats()`` that is not such a dict, or whose bytes or
            seconds are not finite numbers >= 0.
    """

    def __init__(self, cache: TieredCache | None = None, engine: Any = None, *,
                 snapshot_wait_s: float = 2.0) -> None:
        if isinstance(snapshot_wait_s, bool) or not isinstance(snapshot_wait_s, (int, float)) \
                or not finite(snapshot_wait_s) or snapshot_wait_s <= 0:
            raise ConfigError(f"KvtierCollector: snapshot_wait_s must be a finite number of seconds > 0, "
                              f"got {snapshot_wait_s!r}")
        self.snapshot_wait_s = float(snapshot_wait_s)
        self._cond = threading.Condition()
        self._wanted = False  # a scrape waits for the driving thread's snapshot
        self._driven = False
        self._driver = 0  # the driving thread's id
        self._taken = 0  # snapshots the driving thread took
        self._last: _Snapshot | Exception | None = None  # the last snapshot, or why it failed
        self.cache = cache
        self.engine = engine

    @property
    def cache(self) -> TieredCache | None:
        """The cache read (``None``: zeros)."""
        return self._cache

    @cache.setter
    def cache(self, cache: TieredCache | None) -> None:
        if cache is not None and not isinstance(cache, TieredCache):
            raise ConfigError(f"KvtierCollector: cache must be a kvtier.TieredCache or None, got {cache!r}")
        self._cache = cache

    @property
    def engine(self) -> Any:
        """The transfer engine read (``None``: zeros)."""
        return self._engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        if engine is not None and not callable(getattr(engine, "stats", None)):
            raise ConfigError(f"KvtierCollector: engine must have a stats() method (a TransferEngine) or be "
                              f"None, got {engine!r}")
        self._engine = engine

    def describe(self) -> list[Any]:
        return []  # no registration-time collect (the cache may not exist yet)

    # -- the driving thread ---------------------------------------------------------------
    @contextmanager
    def driving(self) -> Iterator[None]:
        """``with collector.driving():`` around the loop of the thread that drives the cache,
        which calls :meth:`step` between its steps: meanwhile scrapes take their values
        from those snapshots and never read the cache themselves (a scrape on the driving
        thread itself reads it directly)."""
        with self._cond:
            self._driven = True
            self._driver = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                self._driven = False
                self._cond.notify_all()  # a waiting scrape reads the cache itself now

    def step(self) -> None:
        """Between two steps of the driving thread: if a scrape waits, read every value
        now, into an immutable snapshot, and hand it over (one attribute test otherwise).
        Never raises: an error reading (e.g. a bad ``engine.stats()``) is raised by the
        scrape, and the driving thread goes on."""
        if self._wanted:
            snap: _Snapshot | Exception
            try:
                snap = _read(self._cache, self._engine)
            except Exception as exc:  # the scrape's failure, not the scheduler's
                snap = exc
            with self._cond:
                self._last = snap
                self._taken += 1
                self._wanted = False
                self._cond.notify_all()

    def _snapshot(self) -> _Snapshot:
        last = None
        with self._cond:
            if self._driven and threading.get_ident() != self._driver:
                taken = self._taken
                self._wanted = True
                self._cond.wait_for(lambda: self._taken != taken or not self._driven, timeout=self.snapshot_wait_s)
                if self._taken != taken or self._driven:
                    last = self._last  # fresh, or (the driving thread is between steps for long) the last one
        if isinstance(last, Exception):
            raise last
        return last if last is not None else _read(self._cache, self._engine)  # nothing drives the cache

    # -- building ------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        scalars = dict(snap.scalars)
        out: list[Any] = []

        def counter(name: str, doc: str, key: str) -> None:
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], scalars[key])
            out.append(c)

        def labelled(kind: type, name: str, doc: str, labels: list[str], rows: Any) -> None:
            sums: dict[tuple[str, ...], float] = {}  # label values that coincide once encodable add up
            for *values, v in rows:
                key = tuple(_label(x) for x in values)
                sums[key] = sums.get(key, 0) + v
            m = kind(PREFIX + name, doc, labels=labels)
            for key, v in sums.items():
                m.add_metric(list(key), v)
            out.append(m)

        counter("prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens")
        labelled(CounterMetricFamily, "prompt_tokens_cached", "Prefix-hit tokens of admitted requests, by source.",
                 ["source"], [("device", scalars["hit_tokens_device"]), ("host", scalars["hit_tokens_host"])])
        counter("requests_admitted", "Requests admitted.", "admissions")
        counter("requests_resumed", "Retracted requests re-admitted.", "resumptions")
        counter("retractions", "Requests preempted (retracted).", "retractions")
        labelled(CounterMetricFamily, "aborts", "Requests that ended aborted, by reason.", ["reason"],
                 sorted(snap.aborts))
        labelled(CounterMetricFamily, "operations", "Transfer operations that ended, by direction and outcome.",
                 ["direction", "outcome"], [(*k.split("/"), n) for k, n in snap.settled])
        labelled(CounterMetricFamily, "transfer_bytes", "Bytes the transfer engine copied, by direction.",
                 ["direction"], [(d, b) for d, b, _ in snap.engine])
        labelled(CounterMetricFamily, "transfer_seconds", "Timed copy seconds of the transfer engine, by direction.",
                 ["direction"], [(d, s) for d, _, s in snap.engine])
        labelled(CounterMetricFamily, "transfer_pages", "Pages the core's operations moved, by direction.",
                 ["direction"], [("writeback", scalars["pages_written"]), ("loadback", scalars["pages_loaded"])])
        labelled(CounterMetricFamily, "evictions", "Nodes evicted from a tier.", ["tier"],
                 [("device", scalars["device_evictions"]), ("host", scalars["host_evictions"])])
        counter("demotions", "Device copies released while the host copy is kept.", "demotions")
        counter("host_drops", "Host copies shed while the device copy is kept.", "host_drops")
        counter("joined_loadbacks", "Admissions that joined a loadback already in flight.", "joined_loadbacks")
        counter("late_completions_absorbed", "Completions that arrived after their operation's deadline.",
                "absorbed_late_completions")
        counter("lifecycle_transitions", "Node lifecycle triggers fired.", "triggers")
        counter("invariant_checks", "check_invariants() calls.", "invariant_checks")
        counter("invariant_check_failures", "check_invariants() calls that raised.", "invariant_failures")
        labelled(GaugeMetricFamily, "pages_used", "Pool pages in use, by tier and cache group.", ["tier", "group"],
                 [(t, g, used) for t, g, used, _ in snap.pools])
        labelled(GaugeMetricFamily, "pages_free", "Pool pages free, by tier and cache group.", ["tier", "group"],
                 [(t, g, free) for t, g, _, free in snap.pools])
        labelled(GaugeMetricFamily, "pages_pinned", "Host pages pinned by loadbacks in flight, by cache group.",
                 ["group"], snap.pinned)
        labelled(GaugeMetricFamily, "pages_locked", "Device pages locked by running requests, by cache group.",
                 ["group"], snap.locked)
        labelled(GaugeMetricFamily, "operations_in_flight", "Transfer operations issued and not yet settled.",
                 ["direction"], snap.in_flight)
        labelled(GaugeMetricFamily, "requests", "Requests the cache tracks, by lifecycle state.", ["state"],
                 snap.states)
        yield from out


@dataclass
class MetricsServer:
    """A running metrics endpoint (:func:`serve`).

    Attributes:
        port: the port it listens on (the one asked for, or the one the OS chose for 0).
        registry: the registry it serves (holds the collector).
    """

    port: int
    registry: Any
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        """Stop serving and wait for the server thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(collector: KvtierCollector, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``collector`` at ``http://ADDR:PORT/metrics`` (Prometheus text format) from a
    daemon thread, in a registry of its own (no process or platform collectors).

    Args:
        port: TCP port (0: any free one; see :attr:`MetricsServer.port`).
        addr: address to bind (default loopback only).

    Raises:
        ValueError: ``port`` not in 0..65535.
        OSError: the port cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an int in 0..65535, got {port!r}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server.server_address[1], registry, server, thread)
