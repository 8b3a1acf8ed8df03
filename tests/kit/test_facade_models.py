"""The facade machine's models of what the facade answers (kvtier.testing.facade_models) and
its checks of refused calls and passes out: each accepts the facade as it is and catches the
wrong answer it is there for (an admission's start, page table and checkpoint, a blocked
admission that moved something, an end reported twice or with the wrong reason, a poll that
keeps commands or exceeds the writeback limit, a drain that leaves a lock, a refusal that
changes the cache or does not name the request, a miscounted pass).

Layout: the kit's (tests use ``kit_layout``): history ``kv`` (2 tokens per page) and ``c4``
(4 tokens per page), alignment 4 tokens, 3 layers; with state, ``swa`` (2 pages a checkpoint).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvtier.fsm import Direction, UsageError
from kvtier.fsm.errors import InvariantViolation
from kvtier.testing import _views as views
from kvtier.testing.base import kit_layout
from kvtier.testing.content import content
from kvtier.testing.facade_models import (
    VICTIM_REASON,
    EndModel,
    check_admission,
    check_blocked,
    check_drained,
    check_poll,
    held,
)
from kvtier.testing.machines import FacadeMachine
from kvtier.testing.models import MODELS, ModelViolation
from kvtier.tiered import PollResult, RequestEvent, TieredCache


def _finished(c: TieredCache, rid: str = "a") -> None:
    """``rid`` computes its 9-token prompt (units a, b) in one pass and finishes."""
    assert c.admit(rid, ["a", "b"], prompt_tokens=9, chunk_tokens=9) is not None
    c.step_done(rid, 9)
    c.finish(rid)


def _machine(**setup: object) -> FacadeMachine:
    m = FacadeMachine()
    m.setup(**{"world": 1, "policy": "write_through", "dev_units": 6, "host_units": 6, "deadline": None,
               "wb_limit": 1, "layout": "kit", "faults": 0, **setup})
    return m


def test_the_new_model_names_are_listed() -> None:
    assert {"model_admission", "model_passes", "model_poll", "model_drain", "model_refusal"} <= set(MODELS)


def test_an_admission_must_start_at_its_hit_and_hand_out_the_table_the_facade_reports() -> None:
    c = TieredCache(kit_layout(), 8, 8)
    adm = c.admit("a", ["a", "b"], prompt_tokens=9, chunk_tokens=9)
    assert adm is not None and (adm.start_token, adm.hit_tokens) == (0, 0)
    check_admission(c, "a", adm, ["a", "b"], {})
    with pytest.raises(ModelViolation) as exc:
        check_admission(c, "a", dataclasses.replace(adm, start_token=4), ["a", "b"], {})
    assert exc.value.invariant == "model_admission" and "starts at token 4" in str(exc.value)
    with pytest.raises(ModelViolation, match="handed out page table"):
        check_admission(c, "a", dataclasses.replace(adm, page_table={}), ["a", "b"], {})
    with pytest.raises(ModelViolation, match="running after an admission that waits on a loadback"):
        check_admission(c, "a", dataclasses.replace(adm, loadback_op=7), ["a", "b"], {})


def test_a_device_hit_hands_out_the_checkpoint_of_its_end() -> None:
    c = TieredCache(kit_layout(with_state=True), 16, 8)
    assert c.admit("a", ["a", "b"], prompt_tokens=9, chunk_tokens=9) is not None
    adopted = c.step_done("a", 9, checkpoint=True)
    assert set(adopted) == {"swa"}
    c.finish("a")
    adm = c.admit("b", ["a", "b"], prompt_tokens=9, chunk_tokens=1)
    assert adm is not None and (adm.hit_tokens, adm.checkpoint_pages) == (8, adopted)
    ppu = views.pages_per_unit(c.core)
    dev = {("swa", p): content(("a", "b"), "swa", j, ppu) for j, p in enumerate(adopted["swa"])}
    check_admission(c, "b", adm, ["a", "b"], dev)
    with pytest.raises(InvariantViolation) as exc:  # the pages hold another prefix's state
        check_admission(c, "b", adm, ["a", "b"], {k: content(("a",), "swa", 0, ppu) for k in dev})
    assert exc.value.invariant == "exact_continuation_state"
    with pytest.raises(InvariantViolation, match="hands out checkpoints of \\[\\]"):
        check_admission(c, "b", dataclasses.replace(adm, checkpoint_pages={}), ["a", "b"], dev)


def test_a_blocked_admission_holds_nothing_and_moves_nothing() -> None:
    c = TieredCache(kit_layout(), 2, 2)
    before = held(c)
    assert c.admit("a", list("abcd"), prompt_tokens=17, chunk_tokens=17) is None
    check_blocked(c, "a", before)
    with pytest.raises(InvariantViolation) as exc:
        check_blocked(c, "a", ({"kv": 3, "c4": 0}, set()))
    assert exc.value.invariant == "atomic_admission"
    with pytest.raises(ModelViolation, match="a blocked admission left"):
        check_blocked(c, "nobody", before)


def test_a_poll_reports_each_end_once_with_a_reason_exactly_when_aborted() -> None:
    c = TieredCache(kit_layout(), 8, 8, finish_writeback=False)
    ends = EndModel()
    ends.admitted("a", None)
    _finished(c)
    out = c.poll()
    assert [e.state for e in out.events] == ["running", "finished"]
    check_poll(c, out, ends)
    with pytest.raises(ModelViolation, match="reported finished: it ended already"):
        check_poll(c, out, ends)
    with pytest.raises(ModelViolation, match="reported finished with reason 'oops'"):
        check_poll(c, PollResult((), (RequestEvent("a", "finished", "oops"),)), EndModel())
    victims = EndModel(victims={"v"})
    with pytest.raises(ModelViolation, match=f"not {VICTIM_REASON!r}"):
        check_poll(c, PollResult((), (RequestEvent("v", "aborted", "aborted by client"),)), victims)
    again = EndModel()  # admitted again before the first end was polled: that end is still due
    again.admitted("b", None)
    again.admitted("b", "finished")
    check_poll(c, PollResult((), (RequestEvent("b", "finished"),)), again)
    check_poll(c, PollResult((), (RequestEvent("b", "aborted", "x"),)), again)


def test_a_poll_hands_out_loadbacks_first_every_command_and_no_more_writebacks_than_allowed() -> None:
    c = TieredCache(kit_layout(), 8, 8, policy="write_through", max_writebacks_in_flight=1, finish_writeback=False)
    wb, lb = SimpleNamespace(direction=Direction.WRITEBACK), SimpleNamespace(direction=Direction.LOADBACK)
    with pytest.raises(ModelViolation, match="loadbacks first"):
        check_poll(c, PollResult((wb, lb), ()), EndModel())  # type: ignore[arg-type]
    _finished(c)
    assert len(c.core.issue_writebacks()) == 1  # a tree writeback issued by the core, not handed out
    with pytest.raises(ModelViolation, match="kept commands"):
        check_poll(c, PollResult((), ()), EndModel())
    out = c.poll()
    assert len(out.commands) == 1
    check_poll(c, out, EndModel())
    c.max_writebacks_in_flight = 0  # a facade that ignored its limit
    with pytest.raises(ModelViolation, match="more than max_writebacks_in_flight=0"):
        check_poll(c, PollResult((), ()), EndModel())


def test_a_drain_leaves_nothing_held() -> None:
    c = TieredCache(kit_layout(), 8, 8, finish_writeback=False)
    _finished(c)
    c.poll()
    check_drained(c)
    node = next(iter(c.core.nodes()))
    receipt = c.core.lock(node, "stray")
    with pytest.raises(ModelViolation) as exc:
        check_drained(c)
    assert exc.value.invariant == "model_drain" and "'locks'" in str(exc.value)
    c.core.unlock(receipt)
    check_drained(c)


def test_the_machine_drains_clean_and_counts_its_passes() -> None:
    m = _machine()
    m.admit(req=0, key=["a", "b"], chunk=3, tail=1)
    m.admit(req=1, key=["a"], chunk=1, tail=2)
    m.check_passes_out()
    m.passes_out["r0"] += 1  # the engine and the facade disagree on r0's passes out
    with pytest.raises(ModelViolation, match="model_passes|owes 1 forward results; the engine has 2"):
        m.check_passes_out()
    m.passes_out["r0"] -= 1
    m.shutdown(go=0)
    assert views.requests(m.cache) == {} and m.ends.ended == {"r0": True, "r1": True}


def test_a_refusal_must_name_the_request_and_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _machine()
    m.admit(req=0, key=["a", "b"], chunk=3, tail=1)
    m.step_done(req=0, checkpoint=False, discard=False)
    m.finish(req=0)
    m.drain(go=0)
    m.admit(req=1, key=["b"], chunk=1, tail=1)
    m.finish_refused(req=0, finish=False)  # retract with a pass out: refused by 'settled', nothing changed
    orig = TieredCache.retract

    def retract_after_evicting(self: TieredCache, request_id: str) -> object:
        self.core.evict_device({"kv": 2})  # the bug: evicts, then refuses
        return orig(self, request_id)

    monkeypatch.setattr(TieredCache, "retract", retract_after_evicting)
    with pytest.raises(ModelViolation) as exc:
        m.finish_refused(req=0, finish=False)
    assert exc.value.invariant == "model_refusal" and "changed the cache" in str(exc.value)

    def retract_anonymously(self: TieredCache, request_id: str) -> object:
        raise UsageError("retract refused")

    monkeypatch.setattr(TieredCache, "retract", retract_anonymously)
    with pytest.raises(ModelViolation, match="expected an error naming the request and the guards"):
        m.finish_refused(req=0, finish=False)


def test_abort_victim_moves_the_scheduler_abort_counter_exactly_when_it_aborts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m = _machine()
    m.admit(req=0, key=["a", "b"], chunk=3, tail=1)
    m.admit(req=1, key=["a"], chunk=1, tail=2)
    m.abort_victim(mask=0, settle=True)  # nothing blocked: no abort, the counter stays
    assert m.cache.aborted_by_scheduler == 0
    m.abort_victim(mask=3, settle=True)  # both blocked, nothing in flight: r0 (more tokens) aborted
    assert m.cache.aborted_by_scheduler == 1 and m.ends.victims == {"r0"}
    orig = TieredCache.abort_victim

    def counts_every_call(self: TieredCache, blocked: object, reason: str = "x") -> object:
        got = orig(self, blocked)  # type: ignore[arg-type]
        self._victims += got is None  # the bug: a call that aborts nothing is counted too
        return got

    monkeypatch.setattr(TieredCache, "abort_victim", counts_every_call)
    with pytest.raises(ModelViolation, match="scheduler-abort counter moved by 1"):
        m.abort_victim(mask=0, settle=False)
