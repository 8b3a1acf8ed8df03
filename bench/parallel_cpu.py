"""The rank-parallel mode's agreement cost on the CPU (issue 21): gloo rank processes
replaying a Mooncake conversation slice (metadata only), per step and per exchange, and the
decision digest's own cost (the same replay in one process, RankCache against TieredCache).

    python bench/parallel_cpu.py --ranks 2,4 --tokens 200000
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from kvtier.fsm.presets import preset
from kvtier.replay.model_replay import conversation_slice
from kvtier.parallel import RankCache, RankJob, launch, run_jobs
from kvtier.parallel.replay import fresh
from kvtier.scheduler import ReferenceScheduler, SchedRequest
from kvtier.tiered import TieredCache
from kvtier.replay.trace import load_trace


def requests(tokens: int, align: int, max_prompt: int = 8192, max_output: int = 8) -> list[SchedRequest]:
    sl = conversation_slice(load_trace(), tokens, max_prompt)
    t0 = min(r.arrival_s for r in sl)
    out = []
    for r in sl:
        n = min(r.input_length, max_prompt)
        units = tuple((h, j) for h in r.hash_ids for j in range(512 // align))[: n // align]
        out.append(SchedRequest(f"r{r.index}", r.arrival_s - t0, n, min(max_output, r.output_length), units))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--tokens", type=int, default=200_000)
    a = ap.parse_args()
    layout = preset("llama-3-8b", num_layers=4, page_tokens=128)
    reqs = requests(a.tokens, layout.alignment)
    longest = max((r.prompt_tokens + r.output_tokens) // layout.alignment + 2 for r in reqs)
    job = RankJob(tuple(reqs), layout, 2 * longest, 3000, policy="write_through")
    rows = []
    for cls in (TieredCache, RankCache):  # the digest's own cost, one process
        best = float("inf")
        for _ in range(3):
            cache = cls(layout, job.device_units, job.host_units, policy=job.policy, world_size=2)
            st = ReferenceScheduler(cache).run(fresh(reqs))
            best = min(best, st.kvtier_s)
        rows.append((cls.__name__, best, st.steps))
    (_, base, steps), (_, digest, _) = rows
    print(f"{len(reqs)} requests, {sum(r.prompt_tokens for r in reqs):,} prompt tokens, {steps} steps")
    print(f"| ranks | exchanges/step | exchange us mean / p50 / p99 | agreement us/step | digest us/step |")
    print("| --- | --- | --- | --- | --- |")
    dig_us = (digest - base) / steps * 1e6
    for n in (int(x) for x in a.ranks.split(",")):
        t0 = time.perf_counter()
        res = launch(run_jobs, n, [job])
        r0 = res[0][0]
        s = r0["sync"]
        st = r0["run"]["steps"]
        assert len({r[0]["digest"] for r in res}) == 1
        print(f"| {n} | {s['exchanges'] / st:.2f} | {s['mean_us']:.0f} / {s['p50_us']:.0f} / {s['p99_us']:.0f} | "
              f"{s['exchange_s'] / st * 1e6:.0f} | {dig_us:.1f} |  ({time.perf_counter() - t0:.1f} s wall)")
    print(f"digest: bookkeeping {base * 1e3:.1f} ms (TieredCache) vs {digest * 1e3:.1f} ms (RankCache), "
          f"+{(digest / base - 1):.1%}")


if __name__ == "__main__":
    main()
