"""``kvtier diagram`` and the command line: what is written equals ``render``; ``--check``
catches stale or missing committed diagrams; rendering without Graphviz says how to
install it; ``kvtier --help`` and ``python -m kvtier --help`` work."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.cli.diagram import DiagramError, render
from kvtier.fsm.lifecycle.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "diagrams"
TEXT_FILES = ("node.dot", "node.mmd", "request.dot", "request.mmd", "l3.dot", "l3.mmd", "transfer.dot", "transfer.mmd")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed")


def test_diagram_writes_text_formats_equal_to_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--format", "dot", "--format", "mermaid", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(TEXT_FILES)
    for lc in ("node", "request", "l3"):
        assert (tmp_path / f"{lc}.dot").read_bytes() == render(lc, "dot")
        assert (tmp_path / f"{lc}.mmd").read_bytes() == render(lc, "mermaid")
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted(TEXT_FILES)


def test_dot_shows_every_event_and_guard() -> None:
    spec = load_spec()
    for lc in spec.lifecycles:
        for fmt in ("dot", "mermaid"):
            text = render(lc.name, fmt).decode()
            assert all(e in text for e in lc.events), (lc.name, fmt)
            assert all(g.label in text for t in lc.transitions for g in t.guards), (lc.name, fmt)
    node_dot = render("node", "dot").decode()
    assert 'backed -> host [label="demote\\l  [unlocked &\\l   unborrowed &\\l   !has_device_child]\\l"]' in node_dot
    assert "!has_host_child" in node_dot
    req = render("request", "dot").decode()
    assert 'waiting -> loading [label="schedule\\l  [has_loadback]\\l"]' in req


def test_layout_reads_at_page_width() -> None:
    """Top to bottom, one edge per pair of states (the five events ending an aborting
    request on one label, their shared guard once), the abort edges of five states into
    ``aborting`` meeting at one junction, labelled once."""
    for lc in ("node", "request", "l3"):
        dot = render(lc, "dot").decode()
        assert "rankdir=TB" in dot
        edges = [line.split(" [", 1)[0].strip() for line in dot.splitlines() if " -> " in line]
        assert len(edges) == len(set(edges)), lc
        assert "direction TB" in render(lc, "mermaid").decode()
    req = render("request", "dot").decode()
    assert ('aborting -> aborted [label="loadback_ack\\lloadback_fail\\lforward_result\\lwriteback_ack'
            '\\lwriteback_fail\\l[settled]\\l"]') in req
    assert req.count('-> aborting [label="abort\\l  [!settled]\\l"]') == 1
    joined = sorted(line.split(" -> ")[0].strip() for line in req.splitlines()
                    if "-> _join1_aborting [arrowhead=none]" in line)
    assert joined == ["fenced", "finishing", "loading", "retracting", "running"]


@needs_dot
def test_drawings_fit_readme_width() -> None:
    """The SVGs are at most about 1,000 pixels wide (dot's points: 96/72 pixels each)."""
    import re

    for lc in ("node", "request", "l3"):
        svg = render(lc, "svg").decode()
        m = re.search(r'<svg width="(\d+)pt" height="(\d+)pt"', svg)
        assert m is not None
        assert int(m.group(1)) * 96 / 72 <= 1050, (lc, m.groups())


def test_check_passes_on_the_committed_diagrams(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--check", "--out", str(COMMITTED)]) == 0
    assert "match the spec" in capsys.readouterr().out


@pytest.mark.parametrize("name", TEXT_FILES)
def test_check_names_an_altered_file(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    shutil.copytree(COMMITTED, out)
    (out / name).write_text((out / name).read_text() + "%% edited by hand\n")
    assert main(["diagram", "--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{out / name}: differs from the spec (run: kvtier diagram --out {out})"]


def test_check_names_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    shutil.copytree(COMMITTED, out)
    (out / "request.mmd").unlink()
    assert main(["diagram", "--check", "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{out / 'request.mmd'}: missing (run: kvtier diagram --out {out})"]


def test_check_of_an_empty_folder_names_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--check", "--out", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert [Path(line.split(":")[0]).name for line in lines] == list(TEXT_FILES)


@needs_dot
def test_svg_renders_with_graphviz(tmp_path: Path) -> None:
    assert main(["diagram", "--format", "svg", "--out", str(tmp_path)]) == 0
    svg = (tmp_path / "node.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "demote" in svg


def test_svg_without_dot_binary_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(DiagramError, match=r"needs the Graphviz 'dot' binary.*apt-get install graphviz"):
        render("node", "svg")
    assert main(["diagram", "--format", "svg", "--out", str(tmp_path / "d")]) == 2
    assert "apt-get install graphviz" in capsys.readouterr().err
    # the text formats need no binary
    assert main(["diagram", "--format", "dot", "--out", str(tmp_path / "d")]) == 0


def test_render_rejects_unknown_lifecycle_and_format() -> None:
    with pytest.raises(ValueError, match="unknown lifecycle 'tree'"):
        render("tree", "dot")
    with pytest.raises(ValueError, match="unknown diagram format 'jpeg'"):
        render("node", "jpeg")


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "diagram" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    [str(Path(sys.executable).with_name("kvtier")), "--help"],
    [sys.executable, "-m", "kvtier", "--help"],
], ids=["kvtier", "python -m kvtier"])
def test_help_lists_diagram(argv: list[str], tmp_path: Path) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvtier") and "diagram" in out.stdout


def test_shadowing_namespace_package_is_named(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A namespace package named kvtier (a folder without __init__.py, as a clone's root)
    imported instead of the installed package: the command line says what is wrong."""
    import types

    shadow = types.ModuleType("kvtier")
    shadow.__path__ = ["/somewhere/kvtier"]  # what a namespace package has, without __file__
    monkeypatch.setitem(sys.modules, "kvtier", shadow)
    assert main(["--help"]) == 2
    err = capsys.readouterr().err
    assert "imported from /somewhere/kvtier as an empty namespace package" in err and "cd into the clone" in err


def test_python_m_kvtier_from_the_folder_holding_the_clone(tmp_path: Path) -> None:
    """From the folder above a clone named kvtier: with an editable install Python imports
    the clone as a namespace package, and ``python -m kvtier`` says so (exit 2); with a
    regular install the installed package wins and it runs (exit 0)."""
    (tmp_path / "kvtier").symlink_to(REPO, target_is_directory=True)
    probe = subprocess.run([sys.executable, "-c", "import kvtier; print(getattr(kvtier, '__file__', None))"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=60)
    shadowed = probe.stdout.strip() == "None"
    out = subprocess.run([sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    if shadowed:
        assert out.returncode == 2 and f"imported from {tmp_path / 'kvtier'}" in out.stderr, out.stderr
    else:
        assert out.returncode == 0 and out.stdout.startswith("usage: kvtier"), out.stderr
