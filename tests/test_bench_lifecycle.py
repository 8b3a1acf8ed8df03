"""bench/lifecycle.py runs (tiny N) and records its section in RESULTS.md without
touching other sections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "lifecycle.py"
OTHER = "<!-- transfer:begin -->\n## Transfer engine\n\nkept as is\n<!-- transfer:end -->\n"


def _run(results: Path) -> str:
    out = subprocess.run([sys.executable, str(BENCH), "-n", "30", "--repeat", "1", "--record", str(results)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_bench_prints_every_row_and_records_its_own_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n" + OTHER)
    table = _run(results)
    names = [line.split("  ")[0] for line in table.splitlines()[2:]]
    assert names == [f"{lc} cycle, {how}" for lc in ("node", "request")
                     for how in ("Lifecycle.fire", "check + fire", "raw events[e].trigger", "direct assignment")
                     ] + ["GuardRejected raise (demote while locked)", "IllegalTransition raise (create on host)"]
    assert "360" in table.splitlines()[2]  # 12 node events x 30 subjects
    _run(results)  # a second run replaces the section
    text = results.read_text()
    assert text.count("## Lifecycle machines") == 1 and text.count("<!-- lifecycle:begin -->") == 1
    assert OTHER in text and text.startswith("# Benchmark results\n")
    section = text.split("<!-- lifecycle:begin -->")[1].split("<!-- lifecycle:end -->")[0]
    assert "- command: `python" in section and "- commit: " in section and "-core " in section
    assert "node cycle, Lifecycle.fire" in section
