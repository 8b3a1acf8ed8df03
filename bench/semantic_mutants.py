"""What ``kvtier fuzz`` alone, and the test suite, catch of the semantic mutants (issue 12).

The mutants are realistic lifecycle bugs (``SEMANTIC`` in tests/broken/make_patches.py;
patches in tests/broken/semantic/). For each one, this script builds a temporary copy of
the package with the patch applied (tests/broken_support.py ``patched_tree``: fsm/,
spec/, src/kvtier/ and, when patched, transfer/ are copied; the worktree is never
touched) and runs, with that copy first on ``PYTHONPATH``:

(a) ``python -m kvtier fuzz --steps 30000 --seed 1 --no-progress`` (the campaign as the
    CI runs it; caught = it reports a violation, exit code 1);
(b) the mutant's designated tests (pytest node ids from the table; caught = every one
    of them fails).

It prints one row per mutant and the rates, and with ``--record`` writes them to
bench/RESULTS.md ("Semantic mutants"). Targets (issue 12): the fuzz alone catches at
least 90 %, the tests catch all.

    python bench/semantic_mutants.py --record              # every mutant: ~15 s CPU per uncaught one
    python bench/semantic_mutants.py --only s26-failed-issue-no-barrier --steps 5000
    python bench/semantic_mutants.py --jobs 2              # two mutants at a time
    python bench/semantic_mutants.py --no-tests --steps 5000 --jobs 2 --min-rate 0.8   # the CI's bound

Long runs: wrap in ``nice -n 10`` on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "broken"), str(REPO / "bench")]

from broken_support import patched_tree, run_catchers  # noqa: E402
from harness import provenance, record_section  # noqa: E402
from make_patches import SEMANTIC, patch_path  # noqa: E402

TARGET_FUZZ = 0.90


@dataclass
class Outcome:
    name: str
    area: str
    fuzz_caught: bool
    fuzz_detail: str  # the violation the fuzz reported, or why not
    fuzz_seconds: float
    tests_caught: bool
    tests_detail: str


def _fuzz(pythonpath: Path, work: Path, steps: int, seed: int, timeout: float) -> tuple[bool, str, float]:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONDONTWRITEBYTECODE="1")
    env.pop("HYPOTHESIS_PROFILE", None)
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "kvtier", "fuzz", "--steps", str(steps), "--seed", str(seed),
                               "--no-progress", "--no-shrink", "--save", str(work / "found.json")],
                              cwd=work, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    secs = time.perf_counter() - t0
    m = re.search(r"VIOLATION of (\S+?): (.*)", done.stdout)
    if done.returncode == 1 and m:
        return True, f"{m.group(1)}: {m.group(2)[:90]}", secs
    if done.returncode == 0:
        return False, "no violation", secs
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["?"]
    return False, f"exit {done.returncode}: {tail[0][:90]}", secs


def measure(name: str, steps: int, seed: int, timeout: float, tests: bool) -> Outcome:
    m = SEMANTIC[name]
    with tempfile.TemporaryDirectory(prefix=f"kvtier-{name}-") as tmp:
        work = Path(tmp)
        pythonpath = patched_tree(patch_path(name), work)
        fuzz_caught, fuzz_detail, secs = _fuzz(pythonpath, work, steps, seed, timeout)
        if tests:
            failed, _ = run_catchers(pythonpath, list(m.catchers))
            missed = [c for c in m.catchers if c not in failed]
            tests_caught = not missed
            tests_detail = ", ".join(c.split("::", 1)[1] for c in m.catchers) if not missed else \
                "survives " + ", ".join(missed)
        else:
            tests_caught, tests_detail = False, "not run"
    return Outcome(name, m.area, fuzz_caught, fuzz_detail, secs, tests_caught, tests_detail)


def table(rows: list[Outcome]) -> str:
    out = ["| mutant | area | caught by fuzz | fuzz says | fuzz s | caught by tests | catching tests |",
           "| --- | --- | :---: | --- | ---: | :---: | --- |"]
    for r in rows:
        out.append(f"| {r.name} | {r.area} | {'yes' if r.fuzz_caught else 'NO'} | {r.fuzz_detail.replace('|', '/')} | "
                   f"{r.fuzz_seconds:.0f} | {'yes' if r.tests_caught else 'NO'} | {r.tests_detail} |")
    return "\n".join(out)


def rates(rows: list[Outcome]) -> str:
    n = len(rows)
    fz = sum(r.fuzz_caught for r in rows)
    ts = sum(r.tests_caught for r in rows)
    by_area = Counter(r.area for r in rows)
    fz_area = Counter(r.area for r in rows if r.fuzz_caught)
    areas = ", ".join(f"{a} {fz_area[a]}/{k}" for a, k in sorted(by_area.items()))
    verdict = "met" if fz >= TARGET_FUZZ * n else "MISSED"
    return (f"- fuzz alone: {fz}/{n} = {fz / n:.0%} caught (target >= {TARGET_FUZZ:.0%}: {verdict}); by area: {areas}\n"
            f"- designated tests: {ts}/{n} = {ts / n:.0%} caught (target 100 %: "
            f"{'met' if ts == n else 'MISSED'})")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(SEMANTIC), help="these mutants only")
    p.add_argument("--steps", type=int, default=30_000, help="fuzz steps per mutant (default 30000)")
    p.add_argument("--seed", type=int, default=1, help="fuzz campaign seed (default 1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per fuzz run (default 900)")
    p.add_argument("--jobs", type=int, default=1, help="mutants measured at a time (default 1)")
    p.add_argument("--no-tests", action="store_true", help="run the fuzz only")
    p.add_argument("--min-rate", type=float, metavar="FRACTION",
                   help="exit 1 when the fuzz alone catches less than this fraction (the CI's bound)")
    p.add_argument("--record", action="store_true", help="write the table to bench/RESULTS.md")
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help="keep each mutant's outcome in DIR/<name>-<steps>-<seed>.json and reuse it (an "
                        "interrupted run goes on where it stopped; clear DIR after the sources change)")
    args = p.parse_args(argv)
    names = args.only or sorted(SEMANTIC)
    t0 = time.perf_counter()
    print(f"{len(names)} semantic mutants: kvtier fuzz --steps {args.steps} --seed {args.seed} --no-progress, "
          f"then each mutant's designated tests", flush=True)

    def one(name: str) -> Outcome:
        cached = args.cache / f"{name}-{args.steps}-{args.seed}.json" if args.cache else None
        if cached is not None and cached.exists():
            return Outcome(**json.loads(cached.read_text(encoding="utf-8")))
        r = measure(name, args.steps, args.seed, args.timeout, not args.no_tests)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(dataclasses.asdict(r)), encoding="utf-8")
        print(f"  {name}: fuzz {'caught' if r.fuzz_caught else 'missed'} ({r.fuzz_detail}, {r.fuzz_seconds:.0f} s), "
              f"tests {'caught' if r.tests_caught else 'missed'}", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, names))
    body = table(rows) + "\n\n" + rates(rows)
    print()
    print(body)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if args.record:
        text = (provenance(["bench/semantic_mutants.py", *argv]) + "\n\n"
                + "Each mutant is a realistic lifecycle bug (tests/broken/make_patches.py, `SEMANTIC`; patches "
                  "in tests/broken/semantic/), applied to a temporary copy of the package. *Caught by fuzz*: "
                  f"`kvtier fuzz --steps {args.steps} --seed {args.seed} --no-progress` reports a violation "
                  "(the campaign the CI runs). *Caught by tests*: every designated test fails "
                  "(tests/test_semantic_mutants.py checks the same in CI).\n\n" + body)
        record_section(REPO / "bench" / "RESULTS.md", "semantic-mutants", "Semantic mutants (issue 12)", text)
        print("recorded in bench/RESULTS.md")
    if args.min_rate is not None:
        caught = sum(r.fuzz_caught for r in rows)
        if caught < args.min_rate * len(rows):
            print(f"FAILED: the fuzz alone caught {caught}/{len(rows)}, below {args.min_rate:.0%}")
            return 1
        print(f"ok: the fuzz alone caught {caught}/{len(rows)} (bound {args.min_rate:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
