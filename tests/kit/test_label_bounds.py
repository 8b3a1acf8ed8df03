"""The metrics' label bound (kvtier.testing.label_bounds): the rows computed from the
abort counts, the kit driving the ``reason`` label past its bound, and a collector that
keeps one reason too many, or one too few, caught."""

from __future__ import annotations

from typing import Any

import pytest

import kvtier.metrics as metrics
from kvtier.fsm.request.counters import KNOWN_ABORT_REASONS
from kvtier.testing.base import kit_layout
from kvtier.testing.counter_model import CounterModel
from kvtier.testing.label_bounds import REASONS, abort_series, drive_abort_reasons
from kvtier.testing.models import ModelViolation
from kvtier.tiered import TieredCache

KNOWN = tuple(KNOWN_ABORT_REASONS)


def test_the_first_n_own_reasons_get_rows_and_later_ones_count_as_other() -> None:
    aborts = [(f"r{i}", i + 1) for i in range(5)] + [("other", 10), (KNOWN[0], 7)]
    rows = abort_series(aborts, KNOWN, 3, 128)
    assert rows == {**dict.fromkeys(KNOWN, 0), KNOWN[0]: 7, "other": 10 + 4 + 5, "r0": 1, "r1": 2, "r2": 3}


def test_labels_are_escaped_then_cut_and_coinciding_ones_add_up() -> None:
    rows = abort_series([("x" * 10 + "A", 1), ("x" * 10 + "B", 2), ("bad \udc80", 4)], KNOWN, 16, 10)
    assert rows["x" * 10] == 3 and rows["bad \\udc80"] == 4 and rows["other"] == 0


def test_the_kit_s_reasons_pass_the_collector_s_bound() -> None:
    own = {r for r in REASONS if r not in KNOWN and r != "other"}
    assert len(own) > metrics.MAX_ABORT_REASONS and "other" in REASONS
    assert any(len(r) > metrics.MAX_LABEL_CHARS for r in REASONS)


def _drained_cache_past_the_bound() -> tuple[TieredCache, CounterModel]:
    cache = TieredCache(kit_layout(), 8, 8)
    model = CounterModel(cache)
    assert drive_abort_reasons(cache, 0, len(REASONS)) == len(REASONS)
    assert cache.quiescent() and sum(cache.stats()["facade"]["aborts"].values()) == len(REASONS)
    return cache, model


def test_a_correct_collector_exports_exactly_the_bounded_rows() -> None:
    cache, model = _drained_cache_past_the_bound()
    model.check_drained()
    model.check_metrics()
    got = {s.labels["reason"] for fam in metrics.KvtierCollector(cache).collect() for s in fam.samples
           if s.name == "kvtier:aborts_total"}
    assert len(got) == len(KNOWN) + 1 + metrics.MAX_ABORT_REASONS - 1  # two long reasons share a cut label


def _rows_with_bound(bound: int) -> Any:
    """The collector's rows with the bound applied at ``bound`` (a planted off-by-one)."""
    def rows(aborts: dict[str, int]) -> tuple[tuple[str, int], ...]:
        out = dict.fromkeys(KNOWN + ("other",), 0)
        own = 0
        for reason, n in aborts.items():
            if reason not in KNOWN:
                own += reason != "other"
                if reason == "other" or own > bound:
                    reason = "other"
            out[reason] = out.get(reason, 0) + n
        return tuple(out.items())
    return rows


def test_the_planted_rows_agree_at_the_true_bound(monkeypatch: Any) -> None:
    monkeypatch.setattr(metrics, "_abort_rows", _rows_with_bound(metrics.MAX_ABORT_REASONS))
    _drained_cache_past_the_bound()[1].check_metrics()


@pytest.mark.parametrize("shift", [-1, 1])
def test_a_collector_keeping_one_reason_too_few_or_too_many_is_caught(shift: int, monkeypatch: Any) -> None:
    monkeypatch.setattr(metrics, "_abort_rows", _rows_with_bound(metrics.MAX_ABORT_REASONS + shift))
    with pytest.raises(ModelViolation) as exc:  # (at a poll's periodic check, or at the last one)
        _, model = _drained_cache_past_the_bound()
        model.check_metrics()
    assert exc.value.invariant == "model_label_bounds" and "distinct reasons" in str(exc.value)


def test_a_collector_that_does_not_cut_long_labels_is_caught(monkeypatch: Any) -> None:
    monkeypatch.setattr(metrics, "_label", lambda value: value.encode("utf-8", "backslashreplace").decode("utf-8"))
    with pytest.raises(ModelViolation) as exc:  # (at a poll's periodic check, or at the last one)
        _, model = _drained_cache_past_the_bound()
        model.check_metrics()
    assert exc.value.invariant == "model_label_bounds"
