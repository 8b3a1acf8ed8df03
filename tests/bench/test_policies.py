"""bench/policies.py prints every policy row beside the ideal LRU and records its section.

The ideal LRU oracles live with the peers' harness outside the repository, which a clone does
not have: the test gives the table fixed ideal rates and runs kvtier's rows on the embedded
trace, so what it checks is kvtier's side of the table and the table's arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import policies  # noqa: E402

from kvtier.data import default_trace_path  # noqa: E402

#: ideal hit rates the test hands the table (the oracle's keys: exclusive|HOST, inclusive|HOST, unbounded)
IDEAL = {"unbounded": 0.5, "exclusive|0": 0.1, "exclusive|8000": 0.2, "inclusive|8000": 0.15,
         "exclusive|32000": 0.3, "inclusive|32000": 0.25}


def test_every_policy_row_sits_beside_its_ideal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = Path(str(default_trace_path()))
    asked: list[tuple[Path, int | None]] = []
    monkeypatch.setattr(policies, "ideal_rows", lambda t, limit, peers: asked.append((t, limit)) or IDEAL)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    assert policies.main([str(trace), "--limit", "120", "--record", str(results)]) == 0
    assert asked == [(trace, 120)]
    section = results.read_text().split("<!-- policies:begin -->")[1].split("<!-- policies:end -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| 4,000 /")]
    assert len(rows) == len(policies.EVICTIONS) + 2 * len(policies.WITH_HOST)
    assert sum("write_back + exclusive" in r for r in rows) == 2 * len(policies.EVICTIONS) == 6
    assert f"| unbounded | | | | | {IDEAL['unbounded']:.2%} | | |" in section
    # every row says how many admissions were refused (none on this slice: the hit rate covers every request)
    assert [r.split(" | ")[4] for r in rows] == ["0"] * len(rows)
    # each row's ideal columns are those of its host size, and the last column is the difference
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        host = cells[0].split(" / ")[1].replace(",", "")
        hb = "0" if host == "none" else host
        assert cells[5] == f"{IDEAL[f'exclusive|{hb}']:.2%}"
        assert cells[6] == ("" if hb == "0" else f"{IDEAL[f'inclusive|{hb}']:.2%}")
        rate = float(cells[3].rstrip("%"))  # percent, to 2 decimals
        assert cells[7].endswith(" points")
        assert float(cells[7].split()[0]) == pytest.approx(rate - IDEAL[f"exclusive|{hb}"] * 100, abs=0.011)
