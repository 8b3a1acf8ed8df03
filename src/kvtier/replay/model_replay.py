"""Trace replay with real forward passes (issue 17): measured time to first token.

A slice of a Mooncake trace is served by the reference scheduler over a
:class:`~kvtier.tiered.TieredCache`, with :class:`~kvtier.model.ModelExecutor` running
the paged decoder and moving pages with a transfer backend. Arrival times are replayed
against a wall clock (optionally time-scaled; idle gaps skipped), so time to first token
is measured: from the request's arrival to the end of the forward pass that produced its
first token, device work included (the pass synchronizes). The same requests are also
replayed metadata-only under :class:`~kvtier.replay.costmodel.CostModel`, with its default
constants and with constants fitted to the measured passes, so measured and modeled
times stand side by side.

The slice (:func:`conversation_slice`): whole conversations (requests that share their
second 512-token block; every request shares the first, a system prompt) of the trace,
in order of their first request, until a prompt-token target is met; prompts are cut to
``max_prompt`` tokens (a cut keeps every shared prefix a prefix) and outputs to
``max_output`` tokens. Token ids are synthetic (:func:`kvtier.model.prompt_tokens_for`).
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvtier.fsm import ConfigError
from kvtier.fsm import units_to_pages
from kvtier.fsm.layout import CacheLayout

from ..model import ModelExecutor, PagedLlama, WallClock, prompt_tokens_for
from ..scheduler import InstantExecutor, ReferenceScheduler, SchedRequest, percentile
from ..tiered import TieredCache
from .costmodel import CostModel
from .trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest

__all__ = ["E2ESetup", "conversation_slice", "build_requests", "run_model_config", "run_model", "modeled_ttft",
           "fit_cost", "summarize", "working_set_units", "unbounded_units", "capacities", "format_model_table",
           "ratios"]


@dataclass(frozen=True, slots=True)
class E2ESetup:
    """Options of one measured replay.

    Attributes:
        device_units: device capacity of the bounded configurations (cache units).
        host_units: host capacity of the device+host configuration (cache units).
        time_scale: arrival times are multiplied by it.
        max_prompt: prompts are cut to this many tokens.
        max_output: outputs are cut to this many tokens.
        token_budget: tokens per scheduler step.
        backend: transfer backend (``numba`` on a GPU, ``cpu`` on the CPU).
        chunk_layers: model layers per loadback chunk.
        policy: write policy.
        check: run the executor's correctness checks.
        no_reuse_samples: loaded requests compared with a computation from scratch.
        measured: the scheduler runs on the wall clock (False: on modeled time, so the
            schedule does not depend on the machine; tests).
    """

    device_units: int
    host_units: int
    time_scale: float = 1.0
    max_prompt: int = 32768
    max_output: int = 8
    token_budget: int = 8192
    backend: str = "cpu"
    chunk_layers: int = 2
    policy: str = "write_through"
    check: bool = True
    no_reuse_samples: int = 4
    measured: bool = True


def conversation_slice(trace: Trace, prompt_tokens: int, max_prompt: int | None = None) -> list[TraceRequest]:
    """Whole conversations of ``trace`` (requests with the same second block id, at least
    two of them), by first arrival, until their prompts (cut to ``max_prompt``) hold at
    least ``prompt_tokens`` tokens; returned by arrival.

    Raises:
        ConfigError: ``prompt_tokens`` < 1.
    """
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ConfigError(f"prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
    groups: dict[int, list[TraceRequest]] = {}
    for r in trace.requests:
        if len(r.hash_ids) > 1:
            groups.setdefault(r.hash_ids[1], []).append(r)
    convs = sorted((g for g in groups.values() if len(g) >= 2), key=lambda g: (g[0].arrival_s, g[0].index))
    out: list[TraceRequest] = []
    total = 0
    for g in convs:
        if total >= prompt_tokens:
            break
        out.extend(g)
        total += sum(min(r.input_length, max_prompt or r.input_length) for r in g)
    return sorted(out, key=lambda r: (r.arrival_s, r.index))


def build_requests(reqs: Sequence[TraceRequest], layout: CacheLayout, vocab: int, setup: E2ESetup
                   ) -> tuple[list[SchedRequest], dict[str, list[int]], dict[str, int]]:
    """Scheduler requests (unit keys ``(block id, j)``), prompts and output lengths.

    Raises:
        ConfigError: the layout's alignment does not divide the 512-token blocks.
    """
    a = layout.alignment
    if MOONCAKE_BLOCK_TOKENS % a:
        raise ConfigError(f"alignment {a} does not divide the trace's {MOONCAKE_BLOCK_TOKENS}-token blocks")
    k = MOONCAKE_BLOCK_TOKENS // a
    t0 = min(r.arrival_s for r in reqs) if reqs else 0.0
    out, prompts, outputs = [], {}, {}
    for r in reqs:
        n = min(r.input_length, setup.max_prompt)
        rid = f"r{r.index}"
        units: list[Hashable] = list([(h, j) for h in r.hash_ids for j in range(k)][: n // a])
        o = max(1, min(r.output_length, setup.max_output))
        out.append(SchedRequest(rid, (r.arrival_s - t0) * setup.time_scale, n, o, tuple(units)))
        prompts[rid] = prompt_tokens_for(r.hash_ids, n, vocab)
        outputs[rid] = o
    return out, prompts, outputs


def working_set_units(requests: Sequence[SchedRequest]) -> int:
    """Distinct unit-key paths of the prompts (the unbounded working set, units)."""
    seen: set[tuple[int, Hashable]] = set()
    n = 0
    for r in requests:
        prev: Any = None
        for u in r.units:
            key = (hash((prev, u)), u)
            prev = key
            if key not in seen:
                seen.add(key)
                n += 1
    return n


def unbounded_units(requests: Sequence[SchedRequest], align: int) -> int:
    """Device units that never evict: the working set plus every request's own tokens."""
    return working_set_units(requests) + sum((r.prompt_tokens + r.output_tokens) // align + 2 for r in requests)


def _fresh(requests: Sequence[SchedRequest]) -> list[SchedRequest]:
    return [SchedRequest(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.units) for r in requests]


def run_model_config(name: str, model: PagedLlama, requests: Sequence[SchedRequest], prompts: dict[str, list[int]],
                     outputs: dict[str, int], device_units: int, host_units: int | None, setup: E2ESetup,
                     backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve ``requests`` with real forward passes in one configuration.

    Returns:
        A JSON-ready dict: capacities, the scheduler's counts, per-request measured
        times (seconds on the replay clock), the executor's checks, per-pass timings,
        transfer statistics and the cache's counters.
    """
    layout = model.layout
    dev = units_to_pages(layout, device_units)
    host = units_to_pages(layout, host_units) if host_units else None
    ex = ModelExecutor(model, dev, host, prompts, outputs, backend=setup.backend, chunk_layers=setup.chunk_layers,
                       check=setup.check, no_reuse_samples=setup.no_reuse_samples, backend_options=backend_options)
    cache = TieredCache(layout, dev, host, policy=setup.policy)
    ex.clock = WallClock(ex._sync)
    sched = ReferenceScheduler(cache, ex, token_budget=setup.token_budget,
                               clock=ex.clock if setup.measured else None)
    stats = sched.run(_fresh(requests))
    ex._sync()
    makespan = ex.clock.now()
    arrivals = {r.request_id: r.arrival_s for r in requests}
    per = ex.per_request()
    for rid, p in per.items():
        p["arrival_s"] = arrivals[rid]
        p["ttft_s"] = p["first_token_s"] - arrivals[rid] if p["first_token_s"] is not None else None
        p["e2e_s"] = p["last_token_s"] - arrivals[rid] if p["last_token_s"] is not None else None
    es = ex.engine.stats()
    cs = cache.core.stats
    res = {
        "name": name, "device_units": device_units, "host_units": host_units or 0,
        "device_tokens": device_units * layout.alignment, "host_tokens": (host_units or 0) * layout.alignment,
        "requests": len(requests), "finished": stats.finished, "aborts": stats.aborts,
        "retractions": stats.retractions, "prompt_tokens": stats.prompt_tokens, "hit_tokens": stats.hit_tokens,
        "device_hit_tokens": stats.device_hit_tokens, "host_hit_tokens": stats.host_hit_tokens,
        "history_hit_tokens": stats.history_hit_tokens, "prefill_tokens": stats.prefill_tokens,
        "decode_tokens": stats.decode_tokens, "loadback_bytes": stats.loadback_bytes,
        "writeback_bytes": stats.writeback_bytes, "steps": stats.steps, "makespan_s": makespan,
        "forward_s": ex.forward_s, "excluded_s": ex.clock.excluded_s, "skipped_s": ex.clock.skipped_s,
        "kvtier_bookkeeping_s": stats.kvtier_s, "scheduler_ttft_s": list(stats.ttft_s),
        "transfer": {d: es["cumulative"].get(d) for d in ("loadback", "writeback")},
        "transfer_backend": es.get("backend"),
        "evictions": cs.device_evictions + cs.host_evictions, "demotions": cs.demotions,
        "loadbacks": cs.loadbacks, "writebacks": cs.writebacks,
        "checks": asdict(ex.checks), "per_request": per, "passes": [list(s) for s in ex.steps],
    }
    res.update(summarize(res))
    del ex, cache, sched
    return res


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99)}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """TTFT and end-to-end statistics, tokens generated, throughput of one result."""
    per = res["per_request"].values()
    ttft = [p["ttft_s"] for p in per if p["ttft_s"] is not None]
    e2e = [p["e2e_s"] for p in per if p["e2e_s"] is not None]
    gen = sum(p["generated"] for p in per)
    first = min((p["arrival_s"] for p in per), default=0.0)
    last = max((p["last_token_s"] for p in per if p["last_token_s"] is not None), default=first)
    span = max(1e-9, last - first)
    return {"ttft": _stats(ttft), "e2e": _stats(e2e), "tokens_generated": gen,
            "throughput": {"requests_per_s": len(e2e) / span, "prompt_tokens_per_s": res["prompt_tokens"] / span,
                           "generated_tokens_per_s": gen / span, "span_s": span}}


def modeled_ttft(layout: CacheLayout, requests: Sequence[SchedRequest], device_units: int,
                 host_units: int | None, setup: E2ESetup, cost: CostModel) -> dict[str, Any]:
    """The same requests replayed metadata-only under ``cost`` (modeled seconds)."""
    cache = TieredCache(layout, device_units, host_units, policy=setup.policy)
    sched = ReferenceScheduler(cache, InstantExecutor(), token_budget=setup.token_budget, cost=cost)
    st = sched.run(_fresh(requests))
    return {"ttft": _stats(st.ttft_s), "hit_tokens": st.hit_tokens, "host_hit_tokens": st.host_hit_tokens,
            "prefill_tokens": st.prefill_tokens, "cost_model": cost.describe()}


def fit_cost(passes: Sequence[Sequence[float]], link_bytes_per_s: float | None) -> CostModel:
    """Cost-model constants fitted (least squares, non-negative) to measured passes
    ``(prefill tokens, decode tokens, seconds)``; the link rate from a measured loadback
    rate when given, else the default."""
    rows = [p for p in passes if p[0] or p[1]]
    if len(rows) < 3:
        return CostModel()
    a = np.array([[1.0, p[0], p[1]] for p in rows])
    y = np.array([p[2] for p in rows])
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    overhead, per_prefill, per_decode = (max(0.0, float(c)) for c in coef)
    base = CostModel()
    return CostModel(prefill_s_per_token=per_prefill, decode_s_per_token=per_decode, step_overhead_s=overhead,
                     link_bytes_per_s=link_bytes_per_s if link_bytes_per_s and link_bytes_per_s > 0
                     else base.link_bytes_per_s)


def capacities(requests: Sequence[SchedRequest], align: int, device_frac: float, host_frac: float
               ) -> dict[str, int]:
    """Device and host units for the bounded configurations: ``device_frac`` and
    ``host_frac`` of the working set (the device at least twice the largest request),
    and the unbounded size."""
    ws = working_set_units(requests)
    biggest = max((r.prompt_tokens + r.output_tokens) // align + 2 for r in requests)
    return {"working_set_units": ws, "device_units": max(2 * biggest, math.ceil(ws * device_frac)),
            "host_units": max(biggest, math.ceil(ws * host_frac)),
            "unbounded_units": unbounded_units(requests, align)}


def run_model(model: PagedLlama, requests: Sequence[SchedRequest], prompts: dict[str, list[int]],
              outputs: dict[str, int], caps: dict[str, int], setup: E2ESetup,
              progress: Callable[[str], None] | None = None,
              backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The three configurations (device only, device + host, unbounded) and the modeled
    replays beside them; returns the JSON-ready document for one model."""
    configs: list[tuple[str, int, int | None]] = [
        ("device-only", caps["device_units"], None),
        ("device+host", caps["device_units"], caps["host_units"]),
        ("unbounded", caps["unbounded_units"], None),
    ]
    results = []
    for name, dev, host in configs:
        if progress is not None:
            progress(name)
        results.append(run_model_config(name, model, requests, prompts, outputs, dev, host, setup,
                                        backend_options=backend_options))
        gc.collect()  # the executor's pools (reference cycles through its clock) go now
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    passes = [p for r in results for p in r["passes"]]
    lb = results[1]["transfer"].get("loadback") or {}
    link = float(lb.get("gbps") or 0.0) * 1e9 or None
    fitted = fit_cost(passes, link)
    for (name, dev, host), r in zip(configs, results):
        r["modeled_default"] = modeled_ttft(model.layout, requests, dev, host, setup, CostModel())
        r["modeled_fitted"] = modeled_ttft(model.layout, requests, dev, host, setup, fitted)
    return {"model": model.cfg.name, "source": model.cfg.source, "dtype": str(model.dtype),
            "alignment_tokens": model.layout.alignment, "unit_bytes": model.layout.unit_bytes(),
            "capacities": caps, "setup": asdict(setup), "fitted_cost_model": {
                "prefill_s_per_token": fitted.prefill_s_per_token, "decode_s_per_token": fitted.decode_s_per_token,
                "step_overhead_s": fitted.step_overhead_s, "link_bytes_per_s": fitted.link_bytes_per_s,
                "describe": fitted.describe(), "source": "least squares over this run's measured forward passes; "
                                                         "link rate: measured loadback GB/s of device+host"},
            "configurations": results}


def format_model_table(doc: dict[str, Any]) -> str:
    """Markdown table of one model's three configurations, measured beside modeled."""
    rs = doc["configurations"]

    def f3(v: float) -> str:
        return f"{v:.3f}"

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("prompt tokens / prefix-hit tokens (device / host)",
         lambda r: f"{r['prompt_tokens']:,} / {r['hit_tokens']:,} ({r['device_hit_tokens']:,} / {r['host_hit_tokens']:,})"),
        ("prefill tokens computed", lambda r: f"{r['prefill_tokens']:,}"),
        ("TTFT measured mean / p50 / p99 s",
         lambda r: f"{f3(r['ttft']['mean'])} / {f3(r['ttft']['p50'])} / {f3(r['ttft']['p99'])}"),
        ("TTFT modeled (default constants) mean / p99 s",
         lambda r: f"{f3(r['modeled_default']['ttft']['mean'])} / {f3(r['modeled_default']['ttft']['p99'])}"),
        ("TTFT modeled (fitted constants) mean / p99 s",
         lambda r: f"{f3(r['modeled_fitted']['ttft']['mean'])} / {f3(r['modeled_fitted']['ttft']['p99'])}"),
        ("end-to-end mean / p99 s", lambda r: f"{f3(r['e2e']['mean'])} / {f3(r['e2e']['p99'])}"),
        ("tokens generated / requests finished", lambda r: f"{r['tokens_generated']:,} / {r['finished']}"),
        ("throughput: prompt tok/s, requests/s",
         lambda r: f"{r['throughput']['prompt_tokens_per_s']:,.0f}, {r['throughput']['requests_per_s']:.2f}"),
        ("forward passes s (compute) / makespan s", lambda r: f"{r['forward_s']:.2f} / {r['makespan_s']:.2f}"),
        ("loadback GB, s, GB/s", lambda r: _xfer(r, "loadback")),
        ("writeback GB, s, GB/s", lambda r: _xfer(r, "writeback")),
        ("loadbacks / writebacks / evictions / retractions",
         lambda r: f"{r['loadbacks']} / {r['writebacks']} / {r['evictions']} / {r['retractions']}"),
        ("loaded requests: re-run bit-identical / pages checksummed (mismatches)",
         lambda r: f"{r['checks']['rerun_identical']}/{r['checks']['loaded_requests']} / "
                   f"{r['checks']['pages_checksummed']:,} ({len(r['checks']['page_mismatches'])})"),
        ("vs no reuse: max rel L2 / top-1 agree",
         lambda r: (f"{r['checks']['no_reuse_max_rel']:.2e} / {r['checks']['no_reuse_top1_agree']}/"
                    f"{r['checks']['no_reuse_compared']}") if r['checks']['no_reuse_compared'] else "-"),
    ]
    head = ["", *(f"{r['name']} ({r['device_tokens']:,} dev / {r['host_tokens']:,} host tokens)" for r in rs)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for label, fn in rows:
        lines.append("| " + " | ".join([label, *(fn(r) for r in rs)]) + " |")
    return "\n".join(lines)


def _xfer(r: dict[str, Any], d: str) -> str:
    t = r["transfer"].get(d) or {}
    return f"{float(t.get('bytes') or 0) / 1e9:.2f}, {float(t.get('seconds') or 0):.3f}, {float(t.get('gbps') or 0):.1f}"


def ratios(doc: dict[str, Any]) -> dict[str, float]:
    """device+host against device only and against unbounded (mean and p99 TTFT)."""
    by = {r["name"]: r["ttft"] for r in doc["configurations"]}
    dh, do, ub = by["device+host"], by["device-only"], by["unbounded"]

    def q(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {"mean_dh_over_do": q(dh["mean"], do["mean"]), "p99_dh_over_do": q(dh["p99"], do["p99"]),
            "mean_dh_over_unbounded": q(dh["mean"], ub["mean"]), "p99_dh_over_unbounded": q(dh["p99"], ub["p99"])}
