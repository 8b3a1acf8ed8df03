"""The mutation score of fsm/: from the committed record, or from a run's raw results.

Inputs (in this folder):
  recorded.json   - the committed record of every module's result (see ``record.py``): per
                    fsm/ file, how many mutants were killed and every mutant that was not
                    (survived, timed out or not run), with its diff.
  results/*.xml   - raw results of a local run, not committed: one ``mutmut junitxml
                    --untested-policy=skipped`` output (mutmut 2.x) per fsm/ file, written by
                    run.sh, run_narrow.py or rerun_results.py. A <failure> is a surviving
                    mutant (with its diff), an <error> a timeout, a <skipped> a mutant not
                    run yet, anything else a killed mutant. A file with raw results here is
                    scored from them instead of from the record.
  exclusions.txt  - one excluded (equivalent) mutant per line:
                    ``<file>:<line> | <mutant diff's + line, stripped> | <reason>`` (no `` | `` in a reason)
                    ('#' starts a comment). An exclusion must match a survivor; its line is
                    the line the result names (the line of the file when it was mutated).

Module paths: a file that moved since its result was recorded (``MOVED`` in
src/kvtier/_moved.py, old dotted module path -> new) is scored under its current path, and
an exclusion or ``--files`` may name either path.

A result file is named after its source's path under fsm/, dotted (:func:`result_name`:
``results/request.fence.xml`` for ``fsm/request/fence.py``).

Kill rate = (killed + timed out) / (tested - excluded); a timeout counts as killed
(the mutant made the suite hang), as mutmut itself does.

Usage: python bench/mutation/score.py [--markdown] [--files fsm/a.py ...] [--min 0.97]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORD = HERE / "recorded.json"
RESULTS = HERE / "results"


def result_name(path: str) -> str:
    """The name of the result file and mutmut cache of an fsm/ source: its path under fsm/,
    dotted (``fsm/request/fence.py`` -> ``request.fence``), as run.sh names them."""
    return path.removeprefix("fsm/").removesuffix(".py").replace("/", ".")


def mutation_line(diff: str) -> tuple[str, str]:
    minus = next((ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")), "")
    plus = next((ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")), "")
    return minus, plus


#: fsm/ modules that became a package of the same name, their code moved into a file of it:
#: ``MOVED`` cannot name these (the old dotted path is the package now). Old file -> new file,
#: used once the old file is gone and the new one is there.
BECAME_PACKAGES = {"fsm/node.py": "fsm/node/node.py", "fsm/request.py": "fsm/request/request.py",
                   "fsm/l3.py": "fsm/l3/tier.py"}


def moved_files(moved_py: Path = ROOT / "src" / "kvtier" / "_moved.py") -> dict[str, str]:
    """Old fsm/ file path -> current one, from ``MOVED`` (``kvtier.fsm.a`` -> ``kvtier.fsm.b.a``)
    and :data:`BECAME_PACKAGES`."""
    out = {old: new for old, new in BECAME_PACKAGES.items() if not (ROOT / old).exists() and (ROOT / new).exists()}
    if not moved_py.exists():
        return out
    spec = importlib.util.spec_from_file_location("kvtier_moved_table", moved_py)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def path(module: str) -> str | None:
        if not module.startswith("kvtier.fsm."):
            return None
        rel = module[len("kvtier.fsm."):].replace(".", "/")
        return f"fsm/{rel}/__init__.py" if (ROOT / "fsm" / rel).is_dir() else f"fsm/{rel}.py"

    for old, new in getattr(mod, "MOVED", {}).items():
        o, n = path(old), path(new)
        if o and n:
            out[o] = n
    return out


def result_name(file: str) -> str:
    """The raw result's name of an fsm/ file: ``fsm/node/core.py`` -> ``node.core`` (results/node.core.xml)."""
    return file.removeprefix("fsm/").removesuffix(".py").replace("/", ".")


def current(where: str, moved: dict[str, str]) -> str:
    """``fsm/old.py[:line]`` with the file at its current path."""
    f, sep, line = where.partition(":")
    return moved.get(f, f) + sep + line


def load_exclusions(exclusions: Path = HERE / "exclusions.txt",
                    moved: dict[str, str] | None = None) -> dict[tuple[str, str], str]:
    """(file:line, the mutant's + line) -> the reason it is excluded (file at its current path)."""
    moved = moved_files() if moved is None else moved
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
            excl[(current(where, moved), plus)] = reason
    return excl


def _mutant(name: str, file: str, line: str, status: str, diff: str) -> dict:
    minus, plus = mutation_line(diff) if diff else ("", "")
    return {"name": name, "file": file, "where": f"{file}:{line}", "status": status, "minus": minus,
            "plus": plus, "diff": diff, "reason": ""}


def from_xml(xml: Path) -> list[dict]:
    """The mutants of one raw junit result (statuses as mutmut wrote them, before exclusions)."""
    out = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        fail, err, skip = tc.find("failure"), tc.find("error"), tc.find("skipped")
        status = "survived" if fail is not None else "timeout" if err is not None else "untested" if skip is not None else "killed"
        child = fail if fail is not None else err if err is not None else skip
        diff = "" if child is None else (child.text or "".join(child.itertext()) or child.get("message", ""))
        out.append(_mutant(tc.get("name", ""), tc.get("file", ""), tc.get("line", ""), status, diff))
    return out


