"""Exact values of fsm/ that the mutation run (bench/mutation, issue 12) found unchecked,
session 6 (helper A): the facade's operator counters (``TieredCache.stats()["facade"]``,
:class:`kvtier.fsm.counters.FacadeCounters`) and their Prometheus series after a scripted
sequence whose every count is derived in the comments; the store operation kinds and a
bare :class:`StoreResult`'s defaults as the L3 tier sees them; the messages of the
request-event and L3 name tables; the :data:`kvtier.fsm.machines.Observer` alias.

Layout ``h1`` (tests/core_helpers.py): one history group ``kv``, 2 tokens per page,
alignment 2 (one unit = 2 tokens = 1 page), 2 layers.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import pytest
from core_helpers import ack as core_ack
from core_helpers import h1, put

from kvtier.fsm import CacheCore, Completion, InvariantViolation, SpecNameError
from kvtier.fsm import machines
from kvtier.fsm.counters import KNOWN_ABORT_REASONS, FacadeCounters
from kvtier.fsm.l3 import L3Options, L3Tier, StoreOp, StoreResult
from kvtier.fsm.names import L3_EVENT, L3_STATE, REQUEST_EVENT
from kvtier.fsm.spec import load_spec
from kvtier.tiered import TieredCache

SPEC = load_spec()


def ack(c: TieredCache, op: int, ok: bool = True) -> None:
    """Acknowledge ``op`` on every rank (one rank here)."""
    for rank in range(c.core.world_size):
        c.complete(Completion(op, rank, ok))


def one_command(c: TieredCache) -> int:
    """poll() hands out exactly one command: its op id."""
    (cmd,) = c.poll().commands
    return int(cmd.op_id)


# ---------------------------------------------------------------------------- facade counters
def scripted() -> tuple[TieredCache, int]:
    """Every counter of FacadeCounters moved by the public API; returns the cache and the
    number of check_invariants() calls made (one of them raised).

    h1, 16 device and 16 host pages, write_back (no tree writeback unless evicting), a
    finish writes back its own pages, operations fail 2 steps after they are issued."""
    c = TieredCache(h1(), 16, 16, policy="write_back", finish_writeback=True, op_deadline_steps=2)
    checks = 0
    # seed: a miss (admission 1, prompt 9); finish writes units abcd back (writeback ok 1)
    assert c.admit("seed", list("abcd"), prompt_tokens=9, chunk_tokens=9) is not None
    c.step_done("seed", 9)
    c.finish("seed")
    assert c.state("seed") == "finishing"
    ack(c, one_command(c))
    assert c.state("seed") == "finished"
    c.core.evict_device({"kv": 16})  # abcd now lives on the host only
    assert [n.state for n in c.core.nodes()] == ["host"]
    # b, 1st: host hit of 4 units = 8 tokens (admission 2, prompt 9); the loadback fails
    adm = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is not None and (adm.hit_tokens, adm.device_hit_tokens) == (8, 0)
    assert one_command(c) == adm.loadback_op
    ack(c, adm.loadback_op, ok=False)  # loadback failed 1
    assert c.state("b") == "fenced"  # its pass is out
    c.step_done("b", 0)
    assert c.state("b") == "waiting"
    # b, 2nd: the same host hit (admission 3, prompt 9, host 8); its loadback passes its deadline
    adm = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is not None
    assert one_command(c) == adm.loadback_op
    c.advance_step(3)  # loadback deadline 1
    assert c.state("b") == "fenced"
    c.step_done("b", 0)
    # b, 3rd: the same host hit (admission 4, prompt 9, host 8); the loadback succeeds (loadback ok 1)
    adm = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is not None
    ack(c, one_command(c))
    assert c.state("b") == "running"
    c.step_done("b", 1)
    # c: abcd is on the device now: device hit 8 (admission 5, prompt 9, host 0)
    adm = c.admit("c", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is None and (adm.hit_tokens, adm.device_hit_tokens) == (8, 8)
    c.step_done("c", 1)
    # b retracted and resumed twice: abcd is on the host already, so no own writeback
    # (retractions 2, resumptions 2; a resumption is no admission and counts no tokens)
    for _ in range(2):
        c.retract("b")
        assert c.state("b") == "retracted"
        adm = c.resume("b", chunk_tokens=1)
        assert adm is not None and adm.start_token == 8 and c.state("b") == "running"
        c.step_done("b", 1)
    # d: device hit 8 of a 13-token prompt (admission 6, prompt 13, device 8); its two new
    # units ef are on the device only, so its retract writes them back (retraction 3): the
    # writeback fails (writeback failed 1) and d is aborted "retract writeback failed"
    adm = c.admit("d", list("abcdef"), prompt_tokens=13, chunk_tokens=5)
    assert adm is not None and (adm.hit_tokens, adm.device_hit_tokens) == (8, 8)
    c.step_done("d", 5)
    c.retract("d")
    assert c.state("d") == "retracting"
    ack(c, one_command(c), ok=False)
    assert c.state("d") == "aborted"
    # c aborted by the client (default reason), b chosen as the capacity victim
    c.abort("c")
    assert c.abort_victim(["b"]) == "b"
    # e, f, g: misses (admissions 7, 8, 9; prompts 5, 4, 4), aborted with an engine's
    # reason, the default reason again and the scheduler's reason
    for rid, units, prompt, reason in (("e", "xy", 5, "engine shutdown"), ("f", "uv", 4, None),
                                       ("g", "st", 4, "scheduler stalled")):
        adm = c.admit(rid, list(units), prompt_tokens=prompt, chunk_tokens=prompt)
        assert adm is not None and adm.hit_tokens == 0
        c.step_done(rid, prompt)
        if reason is None:
            c.abort(rid)
        else:
            c.abort(rid, reason)
    assert c.poll().commands == ()
    # invariant checks: one that holds, one on a corrupted lock count (raises), one restored
    c.check_invariants()
    node = c.core.walk(list("abcd"))[-1]
    node.lock_ref += 1
    with pytest.raises(InvariantViolation):
        c.check_invariants()
    node.lock_ref -= 1
    c.check_invariants()
    checks += 3
    return c, checks


EXPECTED_FACADE: dict[str, Any] = {
    "admissions": 9,  # seed, b three times, c, d, e, f, g
    "resumptions": 2,  # b twice
    "prompt_tokens": 9 + 3 * 9 + 9 + 13 + 5 + 4 + 4,  # = 71: seed, b x3, c, d, e, f, g
    "hit_tokens_device": 8 + 8,  # c and d found abcd (4 units, 8 tokens) on the device
    "hit_tokens_host": 3 * 8,  # b's three admissions found abcd on the host only
    "retractions": 3,  # b twice, d once
    "aborts": {"retract writeback failed": 1, "aborted by client": 2, "cache capacity exhausted": 1,
               "engine shutdown": 1, "scheduler stalled": 1},
    "settled": {"writeback/ok": 1,  # seed's finish writeback
                "loadback/failed": 1,  # b's first loadback
                "loadback/deadline": 1,  # b's second loadback
                "loadback/ok": 1,  # b's third loadback
                "writeback/failed": 1},  # d's retract writeback
    "invariant_checks": 3,
    "invariant_failures": 1,  # the corrupted lock count
}


def test_facade_counters_after_a_scripted_sequence_are_exact() -> None:
    c, checks = scripted()
    fac = c.stats()["facade"]
    assert list(fac) == list(EXPECTED_FACADE)  # the keys, in as_dict's order
    for key, want in EXPECTED_FACADE.items():
        assert fac[key] == want, key
    assert fac["invariant_checks"] == checks
    assert c.stats()["scheduler_aborts"] == 2  # the victim and the failed retract writeback


def test_facade_counters_in_the_prometheus_exposition() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.metrics import KvtierCollector

    def scrape(cache: TieredCache) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(KvtierCollector(cache))
        out = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def aborts(got: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
        return {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "kvtier:aborts_total"}

    def ops(got: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
        return {"{direction}/{outcome}".format(**dict(k[1])): v for k, v in got.items()
                if k[0] == "kvtier:operations_total"}

    # before any work: one zero series per reason kvtier itself gives, and one for the
    # engine's reasons past kvtier.metrics.MAX_ABORT_REASONS
    fresh = scrape(TieredCache(h1(), 16, 16))
    assert aborts(fresh) == {"aborted by client": 0, "cache capacity exhausted": 0,
                             "retract writeback failed": 0, "scheduler stalled": 0, "other": 0}
    assert KNOWN_ABORT_REASONS == ("aborted by client", "cache capacity exhausted", "retract writeback failed",
                                   "scheduler stalled")
    assert ops(fresh) == {f"{d}/{o}": 0 for d in ("writeback", "loadback") for o in ("ok", "failed", "deadline")}
    c, _ = scripted()
    got = scrape(c)
    want = EXPECTED_FACADE
    # every known reason was given once or more, plus the engine's
    assert aborts(got) == {**want["aborts"], "other": 0}
    assert ops(got) == {**{f"{d}/{o}": 0 for d in ("writeback", "loadback") for o in ("ok", "failed", "deadline")},
                        **want["settled"]}  # writeback/deadline stays 0
    assert got[("kvtier:requests_admitted_total", ())] == want["admissions"]
    assert got[("kvtier:requests_resumed_total", ())] == want["resumptions"]
    assert got[("kvtier:retractions_total", ())] == want["retractions"]
    assert got[("kvtier:prompt_tokens_total", ())] == want["prompt_tokens"]
    assert got[("kvtier:prompt_tokens_cached_total", (("source", "device"),))] == want["hit_tokens_device"]
    assert got[("kvtier:prompt_tokens_cached_total", (("source", "host"),))] == want["hit_tokens_host"]
    assert got[("kvtier:invariant_checks_total", ())] == want["invariant_checks"]
    assert got[("kvtier:invariant_check_failures_total", ())] == want["invariant_failures"]


def test_facade_counters_record_by_record() -> None:
    """FacadeCounters on its own: an abort with no reason counts as ``unknown``, each
    call counts one, resumptions count no tokens, and the outcome names of OUTCOMES."""
    fc = FacadeCounters()
    fc.transition("abort", "aborted", None)
    fc.transition("abort", "aborted", "")
    fc.transition("writeback_fail", "aborted", "retract writeback failed")
    fc.transition("retract", "retracting", None)
    fc.transition("writeback_ack", "retracted", None)  # no count: neither retract nor aborted
    fc.transition("retract", "retracted", None)
    fc.transition("abort", "aborting", "gone")  # deferred: counted when it ends aborted
    fc.transition("forward_result", "aborted", "gone")
    fc.admitted("schedule", 10, 6, 2)  # 6 hit tokens, 2 of them on the device: 4 from the host
    fc.admitted("schedule", 7, 4, 4)  # 4 hit tokens, all on the device
    fc.admitted("resume", 9, 8, 0)
    fc.admitted("resume", 9, 8, 8)
    fc.operation_settled("loadback", True, False)
    fc.operation_settled("loadback", False, True)
    fc.operation_settled("loadback", False, False)
    fc.operation_settled("writeback", False, True)
    fc.operation_settled("writeback", False, True)
    fc.operation_settled("writeback", True, True)  # ok wins over expired
    assert fc.as_dict() == {
        "admissions": 2, "resumptions": 2, "prompt_tokens": 17, "hit_tokens_device": 6, "hit_tokens_host": 4,
        "retractions": 2, "aborts": {"unknown": 2, "retract writeback failed": 1, "gone": 1},
        "settled": {"loadback/ok": 1, "loadback/deadline": 1, "loadback/failed": 1, "writeback/deadline": 2,
                    "writeback/ok": 1},
        "invariant_checks": 0, "invariant_failures": 0}


# ---------------------------------------------------------------------------- L3 store records
def l3_pair() -> tuple[CacheCore, L3Tier, CacheCore, L3Tier]:
    """Two h1 cores with L3 tiers (deadline 1 s, no lease); the first holds units abcd on
    the host (backed: written back and acknowledged)."""
    a, b = CacheCore(h1(), 16, 16), CacheCore(h1(), 16, 16)
    res = put(a, tuple("abcd"))
    cmd = a.writeback(res.node)
    assert cmd is not None
    core_ack(a, cmd)
    return a, L3Tier(a, L3Options(deadline_s=1.0)), b, L3Tier(b, L3Options(deadline_s=1.0))


def test_store_commands_carry_their_kind_by_name() -> None:
    """A backend (or a log) reads a command's kind by its value: exists, put, get, remove;
    an object left in the wrong state names its operation's kind in the invariant."""
    assert [(k.name, k.value) for k in StoreOp] == [("EXISTS", "exists"), ("PUT", "put"), ("GET", "get"),
                                                    ("REMOVE", "remove")]
    assert [StoreOp(v) for v in ("exists", "put", "get", "remove")] == list(StoreOp)
    _, ta, _, tb = l3_pair()
    assert ta.offer(tuple("abcd"), 0.0) == 4
    (put_cmd,) = ta.poll_commands()
    assert put_cmd.kind.value == "put" and len(put_cmd.keys) == 4
    obj = ta.objects[put_cmd.keys[0]]
    state, obj.state = obj.state, L3_STATE.leased
    with pytest.raises(InvariantViolation) as exc:
        ta.check_invariants()
    assert (exc.value.invariant, str(exc.value).endswith(f"in put op {put_cmd.op_id} but leased")) == (
        "l3_ends_by_deadline", True), str(exc.value)
    obj.state = state
    ta.complete(StoreResult(put_cmd.op_id, ok=(True,) * 4), 0.0)
    stored = set(put_cmd.keys)
    assert tb.prefetch("r", tuple("abcd") + ("e",), 0.0)
    (exists,) = tb.poll_commands()
    assert exists.kind.value == "exists" and len(exists.keys) == 5
    tb.complete(StoreResult(exists.op_id, present=4), 0.0)
    (get,) = tb.poll_commands()
    assert get.kind.value == "get" and set(get.keys) == stored
    obj = tb.objects[get.keys[1]]
    state, obj.state = obj.state, L3_STATE.leased
    with pytest.raises(InvariantViolation) as exc:
        tb.check_invariants()
    assert str(exc.value).endswith(f"in get op {get.op_id} but leased"), str(exc.value)
    obj.state = state
    tb.complete(StoreResult(get.op_id, ok=(True,) * 4), 0.0)
    assert tb.remove(list(get.keys[:2]), 0.0) == 2
    (rm,) = tb.poll_commands()
    assert rm.kind.value == "remove" and rm.keys == get.keys[:2]
    obj = tb.objects[rm.keys[0]]
    state, obj.state = obj.state, L3_STATE.leased
    with pytest.raises(InvariantViolation) as exc:
        tb.check_invariants()
    assert str(exc.value).endswith(f"in remove op {rm.op_id} but leased"), str(exc.value)
    obj.state = state
    tb.complete(StoreResult(rm.op_id, ok=(True, True)), 0.0)
    tb.check_invariants()


