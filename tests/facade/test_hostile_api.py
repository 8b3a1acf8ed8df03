"""Generated hostile inputs for the Python API (issue 13): the facade's calls, the records an
engine builds, the constructor, and the call contracts.

Every refusal asserts the exact error class, a message naming the value, and that nothing
changed (every public view of the facade and its core, and the forward results owed: a
refused ``step_done`` counts no result). Families, not single cases: every call x every
bad request id; every request state that takes ``step_done`` x every bad ``new_units``,
count and ``checkpoint``; every int argument x every bad value, and every numpy integer
type accepted wherever an int is; every capacity spelling up to and past
``MAX_POOL_PAGES``; unit keys not equal to themselves (NaN) through the whole lifecycle;
every completion defect; and the call contracts (one place for each command, an aborted
request's writeback never handed out, the deadline default, the bounded history of ended
requests, the quiescence report).

Layout ``h1`` (tests/core_helpers.py): one history group ``kv``, 2 tokens per page, one
page per unit (alignment 2), 2 layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from core_helpers import h1, snapshot

from kvtier.fsm import Completion, ConfigError, Direction, DuplicateCompletion, UnknownOperation
from kvtier.fsm.errors import GuardRejected, IllegalTransition, UsageError
from kvtier.fsm.node.pages import MAX_POOL_PAGES
from kvtier.fsm.presets import preset
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family
from kvtier.tiered import DEFAULT_ENDED_HISTORY, DEFAULT_OP_DEADLINE_STEPS, Outstanding, TieredCache


# ---------------------------------------------------------------------------- helpers
def ack(c: TieredCache, op: int, ok: bool = True) -> None:
    for rank in range(c.core.world_size):
        c.complete(Completion(op, rank, ok))


def drain(c: TieredCache) -> None:
    """Poll and acknowledge every command until nothing is in flight (bounded)."""
    for _ in range(100):
        cmds = c.poll().commands
        for cmd in cmds:
            ack(c, cmd.op_id)
        if not cmds and not c.core.ops_in_flight():
            c.poll()
            return
    raise AssertionError("did not drain")


def view(c: TieredCache) -> tuple[Any, ...]:
    """Everything observable about the facade and its core, through public views."""
    reqs = [(v, c.page_table(v.request_id), c.unit_keys(v.request_id),
             [c.layer_ready(v.request_id, i) for i in range(c.layout.num_layers)]) for v in c.requests()]
    return (sorted(reqs, key=repr), c.table.pending_events(), c.aborted_by_scheduler, c.outstanding(),
            c.stats(), c.core.pending_commands(), snapshot(c.core))


def refused(c: TieredCache, call: Callable[[], object], error: type[Exception], *fragments: str) -> None:
    """``call`` raises exactly ``error`` (not a subclass), naming ``fragments``, and
    changes nothing; the invariants still hold."""
    before = view(c)
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert view(c) == before, "a refused call changed something"
    c.check_invariants()


def seeded(**kw: Any) -> TieredCache:
    """Host-only ``abcd`` in the tree (a loadback hit), nothing else held."""
    c = TieredCache(h1(), 8, 8, policy="write_through", **kw)
    c.admit("seed", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("seed", 9)
    c.finish("seed")
    drain(c)
    c.core.evict_device({"kv": 8})
    assert [n.state for n in c.core.nodes()] == ["host"]
    return c


def in_state(state: str) -> TieredCache:
    """A cache whose request ``r`` is in ``state`` with one forward result owed (a pass of
    4 tokens reserved), for the states that take ``step_done``."""
    if state == "running":
        c = TieredCache(h1(), 8, 8)
        c.admit("r", list("wxyz"), prompt_tokens=9, chunk_tokens=4)
    else:
        c = seeded()
        adm = c.admit("r", list("abcdef"), prompt_tokens=13, chunk_tokens=4)  # hit: 8 tokens
        assert adm is not None and adm.loadback_op is not None and adm.chunk_tokens == 4
        c.poll()
        if state == "fenced":
            ack(c, adm.loadback_op, ok=False)
        elif state == "aborting":
            c.abort("r")
    assert c.state("r") == state and c.request("r").owed_forward == 1
    c.check_invariants()
    return c


STEP_STATES = ["running", "loading", "fenced", "aborting"]
BAD_IDS: list[object] = [None, 1, "", b"r", ("r",), "nobody"]
NP_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.intp]


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


# ---------------------------------------------------------------------------- the constructor
CTOR_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("device-negative", {"device_pages": -1}, "device_pages: must be an int >= 0 (units)"),
    ("device-float", {"device_pages": 8.0}, "device_pages: must be an int >= 0 (units)"),
    ("device-str", {"device_pages": "8"}, "device_pages: must be an int >= 0 (units)"),
    ("device-bool", {"device_pages": True}, "device_pages: must be an int >= 0 (units)"),
    ("device-absurd-units", {"device_pages": 10**30}, "above the maximum 9007199254740992"),
    ("device-over-max", {"device_pages": MAX_POOL_PAGES + 1}, "above the maximum 9007199254740992"),
    ("device-map-over-max", {"device_pages": {"kv": 2**60}}, "above the maximum"),
    ("device-map-negative", {"device_pages": {"kv": -1}}, "pages of group 'kv' must be an int >= 0"),
    ("device-map-unknown", {"device_pages": {"kv": 8, "zz": 1}}, "unknown cache groups ['zz']"),
    ("device-map-missing", {"device_pages": {}}, "no capacity for cache groups ['kv']"),
    ("host-absurd-units", {"host_pages": 10**30}, "host pool of group 'kv'"),
    ("host-nan", {"host_pages": math.nan}, "host_pages: must be an int >= 0 (units)"),
    ("deadline-zero", {"op_deadline_steps": 0}, "op_deadline_steps must be None or an int >= 1, got 0"),
    ("deadline-float", {"op_deadline_steps": 5.0}, "op_deadline_steps must be None or an int >= 1, got 5.0"),
    ("deadline-bool", {"op_deadline_steps": True}, "op_deadline_steps must be None or an int >= 1, got True"),
    ("history-negative", {"ended_history": -1}, "ended_history must be an int >= 0, got -1"),
    ("history-float", {"ended_history": 1.5}, "ended_history must be an int >= 0, got 1.5"),
    ("world-zero", {"world_size": 0}, "world_size must be an int >= 1, got 0"),
    ("threshold-str", {"write_threshold": "2"}, "write_threshold must be an int >= 1, got '2'"),
    ("wb-limit-zero", {"max_writebacks_in_flight": 0}, "max_writebacks_in_flight must be an int >= 1, got 0"),
    ("policy", {"policy": "sometimes"}, "write policy must be one of"),
    ("finish-writeback", {"finish_writeback": "yes"}, "finish_writeback (or None) must be True or False"),
    ("history-replay", {"history_replay": 1}, "history_replay must be True or False, got 1"),
]


@pytest.mark.parametrize(("kw", "fragment"), [c[1:] for c in CTOR_BAD], ids=[c[0] for c in CTOR_BAD])
def test_constructor_refuses_bad_options_and_absurd_capacities(kw: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"device_pages": 8, "host_pages": 8, **kw}
    with pytest.raises(ConfigError) as info:
        TieredCache(h1(), **args)
    assert type(info.value) is ConfigError and fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("pages", [0, 1, 10**6, 10**14, MAX_POOL_PAGES])
def test_capacities_up_to_the_maximum_cost_memory_by_use_only(pages: int) -> None:
    """Up to MAX_POOL_PAGES a capacity is accepted, and a full lifecycle with its
    invariant checks and the quiescence report costs the same at any capacity."""
    c = TieredCache(h1(), {"kv": max(pages, 8)}, {"kv": pages}, policy="write_through")
    adm = c.admit("a", list("abcd"), 9, 9)
    assert adm is not None
    c.step_done("a", 9)
    c.check_invariants()
    c.finish("a")
    drain(c)
    c.check_invariants()
    assert c.quiescent() and c.state("a") == "finished"


# ---------------------------------------------------------------------------- unit keys not equal to themselves
def test_nan_unit_keys_keep_the_tree_consistent() -> None:
    """A key not equal to itself (NaN) matches itself by identity, as the tree's dict
    lookups do: publish, hit, split and evict keep every invariant; a different NaN
    object is a different unit."""
    nan = float("nan")
    c = TieredCache(h1(), 16, 16, policy="write_through")
    for rid, key in (("a", [nan, "x", nan, "y"]), ("b", [nan, "x", nan, "z"]), ("c", [nan, "x"])):
        adm = c.admit(rid, key, 2 * len(key) + 1, 2 * len(key) + 1)
        assert adm is not None
        c.check_invariants()
        c.step_done(rid, adm.chunk_tokens)
        c.check_invariants()
        c.finish(rid)
        drain(c)
        c.check_invariants()
    assert c.request("b").hit_tokens == 6 and c.request("c").hit_tokens == 4  # a's nan, x, nan; then nan, x
    other = float("nan")  # equal to nothing, not even the first NaN: no hit
    adm = c.admit("d", [other, "x"], 5, 5)
    assert adm is not None and adm.hit_tokens == 0
    c.step_done("d", 5)
    c.finish("d")
    drain(c)
    c.core.evict_device({"kv": 16})
    c.core.evict_host({"kv": 16})
    c.check_invariants()
    assert c.quiescent()


# ---------------------------------------------------------------------------- completions
def test_completion_defects() -> None:
    c = in_state("loading")
    op = c.request("r").ops[0]
    refused(c, lambda: c.complete(Completion(999)), UnknownOperation, "completion for op 999: never issued")
    refused(c, lambda: c.complete(Completion(op, 1)), UsageError, f"completion for op {op}: rank 1 outside world size 1")
    refused(c, lambda: c.complete(Completion(op, 0, True, 2)), UsageError, f"op {op}: layer 2 outside 0..1")
    refused(c, lambda: c.complete((op, 0, True)), UsageError, "complete() takes a Completion")  # type: ignore[arg-type]
    c.complete(Completion(op, 0, True, 0))
    refused(c, lambda: c.complete(Completion(op, 0, True, 0)), DuplicateCompletion, "arrived twice")
    ack(c, op)
    before = c.stats()["absorbed_late_completions"]
    for late in (Completion(op), Completion(op, 0, False), Completion(op, 0, True, 1)):
        c.complete(late)  # late or duplicate completions of a settled op are absorbed by op id
    assert c.stats()["absorbed_late_completions"] == before + 3
    c.check_invariants()


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"op_id": -1}, "op_id must be an int >= 0, got -1"),
    ({"op_id": 1.0}, "op_id must be an int >= 0, got 1.0"),
    ({"op_id": "1"}, "op_id must be an int >= 0, got '1'"),
    ({"op_id": True}, "op_id must be an int >= 0, got True"),
    ({"op_id": 1, "rank": -1}, "rank must be an int >= 0, got -1"),
    ({"op_id": 1, "ok": 1}, "ok must be True or False, got 1"),
    ({"op_id": 1, "ok": "yes"}, "ok must be True or False, got 'yes'"),
    ({"op_id": 1, "layer": -1}, "layer must be an int >= 0, got -1"),
    ({"op_id": 1, "layer": 0.5}, "layer must be an int >= 0, got 0.5"),
], ids=repr)
def test_completion_records_refuse_bad_fields(kw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        Completion(**kw)
    assert type(info.value) is ConfigError and fragment in str(info.value)


# ---------------------------------------------------------------------------- other arguments
@pytest.mark.parametrize("reason", ["", None, 5, b"x"], ids=repr)
def test_abort_refuses_a_bad_reason(reason: object) -> None:
    c = in_state("running")
    refused(c, lambda: c.abort("r", reason), UsageError, "abort: reason must be a non-empty str")  # type: ignore[arg-type]


@pytest.mark.parametrize("blocked", ["r", None, 5, {"r"}], ids=repr)
def test_abort_victim_refuses_a_bad_list(blocked: object) -> None:
    c = in_state("running")
    refused(c, lambda: c.abort_victim(blocked), UsageError, "blocked must be a list of request ids")  # type: ignore[arg-type]


@pytest.mark.parametrize("call", ["nope", None, "finish", ""], ids=repr)
def test_allows_refuses_an_unknown_call(call: object) -> None:
    c = in_state("running")
    refused(c, lambda: c.allows("r", call), UsageError, "allows: call must be one of")  # type: ignore[arg-type]


@pytest.mark.parametrize("state", STEP_STATES)
@pytest.mark.parametrize("call", ["finish", "retract"])
def test_finish_and_retract_refused_while_a_result_is_owed(state: str, call: str) -> None:
    """Running with a pass out: the ``settled`` guard (GuardRejected); in the other states
    the event does not exist (IllegalTransition)."""
    c = in_state(state)
    error = GuardRejected if state == "running" else IllegalTransition
    refused(c, lambda: getattr(c, call)("r"), error, "'r'", repr(state))


# ---------------------------------------------------------------------------- one contract for each call
def test_poll_is_the_one_place_a_loadback_is_handed_out() -> None:
    c = seeded()
    adm = c.admit("r", list("abcd"), 9, 1)
    assert adm is not None and adm.loadback_op is not None and not hasattr(adm, "loadback")
    first = c.poll().commands
    assert [cmd.op_id for cmd in first] == [adm.loadback_op] and first[0].direction is Direction.LOADBACK
    assert c.poll().commands == ()  # exactly once
    joined = c.admit("s", list("abcd"), 9, 1)
    assert joined is not None and joined.loadback_op is None and joined.wait_ops == (adm.loadback_op,)
    assert c.poll().commands == ()


@pytest.mark.parametrize("end", ["finish", "retract"])
@pytest.mark.parametrize("polled", [False, True])
def test_abort_never_hands_out_the_poisoned_writeback(end: str, polled: bool) -> None:
    """Aborted before poll handed its own writeback out: the writeback is withdrawn (fails
    at once, host reservation released) and never handed out; after: poisoned, it fails
    whatever the ranks report."""
    c = TieredCache(h1(), 8, 8, policy="write_through", finish_writeback=True)
    c.admit("r", list("abcd"), 9, 9)
    c.poll()
    c.step_done("r", 9)
    getattr(c, end)("r")
    assert c.state("r") == ("finishing" if end == "finish" else "retracting")
    (op,) = c.request("r").ops
    if polled:
        assert [cmd.op_id for cmd in c.poll().commands] == [op]
    c.abort("r")
    c.check_invariants()
    if polled:
        assert c.state("r") == "aborting" and c.poll().commands == ()
        ack(c, op)  # succeeds on the rank: still treated as failed
    out = c.poll()
    assert op not in [cmd.op_id for cmd in out.commands]
    assert c.state("r") == "aborted" and out.events[-1].state == "aborted"
    assert all(not n.host for n in c.core.nodes())  # nothing published to the host
    assert c.stats()["withdrawn_ops"] == (0 if polled else 1)
    c.complete(Completion(op))  # a late completion of the withdrawn op is absorbed
    c.check_invariants()
    assert c.quiescent(), c.outstanding()


def test_the_default_deadline_fails_a_lost_completion() -> None:
    c = seeded()
    assert c.core.op_deadline_steps == DEFAULT_OP_DEADLINE_STEPS == 10_000
    adm = c.admit("r", list("abcd"), 9, 1)
    assert adm is not None
    c.poll()  # its loadback is handed out, and its completion is lost
    c.step_done("r", 1)
    c.advance_step(DEFAULT_OP_DEADLINE_STEPS)
    assert c.state("r") == "loading"
    c.advance_step()
    assert c.state("r") == "waiting" and c.stats()["expired_ops"] == 1
    assert c.request("r").ops == () and not c.in_flight()
    ack(c, adm.loadback_op)  # the late completion is absorbed
    assert c.stats()["absorbed_late_completions"] == 1
    assert TieredCache(h1(), 8, 8, op_deadline_steps=None).core.op_deadline_steps is None


@pytest.mark.parametrize("history", [0, 1, 3])
def test_ended_requests_are_remembered_in_a_bounded_history(history: int) -> None:
    c = TieredCache(h1(), 8, None, ended_history=history)
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        c.admit(rid, [rid], 3, 3)
        c.step_done(rid, 3)
        c.finish(rid)
        assert c.poll().events[-1].state == "finished"
    assert c.requests() == [] and len(c.table.ended()) == history
    for rid in ids[len(ids) - history:]:
        assert c.state(rid) == "finished" and c.request(rid).tokens == 3
        refused(c, lambda: c.step_done(rid, 0), UsageError, f"request {rid!r} has ended (finished)")
    for rid in ids[:len(ids) - history]:
        refused(c, lambda: c.state(rid), UsageError, f"unknown request {rid!r}")
    c.admit(ids[-1], ["again"], 3, 3)  # an ended id may be admitted again: a new record
    assert c.state(ids[-1]) == "running" and len(c.table.ended()) == max(0, history - 1)
    assert DEFAULT_ENDED_HISTORY == 1024


def test_quiescence_report_counts_what_is_held_and_owed() -> None:
    c = seeded()
    assert c.quiescent() and c.outstanding() == Outstanding((), 0, (), (), 0, 0, 0, 0, 0, 0)
    adm = c.admit("r", list("abcd"), 9, 1)
    assert adm is not None
    op = adm.loadback_op
    out = c.outstanding()
    assert out == Outstanding(("r",), 1, (op,), (op,), 1, 1, 1, 0, 1, 0) and not out.quiescent
    c.poll()
    assert c.outstanding().commands == () and c.outstanding().events == 0
    ack(c, op)
    c.step_done("r", 1)
    c.finish("r")
    drain(c)
    assert c.quiescent(), c.outstanding()
