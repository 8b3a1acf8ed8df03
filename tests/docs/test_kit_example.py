"""The kit example of docs/testing.md runs the way the page says.

Its two python blocks are saved as the page says (``tests/conftest.py`` and
``tests/test_engine_lifecycle.py`` of a fresh folder) and run by pytest: the test class takes
its settings from the profile ``HYPOTHESIS_PROFILE`` names (``kvtier-fuzz``, cut to 3
examples by ``KVTIER_FUZZ_EXAMPLES``; without the conftest it would run Hypothesis'
default 100). Then the page's ``kvtier fuzz --machine`` command fuzzes the example's
machine, which only ``PYTHONPATH`` makes importable.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from docs.codeblocks import DOCS, blocks, section

PAGE = DOCS / "testing.md"


def test_kit_example_runs_under_pytest_and_kvtier_fuzz(tmp_path: Path) -> None:
    files = {b.saved_as: b.code for b in blocks(PAGE) if b.saved_as is not None}
    assert set(files) == {"tests/conftest.py", "tests/test_engine_lifecycle.py"}, list(files)
    assert "max_examples" not in files["tests/test_engine_lifecycle.py"]  # the profile sets it
    for name, code in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env.update(HYPOTHESIS_PROFILE="kvtier-fuzz", KVTIER_FUZZ_EXAMPLES="3", KVTIER_FUZZ_DB=str(tmp_path / "db"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--hypothesis-show-statistics", "tests/test_engine_lifecycle.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout and "Stopped because settings.max_examples=3" in done.stdout, done.stdout[-3000:]

    fuzzing = section(PAGE, "## Fuzzing and verification")
    command = next(line for line in fuzzing.splitlines() if line.startswith("PYTHONPATH=tests kvtier fuzz --machine"))
    assignment, program, *args = shlex.split(command.replace("--steps 20000", "--steps 300"))
    kvtier = Path(sys.executable).parent / program
    assert assignment == "PYTHONPATH=tests" and kvtier.exists()
    refused = subprocess.run([str(kvtier), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                             check=False, timeout=600)
    assert refused.returncode == 2 and refused.stdout == "" and "PYTHONPATH=." in refused.stderr, refused.stderr
    fuzzed = subprocess.run([str(kvtier), *args, "--no-progress"], cwd=tmp_path, env=dict(env, PYTHONPATH="tests"),
                            capture_output=True, text=True, check=False, timeout=600)
    assert fuzzed.returncode == 0, fuzzed.stdout[-3000:] + fuzzed.stderr[-3000:]
    assert "(test_engine_lifecycle:EngineLifecycle 30" in fuzzed.stdout and "result: no violation" in fuzzed.stdout
