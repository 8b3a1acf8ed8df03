"""bench/policies.py prints every policy row beside the peers' oracles and records its section."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import policies  # noqa: E402

needs_peers = pytest.mark.skipif(not policies.TRACE.exists() or not (policies.PEERS / "lru_oracle.py").exists(),
                                 reason="needs ../shared/peers and ../shared/traces beside the repository")


@needs_peers
def test_every_policy_row_sits_beside_its_ideal(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    assert policies.main(["--limit", "120", "--record", str(results)]) == 0
    section = results.read_text().split("<!-- policies:begin -->")[1].split("<!-- policies:end -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| 4,000 /")]
    assert len(rows) == len(policies.EVICTIONS) + 2 * len(policies.WITH_HOST)
    assert sum("write_back + exclusive" in r for r in rows) == 2 * len(policies.EVICTIONS) == 6
    ideal = policies.ideal_rows(policies.TRACE, 120, policies.PEERS)
    # the oracles agree with themselves: more host, more hits; exclusive >= inclusive
    assert ideal["exclusive|0"] <= ideal["exclusive|8000"] <= ideal["exclusive|32000"] <= ideal["unbounded"]
    assert ideal["inclusive|8000"] <= ideal["exclusive|8000"]
    assert f"| unbounded | | | | | {ideal['unbounded']:.2%} | | |" in section
    # every row says how many admissions were refused (none on this slice: the hit rate covers every request)
    assert [r.split(" | ")[4] for r in rows] == ["0"] * len(rows)
