"""The operator-counter model (``kvtier.testing.counter_model``): it agrees with a correct
cache, and a counter that moves on the wrong event, or by the wrong amount, is caught."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.fsm import Completion
from kvtier.fsm.request.counters import FacadeCounters
from kvtier.testing.base import kit_layout
from kvtier.testing.counter_model import CounterModel
from kvtier.testing.models import ModelViolation
from kvtier.tiered import TieredCache


def _run(cache: TieredCache) -> None:
    """Two requests sharing a prefix: admit, compute, finish with a writeback, retract and
    resume one, abort the other; every command completed."""
    align = cache.layout.alignment

    def settle() -> None:
        for cmd in cache.poll().commands:
            cache.complete(Completion(cmd.op_id, 0, True, None))
        cache.poll()

    assert cache.admit("a", ["x", "y"], 2 * align, 2 * align) is not None
    cache.step_done("a", 2 * align, checkpoint=True)
    cache.finish("a")
    settle()
    assert cache.admit("b", ["x", "y", "z"], 3 * align, 3 * align) is not None
    settle()
    cache.step_done("b", 3 * align - cache.request("b").tokens)
    cache.retract("b")
    settle()
    assert cache.resume("b", align) is not None
    settle()
    cache.check_invariants()
    cache.abort("b")
    cache.step_done("b", 0)  # its pass out returns discarded: it ends aborted
    settle()


def test_the_counts_agree_with_a_correct_cache() -> None:
    cache = TieredCache(kit_layout(), 8, 8)
    model = CounterModel(cache)
    _run(cache)
    model.check_drained()
    model.check_metrics()
    stats = cache.stats()
    assert stats["facade"]["admissions"] == 2 and stats["facade"]["resumptions"] == 1
    assert stats["facade"]["retractions"] == 1 and model.aborts == {"aborted by client": 1}


def test_a_resumption_counted_as_an_admission_is_caught(monkeypatch: Any) -> None:
    real = FacadeCounters.admitted

    def also_admission(self: FacadeCounters, event: str, prompt: int, hit: int, dev: int) -> None:  # planted
        real(self, event, prompt, hit, dev)
        if event == "resume":
            self.admissions += 1

    monkeypatch.setattr(FacadeCounters, "admitted", also_admission)
    cache = TieredCache(kit_layout(), 8, 8)
    CounterModel(cache)
    with pytest.raises(ModelViolation) as exc:
        _run(cache)
    assert exc.value.invariant == "model_counters"
    assert "admissions is 3, the calls made 2" in str(exc.value)


def test_an_abort_counted_under_the_wrong_reason_is_caught(monkeypatch: Any) -> None:
    real = FacadeCounters.transition

    def wrong_reason(self: FacadeCounters, event: str, state: str, reason: str | None) -> None:  # planted
        real(self, event, state, "cache capacity exhausted" if reason else reason)

    monkeypatch.setattr(FacadeCounters, "transition", wrong_reason)
    cache = TieredCache(kit_layout(), 8, 8)
    CounterModel(cache)
    with pytest.raises(ModelViolation) as exc:
        _run(cache)
    assert exc.value.invariant == "model_counters" and "aborts" in str(exc.value)


def _snapshot_patched(monkeypatch: Any, change: Any) -> None:
    """The exporter reads its values through ``metrics._read``: ``change`` rewrites them (planted)."""
    import dataclasses

    import kvtier.metrics as metrics

    real = metrics._read
    monkeypatch.setattr(metrics, "_read", lambda cache, engine: dataclasses.replace(real(cache, engine),
                                                                                   **change(real(cache, engine))))


def test_the_exported_values_agree_after_every_poll_with_a_correct_cache() -> None:
    cache = TieredCache(kit_layout(), 8, 8)
    model = CounterModel(cache)
    model.metrics_every = 1
    _run(cache)
    model.check_metrics()
    assert model.polls >= 4 and model.pages["writeback"] > 0


def test_operations_in_flight_exported_under_the_other_direction_are_caught(monkeypatch: Any) -> None:
    _snapshot_patched(monkeypatch, lambda snap: {"in_flight": tuple(zip([d for d, _ in snap.in_flight],
                                                                        [n for _, n in reversed(snap.in_flight)]))})
    cache = TieredCache(kit_layout(), 8, 8)
    CounterModel(cache).metrics_every = 1
    with pytest.raises(ModelViolation) as exc:
        _run(cache)
    assert exc.value.invariant == "model_metrics" and "operations_in_flight" in str(exc.value)


def test_free_pages_exported_as_the_pool_capacity_are_caught(monkeypatch: Any) -> None:
    _snapshot_patched(monkeypatch, lambda snap: {"pools": tuple((t, g, used, used + free)
                                                                for t, g, used, free in snap.pools)})
    cache = TieredCache(kit_layout(), 8, 8)
    CounterModel(cache).metrics_every = 1
    with pytest.raises(ModelViolation) as exc:
        _run(cache)
    assert exc.value.invariant == "model_metrics" and "pages_free" in str(exc.value)