def test_a_bare_store_result_moved_nothing_and_succeeded_at_nothing() -> None:
    """StoreResult's defaults: no key ok, none present, nothing corrupt, 0 bytes in 0 s, no
    error; so a bare result of an exists finds nothing, of a put stores nothing, and the
    failures the tier makes itself at a deadline add no bytes and no seconds."""
    r = StoreResult(7)
    assert (r.op_id, r.ok, r.present, r.corrupt, r.nbytes, r.seconds, r.error) == (7, (), 0, (), 0, 0.0, None)
    assert type(r.seconds) is float and type(r.nbytes) is int and type(r.present) is int
    a, ta, b, tb = l3_pair()
    # a put answered by a bare result (no error): no key was stored
    assert ta.offer(tuple("abcd"), 0.0) == 4
    (put1,) = ta.poll_commands()
    ta.complete(StoreResult(put1.op_id), 0.0)
    assert (ta.stats.put_ok, ta.stats.put_failed, ta.stats.bytes_out, ta.stats.seconds) == (0, 4, 0, 0.0)
    assert all(n.host_pin == 0 for n in a.walk(tuple("abcd")))
    # the put again, past its deadline: failed by the tier, 0 bytes in 0 seconds
    assert ta.offer(tuple("abcd"), 1.0) == 4
    (put2,) = ta.poll_commands()
    assert ta.expire(2.0) == [put2.op_id]
    assert (ta.stats.put_failed, ta.stats.expired_ops, ta.stats.bytes_out, ta.stats.seconds) == (8, 1, 0, 0.0)
    ta.check_invariants()
    # an exists answered by a bare result: none present, so no get
    assert tb.prefetch("r", tuple("abcd"), 0.0)
    (ex,) = tb.poll_commands()
    tb.complete(StoreResult(ex.op_id), 0.0)
    assert (tb.stats.exists_present, tb.poll_commands(), tb.prefetching("r")) == (0, [], False)
    assert (tb.stats.get_seconds, tb.stats.seconds) == (0.0, 0.0)
    # a get past its deadline adds no bytes and no seconds either
    ta.offer(tuple("abcd"), 3.0)
    (put3,) = ta.poll_commands()
    ta.complete(StoreResult(put3.op_id, ok=(True,) * 4, nbytes=400, seconds=0.25), 3.0)
    assert (ta.stats.put_ok, ta.stats.bytes_out, ta.stats.seconds) == (4, 400, 0.25)
    tb.forget("r")
    assert tb.prefetch("r2", tuple("abcd"), 3.0)
    (ex2,) = tb.poll_commands()
    tb.complete(StoreResult(ex2.op_id, present=4, seconds=0.5), 3.0)
    (get,) = tb.poll_commands()
    assert tb.expire(5.0) == [get.op_id]
    assert (tb.stats.bytes_in, tb.stats.get_seconds, tb.stats.seconds, tb.stats.expired_ops) == (0, 0.5, 0.5, 1)
    assert b.match(tuple("abcd")).host_units == 0
    tb.check_invariants()
    b.check_invariants()


