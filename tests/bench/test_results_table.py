"""bench/RESULTS.md's transfer table is what bench/render_results.py makes of the newest
committed bench/results/transfer-*.json (regenerate with ``python bench/render_results.py``)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


def _renderer():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvtier_bench_render_results",
                                                  os.path.join(BENCH, "render_results.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_transfer_table_matches_the_committed_json() -> None:
    rr = _renderer()
    src = rr.newest_json(os.path.join(BENCH, "results"))
    if src is None:
        pytest.skip("no bench/results/transfer-*.json committed yet")
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    body = rr.render(data, os.path.relpath(src, ROOT))
    md = open(os.path.join(BENCH, "RESULTS.md"), encoding="utf-8").read()
    assert rr.BEGIN in md and rr.END in md, "bench/RESULTS.md has no transfer section markers"
    got = md[md.index(rr.BEGIN) + len(rr.BEGIN) + 1: md.index(rr.END)]
    assert got == body, "bench/RESULTS.md transfer table is stale: run python bench/render_results.py"


def test_results_json_records_what_the_issue_asks_for() -> None:
    rr = _renderer()
    src = rr.newest_json(os.path.join(BENCH, "results"))
    if src is None:
        pytest.skip("no bench/results/transfer-*.json committed yet")
    with open(src, encoding="utf-8") as f:
        data = json.load(f)
    for key in ("date", "gpu", "commit", "command", "ceilings", "configs", "gpu_tests", "sanitizer"):
        assert key in data, key
    for c in data["configs"]:
        assert c["correct"], c["name"]
        for k in ("cold_gbps", "warm_gbps", "replay_gbps", "kernel_gbps", "kernel_launches"):
            assert k in c["h2d"] and k in c["d2h"]
        assert c["plan_cache"]["plan_hits"] > 0


def test_renderer_keeps_other_sections() -> None:
    rr = _renderer()
    md = "# Benchmark results\n\n<!-- lifecycle:begin -->\nX\n<!-- lifecycle:end -->\n"
    once = rr.updated(md, "T1\n")
    assert "<!-- lifecycle:begin -->\nX\n<!-- lifecycle:end -->" in once and "## Transfer engine" in once
    twice = rr.updated(once + "\n## Later\nY\n", "T2\n")
    assert "T1" not in twice and "T2\n<!-- transfer:end -->" in twice and twice.endswith("## Later\nY\n")
