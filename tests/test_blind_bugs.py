"""The blind bug sets of ``tests/broken/blind/`` and ``blind3/`` to ``blind7/`` still apply to the
sources, so the fuzz can be measured on them again (each set's ``README.md`` lists each bug with
its catching campaign)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BROKEN = Path(__file__).resolve().parent / "broken"
SETS = tuple(BROKEN / name for name in ("blind", "blind3", "blind4", "blind5", "blind6", "blind7"))
PATCHES = [p for folder in SETS for p in sorted(folder.glob("bug*.patch"))]


@pytest.mark.parametrize("folder", SETS, ids=lambda f: f.name)
def test_each_blind_set_numbers_its_bugs_from_01_and_lists_each(folder: Path) -> None:
    """Sets one to six have ten bugs; the seventh writer finished seven of the ten."""
    listed = (folder / "README.md").read_text(encoding="utf-8")
    patches = sorted(folder.glob("bug*.patch"))
    assert [p.stem for p in patches] == [f"bug{i:02d}" for i in range(1, len(patches) + 1)]
    assert len(patches) == (7 if folder.name == "blind7" else 10)
    assert all(f"| {p.stem.removeprefix('bug')} |" in listed for p in patches)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_blind_bug_applies_to_the_sources(patch: Path) -> None:
    done = subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=BROKEN.parent.parent,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"
