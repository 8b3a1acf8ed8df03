"""The blind bug sets of ``tests/broken/blind/`` and ``blind3/`` to ``blind6/`` still apply to the
sources, so the fuzz can be measured on them again (each set's ``README.md`` lists each bug with
its catching campaign)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BROKEN = Path(__file__).resolve().parent / "broken"
SETS = (BROKEN / "blind", BROKEN / "blind3", BROKEN / "blind4", BROKEN / "blind5", BROKEN / "blind6")
PATCHES = [p for folder in SETS for p in sorted(folder.glob("bug*.patch"))]


@pytest.mark.parametrize("folder", SETS, ids=lambda f: f.name)
def test_each_blind_set_has_ten_bugs_each_listed(folder: Path) -> None:
    listed = (folder / "README.md").read_text(encoding="utf-8")
    patches = sorted(folder.glob("bug*.patch"))
    assert [p.stem for p in patches] == [f"bug{i:02d}" for i in range(1, 11)]
    assert all(f"| {p.stem.removeprefix('bug')} |" in listed for p in patches)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_blind_bug_applies_to_the_sources(patch: Path) -> None:
    done = subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=BROKEN.parent.parent,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"
