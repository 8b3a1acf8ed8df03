"""The scheduler hot path's speed targets (issue 14), measured in one run.

    python bench/speed.py [TRACE] [--slice N] [--skip-16] [--skip-whole] [--skip-bytes] [--record]

Rows (each configuration of ``kvtier replay``: device-only, device+host, unbounded):

- ``replay bookkeeping``: microseconds per request inside the cache's calls under the
  reference scheduler (``RunStats.kvtier_s``; decode included), embedded default trace,
  default preset, ``--backend none``. Target <= 300 us.
- ``default preset, none``: wall and CPU seconds of one configuration of the whole trace,
  default preset, metadata only. Target <= 10 s each.
- ``16-token pages``: the same with ``llama-3-8b --page-tokens 16`` (the whole trace, or its
  first ``--slice`` requests). Target <= 120 s each (whole trace).
- ``embedded default, cpu bytes``: wall seconds of all three configurations together with
  real bytes (``--backend cpu``, fingerprints written and checked). Target <= 30 s.

CPU seconds are this process's (``time.process_time``), reported beside wall seconds
because the machine is shared: the load average is printed before and after.
``--record`` appends the table to bench/RESULTS.md (section "Scheduler hot path").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import provenance, record_section  # noqa: E402


TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def measure(trace_path: Path | None, preset: str, page_tokens: int | None, backend: str,
            limit: int | None) -> tuple[list[tuple[str, float, float, float, float, float]], float]:
    """One ``kvtier replay --json`` (three configurations) in a child process: per
    configuration (name, wall s, CPU s (the child's CPU seconds shared out by wall time),
    bookkeeping us/request, hit rate, prefill tokens), and the child's whole wall time."""
    cmd = [sys.executable, "-m", "kvtier", "replay", "--json", "--preset", preset, "--backend", backend]
    if page_tokens is not None:
        cmd += ["--page-tokens", str(page_tokens)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if trace_path is not None:
        cmd.append(str(trace_path))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    configs = json.loads(out.stdout)["configurations"]
    walls = sum(c["wall_s"] for c in configs)
    rows = [(c["name"], c["wall_s"], cpu * c["wall_s"] / max(walls, 1e-9), c["bookkeeping_us_per_request"],
             c["hit_rate"], float(c["prefill_tokens"])) for c in configs]
    return rows, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", type=Path, default=TRACE)
    ap.add_argument("--slice", type=int, default=None, help="16-token pages: the first N requests only")
    ap.add_argument("--skip-16", action="store_true")
    ap.add_argument("--skip-whole", action="store_true")
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)
    load_before = _load()
    lines = ["| measure | configuration | wall s | CPU s (share) | bookkeeping us / request | hit rate | "
             "prefill tokens | target |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]

    def add(what: str, rows: list[tuple[str, float, float, float, float, float]], target: str) -> None:
        for name, wall, cpu, bk, hit, prefill in rows:
            lines.append(f"| {what} | {name} | {wall:.1f} | {cpu:.1f} | {bk:,.0f} | {hit:.2%} | {prefill:,.0f} | "
                         f"{target} |")
        print(lines[-1] if len(lines) > 2 else "", file=sys.stderr, flush=True)

    rows, _ = measure(None, "deepseek-v4", None, "none", None)
    add("embedded default, none (replay bookkeeping)", rows, "bookkeeping <= 300 us")
    if not args.skip_bytes:
        rows, total = measure(None, "deepseek-v4", None, "cpu", None)
        add("embedded default, cpu bytes", rows, f"all three <= 30 s (whole command {total:.1f} s)")
    if not args.skip_whole:
        rows, _ = measure(args.trace, "deepseek-v4", None, "none", None)
        add("whole trace, default preset, none", rows, "<= 10 s each")
    if not args.skip_16:
        what = "16-token pages, llama-3-8b, none" + (f", first {args.slice} requests" if args.slice else
                                                     ", whole trace")
        rows, _ = measure(args.trace, "llama-3-8b", 16, "none", args.slice)
        add(what, rows, "<= 120 s each (whole trace)")
    table = "\n".join(lines)
    note = f"load average (1/5/15 min) before {load_before}, after {_load()}"
    print(table)
    print(note)
    if args.record:
        record_section(RESULTS, "speed", "Scheduler hot path (issue 14)",
                       table + "\n\n" + note + "\n\n" + provenance(sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
