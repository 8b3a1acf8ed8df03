"""bench/lifecycle.py runs (tiny sizes, every row, the core's included) and records its
section in RESULTS.md without touching other sections."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lifecycle.py"
OTHER = "<!-- transfer:begin -->\n## Transfer engine\n\nkept as is\n<!-- transfer:end -->\n"


def _run(results: Path) -> str:
    out = subprocess.run([sys.executable, str(BENCH), "-n", "30", "--repeat", "1", "--requests", "3",
                          "--tree-nodes", "60", "--matches", "20", "--record", str(results)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_bench_prints_every_row_and_records_its_own_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n" + OTHER)
    table = _run(results)
    lines = {line.split("  ")[0]: line for line in table.splitlines()[2:]}
    core_ops = ["insert", "writeback+ack", "demote (evict_device)", "match", "load+ack",
                "drop host (evict_host)", "remove (evict_device)"]
    assert list(lines) == [f"{lc} cycle, {how}" for lc in ("node", "request")
                           for how in ("Lifecycle.fire", "Lifecycle.fire, checked mode", "check + fire",
                                       "raw events[e].trigger", "direct assignment")
                           ] + ["GuardRejected raise (demote while locked)", "IllegalTransition raise (create on host)",
                                "core cycle (node triggers), machine", "core cycle (node triggers), checked mode",
                                "core cycle (node triggers), direct assignment",
                                ] + [f"core {op}, {how}" for op in core_ops for how in ("machine", "direct assignment")
                                     ] + ["match 64-page prompt, 60-node tree: median",
                                          "match 64-page prompt, 60-node tree: p90", "memory per node (tracemalloc)"]
    assert "360" in lines["node cycle, Lifecycle.fire"]  # 12 node events x 30 subjects
    # 3 requests x 4 chunks = 12 nodes, 8 triggers each; the ratio vs direct assignment is shown
    cells = {name: re.split(r"\s{2,}", line) for name, line in lines.items()}
    core = cells["core cycle (node triggers), machine"]
    assert core[1] == "96" and core[5].endswith("x") and core[6].startswith(">= 100,000/s: ")
    assert cells["match 64-page prompt, 60-node tree: median"][6].startswith("median < 50 us: ")
    mem = cells["memory per node (tracemalloc)"]
    assert int(mem[1]) >= 60 and mem[2:6] == ["-"] * 4 and mem[6].startswith("< 1 KiB: ") and " B/node: " in mem[7]
    _run(results)  # a second run replaces the section
    text = results.read_text()
    assert text.count("## Lifecycle machines") == 1 and text.count("<!-- lifecycle:begin -->") == 1
    assert OTHER in text and text.startswith("# Benchmark results\n")
    section = text.split("<!-- lifecycle:begin -->")[1].split("<!-- lifecycle:end -->")[0]
    assert "- command: `python" in section and "- commit: " in section and "-core " in section
    assert "node cycle, Lifecycle.fire" in section
