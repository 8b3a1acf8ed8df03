"""Decode bookkeeping per decoded token per request, at a given batch size.

A batch of running requests decodes one token per step: per step one batched
``TieredCache.step`` reserving a token for each request, then one reporting each
request's forward result (with the unit's key when a decode token completes a unit), the
two calls an engine makes per decode step. Metadata only (no bytes). The time is the
wall time inside those calls, divided by steps x batch; the next column is the same over
the steps in which no request crosses a page or unit boundary (the batched counter
arithmetic alone), and the last the time of one boundary step per request (a new page
reserved, or a unit completed and published into the tree).

    python bench/decode.py [--batch 256] [--steps 512] [--page-tokens 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvtier import TieredCache
from kvtier.fsm.presets import preset

TARGET_US = 1.0


def run(batch: int, steps: int, page_tokens: int, prompt_units: int) -> tuple[float, float, int, float, float]:
    """(us per decoded token per request, share of steps that completed a unit, pages the
    decode reserved, us per token per request over the steps without a boundary, us per
    request of a boundary step)."""
    layout = preset("llama-3-8b", page_tokens=page_tokens)
    align = layout.alignment
    prompt = prompt_units * align
    units_total = prompt_units + steps // align + 2
    cache = TieredCache(layout, batch * (units_total + 1) * 2, None)
    ids = [f"r{i}" for i in range(batch)]
    keys = {rid: [(rid, u) for u in range(units_total)] for rid in ids}
    for rid in ids:
        adm = cache.admit(rid, keys[rid][:prompt_units], prompt, prompt)
        assert adm is not None
    cache.step(results=[(rid, prompt, (), False) for rid in ids])
    tokens = prompt
    crossed = 0
    pages0 = sum(a.used for a in cache.core.device.values())
    t_in = 0.0
    t_plain = 0.0
    plain = 0
    tpp = layout.history_groups[0].tokens_per_page
    for _ in range(steps):
        reserve = [(rid, 1) for rid in ids]
        boundary = tokens % tpp == 0 or (tokens + 1) % align == 0  # a new page, or a unit completes
        t_step = 0.0
        t0 = time.perf_counter()
        out = cache.step(reserve=reserve)
        t_step += time.perf_counter() - t0
        tokens += 1
        if tokens % align == 0:
            u = tokens // align - 1
            results = [(rid, 1, (keys[rid][u],)) for rid in ids]
            crossed += 1
        else:
            results = [(rid, 1) for rid in ids]
        t0 = time.perf_counter()
        res = cache.step(results=results)
        t_step += time.perf_counter() - t0
        t_in += t_step
        if not boundary:
            t_plain += t_step
            plain += 1
        if not (out.ok and res.ok):
            raise SystemExit(f"a decode step was refused: {out.errors or res.errors}")
    pages = sum(a.used for a in cache.core.device.values()) - pages0
    edge = steps - plain
    return (t_in / (steps * batch) * 1e6, crossed / steps, pages, t_plain / max(1, plain * batch) * 1e6,
            (t_in - t_plain) / max(1, edge * batch) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--prompt-units", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    print(f"llama-3-8b, {a.page_tokens}-token pages, {a.steps} decode steps after a "
          f"{a.prompt_units}-unit prompt, metadata only; median of {a.repeat}")
    print(f"{'batch':>6}  {'us / token / request':>21}  {'boundary steps':>14}  {'pages reserved':>14}  "
          f"{'us, no-boundary steps':>21}  {'us, boundary step':>17}  target")
    for b in a.batch:
        runs = [run(b, a.steps, a.page_tokens, a.prompt_units) for _ in range(a.repeat)]
        us = statistics.median(x[0] for x in runs)
        us_plain = statistics.median(x[3] for x in runs)
        us_edge = statistics.median(x[4] for x in runs)
        verdict = f"<= {TARGET_US} us: {'met' if us <= TARGET_US else 'MISSED'}" if b == 256 else "-"
        print(f"{b:>6}  {us:>21.3f}  {runs[0][1]:>13.1%}  {runs[0][2]:>14,}  {us_plain:>21.3f}  {us_edge:>17.2f}  "
              f"{verdict}")


if __name__ == "__main__":
    main()
