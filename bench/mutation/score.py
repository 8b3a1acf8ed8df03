"""Recompute the mutation score of fsm/ from the committed raw results.

Inputs (in this folder):
  results/*.xml   - one ``mutmut junitxml --untested-policy=skipped`` output (mutmut 2.x)
                    per fsm/ file, written by run.sh: a <failure> is a surviving mutant
                    (with its diff), an <error> a timeout, a <skipped> a mutant not run
                    yet, anything else a killed mutant.
  exclusions.txt  - one excluded (equivalent) mutant per line:
                    ``<file>:<line> | <mutant diff's + line, stripped> | <reason>`` (no `` | `` in a reason)
                    ('#' starts a comment). An exclusion must match a survivor.

A result file is named after its source's path under fsm/, dotted (:func:`result_name`:
``results/request.fence.xml`` for ``fsm/request/fence.py``).

Kill rate = (killed + timed out) / (tested - excluded); a timeout counts as killed
(the mutant made the suite hang), as mutmut itself does.

Usage: python bench/mutation/score.py [--markdown] [--files fsm/a.py ...] [--min 0.97]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def result_name(path: str) -> str:
    """The name of the result file and mutmut cache of an fsm/ source: its path under fsm/,
    dotted (``fsm/request/fence.py`` -> ``request.fence``), as run.sh names them."""
    return path.removeprefix("fsm/").removesuffix(".py").replace("/", ".")


def mutation_line(diff: str) -> tuple[str, str]:
    minus = next((ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")), "")
    plus = next((ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")), "")
    return minus, plus


def load_exclusions(exclusions: Path = HERE / "exclusions.txt") -> dict[tuple[str, str], str]:
    """(file:line, the mutant's + line) -> the reason it is excluded."""
    excl = {}
    if exclusions.exists():
        for raw in exclusions.read_text(encoding="utf-8").splitlines():
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            where, rest = raw.split("|", 1)  # the mutated line may hold " | " (a union type); a reason may not
            plus, _, reason = rest.rpartition(" | ")
            where, plus, reason = where.strip(), plus.strip(), reason.strip()
            if not reason:
                raise SystemExit(f"exclusion without a reason: {raw}")
            excl[(where, plus)] = reason
    return excl


def load(results: Path = HERE / "results", exclusions: Path = HERE / "exclusions.txt") -> dict:
    excl = load_exclusions(exclusions)
    mutants = []
    testcases = [tc for xml in sorted(results.glob("*.xml")) for tc in ET.parse(xml).getroot().iter("testcase")]
    if not testcases:
        raise SystemExit(f"no mutmut results under {results}")
    for tc in testcases:
        where = f"{tc.get('file')}:{tc.get('line')}"
        fail, err, skip = tc.find("failure"), tc.find("error"), tc.find("skipped")
        status = "survived" if fail is not None else "timeout" if err is not None else "untested" if skip is not None else "killed"
        diff = (fail.text or fail.get("message", "")) if fail is not None else ""
        if fail is not None and fail.text is None:
            diff = "".join(fail.itertext())
        minus, plus = mutation_line(diff) if diff else ("", "")
        if status == "survived" and (where, plus) in excl:
            status = "excluded"
        mutants.append({"name": tc.get("name"), "file": tc.get("file"), "where": where,
                        "status": status, "minus": minus, "plus": plus,
                        "reason": excl.get((where, plus), "")})
    used = {(m["where"], m["plus"]) for m in mutants if m["status"] == "excluded"}
    stale = set(excl) - used
    if stale:
        raise SystemExit(f"exclusions that match no surviving mutant: {sorted(stale)}")
    return {"mutants": mutants}


def summary(mutants: list[dict]) -> dict:
    c = Counter(m["status"] for m in mutants)
    tested = c["killed"] + c["survived"] + c["timeout"] + c["excluded"]
    denom = tested - c["excluded"]
    rate = (c["killed"] + c["timeout"]) / denom if denom else float("nan")
    return {"total": len(mutants), "tested": tested, "killed": c["killed"], "survived": c["survived"],
            "timeout": c["timeout"], "excluded": c["excluded"], "untested": c["untested"], "kill_rate": rate}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Kill rate of fsm/ from bench/mutation/results/*.xml")
    p.add_argument("--markdown", action="store_true", help="also list the survivors and the exclusions")
    p.add_argument("--files", nargs="+", metavar="FSM_FILE", help="only these files (fsm/CHAPTER/NAME.py)")
    p.add_argument("--min", type=float, help="exit 1 when the kill rate (0-1) is below this, or a mutant is not run")
    args = p.parse_args(argv)
    mutants = load()["mutants"]
    if args.files:
        unknown = set(args.files) - {m["file"] for m in mutants}
        if unknown:
            raise SystemExit(f"no results for {sorted(unknown)} under {HERE / 'results'}")
        mutants = [m for m in mutants if m["file"] in args.files]
    files = sorted({m["file"] for m in mutants})
    rows = [("all", summary(mutants))] + [(f, summary([m for m in mutants if m["file"] == f])) for f in files]
    print("| file | mutants | tested | killed | survived | timed out | excluded | not run | kill rate |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in rows:
        print(f"| {name} | {s['total']} | {s['tested']} | {s['killed']} | {s['survived']} | {s['timeout']} | "
              f"{s['excluded']} | {s['untested']} | {s['kill_rate']:.2%} |")
    if args.markdown:
        print("\nSurviving mutants:\n")
        for m in mutants:
            if m["status"] == "survived":
                print(f"- `{m['where']}` ({m['name']}): `{m['minus']}` → `{m['plus']}`")
        ex = [m for m in mutants if m["status"] == "excluded"]
        print("\nExcluded mutants (bench/mutation/exclusions.txt):\n")
        for m in ex:
            print(f"- `{m['where']}` ({m['name']}): `{m['minus']}` → `{m['plus']}` — {m['reason']}")
        if not ex:
            print("- none")
    if args.min is not None:
        s = rows[0][1]
        if s["untested"] or not s["kill_rate"] >= args.min:
            print(f"kill rate {s['kill_rate']:.2%} with {s['untested']} mutants not run: below the target {args.min:.2%}")
            return 1
        print(f"kill rate {s['kill_rate']:.2%} >= {args.min:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
