"""The scheduler machine (``kvtier.testing.scheduler_machine``): the reference scheduler over a
cache with late, reordered and failing transfers, checked for what a correct scheduler does.
Planted scheduler bugs (a request sent back to waiting never requeued, a checkpoint flag from
the chunk's length) are caught; a retraction livelock fails within the machine's bound."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from kvtier.scheduler import ReferenceScheduler
from kvtier.scheduler.requests import SchedRequest
from kvtier.testing.fuzz import DEFAULT_MIX, campaign
from kvtier.testing.models import ModelViolation
from kvtier.testing.scheduler_machine import SchedulerMachine, WatchedCache
from kvtier.testing.sequence import EventSequence, replay

HERE = Path(__file__).parent


def _machine(device: int, host: int | None, faults: int, late: int, prompts: list[tuple[str, int, int]],
             budget: int = 8, seed: int = 1, policy: str = "write_through") -> SchedulerMachine:
    m = SchedulerMachine.configured(fault_rate=0.25)()
    m.setup.__wrapped__(m, device=device, host=host, policy=policy, world=1, budget=budget,  # type: ignore[attr-defined]
                        seed=seed, faults=faults, late=late)
    for units, tail, out in prompts:
        m.arrive.__wrapped__(m, units=list(units), tail=tail, output=out, gap=0.0)  # type: ignore[attr-defined]
    return m


# requests over shared prefixes, with a host tier whose loadbacks fail at twice the rate
_PROMPTS = [("ab", 1, 3), ("abc", 0, 2), ("ab", 2, 4), ("a", 3, 1), ("abca", 0, 2), ("abc", 1, 3),
            ("ba", 0, 2), ("ab", 0, 3), ("abc", 2, 2), ("abca", 1, 1)]


def _failing_loadbacks() -> SchedulerMachine:
    """A machine whose workload sends requests back to waiting (failed loadbacks)."""
    for seed in range(40):
        m = _machine(4, 8, 3, 2, _PROMPTS, seed=seed)
        m.kit_drain()
        if m.cache is not None and m.executor is not None and m.executor.failed:
            return _machine(4, 8, 3, 2, _PROMPTS, seed=seed)
    raise AssertionError("no seed made a loadback fail")


def test_the_correct_scheduler_drains_every_example() -> None:
    m = _failing_loadbacks()
    m.kit_drain()
    assert m.cache is not None and m.cache.quiescent()
    assert all(r.done for r in m.requests)
    assert m.cache.stalled == [] and m.cache.sent_back == set() and m.cache.bad_flags == []


def test_a_request_sent_back_to_waiting_and_never_requeued_is_caught(monkeypatch: Any) -> None:
    m = _failing_loadbacks()

    def lost(self: ReferenceScheduler, r: SchedRequest) -> None:  # planted: it leaves the running list only
        if r in self._running:
            self._running.remove(r)
        r.tokens = 0

    monkeypatch.setattr(ReferenceScheduler, "_requeue", lost)
    with pytest.raises(ModelViolation) as exc:
        m.kit_drain()
    # the policy model sees the lost request first in line when another is admitted before it
    assert exc.value.invariant in ("model_liveness", "model_scheduler_policy")
    assert ("never admitted again" in str(exc.value) or "scheduler stalled" in str(exc.value)
            or "first in the waiting queue" in str(exc.value))


def test_a_checkpoint_flag_from_the_chunk_length_is_caught(monkeypatch: Any) -> None:
    m = _machine(8, 8, 0, 0, [("abc", 1, 2), ("ab", 3, 1)], budget=6)
    real_step = WatchedCache.step

    def flag_by_chunk(self: WatchedCache, results: Any = (), reserve: Any = (), **kw: Any) -> Any:
        align = self.layout.alignment
        wrong = [(it[0], it[1], it[2] if len(it) > 2 else (), it[1] % align == 0) if len(it) >= 2 and it[1] else it
                 for it in results]
        return real_step(self, wrong, reserve, **kw)

    monkeypatch.setattr(WatchedCache, "step", flag_by_chunk)
    with pytest.raises(ModelViolation) as exc:
        m.kit_drain()
    assert exc.value.invariant == "model_checkpoint"
    assert "does not flag a checkpoint" in str(exc.value) or "flags a checkpoint" in str(exc.value)


def test_a_retraction_livelock_fails_within_the_machines_bound() -> None:
    """A decoding request that retracted itself while only older prefills ran beside it (now
    fixed in the scheduler: it retracts the newest prefill); the sequence passes."""
    seq = EventSequence.load(HERE / "sequences" / "scheduler-decode-retracts-itself.json")
    result = replay(seq)
    assert result.outcome == "pass", result.describe()


@pytest.mark.parametrize("name", ["scheduler-done-while-loading", "scheduler-requeued-after-decoding-past-resume"])
def test_a_request_finishes_after_exactly_its_output_tokens(name: str) -> None:
    """Two orderings where the scheduler decoded one token too many (a request done while
    loading) or too few (requeued after decoding past its resume), caught by the finish
    model and fixed; the sequences pass."""
    result = replay(EventSequence.load(HERE / "sequences" / f"{name}.json"))
    assert result.outcome == "pass", result.describe()


def test_a_finish_one_decode_token_late_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real_finish = ReferenceScheduler._finish
    held: set[str] = set()

    def late_finish(self: ReferenceScheduler, r: SchedRequest) -> None:
        if r.request_id in held or r.output_tokens == 0:
            real_finish(self, r)
        else:
            held.add(r.request_id)  # one decode token more first
            r.generated -= 1

    monkeypatch.setattr(ReferenceScheduler, "_finish", late_finish)
    res = campaign(steps=300, seed_value=1, progress=False, mix={"scheduler": 1.0}, shrink=False, stream=io.StringIO())
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "model_scheduler_policy" and "output tokens asked" in res.failure_result.message


def test_the_scheduler_machine_is_in_the_default_mix() -> None:
    assert DEFAULT_MIX.get("scheduler", 0) > 0
    res = campaign(steps=300, seed_value=2, progress=False, mix={"scheduler": 1.0})
    assert res.ok and res.steps_by_machine["scheduler"] >= 300



def _retracting() -> SchedulerMachine:
    """A machine whose decode tokens run short with several requests decoding (retractions)."""
    for seed in range(40):
        prompts = [("ab", 1, 12), ("ba", 2, 12), ("ca", 1, 12), ("ac", 0, 12)]
        m = _machine(5, 8, 0, 0, prompts, budget=16, seed=seed)
        m.kit_drain()
        assert m.cache is not None and m.cache.bad_policy == []
        if m.cache.retractions:
            return _machine(5, 8, 0, 0, prompts, budget=16, seed=seed)
    raise AssertionError("no workload retracted")


def test_retracting_the_oldest_decoding_request_is_caught(monkeypatch: Any) -> None:
    """The documented victim is the newest-admitted decoding request; the oldest is a legal
    but costlier choice (more recompute) that only the policy model sees."""
    import kvtier.scheduler.retraction as retraction

    prompts = [("ab", 1, 12), ("ba", 2, 12), ("ca", 1, 12), ("ac", 0, 12)]
    configs = [(dev, budget) for dev in (4, 5, 6, 7) for budget in (4, 8, 16)]
    for dev, budget in configs:  # the correct scheduler passes every one
        m = _machine(dev, 8, 0, 0, prompts, budget=budget)
        m.kit_drain()
    monkeypatch.setattr(retraction, "max", min, raising=False)  # planted: every victim the oldest
    caught = []
    for dev, budget in configs:
        try:
            _machine(dev, 8, 0, 0, prompts, budget=budget).kit_drain()
        except ModelViolation as exc:
            caught.append(exc)
    assert caught, "no configuration retracted with two requests decoding"
    assert caught[0].invariant == "model_scheduler_policy"
    assert "the documented victim is" in str(caught[0])


def test_admitting_out_of_arrival_order_is_caught(monkeypatch: Any) -> None:
    m = _machine(8, 8, 0, 0, [("ab", 1, 2), ("ba", 0, 2), ("ab", 2, 1)], budget=64)
    real = ReferenceScheduler._arrivals

    def newest_first(self: ReferenceScheduler) -> int:  # planted: the waiting queue as a stack
        n = real(self)
        self._waiting.reverse()
        return n

    monkeypatch.setattr(ReferenceScheduler, "_arrivals", newest_first)
    with pytest.raises(ModelViolation) as exc:
        m.kit_drain()
    assert exc.value.invariant == "model_scheduler_policy"
    assert "first in the waiting queue" in str(exc.value)


def test_a_run_stats_counter_moved_wrongly_is_caught(monkeypatch: Any) -> None:
    m = _retracting()
    real = ReferenceScheduler._retract

    def counted_twice(self: ReferenceScheduler, victim: SchedRequest) -> None:  # planted
        real(self, victim)
        self.stats.retractions += 1

    monkeypatch.setattr(ReferenceScheduler, "_retract", counted_twice)
    with pytest.raises(ModelViolation) as exc:
        m.kit_drain()
    assert exc.value.invariant == "model_counters"
    assert "retractions is" in str(exc.value)


def test_the_run_stats_bytes_and_tokens_match_the_commands_and_forward_passes() -> None:
    m = _failing_loadbacks()
    m.kit_drain()
    assert m.cache is not None
    model = m.counters
    assert model.bytes["writeback"] > 0 and model.bytes["loadback"] > 0
    assert m.cache.computed["prefill"] > 0 and m.cache.computed["decode"] > 0


def test_transfer_bytes_of_one_layer_only_are_caught(monkeypatch: Any) -> None:
    m = _failing_loadbacks()

    def one_layer(self: ReferenceScheduler, cmd: Any) -> int:  # planted: a page's bytes in one layer
        groups = {g.name: g for g in self.cache.layout.groups}
        return sum(t.pages * groups[t.group].layer_page_bytes for t in cmd.transfers)

    monkeypatch.setattr(ReferenceScheduler, "_command_bytes", one_layer)
    with pytest.raises(ModelViolation) as exc:
        m.kit_drain()
    assert exc.value.invariant == "model_scheduler_stats"
    assert "_bytes is" in str(exc.value)


def test_a_decode_token_counted_as_prefill_is_caught(monkeypatch: Any) -> None:
    m = _machine(8, 8, 0, 0, [("abc", 1, 4), ("ab", 3, 3)], budget=6)
    real = ReferenceScheduler._forward

    def misclassed(self: ReferenceScheduler, batch: Any, load_s: float) -> None:  # planted: one decode as prefill
        real(self, batch, load_s)
        if self.stats.decode_tokens and not getattr(self, "_planted", False):
            self._planted = True  # type: ignore[attr-defined]
            self.stats.decode_tokens -= 1
            self.stats.prefill_tokens += 1

    monkeypatch.setattr(ReferenceScheduler, "_forward", misclassed)
    with pytest.raises(ModelViolation) as exc:
        m.kit_drain()
    assert exc.value.invariant == "model_scheduler_stats"
    assert "prefill_tokens is" in str(exc.value)
