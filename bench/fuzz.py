"""Fuzzing speed and the largest ``kvtier verify`` bound that completes in 10 minutes.

    python bench/fuzz.py [--steps 20000] [--verify-seconds 600] [--record]

``--verify-seconds 0`` measures the fuzzing speed alone (the bounds ``kvtier verify`` takes
to a fixpoint are measured by their own commands: bench/RESULTS.md, "Verify to a fixpoint").

Fuzzing speed: steps per second of each kit machine alone and of the default mix
(a step = one rule call followed by every invariant check). Verify: one breadth-first
run per world size with a 10-minute budget; the largest bound is the deepest level
fully explored within it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import provenance, record_section  # noqa: E402

from kvtier.testing.fuzz import campaign  # noqa: E402
from kvtier.testing.machines import FacadeMachine  # noqa: E402
from kvtier.testing.verify import verify  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def fuzz_speed(steps: int) -> list[tuple[str, int, float]]:
    rows = []
    for name in ("core", "facade", "node", "request"):
        res = campaign(steps=steps, seed_value=1, mix={name: 1.0}, progress=False)
        rows.append((name, res.steps, res.seconds))
    res = campaign(steps=5 * steps, seed_value=1, progress=False)
    rows.append(("mix (kvtier fuzz default)", res.steps, res.seconds))
    return rows


def verify_bound(world: int, seconds: float) -> tuple[int, list[tuple[int, int, float]], bool]:
    levels: list[tuple[int, int, float]] = []
    t0 = time.perf_counter()

    def progress(level: int, frontier: int, states: int) -> None:
        levels.append((level, states, time.perf_counter() - t0))
        print(f"  world {world} depth {level}: {states:,} states at {time.perf_counter() - t0:.0f} s", flush=True)

    res = verify(60, setup=FacadeMachine.verify_setup(world=world), seconds=seconds, progress=progress)
    return res.depth, levels, res.fixpoint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000, help="steps per machine alone (the mix runs 5x as many)")
    ap.add_argument("--verify-seconds", type=float, default=600.0, help="budget per world size (0: no verify run)")
    ap.add_argument("--record", action="store_true", help="write the section into bench/RESULTS.md")
    args = ap.parse_args()
    speed = fuzz_speed(args.steps)
    lines = ["### Fuzzing speed", "", "| machine | steps | seconds | steps/s |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {n} | {s:,} | {t:.1f} | {s / t:,.0f} |" for n, s, t in speed]
    lines += ["", "A step is one rule call followed by every invariant check of the machine "
              "(the core's `check_invariants()` walks the whole tree and every pool)."]
    if args.verify_seconds > 0:
        lines += verify_lines(args.verify_seconds)
    body = provenance(sys.argv) + "\n\n" + "\n".join(lines)
    print(body)
    if args.record:
        record_section(RESULTS, "fuzz", "Fuzzing and bounded verification (kvtier.testing)", body)
    return 0


def verify_lines(seconds: float) -> list[str]:
    lines = ["", f"### Largest `kvtier verify` bound in {seconds:.0f} s", "",
              "Configuration: the facade with 2 requests (prompts `ab`, `ac`: 3 nodes after the split, "
              "plus decode units), 2 history cache groups, write-through, 4 device and 4 host units, "
              "completions succeeding or failing per rank, aborts, retractions, resumptions.", "",
              "| world size | largest depth completed | distinct states | seconds | fixpoint |",
              "| ---: | ---: | ---: | ---: | --- |"]
    notes = [""]
    for world in (1, 2):
        depth, levels, fix = verify_bound(world, seconds)
        done = [lv for lv in levels if lv[0] == depth]
        states, secs = (done[0][1], done[0][2]) if done else (0, 0.0)
        lines.append(f"| {world} | {depth} | {states:,} | {secs:.0f} | {'yes' if fix else 'no'} |")
        notes.append(f"World size {world}, distinct states by depth: "
                     + ", ".join(f"{lv}: {st:,} ({sec:.0f} s)" for lv, st, sec in levels))
        notes.append("")
    return lines + notes


if __name__ == "__main__":
    sys.exit(main())
