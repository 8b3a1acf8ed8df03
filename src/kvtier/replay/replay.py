"""Trace replay: push a request trace through the reference scheduler, the tiered cache and
a transfer backend, for three configurations of the same trace: device cache only,
device plus host tier, and an unbounded cache (the upper bound).

The exact counts (hit tokens, prefill tokens computed, bytes and pages moved) are the
headline; times to first token come from the scheduler's cost model and are labelled
modeled. ``--json`` output: one object per configuration with the fields of
:class:`ConfigResult` (documented there), plus a ``"setup"`` object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.fsm import ConfigError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.presets import preset

from ..scheduler import Executor, InstantExecutor, ReferenceScheduler, SchedRequest, percentile
from ..tiered import TieredCache
from .costmodel import CostModel
from .trace import MOONCAKE_BLOCK_TOKENS, Trace

__all__ = ["ReplaySetup", "ConfigResult", "trace_requests", "run_replay", "run_config", "make_executor",
           "working_set_units", "capacity_bounds", "format_table", "run_title", "to_json"]


@dataclass(frozen=True, slots=True)
class ReplaySetup:
    """The options of one replay (capacities in cache units of ``layout.alignment`` tokens).

    Attributes:
        preset: model preset name.
        device_units: device capacity of the bounded configurations.
        host_units: host capacity of the device-plus-host configuration.
        policy: write policy.
        eviction: eviction policy (``lru``, ``lru_turns`` or ``lru2``).
        exclusive: an exclusive host tier (host eviction drops duplicates first).
        backend: ``none`` (metadata only), ``cpu``, ``torch`` or ``numba``.
        byte_scale: bytes per page are divided by this for real copies (at least 64 B kept).
        limit: requests replayed (``None``: all).
        seed: seed of anything random (the fingerprints' salt).
        token_budget: tokens per scheduler step.
        preset_params: preset parameter overrides, e.g. ``(("num_layers", 8),)`` or
            ``(("num_layers", 1), ("ratios", (4,)))``.
    """

    preset: str = "deepseek-v4"
    device_units: int = 0
    host_units: int = 0
    policy: str = "write_through_selective"
    eviction: str = "lru"
    exclusive: bool = False
    backend: str = "none"
    byte_scale: int = 1024
    limit: int | None = None
    seed: int = 0
    token_budget: int = 8192
    preset_params: tuple[tuple[str, int | tuple[int, ...]], ...] = ()

    def layout(self) -> CacheLayout:
        """The preset's layout with ``preset_params`` applied."""
        return preset(self.preset, **dict(self.preset_params))


@dataclass
class ConfigResult:
    """One configuration's results (the ``--json`` schema: one object per configuration).

    Attributes:
        name: ``device-only``, ``device+host`` or ``unbounded``.
        device_tokens, host_tokens: capacities in tokens (``host_tokens`` 0 without a host tier).
        requests, finished, aborts: request counts.
        prompt_tokens: prompt tokens of the replayed requests.
        hit_tokens, device_hit_tokens, host_hit_tokens: prefix-hit tokens (exact-state hits).
        history_hit_tokens: the history-only bound (hits if continuation state were not needed).
        prefill_tokens: prompt (and recomputed) tokens computed.
        hit_rate: hit_tokens / prompt_tokens.
        hit_rate_vs_unbounded: hit_tokens / the unbounded configuration's hit_tokens.
        loadback_bytes, writeback_bytes, loadback_pages, writeback_pages: bytes and pages
            moved (full model geometry, whatever the byte scale).
        transfer_s_measured: seconds the backend spent moving (scaled) bytes (0 without one).
        transfer_s_modeled: the full-geometry bytes at the cost model's link rate.
        evictions, demotions, loadbacks, writebacks, retractions: counts.
        ttft_mean_s, ttft_p50_s, ttft_p99_s: modeled time to first token.
        bookkeeping_s: wall seconds spent inside the cache's calls (kvtier's bookkeeping;
            the scheduler's own loop and the backend's copies excluded).
        bookkeeping_us_per_request: that per request.
        decode_bookkeeping_us_per_request: of which the per-token calls of decode steps
            (reserve and step_done of one token), per request.
        lifecycle_triggers: node lifecycle triggers fired.
        wall_s: wall-clock seconds of the configuration's run.
        fingerprint_pages_checked: pages read back and checked against their fingerprint.
        abort_reasons: abort reason -> count.
        timeline: samples every 64 steps of (modeled seconds, hit rate so far, device pool
            used fraction, host pool used fraction).
    """

    name: str
    device_tokens: int
    host_tokens: int
    requests: int = 0
    finished: int = 0
    aborts: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    history_hit_tokens: int = 0
    prefill_tokens: int = 0
    hit_rate: float = 0.0
    hit_rate_vs_unbounded: float = 0.0
    loadback_bytes: int = 0
    writeback_bytes: int = 0
    loadback_pages: int = 0
    writeback_pages: int = 0
    transfer_s_measured: float = 0.0
    transfer_s_modeled: float = 0.0
    evictions: int = 0
    demotions: int = 0
    loadbacks: int = 0
    writebacks: int = 0
    retractions: int = 0
    ttft_mean_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    bookkeeping_s: float = 0.0
    bookkeeping_us_per_request: float = 0.0
    decode_bookkeeping_us_per_request: float = 0.0
    lifecycle_triggers: int = 0
    wall_s: float = 0.0
    fingerprint_pages_checked: int = 0
    abort_reasons: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, float, float, float]] = field(default_factory=list)


