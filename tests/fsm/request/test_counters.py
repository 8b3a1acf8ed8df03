"""The request side's operator counters (kvtier.fsm.request.counters, ``TieredCache.stats()["facade"]``):
every count after a scripted sequence whose counts are derived in the comments, the same
counts in the Prometheus exposition, and :class:`FacadeCounters` record by record.

Layout ``h1`` (tests/core_helpers.py): one history group ``kv``, 2 tokens per page,
alignment 2 (one unit = 2 tokens = 1 page), 2 layers.
"""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import h1

from kvtier.fsm import Completion, InvariantViolation
from kvtier.fsm.request.counters import KNOWN_ABORT_REASONS, FacadeCounters
from kvtier.tiered import TieredCache


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
