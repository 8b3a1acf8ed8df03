"""Every mutant of one fsm/ file, without mutmut's driver: the first pass against a few fast tests.

mutmut 2.5.1 generates the mutants (its own ids and order); each is applied in place (the
original kept as ``fsm/.../<file>.py.bak``, as mutmut does) and run first against the TESTs given
(all in the subset, ``tests.txt``), through run.sh's fork server when its socket exists; a
mutant they do not kill is then run against ``runner.sh``'s selection from the whole subset,
as in run.sh. A mutant listed in exclusions.txt is recorded as a survivor without a run. The
result is a junit file like ``mutmut junitxml``'s (score.py reads it). Used where run.sh is
slow: a module whose mutants are mostly at class level (dataclass fields, defaults) runs each
against the whole subset (l3options.py under run.sh: 14 mutants in 8 minutes on the shared
2-core machine at load 4-5). Mutates fsm/ in place: run it in a checkout nothing else uses.

Usage: python bench/mutation/run_narrow.py CHECKOUT fsm/FILE.py OUT.xml TEST [TEST ...]
(CHECKOUT: the repository root to mutate, e.g. ``.``)"""
import difflib
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

from mutmut import Context, list_mutations, mutate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score import load_exclusions, mutation_line  # noqa: E402

wt, fn, out, tests = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
root = os.path.abspath(wt)
path = f"{root}/{fn}"
src = open(path).read()
env = dict(os.environ, HYPOTHESIS_PROFILE="kvtier-ci", NUMBA_ENABLE_CUDASIM="1", PYTHONDONTWRITEBYTECODE="1")
ids = list_mutations(Context(source=src, filename=fn))  # (line, index) per mutant, in mutmut's order
suites = ET.Element("testsuites")
suite = ET.SubElement(suites, "testsuite", name="mutmut")
stats = {"killed": 0, "survived": 0}
excl = load_exclusions()
for k, mid in enumerate(ids, 1):
    new, _ = mutate(Context(source=src, mutation_id=mid, filename=fn))
    diff = "\n".join(difflib.unified_diff(src.split("\n"), new.split("\n"), fn, fn, lineterm=""))
    if (f"{fn}:{mid.line_number + 1}", mutation_line(diff)[1]) in excl:
        tc = ET.SubElement(suite, "testcase", name=f"Mutant #{k}", file=fn, line=str(mid.line_number + 1))
        ET.SubElement(tc, "failure", type="failure", message="bad_survived").text = diff
        ET.SubElement(tc, "system-out").text = mid.line
        print(f"Mutant #{k} {fn}:{mid.line_number + 1}: excluded, not run", flush=True)
        continue
    shutil.copyfile(path, path + ".bak")
    try:
        open(path, "w").write(new)
        rc = 0 if not tests else subprocess.run([f"{root}/.venv/bin/python", f"{root}/bench/mutation/forkserver.py", "client", f"{root}/bench/mutation/.forkserver.sock", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:pytest_cov", "--timeout=60", *tests],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        how = "narrow"
        if rc == 0:
            rc = subprocess.run(["bash", "bench/mutation/runner.sh"], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            how = "runner"
    finally:
        shutil.move(path + ".bak", path)
    tc = ET.SubElement(suite, "testcase", name=f"Mutant #{k}", file=fn, line=str(mid.line_number + 1))
    if rc == 0:
        ET.SubElement(tc, "failure", type="failure", message="bad_survived").text = diff
        stats["survived"] += 1
    else:
        stats["killed"] += 1
    ET.SubElement(tc, "system-out").text = mid.line
    print(f"Mutant #{k} {fn}:{mid.line_number + 1}: {'killed' if rc else 'SURVIVED'} ({how})", flush=True)
ET.ElementTree(suites).write(out, encoding="unicode")
print(stats)
