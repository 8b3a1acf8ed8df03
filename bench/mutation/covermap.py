"""Build the per-test coverage map of fsm/ that the mutation runner selects tests from.

Runs the subset in ``tests.txt`` once, unmutated, under coverage.py with one context per
test (pytest-cov ``--cov-context=test``), and writes ``covermap.json``:
``{"tests": [node id, ...], "files": {"fsm/<file>.py": {"<line>": [test index, ...]}}}``,
tests in order of their duration, fastest first, with ``"<import>"`` (index 0) for lines
run outside any test (at import or collection). Line numbers are those of the committed
sources: rebuild the map after any change to fsm/ or to the tests (run.sh builds it only
when it is missing). It must run on unmutated sources: not in a checkout where a mutation
run is in progress (MUTATION_FSM_DIR names the fsm/ directory imported, when that is not
./fsm, e.g. a copy).

Usage: python bench/mutation/covermap.py [--add TEST ...]   (needs coverage and pytest-cov)
  --add: run only the named tests (new ones, already listed in tests.txt) and merge them
  into the existing map, instead of rebuilding it from the whole subset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def subset() -> list[str]:
    lines = (HERE / "tests.txt").read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def write(files: dict[str, dict[str, list[str]]], durations: dict[str, float]) -> None:
    """Write covermap.json compactly: tests by index, fastest first."""
    names = sorted({t for lines in files.values() for ts in lines.values() for t in ts} | set(durations),
                   key=lambda t: (t != "<import>", durations.get(t, 0.0), t))
    index = {t: i for i, t in enumerate(names)}
    compact = {f: {ln: sorted(index[t] for t in ts) for ln, ts in lines.items()} for f, lines in files.items()}
    (HERE / "covermap.json").write_text(json.dumps({"tests": names, "files": compact}, separators=(",", ":")),
                                        encoding="utf-8")


def main(argv: list[str]) -> int:
    from coverage import CoverageData

    add = argv[argv.index("--add") + 1:] if "--add" in argv else []

    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / ".coverage"
        junit = Path(tmp) / "junit.xml"
        env = dict(os.environ, COVERAGE_FILE=str(data_file), HYPOTHESIS_PROFILE="kvtier-ci",
                   NUMBA_ENABLE_CUDASIM="1", PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=300",
               f"--cov={os.environ.get('MUTATION_FSM_DIR', ROOT / 'fsm')}", "--cov-context=test", "--cov-report=", f"--junitxml={junit}", *(add or subset())]
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if rc != 0:
            print(f"the subset fails unmutated (pytest status {rc})", file=sys.stderr)
            return 1
        data = CoverageData(basename=str(data_file))
        data.read()
        out: dict[str, dict[str, list[str]]] = {}
        measured = Path(os.environ.get("MUTATION_FSM_DIR", ROOT / "fsm")).resolve()
        for f in sorted(data.measured_files()):
            rel = f"fsm/{Path(f).resolve().relative_to(measured).as_posix()}"  # fsm/<chapter>/<file>.py
            by_line = data.contexts_by_lineno(f)
            out[rel] = {str(ln): sorted({(c.rsplit("|", 1)[0] if c else "<import>") for c in ctxs})
                        for ln, ctxs in sorted(by_line.items())}
        durations: dict[str, float] = {}
        cases = list(ET.parse(junit).getroot().iter("testcase"))
        skipped = [f"{tc.get('classname')}::{tc.get('name')}" for tc in cases if tc.find("skipped") is not None]
        if skipped:  # a skipped test sees no mutant; a skipped module's entry is no test id pytest takes
            print(f"warning: tests of the subset skipped, left out of the map (install kvtier[test]): {skipped}",
                  file=sys.stderr)
        for tc in (tc for tc in cases if tc.find("skipped") is None):
            cls, name = tc.get("classname", ""), tc.get("name", "")
            path = cls.replace(".", "/")
            # junit classname is "tests.test_x" or "tests.test_x.TestClass"
            parts = cls.split(".")
            for i in range(len(parts), 0, -1):
                if (ROOT / ("/".join(parts[:i]) + ".py")).exists():
                    path = "/".join(parts[:i]) + ".py" + "".join("::" + p for p in parts[i:])
                    break
            durations[f"{path}::{name}"] = float(tc.get("time", "0"))
    if add:  # merge into the existing map, keeping its order; the added tests go first
        old = json.loads((HERE / "covermap.json").read_text(encoding="utf-8"))
        names = old["tests"]
        merged = {f: {ln: [names[i] for i in ids] for ln, ids in lines.items()} for f, lines in old["files"].items()}
        for f, lines in out.items():
            for ln, ts in lines.items():
                merged.setdefault(f, {}).setdefault(ln, [])
                merged[f][ln] = sorted(set(merged[f][ln]) | set(ts))
        rank = {t: float(i) for i, t in enumerate(names)}  # keep the old order; new tests first
        rank.update({t: -1.0 + d / 1e6 for t, d in durations.items()})
        out, durations = merged, rank
    write(out, durations)
    print(f"covermap.json: {len(out)} files, {len(durations)} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
