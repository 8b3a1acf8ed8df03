"""The blind bugs of ``tests/broken/blind/`` still apply to the sources, so the fuzz can be
measured on them again (``tests/broken/blind/README.md`` lists each with its catching campaign)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BLIND = Path(__file__).resolve().parent / "broken" / "blind"
PATCHES = sorted(BLIND.glob("bug*.patch"))


def test_the_blind_set_has_ten_bugs_each_listed() -> None:
    listed = (BLIND / "README.md").read_text(encoding="utf-8")
    assert [p.stem for p in PATCHES] == [f"bug{i:02d}" for i in range(1, 11)]
    assert all(f"| {p.stem.removeprefix('bug')} |" in listed for p in PATCHES)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_blind_bug_applies_to_the_sources(patch: Path) -> None:
    done = subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=BLIND.parents[2],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"
