"""Re-run the survivors and not-run mutants of recorded results against today's tests.

run.sh's mutmut cache is per worktree; once it is gone, mutmut's ids no longer name the
mutants. This needs only the committed raw results: every ``<failure>`` (survivor) and
``<skipped>`` (not run) testcase of ``results/<name>.xml`` (:func:`score.result_name`) holds the mutant's unified diff.
For each, it checks that the diff's old lines are still the file's lines at that place
(a mutant on a line changed since is reported ``stale`` and left as it is; an excluded one,
in exclusions.txt, is skipped), applies the
diff in place (the original kept as ``fsm/.../<file>.py.bak``, as mutmut does, so runner.sh
selects the tests), runs ``runner.sh`` (the same test subset and per-test selection as
run.sh), and puts the original back. A mutant the tests now kill loses its
``<failure>``/``<skipped>`` (a killed mutant, as mutmut writes it) and gains a
``rerun="DATE COMMIT"`` attribute; one still surviving keeps, or gets, its ``<failure>``.
The xml is rewritten at the end of each file. Mutates fsm/ in place: run it in a checkout
nothing else uses, with covermap.json built for the current tests.

Usage: python bench/mutation/rerun_results.py [--only-skipped] fsm/file.py [...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from score import load_exclusions, mutation_line, result_name  # noqa: E402

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")


def apply(diff: str, source: list[str]) -> list[str] | None:
    """``source`` with the one-hunk unified ``diff`` applied, or None if its old lines changed."""
    lines = diff.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
    m = HUNK.match(lines[start])
    if m is None:
        raise ValueError(f"not a unified diff hunk: {lines[start]!r}")
    first = int(m.group(1)) - 1
    old = [ln[1:] for ln in lines[start + 1:] if ln[:1] in (" ", "-")]
    new = [ln[1:] for ln in lines[start + 1:] if ln[:1] in (" ", "+")]
    # the hunk's old lines at its header's line, else at the one place near it that holds them
    # (mutmut's junitxml puts a decorator mutant's hunk two lines early)
    near = [i for i in range(max(first - 10, 0), first + 11) if source[i:i + len(old)] == old]
    if first in near:
        near = [first]
    if len(near) == 1:
        return source[:near[0]] + new + source[near[0] + len(old):]
    # a context line changed since: the mutated lines alone, at the one place near the hunk that holds them
    body = lines[start + 1:]
    lead = next(i for i, ln in enumerate(body) if ln[:1] in "-+")
    minus = [ln[1:] for ln in body if ln[:1] == "-"]
    plus = [ln[1:] for ln in body if ln[:1] == "+"]
    at = first + lead
    near = sorted((abs(i - at), i) for i in range(max(at - 10, 0), at + 11) if minus and source[i:i + len(minus)] == minus)
    if not near or (len(near) > 1 and near[0][0] == near[1][0]):  # none, or no single nearest place
        return None
    near = [near[0][1]]
    return source[:near[0]] + plus + source[near[0] + len(minus):]


def run_mutant(path: Path, mutated: list[str], env: dict[str, str]) -> bool:
    """True when the tests kill the mutant (runner.sh exits non-zero)."""
    bak = path.with_name(path.name + ".bak")
    shutil.copyfile(path, bak)
    try:
        path.write_text("\n".join(mutated), encoding="utf-8")
        rc = subprocess.run(["bash", str(HERE / "runner.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    finally:
        shutil.move(bak, path)
    return rc != 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="FSM_FILE")
    ap.add_argument("--only-skipped", action="store_true", help="only the mutants not run yet")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # put fsm/ back (finally) when stopped
    if list((ROOT / "fsm").rglob("*.py.bak")):
        raise SystemExit("fsm/ holds a .py.bak: a mutation run is in progress here or was interrupted")
    if not (HERE / "covermap.json").exists():
        raise SystemExit("no covermap.json: build it first (python bench/mutation/covermap.py)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    env = dict(os.environ, HYPOTHESIS_PROFILE="kvtier-ci", NUMBA_ENABLE_CUDASIM="1", PYTHONDONTWRITEBYTECODE="1")
    sock = HERE / ".forkserver.sock"  # run.sh's fork server: pytest imported once (runner.sh uses it)
    server = subprocess.Popen([sys.executable, str(HERE / "forkserver.py"), "serve", str(sock)], cwd=ROOT, env=env)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.2)
        rerun(args.files, args.only_skipped, f"{datetime.date.today().isoformat()} {commit}", env)
    finally:
        server.terminate()
        server.wait()
        sock.unlink(missing_ok=True)
    return 0


def rerun(files: list[str], only_skipped: bool, stamp: str, env: dict[str, str]) -> None:
    skip_excluded = set(load_exclusions())  # equivalent mutants: not re-run
    for f in files:
        path = ROOT / f
        xml = HERE / "results" / f"{result_name(f)}.xml"
        tree = ET.parse(xml)
        source = path.read_text(encoding="utf-8").split("\n")  # a last "" for the end of the file, as in mutmut's diffs
        for tc in tree.getroot().iter("testcase"):
            fail, skip = tc.find("failure"), tc.find("skipped")
            child = skip if only_skipped else (fail if fail is not None else skip)
            if child is None:
                continue
            diff = child.text or ""
            if (f"{f}:{tc.get('line')}", mutation_line(diff)[1]) in skip_excluded:
                continue
            mutated = apply(diff, source)
            if mutated is None:
                print(f"{tc.get('name')} {f}:{tc.get('line')}: stale (its lines changed since the run)")
                continue
            killed = run_mutant(path, mutated, env)
            print(f"{tc.get('name')} {f}:{tc.get('line')}: {'killed' if killed else 'survived'}", flush=True)
            tc.set("rerun", stamp)
            if killed:
                tc.remove(child)
            elif child is skip:
                tc.remove(skip)
                ET.SubElement(tc, "failure", {"type": "failure", "message": "bad_survived"}).text = diff
        tree.write(xml, encoding="unicode")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
