"""bench/bookkeeping.py runs on the embedded trace slice and records its own section."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bookkeeping  # noqa: E402


def test_every_configuration_runs_and_the_host_tier_adds_hits() -> None:
    by = {(d, h, p, e, x): bookkeeping.run(None, 300, d, h, p, e, x) for d, h, p, e, x in bookkeeping.CONFIGS}
    assert len(by) == 30  # the peers' capacities, then every write and eviction policy (3) at none, 2x, 8x
    for r in by.values():
        assert (r.requests, r.refused) == (300, 0)
        assert 0.0 < r.hit_rate < 1.0 and r.us_per_request > 0
        assert r.calls_per_request >= 6.0  # admit, step_done, finish and three polls at least
    for d, h in ((1000, 8000), (4000, 32000)):
        assert by[(d, h, "write_through", "lru", False)].hit_rate > by[(d, None, "write_through", "lru", False)].hit_rate
    assert by[(4000, None, "write_through", "lru", False)].hit_rate >= by[(1000, None, "write_through", "lru", False)].hit_rate


def test_record_writes_the_table_into_its_section(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- other:begin -->\nkept\n<!-- other:end -->\n")
    assert bookkeeping.main(["--limit", "50", "--record", str(results)]) == 0
    text = results.read_text()
    assert "<!-- other:begin -->\nkept\n<!-- other:end -->" in text
    section = text.split("<!-- bookkeeping:begin -->")[1].split("<!-- bookkeeping:end -->")[0]
    assert "## Bookkeeping per request, peers' method" in section
    assert section.count("| 4,000 / 32,000 |") == 12 and "SGLang HiCache 33.60 %" in section
    assert "| 4,000 / 8,000 | write_back + exclusive | lru |" in section