# ---------------------------------------------------------------------------- names
@pytest.mark.parametrize("table, what, declared", [
    (REQUEST_EVENT, "request event", SPEC.request.events),
    (L3_STATE, "l3 state", SPEC.l3.state_names if SPEC.l3 else ()),
    (L3_EVENT, "l3 event", SPEC.l3.events if SPEC.l3 else ()),
])
def test_request_and_l3_name_tables_name_themselves_in_errors(table: Any, what: str, declared: Any) -> None:
    assert declared and list(table) == sorted(declared)
    with pytest.raises(SpecNameError) as exc:
        table.no_such_name  # noqa: B018
    assert str(exc.value) == f"the spec declares no {what} 'no_such_name'; declared: {sorted(declared)}"
    with pytest.raises(AttributeError) as ro:
        table.no_such_name = "x"
    assert str(ro.value) == f"{what} names are read-only"


# ---------------------------------------------------------------------------- Observer
def test_the_observer_alias_names_the_lifecycle_class() -> None:
    """``Observer`` is a public alias an engine annotates its event-log callback with: it
    resolves (in kvtier.fsm.machines) to a callable of (Lifecycle, subject, event, source,
    dest) returning None."""
    def hook(callback: machines.Observer) -> None: ...

    hints = typing.get_type_hints(hook, globalns=vars(machines), localns={"machines": machines})
    assert hints["callback"] == Callable[[machines.Lifecycle, Any, str, str, str], None]
    params, ret = typing.get_args(machines.Observer)
    assert params == ["Lifecycle", Any, str, str, str] and ret is None
    assert typing.get_origin(machines.Observer) is Callable
