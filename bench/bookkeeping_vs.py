"""Bookkeeping per request of this tree against an older commit, measured in one run.

    python bench/bookkeeping_vs.py OLD_COMMIT [TRACE] [--limit N] [--reps 3]

The older commit is checked out with ``git worktree add`` into a temporary folder and
imported from there (``PYTHONPATH`` ahead of the editable install, the package-dir mapping
rebuilt with links, as tests/broken_support.py does); this tree is imported as installed.
Each configuration is driven with ``bench/bookkeeping.py``'s own ``run`` of each tree (the
peers' method), old and new alternating ``--reps`` times in fresh processes, so both see
the same machine load; the table gives the median us / request of each and their ratio
(new / old: below 1.0 is faster). The time is the process's CPU time inside kvtier's calls
(``time.process_time`` in place of ``bookkeeping.py``'s wall clock), so other jobs on a
shared machine do not inflate one side. Configurations a commit's ``run`` cannot take (an eviction
policy or an exclusive host tier before they existed) run there with its defaults, which
the row says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
#: (device blocks, host blocks or None, write policy, eviction policy, exclusive host tier)
CONFIGS: tuple[tuple[int, int | None, str, str, bool], ...] = (
    (4000, None, "write_through", "lru", False),
    (4000, 8000, "write_back", "lru", False),
    (4000, 8000, "write_back", "lru", True),
    (4000, 8000, "write_back", "lru_turns", True),
    (4000, 32000, "write_through", "lru", False),
)

_CHILD = """
import inspect, json, sys, time
time.perf_counter = time.process_time  # CPU seconds of this process: other jobs' load does not count
sys.path.insert(0, sys.argv[1])
from bookkeeping import run
trace, limit, device, host, policy, eviction, exclusive = json.loads(sys.argv[2])
extra = {}
params = inspect.signature(run).parameters
if "eviction" in params:
    extra["eviction"] = eviction
if "exclusive" in params:
    extra["exclusive"] = exclusive
r = run(trace and __import__("pathlib").Path(trace), limit, device, host, policy, **extra)
print(json.dumps({"us": r.us_per_request, "hit": r.hit_rate, "refused": getattr(r, "refused", 0),
                  "took": sorted(extra.items())}))
"""


def old_tree(commit: str, dest: Path) -> tuple[Path, Path]:
    """Check ``commit`` out into ``dest/src`` and link its package layout into ``dest/pkg``;
    returns (the folder for ``PYTHONPATH``, the commit's bench folder)."""
    src = dest / "src"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(src), commit],
                   check=True, capture_output=True)
    pkg = dest / "pkg" / "kvtier"
    pkg.mkdir(parents=True)
    for entry in (src / "src" / "kvtier").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name in ("fsm", "transfer", "spec"):
        (pkg / name).symlink_to(src / name, target_is_directory=True)
    return dest / "pkg", src / "bench"


def measure(pythonpath: Path | None, bench: Path, args: list[object]) -> dict[str, object]:
    env = None
    if pythonpath is not None:
        import os
        env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(bench), json.dumps(args)], env=env,
                          capture_output=True, text=True, check=True)
    out: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the older commit (any git revision)")
    ap.add_argument("trace", nargs="?", default=str(TRACE) if TRACE.exists() else None)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--reps", type=int, default=3, help="runs of each tree per configuration")
    ap.add_argument("--configs", type=int, nargs="+", default=None, metavar="I",
                    help="only these rows of CONFIGS (0-based; default: all)")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvtier-bookkeeping-vs-") as tmp:
        pythonpath, old_bench = old_tree(args.old, Path(tmp))
        try:
            lines = [f"trace: {args.trace or 'embedded slice'}, limit {args.limit}, median of {args.reps} "
                     f"alternating runs; old {args.old}, new {head} (+ working tree)", "",
                     "| device / host blocks | policy | eviction | old us / request | new us / request | "
                     "new / old | old hit rate | new hit rate | old ran as |",
                     "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
            chosen = CONFIGS if args.configs is None else [CONFIGS[i] for i in args.configs]
            for device, host, policy, eviction, exclusive in chosen:
                job: list[object] = [args.trace, args.limit, device, host, policy, eviction, exclusive]
                olds, news = [], []
                for _ in range(args.reps):
                    olds.append(measure(pythonpath, old_bench, job))
                    news.append(measure(None, REPO / "bench", job))
                o = statistics.median(float(r["us"]) for r in olds)  # type: ignore[arg-type]
                n = statistics.median(float(r["us"]) for r in news)  # type: ignore[arg-type]
                took = dict(olds[0]["took"])  # type: ignore[call-overload]
                ran = ", ".join(f"{k}={v}" for k, v in took.items()) or "lru, inclusive (its only mode)"
                name = policy + (" + exclusive" if exclusive else "") if host else "-"
                lines.append(f"| {device:,} / {f'{host:,}' if host else 'none'} | {name} | {eviction} | {o:,.0f} | "
                             f"{n:,.0f} | {n / o:.2f} | {float(olds[0]['hit']):.2%} | {float(news[0]['hit']):.2%} | "
                             f"{ran} |")
                print(lines[-1], file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(tmp) / "src")],
                           check=False, capture_output=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
