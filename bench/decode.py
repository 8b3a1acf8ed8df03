"""Decode bookkeeping per decoded token per request, at a given batch size.

A batch of running requests decodes one token per step: per step one batched
``TieredCache.step`` reserving a token for each request, then one reporting each
request's forward result (with the unit's key when a decode token completes a unit), the
two calls an engine makes per decode step. Metadata only (no bytes). The time is the
wall time inside those calls, divided by steps x batch.

    python bench/decode.py [--batch 256] [--steps 512] [--page-tokens 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvtier import TieredCache
from kvtier.fsm.presets import preset

TARGET_US = 1.0


def run(batch: int, steps: int, page_tokens: int, prompt_units: int) -> tuple[float, float, int]:
    """(us per decoded token per request, share of items that crossed a unit boundary,
    pages the decode reserved)."""
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
    for _ in range(steps):
        reserve = [(rid, 1) for rid in ids]
        t0 = time.perf_counter()
        out = cache.step(reserve=reserve)
        t_in += time.perf_counter() - t0
        tokens += 1
        if tokens % align == 0:
            u = tokens // align - 1
            results = [(rid, 1, (keys[rid][u],)) for rid in ids]
            crossed += 1
        else:
            results = [(rid, 1) for rid in ids]
        t0 = time.perf_counter()
        res = cache.step(results=results)
        t_in += time.perf_counter() - t0
        if not (out.ok and res.ok):
            raise SystemExit(f"a decode step was refused: {out.errors or res.errors}")
    pages = sum(a.used for a in cache.core.device.values()) - pages0
    return t_in / (steps * batch) * 1e6, crossed / steps, pages


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
    print(f"{'batch':>6}  {'us / token / request':>21}  {'boundary steps':>14}  {'pages reserved':>14}  target")
    for b in a.batch:
        runs = [run(b, a.steps, a.page_tokens, a.prompt_units) for _ in range(a.repeat)]
        us = statistics.median(x[0] for x in runs)
        verdict = f"<= {TARGET_US} us: {'met' if us <= TARGET_US else 'MISSED'}" if b == 256 else "-"
        print(f"{b:>6}  {us:>21.3f}  {runs[0][1]:>13.1%}  {runs[0][2]:>14,}  {verdict}")


if __name__ == "__main__":
    main()
