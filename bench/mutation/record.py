"""Record a mutation run: fold its raw results into recorded.json, rewrite RESULTS.md's section.

Raw results (``results/<module>.xml``, written by run.sh, run_narrow.py, rerun_results.py)
are not committed: they hold every mutant (about 1 MB for all of fsm/). This folds each
one into the committed record ``recorded.json`` (per fsm/ file: the number of mutants killed,
and every mutant not killed: survived, timed out or not run, with its diff, which is what
score.py and rerun_results.py read), replacing that file's earlier record and stamping it
with ``--stamp`` (default: today's date and the checkout's commit). Then it rewrites the
section "mutation" of bench/RESULTS.md from notes.md, with score.py's table and survivors.

Usage: python bench/mutation/record.py [--stamp "2026-12-02 b1a6d87"] [--no-section]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import record_section  # noqa: E402
import score  # noqa: E402


def fold(results: Path, record_path: Path, stamp: str) -> list[str]:
    """Fold every ``results/*.xml`` into the record; the files folded."""
    record = json.loads(record_path.read_text(encoding="utf-8")) if record_path.exists() else {"files": {}}
    folded = []
    for xml in sorted(results.glob("*.xml")) if results.is_dir() else []:
        by_file: dict[str, list[dict]] = {}
        for m in score.from_xml(xml):
            by_file.setdefault(m["file"], []).append(m)
        for file, mutants in by_file.items():
            record["files"][file] = {
                "recorded": stamp,
                "killed": sum(m["status"] == "killed" for m in mutants),
                "not_killed": [{"name": m["name"], "line": int(m["where"].rpartition(":")[2]), "status": m["status"],
                                "diff": m["diff"]} for m in mutants if m["status"] != "killed"],
            }
            folded.append(file)
    record["files"] = dict(sorted(record["files"].items()))
    record_path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return folded


def section() -> str:
    loaded = score.load(results=None)  # the committed record only
    mutants = loaded["mutants"]
    body = "\n".join(score.table(mutants)) + "\n\nSurviving mutants:\n\n" + ("\n".join(score.survivors(mutants)) or "- none")
    return (HERE / "notes.md").read_text(encoding="utf-8").replace("{{TABLE}}", body)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stamp", help="the provenance recorded with the folded results (default: today and HEAD)")
    p.add_argument("--no-section", action="store_true", help="only fold; leave bench/RESULTS.md as it is")
    args = p.parse_args(argv)
    stamp = args.stamp
    if stamp is None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                                text=True, check=True).stdout.strip()
        stamp = f"{datetime.date.today().isoformat()} {commit}"
    folded = fold(score.RESULTS, score.RECORD, stamp)
    print(f"folded into {score.RECORD.name}: {', '.join(folded) or 'nothing (no results/*.xml)'}")
    if not args.no_section:
        record_section(HERE.parent / "RESULTS.md", "mutation", "Mutation testing of fsm/ (mutmut 2.x)", section())
        print("rewrote the section 'mutation' of bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
