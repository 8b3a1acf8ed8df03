"""The semantic mutants of issue 12 (tests/broken/make_patches.py, ``SEMANTIC``): realistic
lifecycle bugs in the node core, the request lifecycle, the facade and transfer/.

Each patch in ``tests/broken/semantic/`` still applies to the sources, every saved
sequence of ``tests/regressions/semantic/`` names the mutants it catches, and, applied
to a temporary copy of the package, each mutant makes every one of its designated tests
fail (only those run: the proof stays bounded). What ``kvtier fuzz`` alone catches is
measured by ``bench/semantic_mutants.py`` (bench/RESULTS.md, "Semantic mutants").
"""

from __future__ import annotations

import ast
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from broken.make_patches import SEMANTIC, make, patch_path
from broken_support import REPO, patched_tree, run_catchers

SEQUENCES = sorted((REPO / "tests" / "regressions" / "semantic").glob("*.json"))
NAMES = sorted(SEMANTIC)


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_the_table_and_the_patches_agree() -> None:
    assert len(SEMANTIC) >= 24
    areas = Counter(m.area for m in SEMANTIC.values())
    assert set(areas) == {"fsm-core", "fsm-request", "facade", "transfer"} and areas["transfer"] >= 3, areas
    on_disk = {p.stem for p in (REPO / "tests" / "broken" / "semantic").glob("*.patch")}
    assert on_disk == set(SEMANTIC)
    for name, m in SEMANTIC.items():
        assert m.catchers and m.bug, name
        touched = {f.split("/")[0] for f, _, _ in m.edits}
        want = {"fsm-core": {"fsm"}, "fsm-request": {"fsm"}, "facade": {"src"}, "transfer": {"transfer"}}[m.area]
        assert touched == want, (name, touched)


def test_every_catcher_exists() -> None:
    seq_stems = {p.stem for p in SEQUENCES}
    for name, m in SEMANTIC.items():
        for node in m.catchers:
            file, _, test = node.partition("::")
            func, _, param = test.partition("[")
            assert func in _test_names(REPO / file), f"{name}: no test {node}"
            if func == "test_sequence_passes":
                assert param.rstrip("]") in seq_stems, f"{name}: no sequence {param}"


def test_every_sequence_names_mutants_that_designate_it() -> None:
    for path in SEQUENCES:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["expect"] == {"outcome": "pass"} and data["mutants"], path.name
        for patch in data["mutants"]:
            name = patch.removesuffix(".patch")
            assert name in SEMANTIC, f"{path.name}: unknown mutant {patch}"
            assert f"tests/test_semantic_catchers.py::test_sequence_passes[{path.stem}]" in SEMANTIC[name].catchers


@pytest.mark.parametrize("name", NAMES)
def test_patch_applies_and_can_be_regenerated(name: str) -> None:
    path = patch_path(name)
    done = subprocess.run(["git", "apply", "--check", "-p1", str(path)], cwd=REPO, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, f"{path.name} no longer applies: {done.stderr.strip()} " \
                                 "(python tests/broken/make_patches.py regenerates it)"
    make(name)  # the text it breaks is still there exactly once (else SystemExit: regenerate after a fix)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_mutant_is_caught_by_its_designated_tests(name: str, tmp_path: Path) -> None:
    m = SEMANTIC[name]
    failed, out = run_catchers(patched_tree(patch_path(name), tmp_path), list(m.catchers))
    missed = [c for c in m.catchers if c not in failed]
    assert not missed, f"{name} ({m.bug}) survives {missed}:\n{out}"
