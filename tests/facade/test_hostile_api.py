"""Generated hostile arguments for the facade's calls: every request state that takes
``step_done`` x every bad ``new_units``, count and ``checkpoint``; every call x every bad
request id; every int argument x every bad value, and every numpy integer type accepted
wherever an int is (calls, records, layouts, presets).

Every refusal asserts the exact error class, a message naming the value, and that nothing
changed (every public view of the facade and its core, and the forward results owed: a
refused ``step_done`` counts no result).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hostile_api_helpers import BAD_IDS, NP_INTS, STEP_STATES, drain, h1, in_state, refused, view

from kvtier.fsm import Completion
from kvtier.fsm.errors import UsageError
from kvtier.fsm.presets import preset
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family
from kvtier.tiered import TieredCache


# ---------------------------------------------------------------------------- step_done
BAD_UNITS: list[tuple[str, object, str]] = [
    ("int", 5, "must be a list or tuple of unit keys, got 5"),
    ("float", 5.0, "must be a list or tuple of unit keys"),
    ("str", "ef", "must be a list or tuple of unit keys, got 'ef'"),
    ("bytes", b"ef", "must be a list or tuple of unit keys"),
    ("None", None, "must be a list or tuple of unit keys, got None"),
    ("set", {"e"}, "must be a list or tuple of unit keys"),
    ("dict", {"e": 1}, "must be a list or tuple of unit keys"),
    ("generator", (u for u in "ef"), "must be a list or tuple of unit keys"),
    ("list-of-list", [["e"]], "unit keys must be hashable, got ['e']"),
    ("list-of-dict", [{}], "unit keys must be hashable, got {}"),
    ("list-of-set", ["e", set()], "unit keys must be hashable, got set()"),
    ("tuple-with-list", ("e", ["f"]), "unit keys must be hashable, got ['f']"),
    ("hashable-tuple-of-list", [("e", ["f"])], "unit keys must be hashable"),
]


@pytest.mark.parametrize("state", STEP_STATES)
@pytest.mark.parametrize(("units", "fragment"), [c[1:] for c in BAD_UNITS], ids=[c[0] for c in BAD_UNITS])
def test_step_done_refuses_bad_new_units_before_counting_the_result(state: str, units: object,
                                                                    fragment: str) -> None:
    c = in_state(state)
    refused(c, lambda: c.step_done("r", 1, new_units=units), UsageError,  # type: ignore[arg-type]
            "step_done new_units", fragment)
    assert c.request("r").owed_forward == 1  # the result was not counted
    c.step_done("r", 1)  # and the real one is still taken
    assert c.request("r").owed_forward == 0


BAD_COUNTS: list[tuple[str, object, str]] = [
    ("negative", -1, "must be an int >= 0, got -1"),
    ("float", 1.0, "must be an int >= 0, got 1.0"),
    ("nan", math.nan, "must be an int >= 0, got nan"),
    ("str", "1", "must be an int >= 0, got '1'"),
    ("None", None, "must be an int >= 0, got None"),
    ("bool", True, "must be an int >= 0, got True"),
    ("over-reserved", 5, "5 tokens computed but only 4 reserved"),
    ("absurd", 10**30, f"{10**30} tokens computed but only 4 reserved"),
]


@pytest.mark.parametrize("state", STEP_STATES)
@pytest.mark.parametrize(("count", "fragment"), [c[1:] for c in BAD_COUNTS], ids=[c[0] for c in BAD_COUNTS])
def test_step_done_refuses_bad_counts_in_every_state(state: str, count: object, fragment: str) -> None:
    """An absurd count is refused while aborting (or fenced) too, where the result is
    discarded: no pass computes more tokens than were reserved."""
    c = in_state(state)
    refused(c, lambda: c.step_done("r", count), UsageError, fragment)  # type: ignore[arg-type]
    assert c.request("r").owed_forward == 1


@pytest.mark.parametrize("state", STEP_STATES)
@pytest.mark.parametrize("flag", ["no", "yes", "", 0, 1, None, 1.0, []], ids=repr)
def test_step_done_refuses_a_checkpoint_that_is_not_a_bool(state: str, flag: object) -> None:
    c = in_state(state)
    refused(c, lambda: c.step_done("r", 1, checkpoint=flag), UsageError,  # type: ignore[arg-type]
            f"step_done checkpoint must be True or False, got {flag!r}")


def test_step_done_without_a_result_owed_is_refused() -> None:
    c = in_state("running")
    c.step_done("r", 4)
    refused(c, lambda: c.step_done("r", 0), UsageError, "owes no forward result")


# ---------------------------------------------------------------------------- request ids
CALLS_BY_ID: dict[str, Callable[[TieredCache, object], object]] = {
    "request": lambda c, r: c.request(r),  # type: ignore[arg-type]
    "state": lambda c, r: c.state(r),  # type: ignore[arg-type]
    "unit_keys": lambda c, r: c.unit_keys(r),  # type: ignore[arg-type]
    "page_table": lambda c, r: c.page_table(r),  # type: ignore[arg-type]
    "allows": lambda c, r: c.allows(r, "reserve"),  # type: ignore[arg-type]
    "reserve": lambda c, r: c.reserve(r, 2),  # type: ignore[arg-type]
    "step_done": lambda c, r: c.step_done(r, 0),  # type: ignore[arg-type]
    "finish": lambda c, r: c.finish(r),  # type: ignore[arg-type]
    "retract": lambda c, r: c.retract(r),  # type: ignore[arg-type]
    "resume": lambda c, r: c.resume(r, 2),  # type: ignore[arg-type]
    "abort": lambda c, r: c.abort(r),  # type: ignore[arg-type]
    "layer_ready": lambda c, r: c.layer_ready(r, 0),  # type: ignore[arg-type]
    "abort_victim": lambda c, r: c.abort_victim([r]),  # type: ignore[list-item]
}


@pytest.mark.parametrize("call", sorted(CALLS_BY_ID))
@pytest.mark.parametrize("rid", BAD_IDS, ids=repr)
def test_every_call_refuses_an_unknown_request(call: str, rid: object) -> None:
    c = in_state("running")
    refused(c, lambda: CALLS_BY_ID[call](c, rid), UsageError, f"unknown request {rid!r}")


@pytest.mark.parametrize("rid", [None, 1, "", b"r", ("r",)], ids=repr)
def test_admit_refuses_a_bad_request_id(rid: object) -> None:
    c = in_state("running")
    refused(c, lambda: c.admit(rid, ["a"], 2, 2), UsageError,  # type: ignore[arg-type]
            f"request_id must be a non-empty str, got {rid!r}")


# ---------------------------------------------------------------------------- int arguments
BAD_INTS: list[object] = [0, -1, 1.5, math.inf, "2", None, True, [2]]
INT_CALLS: dict[str, tuple[Callable[[TieredCache, object], object], str]] = {
    "admit-prompt": (lambda c, v: c.admit("n", list("ab"), v, 2), "prompt_tokens must be an int >= 1"),  # type: ignore[arg-type]
    "admit-chunk": (lambda c, v: c.admit("n", list("ab"), 4, v), "chunk_tokens must be an int >= 1"),  # type: ignore[arg-type]
    "reserve": (lambda c, v: c.reserve("r", v), "reserve tokens must be an int >= 1"),  # type: ignore[arg-type]
    "advance_step": (lambda c, v: c.advance_step(v), "advance_step: steps must be an int >= 1"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", sorted(INT_CALLS))
@pytest.mark.parametrize("bad", BAD_INTS, ids=repr)
def test_int_arguments_refuse_non_ints_and_out_of_range(call: str, bad: object) -> None:
    c = in_state("running")
    fn, fragment = INT_CALLS[call]
    refused(c, lambda: fn(c, bad), UsageError, fragment, repr(bad))


@pytest.mark.parametrize("tokens", [2**60 + 1, 10**400], ids=["2**60+1", "10**400"])
def test_a_reservation_of_more_tokens_than_a_float_holds_is_short_and_changes_nothing(tokens: int) -> None:
    """The pages a reservation needs are counted in ints: 10**400 tokens is short of pages
    (``None``; in a step, ``"short"``), not an OverflowError from a float division, and
    nothing changes; the request still reserves and finishes."""
    from kvtier.tiered import Reservation

    c = in_state("running")
    c.step_done("r", 4)
    before = view(c)
    assert c.reserve("r", tokens) is None
    assert c.step(reserve=[Reservation("r", tokens)]).reserve_status == ("short",)
    assert view(c) == before
    c.check_invariants()
    assert c.reserve("r", 5) is not None
    c.step_done("r", 5)
    c.finish("r")
    drain(c)
    assert c.quiescent(), c.outstanding()


@pytest.mark.parametrize("bad", [-1, 2, 10**20, 1.0, "0", None, True], ids=repr)
def test_layer_ready_refuses_a_layer_outside_the_model(bad: object) -> None:
    c = in_state("loading")
    refused(c, lambda: c.layer_ready("r", bad), UsageError, "layer must be an int in 0..1", repr(bad))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, True], ids=repr)
def test_resume_refuses_a_bad_chunk(bad: object) -> None:
    c = in_state("running")
    c.step_done("r", 4)
    c.retract("r")
    drain(c)
    assert c.state("r") == "retracted"
    refused(c, lambda: c.resume("r", bad), UsageError, "resume chunk_tokens must be an int >= 1")  # type: ignore[arg-type]


def _run(c: TieredCache, to: Callable[[int], Any]) -> None:
    """A full lifecycle whose every int argument goes through ``to``."""
    adm = c.admit("a", list("abcd"), to(9), to(4))
    assert adm is not None
    c.poll()
    c.step_done("a", to(4))
    c.reserve("a", to(5))
    c.step_done("a", to(5), new_units=["e"], checkpoint=np.bool_(True))
    assert c.layer_ready("a", to(1))
    c.retract("a")
    for cmd in c.poll().commands:
        c.complete(Completion(to(cmd.op_id), to(0), np.bool_(True)))
    c.advance_step(to(2))
    again = c.resume("a", to(2))
    assert again is not None
    drain(c)
    c.step_done("a", to(again.chunk_tokens))
    c.finish("a")
    drain(c)


@pytest.mark.parametrize("np_type", NP_INTS, ids=lambda t: t.__name__)
def test_numpy_integers_are_accepted_wherever_an_int_is(np_type: Any) -> None:
    """Anything ``operator.index`` accepts works as an int, with exactly the effect of the
    plain int, and what comes back holds plain ints (page ids, op ids)."""
    plain = TieredCache(h1(), 8, 8, policy="write_through", world_size=1, write_threshold=1,
                        max_writebacks_in_flight=2, op_deadline_steps=50, ended_history=4)
    numpy = TieredCache(h1(), {"kv": np_type(8)}, np_type(8), policy="write_through", world_size=np_type(1),
                        write_threshold=np_type(1), max_writebacks_in_flight=np_type(2),
                        op_deadline_steps=np_type(50), ended_history=np_type(4))
    _run(plain, int)
    _run(numpy, np_type)
    assert view(numpy) == view(plain) and numpy.state("a") == "finished"
    assert all(type(p) is int for n in numpy.core.nodes() for ps in n.host.values() for p in ps)


@pytest.mark.parametrize("np_type", NP_INTS, ids=lambda t: t.__name__)
def test_numpy_integers_in_records_layouts_and_presets(np_type: Any) -> None:
    c = Completion(np_type(3), np_type(1), np.bool_(False), np_type(1))
    assert (c.op_id, c.rank, c.ok, c.layer) == (3, 1, False, 1)
    assert [type(x) for x in (c.op_id, c.rank, c.ok, c.layer)] == [int, int, bool, int]
    g = CacheGroupSpec("kv", Family.HISTORY, np_type(2), np_type(1), (np_type(0), np_type(1)),
                       (ComponentSpec("kv", np_type(16)),))
    assert (g.rows, g.stride, g.layers, g.components[0].page_bytes) == (2, 1, (0, 1), 16)
    assert type(g.rows) is int and type(g.layers[0]) is int
    assert preset("llama-3-8b", page_tokens=np_type(16), num_layers=np_type(2)) == \
        preset("llama-3-8b", page_tokens=16, num_layers=2)
