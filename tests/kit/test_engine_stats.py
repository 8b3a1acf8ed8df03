"""The transfer engine's ``stats()`` in the engine machine (``kvtier.testing.engine_stats``):
the counters of the correct engine match the commands each flush took; an engine that counts
a flush's pages or bytes wrong fails ``model_engine_stats``; an exporter reporting other bytes
than rank 0's engine copied fails ``model_metrics``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from kvtier.fsm import Direction
from kvtier.testing.fuzz import campaign
from kvtier.transfer.stats import DirectionStats, TransferStats

_REAL = TransferStats.issued


def _engine_campaign(tmp_path: Path) -> Any:
    return campaign(steps=600, seed_value=1, progress=False, mix={"engine": 1.0}, shrink=False,
                    save=tmp_path / "failure.json", stream=io.StringIO())


def test_the_engine_counters_match_the_commands_flushed(tmp_path: Path, monkeypatch: Any) -> None:
    seen: list[tuple[Direction, int, int]] = []

    def watched(self: TransferStats, direction: Direction, s: DirectionStats) -> None:
        seen.append((direction, s.pages, s.bytes))
        _REAL(self, direction, s)

    monkeypatch.setattr(TransferStats, "issued", watched)
    res = _engine_campaign(tmp_path)
    assert res.ok, res.failure_result
    assert {d for d, pages, nbytes in seen if pages and nbytes} == set(Direction)


def _one_page_too_many(self: TransferStats, direction: Direction, s: DirectionStats) -> None:  # planted
    s.pages += 1
    _REAL(self, direction, s)


def _loadback_bytes_halved(self: TransferStats, direction: Direction, s: DirectionStats) -> None:  # planted
    if direction is Direction.LOADBACK:
        s.bytes //= 2
    _REAL(self, direction, s)


@pytest.mark.parametrize(("planted", "counter"), [(_one_page_too_many, "pages"), (_loadback_bytes_halved, "bytes")],
                         ids=["a flush counting one page too many", "loadback bytes of half the layers"])
def test_a_wrong_engine_count_is_caught(tmp_path: Path, monkeypatch: Any, planted: Any, counter: str) -> None:
    monkeypatch.setattr(TransferStats, "issued", planted)
    res = _engine_campaign(tmp_path)
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "model_engine_stats" and f"{counter} is" in res.failure_result.message


def test_an_exporter_reporting_the_bytes_of_every_rank_is_caught(tmp_path: Path, monkeypatch: Any) -> None:
    import kvtier.metrics as metrics

    real = metrics._engine_rows

    def doubled(engine: Any) -> Any:  # planted: the bytes of two ranks, as if summed
        return tuple((d, 2 * b, s) for d, b, s in real(engine))

    monkeypatch.setattr(metrics, "_engine_rows", doubled)
    res = _engine_campaign(tmp_path)
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "model_metrics" and "transfer_bytes_total" in res.failure_result.message
