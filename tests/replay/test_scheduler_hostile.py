"""Generated hostile inputs for the reference scheduler: every ``SchedRequest`` field x bad
value (at construction and after reassignment), bad request lists and options; each case
asserts the exact error class and message, that nothing ran, and that the cache behaves
afterwards exactly like a fresh one; a lost completion stops the run instead of spinning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvtier.fsm import ConfigError, Direction
from kvtier.fsm.presets import preset
from kvtier.scheduler import InstantExecutor, ReferenceScheduler, RunStats, SchedRequest, SchedulerStalled
from kvtier.tiered import TieredCache
from kvtier.replay.trace import (
    MAX_INPUT_LENGTH,
    MAX_OUTPUT_LENGTH,
)

# --- reference scheduler: every SchedRequest field x bad value ---------------------------

LAYOUT = preset("llama-3-8b", page_tokens=16)
_ARRIVAL = "arrival_s must be a finite number of seconds in 0 .. 1e+10"
_PROMPT = "prompt_tokens must be an int in 1..1048576"
_OUTPUT = "output_tokens must be an int in 0..131072"
SCHED_CASES: list[tuple[str, object, str]] = [
    *[("request_id", v, "request_id must be a non-empty str") for v in ("", None, 5, b"r1")],
    *[("arrival_s", v, _ARRIVAL) for v in (float("nan"), float("inf"), float("-inf"), -1.0, -1e-9, 1e308, 2e10,
                                            "0", None, True, 1j, [0.0], 10**400)],
    *[("prompt_tokens", v, _PROMPT) for v in (0, -1, 1.5, 40.0, True, "40", None, MAX_INPUT_LENGTH + 1, 2**100,
                                               float("nan"))],
    *[("output_tokens", v, _OUTPUT) for v in (-1, 1.5, False, "3", None, MAX_OUTPUT_LENGTH + 1, 3_000_000)],
    *[("units", v, "units must be a tuple of unit keys") for v in ("ab", None, 5, {"a": 1}, {"a"})],
]


def _request(rid: str = "r1", **change: Any) -> SchedRequest:
    fields: dict[str, Any] = dict(request_id=rid, arrival_s=0.0, prompt_tokens=40, output_tokens=3,
                                  units=(("p", 0), ("p", 1)))
    fields.update(change)
    return SchedRequest(**fields)


def _workload() -> list[SchedRequest]:
    return [_request("r0"), _request("r1", arrival_s=0.01, units=(("p", 0), ("q", 1))),
            _request("r2", arrival_s=0.02, prompt_tokens=70, units=tuple(("s", i) for i in range(4)))]


def _outcome(stats: RunStats) -> dict[str, object]:
    out = dict(vars(stats))
    for timing in ("kvtier_s", "kvtier_decode_s"):
        out.pop(timing)
    return out


def _assert_unchanged(cache: TieredCache, sched: ReferenceScheduler) -> None:
    """Nothing ran: the scheduler counted nothing, and the cache then serves a workload exactly
    as a fresh cache does."""
    assert sched.stats == RunStats()
    assert not cache.in_flight()
    after = ReferenceScheduler(cache).run(_workload())
    fresh = ReferenceScheduler(TieredCache(LAYOUT, 16, 16)).run(_workload())
    assert after.finished == 3 and _outcome(after) == _outcome(fresh)


@pytest.mark.parametrize(("field", "value", "fragment"), SCHED_CASES,
                         ids=[f"{c[0]}={c[1]!r}"[:40] for c in SCHED_CASES])
def test_sched_request_rejects_bad_field(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        _request(**{field: value})
    assert type(info.value) is ConfigError and fragment in str(info.value)
    assert f"got {value!r}" in str(info.value) or field == "units"


@pytest.mark.parametrize(("field", "value", "fragment"), SCHED_CASES,
                         ids=[f"{c[0]}={c[1]!r}"[:40] for c in SCHED_CASES])
def test_run_rechecks_reassigned_fields_before_anything_runs(field: str, value: object, fragment: str) -> None:
    cache = TieredCache(LAYOUT, 16, 16)
    sched = ReferenceScheduler(cache)
    good, bad = _request("r0"), _request("r1")
    setattr(bad, field, value)
    with pytest.raises(ConfigError) as info:
        sched.run([good, bad])
    assert type(info.value) is ConfigError and fragment in str(info.value)
    assert good.tokens == 0 and not good.done
    _assert_unchanged(cache, sched)


def _used(r: SchedRequest) -> SchedRequest:
    r.tokens = 5
    return r


RUN_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("str", lambda: "r0", "requests must be a sequence of SchedRequest, got str"),
    ("None", lambda: None, "requests must be a sequence of SchedRequest, got NoneType"),
    ("int", lambda: 5, "requests must be a sequence of SchedRequest, got int"),
    ("generator", lambda: (r for r in _workload()), "requests must be a sequence of SchedRequest, got generator"),
    ("dict item", lambda: [_request("r0"), {"request_id": "r1"}], "requests[1] must be a SchedRequest, got dict"),
    ("None item", lambda: [None], "requests[0] must be a SchedRequest, got NoneType"),
    ("duplicate id", lambda: [_request("r0"), _request("r1"), _request("r0")], "request id 'r0' appears twice"),
    ("run before", lambda: [_request("r0"), _used(_request("r1"))], "requests[1] ('r1') was run before"),
]


@pytest.mark.parametrize(("make", "fragment"), [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_run_rejects_bad_request_lists(make: Callable[[], Any], fragment: str) -> None:
    cache = TieredCache(LAYOUT, 16, 16)
    sched = ReferenceScheduler(cache)
    with pytest.raises(ConfigError) as info:
        sched.run(make())
    assert type(info.value) is ConfigError and fragment in str(info.value)
    _assert_unchanged(cache, sched)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_run_rejects_bad_max_steps(bad: object) -> None:
    cache = TieredCache(LAYOUT, 16, 16)
    sched = ReferenceScheduler(cache)
    with pytest.raises(ConfigError, match="max_steps must be an int in 0[.][.]"):
        sched.run(_workload(), max_steps=bad)  # type: ignore[arg-type]
    _assert_unchanged(cache, sched)


@pytest.mark.parametrize("option", ["token_budget", "max_idle_steps"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8", None])
def test_scheduler_options_are_checked(option: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be an int in 1[.][.]"):
        ReferenceScheduler(TieredCache(LAYOUT, 16, 16), **{option: bad})


def test_numpy_values_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    r = _request("r0", arrival_s=np.float64(0.5), prompt_tokens=np.int64(40), output_tokens=np.int32(3),
                 units=[("p", 0), ("p", 1)])
    assert (type(r.arrival_s), type(r.prompt_tokens), type(r.output_tokens), r.units) == (
        float, int, int, (("p", 0), ("p", 1)))
    stats = ReferenceScheduler(TieredCache(LAYOUT, 16, 16), token_budget=np.int64(64)).run([r])
    assert stats.finished == 1


class _LosesLoadbacks(InstantExecutor):
    """Completes writebacks, never loadbacks (a lost completion, and no deadline)."""

    def submit(self, commands: Any) -> None:
        self._pending.extend(c for c in commands if c.direction is not Direction.LOADBACK)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])  # selective: no loadback in this workload
def test_lost_completion_raises_scheduler_stalled_instead_of_spinning(policy: str) -> None:
    cache = TieredCache(LAYOUT, 8, 64, policy=policy, op_deadline_steps=None)  # no deadline: waits forever
    sched = ReferenceScheduler(cache, _LosesLoadbacks(), max_idle_steps=500)
    a, b = tuple(("a", j) for j in range(4)), tuple(("b", j) for j in range(4))
    reqs = [_request("r0", prompt_tokens=70, units=a), _request("r1", arrival_s=1.0, prompt_tokens=70, units=b),
            _request("r2", arrival_s=2.0, prompt_tokens=70, units=a)]
    with pytest.raises(SchedulerStalled) as info:
        sched.run(reqs)
    err = info.value
    assert err.live == ("r2",) and cache.state("r2") == "loading"
    assert 500 < err.steps < 2000
    assert "no forward pass, arrival or ended request for 500 iterations (max_idle_steps)" in str(err)
    assert "1 request(s) not ended (r2)" in str(err)
