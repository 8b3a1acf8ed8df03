"""Build a temporary copy of kvtier with one deliberately broken patch applied, and run
Python in it (tests/test_regressions.py).

The copy mirrors the setuptools package-dir mapping: ``<tmp>/src/kvtier`` is a copy of
``src/kvtier`` with ``fsm`` and ``spec`` copied beside its modules (``kvtier.fsm``,
``kvtier.spec``) and ``transfer`` linked (copied and patched when the patch touches it);
``PYTHONPATH=<tmp>/src`` then imports the patched package ahead of the editable install
(whose finder comes last on ``sys.meta_path``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BROKEN = REPO / "tests" / "broken"
REGRESSIONS = REPO / "tests" / "regressions"

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "data")


def patched_tree(patch: Path | None, dest: Path) -> Path:
    """Copy fsm/, spec/ and src/kvtier/ to ``dest``, apply ``patch`` (a unified diff
    against those folders) and return the folder to put on ``PYTHONPATH``."""
    work = dest / "repo"
    copy_transfer = patch is not None and "\n+++ b/transfer/" in "\n" + patch.read_text(encoding="utf-8")
    for folder in ("fsm", "spec", "src/kvtier", *(("transfer",) if copy_transfer else ())):
        shutil.copytree(REPO / folder, work / folder, ignore=_IGNORE)
    if patch is not None:
        done = subprocess.run(["git", "apply", "--unsafe-paths", "-p1", str(patch)], cwd=work,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{patch.name} no longer applies: {done.stderr.strip()}")
    pkg = work / "src" / "kvtier"
    shutil.move(str(work / "fsm"), pkg / "fsm")
    shutil.move(str(work / "spec"), pkg / "spec")
    if copy_transfer:
        shutil.move(str(work / "transfer"), pkg / "transfer")
    else:
        (pkg / "transfer").symlink_to(REPO / "transfer", target_is_directory=True)
    (pkg / "data").symlink_to(REPO / "src" / "kvtier" / "data", target_is_directory=True)
    return work / "src"


def run_python(pythonpath: Path, args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with the patched tree first on the path (no bytecode written)."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONDONTWRITEBYTECODE="1")
    env.pop("HYPOTHESIS_PROFILE", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


#: replay every given sequence in the current interpreter and print one JSON line each
REPLAY_SCRIPT = """
import json, sys, kvtier
from kvtier.testing.sequence import EventSequence, replay
for path in sys.argv[1:]:
    r = replay(EventSequence.load(path))
    print(json.dumps({"path": path, "outcome": r.outcome, "invariant": r.invariant,
                      "message": r.message, "step": r.failed_step, "kvtier": kvtier.__file__}))
"""


#: the catcher that proves the patched copy is the package imported (tests/test_semantic_catchers.py)
IMPORT_CHECK = "tests/test_semantic_catchers.py::test_the_package_under_test_is_the_one_expected"


def run_catchers(pythonpath: Path, node_ids: list[str], timeout: float = 600) -> tuple[set[str], str]:
    """Run the pytest ``node_ids`` (from the repository root) against the package under
    ``pythonpath``; returns the node ids that failed (or errored) and the output's tail.

    The first test run checks that the package imported is the one under ``pythonpath``;
    if it fails, :class:`RuntimeError` is raised (the patched copy was not tested).
    """
    env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONDONTWRITEBYTECODE="1",
               KVTIER_EXPECT_PACKAGE_UNDER=str(pythonpath), NUMBA_ENABLE_CUDASIM="1",
               HYPOTHESIS_PROFILE="kvtier-ci")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                           "--timeout", str(int(timeout)), IMPORT_CHECK, *node_ids],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 60, check=False)
    out = done.stdout + done.stderr
    failed = set()
    for line in out.splitlines():
        for tag in ("FAILED ", "ERROR "):
            if line.startswith(tag):
                failed.add(line[len(tag):].split(" - ")[0].strip())
    if IMPORT_CHECK in failed or done.returncode not in (0, 1):
        raise RuntimeError(f"pytest in the patched copy did not run as expected (exit {done.returncode}):\n"
                           + out[-3000:])
    return failed, out[-3000:]