def from_record(record: dict) -> list[dict]:
    """The mutants of the committed record: the killed ones by count, the others in full."""
    out = []
    for file, r in record["files"].items():
        out += [_mutant(f"killed #{k}", file, "", "killed", "") for k in range(r["killed"])]
        out += [_mutant(m["name"], file, str(m["line"]), m["status"], m["diff"]) for m in r["not_killed"]]
    return out


def load(results: Path | None = RESULTS, exclusions: Path = HERE / "exclusions.txt", record: Path = RECORD) -> dict:
    """Every mutant with its status (excluded survivors marked), and where each file's result is from
    (``results=None``: the committed record alone)."""
    moved = moved_files()
    excl = load_exclusions(exclusions, moved)
    by_file: dict[str, list[dict]] = {}
    source: dict[str, str] = {}
    if record.exists():
        for m in from_record(json.loads(record.read_text(encoding="utf-8"))):
            by_file.setdefault(current(m["file"], moved), []).append(m)
        source = {f: record.name for f in by_file}
    raw: dict[str, list[dict]] = {}
    for xml in sorted(results.glob("*.xml")) if results is not None and results.is_dir() else []:
        for m in from_xml(xml):
            raw.setdefault(current(m["file"], moved), []).append(m)
            source[current(m["file"], moved)] = f"results/{xml.name}"
    by_file.update(raw)  # a local run's raw results replace the record of its files
    if not by_file:
        raise SystemExit(f"no mutation results: neither {record} nor {results}/*.xml")
    # an exclusion names its file, line and mutated text; where the line moved since it was
    # written (a fresh run of code edited since), the same file and mutated text match it
    by_text: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for where, plus in sorted(excl):
        by_text.setdefault((where.rpartition(":")[0], plus), []).append((where, plus))
    used: set[tuple[str, str]] = set()
    mutants = []
    for f in sorted(by_file):
        for m in by_file[f]:
            m["file"], m["where"] = f, current(m["where"], moved)
            if m["status"] == "survived":
                key = (m["where"], m["plus"])
                if key not in excl or key in used:
                    key = next((k for k in by_text.get((f, m["plus"]), []) if k not in used), key)
                if key in excl and key not in used:
                    m["status"], m["reason"] = "excluded", excl[key]
                    used.add(key)
            mutants.append(m)
    stale = set(excl) - used
    if stale:
        raise SystemExit(f"exclusions that match no surviving mutant: {sorted(stale)}")
    return {"mutants": mutants, "source": source}


def summary(mutants: list[dict]) -> dict:
    c = Counter(m["status"] for m in mutants)
    tested = c["killed"] + c["survived"] + c["timeout"] + c["excluded"]
    denom = tested - c["excluded"]
    rate = (c["killed"] + c["timeout"]) / denom if denom else float("nan")
    return {"total": len(mutants), "tested": tested, "killed": c["killed"], "survived": c["survived"],
            "timeout": c["timeout"], "excluded": c["excluded"], "untested": c["untested"], "kill_rate": rate}


def table(mutants: list[dict]) -> list[str]:
    files = sorted({m["file"] for m in mutants})
    rows = [("all", summary(mutants))] + [(f, summary([m for m in mutants if m["file"] == f])) for f in files]
    out = ["| file | mutants | tested | killed | survived | timed out | excluded | not run | kill rate |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in rows:
        out.append(f"| {name} | {s['total']} | {s['tested']} | {s['killed']} | {s['survived']} | {s['timeout']} | "
                   f"{s['excluded']} | {s['untested']} | {s['kill_rate']:.2%} |")
    return out


def survivors(mutants: list[dict]) -> list[str]:
    return [f"- `{m['where']}` ({m['name']}): `{m['minus']}` → `{m['plus']}`" for m in mutants if m["status"] == "survived"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="Kill rate of fsm/ from bench/mutation/recorded.json "
                                            "(and a local run's bench/mutation/results/*.xml)")
    p.add_argument("--markdown", action="store_true", help="also list the survivors and the exclusions")
    p.add_argument("--files", nargs="+", metavar="FSM_FILE", help="only these files (fsm/CHAPTER/NAME.py)")
    p.add_argument("--min", type=float, help="exit 1 when the kill rate (0-1) is below this, or a mutant is not run")
    args = p.parse_args(argv)
    loaded = load()
    mutants, source = loaded["mutants"], loaded["source"]
    if args.files:
        moved = moved_files()
        want = {current(f, moved) for f in args.files}
        unknown = want - {m["file"] for m in mutants}
        if unknown:
            raise SystemExit(f"no results for {sorted(unknown)} in {RECORD.name} or {RESULTS}/")
        mutants = [m for m in mutants if m["file"] in want]
    print("\n".join(table(mutants)))
    raw = sorted({source[m["file"]] for m in mutants} - {RECORD.name})
    if raw:
        print(f"\nfrom this checkout's raw results: {', '.join(raw)}; the other files from {RECORD.name}")
    if args.markdown:
        print("\nSurviving mutants:\n")
        print("\n".join(survivors(mutants)) or "- none")
        ex = [m for m in mutants if m["status"] == "excluded"]
        print("\nExcluded mutants (bench/mutation/exclusions.txt):\n")
        for m in ex:
            print(f"- `{m['where']}` ({m['name']}): `{m['minus']}` → `{m['plus']}` — {m['reason']}")
        if not ex:
            print("- none")
    if args.min is not None:
        s = summary(mutants)
        if s["untested"] or not s["kill_rate"] >= args.min:
            print(f"kill rate {s['kill_rate']:.2%} with {s['untested']} mutants not run: below the target {args.min:.2%}")
            return 1
        print(f"kill rate {s['kill_rate']:.2%} >= {args.min:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
