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
    ...
    server.close()

or register the collector in an engine's own registry (``registry.register(collector)``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server  # type: ignore[import-not-found,unused-ignore]
from prometheus_client.core import (  # type: ignore[import-not-found,unused-ignore]
    CounterMetricFamily,
    GaugeMetricFamily,
)
from prometheus_client.registry import Collector  # type: ignore[import-not-found,unused-ignore]

from kvtier.fsm import Direction
from kvtier.fsm.request.counters import KNOWN_ABORT_REASONS, OUTCOMES
from kvtier.fsm.lifecycle.spec import load_spec

__all__ = ["PREFIX", "KvtierCollector", "MetricsServer", "serve"]

#: Every series' name starts with this.
PREFIX = "kvtier:"
_TIERS = ("device", "host")
_DIRECTIONS = tuple(d.value for d in Direction)
#: request lifecycle states, from the spec (spec/lifecycle.toml)
_REQUEST_STATES = tuple(load_spec().request.state_names)


class KvtierCollector(Collector):  # type: ignore[misc,unused-ignore]
    """Scrape-time collector of one cache (and optionally its transfer engine).

    Args:
        cache: a :class:`~kvtier.tiered.TieredCache`, or ``None`` (zeros exported until
            one is set: assign :attr:`cache` and :attr:`engine` to switch, e.g. per run).
        engine: anything with ``stats()`` returning :meth:`TransferEngine.stats`'s dict
            (its ``cumulative`` part is read), or ``None``.

    Thread safety: ``collect`` runs on the HTTP server's thread while the scheduler
    drives the cache; it only reads plain counters and dict/list snapshots, retrying
    once if a container changed size under it (the values are then at most one call old).
    """

    def __init__(self, cache: Any = None, engine: Any = None) -> None:
        self.cache = cache
        self.engine = engine

    def describe(self) -> list[Any]:
        return []  # no registration-time collect (the cache may not exist yet)

    def collect(self) -> Iterator[Any]:
        for attempt in range(3):
            try:
                families = self._families()
                break
            except RuntimeError:  # a dict changed size during a read on the scheduler's thread
                if attempt == 2:
                    raise
        yield from families

    # -- building ------------------------------------------------------------------------
    def _families(self) -> list[Any]:
        cache = self.cache
        stats: dict[str, Any] = cache.stats() if cache is not None else {}
        fac: dict[str, Any] = stats.get("facade", {})
        eng: dict[str, Any] = {}
        if self.engine is not None:
            eng = self.engine.stats().get("cumulative", {})
        groups = [g.name for g in cache.layout.groups] if cache is not None else []
        out: list[Any] = []

        def counter(name: str, doc: str, value: float) -> None:
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], value)
            out.append(c)

        def labelled(kind: type, name: str, doc: str, labels: list[str],
                     rows: list[tuple[list[str], float]]) -> None:
            m = kind(PREFIX + name, doc, labels=labels)
            for values, v in rows:
                m.add_metric(values, v)
            out.append(m)

        counter("prompt_tokens", "Prompt tokens of admitted requests.", fac.get("prompt_tokens", 0))
        labelled(CounterMetricFamily, "prompt_tokens_cached", "Prefix-hit tokens of admitted requests, by source.",
                 ["source"], [(["device"], fac.get("hit_tokens_device", 0)),
                              (["host"], fac.get("hit_tokens_host", 0))])
        counter("requests_admitted", "Requests admitted.", fac.get("admissions", 0))
        counter("requests_resumed", "Retracted requests re-admitted.", fac.get("resumptions", 0))
        counter("retractions", "Requests preempted (retracted).", fac.get("retractions", 0))
        aborts = dict.fromkeys(KNOWN_ABORT_REASONS, 0)
        aborts.update(fac.get("aborts", {}))
        labelled(CounterMetricFamily, "aborts", "Requests that ended aborted, by reason.", ["reason"],
                 [([r], n) for r, n in sorted(aborts.items())])
        settled = fac.get("settled", {})
        labelled(CounterMetricFamily, "operations", "Transfer operations that ended, by direction and outcome.",
                 ["direction", "outcome"],
                 [([d, o], settled.get(f"{d}/{o}", 0)) for d in _DIRECTIONS for o in OUTCOMES])
        labelled(CounterMetricFamily, "transfer_bytes", "Bytes the transfer engine copied, by direction.",
                 ["direction"], [([d], eng.get(d, {}).get("bytes", 0)) for d in _DIRECTIONS])
        labelled(CounterMetricFamily, "transfer_seconds", "Timed copy seconds of the transfer engine, by direction.",
                 ["direction"], [([d], eng.get(d, {}).get("seconds", 0.0)) for d in _DIRECTIONS])
        labelled(CounterMetricFamily, "transfer_pages", "Pages the core's operations moved, by direction.",
                 ["direction"], [(["writeback"], stats.get("pages_written", 0)),
                                 (["loadback"], stats.get("pages_loaded", 0))])
        labelled(CounterMetricFamily, "evictions", "Nodes evicted from a tier.", ["tier"],
                 [(["device"], stats.get("device_evictions", 0)), (["host"], stats.get("host_evictions", 0))])
        counter("demotions", "Device copies released while the host copy is kept.", stats.get("demotions", 0))
        counter("host_drops", "Host copies shed while the device copy is kept.", stats.get("host_drops", 0))
        counter("joined_loadbacks", "Admissions that joined a loadback already in flight.",
                stats.get("joined_loadbacks", 0))
        counter("late_completions_absorbed", "Completions that arrived after their operation's deadline.",
                stats.get("absorbed_late_completions", 0))
        counter("lifecycle_transitions", "Node lifecycle triggers fired.", stats.get("triggers", 0))
        counter("invariant_checks", "check_invariants() calls.", fac.get("invariant_checks", 0))
        counter("invariant_check_failures", "check_invariants() calls that raised.", fac.get("invariant_failures", 0))

        used: list[tuple[list[str], float]] = []
        free: list[tuple[list[str], float]] = []
        pinned = dict.fromkeys(groups, 0)
        locked = dict.fromkeys(groups, 0)
        in_flight = dict.fromkeys(_DIRECTIONS, 0)
        states = dict.fromkeys(_REQUEST_STATES, 0)
        if cache is not None:
            core = cache.core
            pools = {"device": core.device, "host": core.host or {}}
            for tier in _TIERS:
                for g in groups:
                    alloc = pools[tier].get(g)
                    used.append(([tier, g], alloc.used if alloc is not None else 0))
                    free.append(([tier, g], alloc.free if alloc is not None else 0))
            for n in core.nodes():
                if n.host_pin:
                    for g, p in n.host.items():
                        pinned[g] += len(p)
                    for g, p in n.host_ckpt.items():
                        pinned[g] += len(p)
                if n.lock_ref:
                    for g, p in n.dev.items():
                        locked[g] += len(p)
                    for g, p in n.dev_ckpt.items():
                        locked[g] += len(p)
            for d in Direction:
                in_flight[d.value] = core.ops_in_flight(d)
            for view in cache.requests():
                states[view.state] = states.get(view.state, 0) + 1
        else:
            used = [([t, g], 0) for t in _TIERS for g in groups]
            free = list(used)
        labelled(GaugeMetricFamily, "pages_used", "Pool pages in use, by tier and cache group.", ["tier", "group"], used)
        labelled(GaugeMetricFamily, "pages_free", "Pool pages free, by tier and cache group.", ["tier", "group"], free)
        labelled(GaugeMetricFamily, "pages_pinned", "Host pages pinned by loadbacks in flight, by cache group.",
                 ["group"], [([g], n) for g, n in pinned.items()])
        labelled(GaugeMetricFamily, "pages_locked", "Device pages locked by running requests, by cache group.",
                 ["group"], [([g], n) for g, n in locked.items()])
        labelled(GaugeMetricFamily, "operations_in_flight", "Transfer operations issued and not yet settled.",
                 ["direction"], [([d], n) for d, n in in_flight.items()])
        labelled(GaugeMetricFamily, "requests", "Requests the cache tracks, by lifecycle state.", ["state"],
                 [([s], n) for s, n in states.items()])
        return out


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