def _units_per_block(layout: CacheLayout) -> int:
    a = layout.alignment
    if MOONCAKE_BLOCK_TOKENS % a:
        raise ConfigError(f"preset {layout.name!r}: its alignment of {a} tokens does not divide the trace's "
                          f"{MOONCAKE_BLOCK_TOKENS}-token blocks")
    return MOONCAKE_BLOCK_TOKENS // a


def trace_requests(trace: Trace, layout: CacheLayout) -> list[SchedRequest]:
    """The trace's requests with unit keys: block id ``h`` of a 512-token block becomes the
    units ``(h, 0) .. (h, k-1)`` (k = 512 / alignment); only the prompt's full units are keyed."""
    k = _units_per_block(layout)
    a = layout.alignment
    out = []
    for tr in trace.requests:
        full = tr.input_length // a
        units: list[Hashable] = [(h, j) for h in tr.hash_ids for j in range(k)]
        del units[full:]
        out.append(SchedRequest(f"r{tr.index}", tr.arrival_s, tr.input_length, tr.output_length, tuple(units)))
    return out


def working_set_units(trace: Trace, layout: CacheLayout) -> int:
    """Distinct cache units of the trace's prompts (the unbounded working set)."""
    k = _units_per_block(layout)
    root: dict[Any, Any] = {}
    count = 0
    a = layout.alignment
    for tr in trace.requests:
        node = root
        units = [(h, j) for h in tr.hash_ids for j in range(k)][: tr.input_length // a]
        for u in units:
            nxt = node.get(u)
            if nxt is None:
                nxt = node[u] = {}
                count += 1
            node = nxt
    return count


def capacity_bounds(trace: Trace, layout: CacheLayout) -> tuple[int, int]:
    """``(longest, unbounded)`` in cache units: the units one request can hold at once (its
    prompt and output plus 2, for the longest request), and the capacity of the unbounded
    configuration (the working set plus that for every request), which never evicts."""
    reqs = trace.requests
    per = [(r.input_length + r.output_length) // layout.alignment + 2 for r in reqs]
    longest = max(per) if per else 1
    return longest, max(working_set_units(trace, layout) + sum(per), longest)


def run_config(name: str, requests: Sequence[SchedRequest], layout: CacheLayout, device_units: int,
               host_units: int | None, setup: ReplaySetup, executor: Executor | None = None,
               cost: CostModel | None = None, progress: Callable[[int], None] | None = None,
               on_start: Callable[[str, TieredCache, Executor], None] | None = None,
               on_step: Callable[[], None] | None = None) -> ConfigResult:
    """Run one configuration over fresh copies of ``requests``.

    Args:
        on_start: called with (name, cache, executor) before the first step (e.g. to point
            a metrics collector or an event recorder at this configuration's cache).
        on_step: called between steps (:meth:`ReferenceScheduler.run`).
    """
    cache = TieredCache(layout, device_units, host_units, policy=setup.policy, eviction=setup.eviction,
                        exclusive=setup.exclusive)
    reqs = [SchedRequest(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.units) for r in requests]
    sched = ReferenceScheduler(cache, executor, token_budget=setup.token_budget, cost=cost)
    if on_start is not None:
        on_start(name, cache, sched.executor)
    t0 = time.perf_counter()
    stats = sched.run(reqs, progress=progress, on_step=on_step)
    wall = time.perf_counter() - t0
    cs = cache.core.stats
    a = layout.alignment
    res = ConfigResult(
        name=name, device_tokens=device_units * a, host_tokens=(host_units or 0) * a, requests=len(reqs),
        finished=stats.finished, aborts=stats.aborts, prompt_tokens=stats.prompt_tokens,
        hit_tokens=stats.hit_tokens, device_hit_tokens=stats.device_hit_tokens,
        host_hit_tokens=stats.host_hit_tokens, history_hit_tokens=stats.history_hit_tokens,
        prefill_tokens=stats.prefill_tokens,
        hit_rate=stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        loadback_bytes=stats.loadback_bytes, writeback_bytes=stats.writeback_bytes,
        loadback_pages=stats.loadback_pages, writeback_pages=stats.writeback_pages,
        transfer_s_measured=sched.executor.transfer_seconds(),
        transfer_s_modeled=sched.cost.transfer_s(stats.loadback_bytes + stats.writeback_bytes),
        evictions=cs.device_evictions + cs.host_evictions, demotions=cs.demotions, loadbacks=cs.loadbacks,
        writebacks=cs.writebacks, retractions=stats.retractions,
        ttft_mean_s=sum(stats.ttft_s) / len(stats.ttft_s) if stats.ttft_s else 0.0,
        ttft_p50_s=percentile(stats.ttft_s, 0.5), ttft_p99_s=percentile(stats.ttft_s, 0.99),
        bookkeeping_s=stats.kvtier_s, bookkeeping_us_per_request=stats.kvtier_s / max(1, len(reqs)) * 1e6,
        decode_bookkeeping_us_per_request=stats.kvtier_decode_s / max(1, len(reqs)) * 1e6,
        lifecycle_triggers=cs.triggers, wall_s=wall, abort_reasons=dict(stats.abort_reasons),
        timeline=list(stats.timeline),
    )
    checked = getattr(sched.executor, "pages_checked", 0)
    res.fingerprint_pages_checked = int(checked)
    return res


def make_executor(setup: ReplaySetup, layout: CacheLayout, device_units: int, host_units: int | None) -> Executor:
    """The executor for ``setup.backend``: metadata only for ``none``, else real bytes at
    the scaled geometry with fingerprint checks."""
    if setup.backend == "none":
        return InstantExecutor()
    from kvtier.fsm import units_to_pages

    from .fingerprint import BytesExecutor, scaled_layout

    return BytesExecutor(scaled_layout(layout, setup.byte_scale), units_to_pages(layout, device_units),
                         units_to_pages(layout, host_units) if host_units else None, setup.backend, salt=setup.seed)


def run_replay(trace: Trace, setup: ReplaySetup, *,
               executor_factory: Callable[[CacheLayout, int, int | None], Executor] | None = None,
               progress: Callable[[str, int], Callable[[int], None]] | None = None,
               cost: CostModel | None = None,
               on_start: Callable[[str, TieredCache, Executor], None] | None = None,
               on_step: Callable[[], None] | None = None,
               ) -> tuple[list[ConfigResult], dict[str, Any]]:
    """Replay ``trace`` in the three configurations.

    Args:
        executor_factory: (layout, device units, host units) -> executor; default
            :func:`make_executor` for ``setup.backend``.
        on_start: as :func:`run_config`, for each configuration.
        on_step: as :func:`run_config`, for each configuration.

    Returns:
        The three results (device-only, device+host, unbounded) and a setup summary.
    """
    layout = setup.layout()
    reqs = trace_requests(trace, layout)
    ws = working_set_units(trace, layout)
    unbounded = capacity_bounds(trace, layout)[1]
    configs: list[tuple[str, int, int | None]] = [
        ("device-only", setup.device_units, None),
        ("device+host", setup.device_units, setup.host_units),
        ("unbounded", unbounded, None),
    ]
    results = []
    for name, dev, host in configs:
        ex = (executor_factory(layout, dev, host) if executor_factory is not None
              else make_executor(setup, layout, dev, host))
        cb = progress(name, len(reqs)) if progress is not None else None
        results.append(run_config(name, reqs, layout, dev, host, setup, ex, cost, cb, on_start, on_step))
    bound = results[-1].hit_tokens
    for r in results:
        r.hit_rate_vs_unbounded = r.hit_tokens / bound if bound else 0.0
    summary = {
        "trace": trace.source, "preset": layout.name, "alignment_tokens": layout.alignment, "requests": len(reqs),
        "working_set_units": ws, "working_set_tokens": ws * layout.alignment,
        "device_tokens": setup.device_units * layout.alignment, "host_tokens": setup.host_units * layout.alignment,
        "policy": setup.policy, "eviction": setup.eviction, "exclusive": setup.exclusive,
        "backend": setup.backend, "byte_scale": setup.byte_scale,
        "cost_model": (cost or CostModel()).describe(), "state_groups": [g.name for g in layout.state_groups],
    }
    return results, summary


#: (label, field or cell key, format, shown by default): the default table shows what a
#: user decides on; ``--verbose`` adds the internal counters.
ROWS: list[tuple[str, str, Callable[[Any], str], bool]] = [
    ("prompt tokens", "prompt_tokens", lambda v: f"{v:,}", True),
    ("prefix-hit tokens", "hit_tokens", lambda v: f"{v:,}", True),
    ("  from device", "device_hit_tokens", lambda v: f"{v:,}", True),
    ("  from host", "host_hit_tokens", lambda v: f"{v:,}", True),
    ("history-only bound", "history_hit_tokens", lambda v: f"{v:,}", False),
    ("prefill tokens computed (with recompute)", "prefill_tokens", lambda v: f"{v:,}", True),
    ("hit rate", "hit_rate", lambda v: f"{v:.2%}", True),
    ("hit rate vs unbounded", "hit_rate_vs_unbounded", lambda v: f"{v:.2%}", True),
    ("loadback bytes / pages", "loadback", lambda v: v, True),
    ("writeback bytes / pages", "writeback", lambda v: v, True),
    ("transfer s (measured)", "transfer_s_measured", lambda v: f"{v:.3f}", False),
    ("transfer s (modeled)", "transfer_s_modeled", lambda v: f"{v:.3f}", False),
    ("evictions / demotions", "evict", lambda v: v, True),
    ("loadbacks / writebacks", "ops", lambda v: v, False),
    ("retractions / aborts", "ra", lambda v: v, True),
    ("TTFT mean / p50 / p99 s (modeled)", "ttft", lambda v: v, True),
    ("kvtier bookkeeping us / request", "bookkeeping_us_per_request", lambda v: f"{v:,.0f}", True),
    ("  of which per-token decode calls", "decode_bookkeeping_us_per_request", lambda v: f"{v:,.0f}", False),
    ("lifecycle events / s", "events_per_s", lambda v: f"{v:,.0f}", False),
    ("lifecycle triggers", "lifecycle_triggers", lambda v: f"{v:,}", False),
    ("pages fingerprint-checked", "fingerprint_pages_checked", lambda v: f"{v:,}", False),
]


def _cell(r: ConfigResult, key: str, fmt: Callable[[Any], str]) -> str:
    if key == "loadback":
        return f"{r.loadback_bytes / 1e9:,.2f} GB / {r.loadback_pages:,}"
    if key == "writeback":
        return f"{r.writeback_bytes / 1e9:,.2f} GB / {r.writeback_pages:,}"
    if key == "evict":
        return f"{r.evictions:,} / {r.demotions:,}"
    if key == "ops":
        return f"{r.loadbacks:,} / {r.writebacks:,}"
    if key == "ra":
        return f"{r.retractions:,} / {r.aborts:,}"
    if key == "events_per_s":
        return f"{r.lifecycle_triggers / r.bookkeeping_s:,.0f}" if r.bookkeeping_s else "-"
    if key == "ttft":
        return f"{r.ttft_mean_s:.3f} / {r.ttft_p50_s:.3f} / {r.ttft_p99_s:.3f}"
    return fmt(getattr(r, key))


def format_table(results: Sequence[ConfigResult], summary: dict[str, Any], verbose: bool = False) -> str:
    """The replay's table as Markdown-compatible text: the rows a user decides on, every
    row with ``verbose``, then notes on how to read it."""
    head = ["", *(f"{r.name} ({r.device_tokens:,} dev / {r.host_tokens:,} host tokens)" for r in results)]
    rows = [head, ["---"] * len(head)]
    for label, key, fmt, default in ROWS:
        if default or verbose:
            rows.append([label, *(_cell(r, key, fmt) for r in results)])
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    notes = [
        f"preset {summary['preset']} (unit {summary['alignment_tokens']} tokens), {summary['requests']:,} requests, "
        f"unbounded working set {summary['working_set_tokens']:,} tokens ({summary['working_set_units']:,} units), "
        f"policy {summary['policy']}, eviction {summary['eviction']}"
        f"{' (exclusive host tier)' if summary['exclusive'] else ''}, backend {summary['backend']}",
        f"modeled times: {summary['cost_model']}",
        "capacities are fractions of this trace's unbounded working set (a --limit shrinks the working set and "
        "the capacities with it); prefill tokens computed can exceed prompt tokens: retracted requests "
        "recompute what they lost" + ("" if verbose else "; --verbose shows every row"),
    ]
    return "\n".join(lines + [""] + notes)


def run_title(summary: dict[str, Any] | Any) -> str:
    """Two lines naming a run: what ran (requests, trace, preset) and with what (capacities,
    policy, backend); the title of ``--plot``'s figure. ``summary``: :func:`run_replay`'s."""
    return (f"kvtier replay: {summary.get('requests', 0):,} requests of {summary.get('trace', 'a trace')}, "
            f"preset {summary.get('preset', '?')}\n"
            f"device {summary.get('device_tokens', 0):,} tokens, host {summary.get('host_tokens', 0):,} tokens "
            f"(of a {summary.get('working_set_tokens', 0):,}-token working set), policy {summary.get('policy', '?')}, "
            f"backend {summary.get('backend', '?')}")


def to_json(results: Sequence[ConfigResult], summary: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {"setup": summary, "configurations": [asdict(r) for r in results]}
