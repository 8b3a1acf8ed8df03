"""Generated hostile completions and the call contracts of the facade: every completion
defect and bad record field, bad abort reasons and victim lists, unknown calls, ends refused
while a result is owed, and the contracts (one place for each command, an aborted request's
writeback never handed out, the deadline default, the bounded history of ended requests,
the quiescence report).
"""

from __future__ import annotations

from typing import Any

import pytest
from hostile_api_helpers import STEP_STATES, ack, drain, h1, in_state, refused, seeded

from kvtier.fsm import Completion, ConfigError, Direction, DuplicateCompletion, UnknownOperation
from kvtier.fsm.errors import GuardRejected, IllegalTransition, UsageError
from kvtier.tiered import DEFAULT_ENDED_HISTORY, DEFAULT_OP_DEADLINE_STEPS, Outstanding, TieredCache


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
