"""One thread drives a cache: generated calls from a second thread.

Families, not single cases: every call that changes the cache x a second thread, before and
after the first thread's calls, each refused with ``UsageError`` naming both threads and
changing nothing; every read-only query answers from any thread; ``bind_thread`` hands
the cache over; two threads racing at the first call bind exactly one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from hostile_api_helpers import ack, drain, h1, in_state, refused, view

from kvtier.fsm import Completion, KvtierError, UsageError
from kvtier.tiered import ForwardResult, Reservation, TieredCache

CHANGING: dict[str, Callable[[TieredCache], object]] = {
    "admit": lambda c: c.admit("n", list("ab"), 5, 5),
    "resume": lambda c: c.resume("r", 2),
    "reserve": lambda c: c.reserve("r", 1),
    "step_done": lambda c: c.step_done("r", 4),
    "step": lambda c: c.step(results=[ForwardResult("r", 4)], reserve=[Reservation("r", 1)]),
    "finish": lambda c: c.finish("r"),
    "retract": lambda c: c.retract("r"),
    "abort": lambda c: c.abort("r"),
    "abort_victim": lambda c: c.abort_victim(["r"]),
    "complete": lambda c: c.complete(Completion(0)),
    "advance_step": lambda c: c.advance_step(),
    "poll": lambda c: c.poll(),
}

READING: dict[str, Callable[[TieredCache], object]] = {
    "request": lambda c: c.request("r"), "state": lambda c: c.state("r"), "states": lambda c: c.states(["r"]),
    "requests": lambda c: c.requests(), "unit_keys": lambda c: c.unit_keys("r"),
    "page_table": lambda c: c.page_table("r"), "allows": lambda c: c.allows("r", "reserve"),
    "layer_ready": lambda c: c.layer_ready("r", 0), "outstanding": lambda c: c.outstanding(),
    "quiescent": lambda c: c.quiescent(), "stats": lambda c: c.stats(), "in_flight": lambda c: c.in_flight(),
    "check_invariants": lambda c: c.check_invariants(),
}


def elsewhere(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new thread; its result, or re-raise what it raised."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed back to the caller)
            box["exc"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "exc" in box:
        raise box["exc"]
    return box.get("out")


@pytest.mark.parametrize("call", sorted(CHANGING))
def test_a_second_thread_is_refused_before_anything_changes(call: str) -> None:
    c = in_state("running")  # driven on this thread: bound to it
    refused(c, lambda: elsewhere(lambda: CHANGING[call](c)), UsageError,
            "TieredCache called from thread", f"but thread {threading.get_ident()} drives it")
    c.step_done("r", 4)  # the driving thread goes on
    c.finish("r")
    drain(c)
    assert c.quiescent(), c.outstanding()


@pytest.mark.parametrize("call", sorted(CHANGING))
def test_the_first_call_binds_its_thread(call: str) -> None:
    c = TieredCache(h1(), 8, 8)  # built here, driven by the first caller's thread
    try:
        elsewhere(lambda: CHANGING[call](c))
    except KvtierError as exc:
        assert "thread" not in str(exc)  # refused for its arguments or state, not the thread
    refused(c, lambda: c.poll(), UsageError, "TieredCache called from thread")


@pytest.mark.parametrize("query", sorted(READING))
def test_read_only_queries_answer_from_any_thread(query: str) -> None:
    c = in_state("loading")
    assert elsewhere(lambda: READING[query](c)) == READING[query](c)


def test_bind_thread_hands_the_cache_over() -> None:
    c = in_state("running")
    before = view(c)

    def drive() -> None:
        c.bind_thread()
        c.step_done("r", 4)
        c.finish("r")
        drain(c)

    elsewhere(drive)
    assert view(c) != before and c.state("r") == "finished"
    refused(c, lambda: c.poll(), UsageError, "TieredCache called from thread")
    c.bind_thread()
    c.poll()


@pytest.mark.parametrize("threads", [2, 4])
def test_racing_first_calls_bind_one_thread_and_leak_nothing(threads: int) -> None:
    """Several threads drive one cache at once (the case that ended in an internal
    IllegalTransition and a leaked host page): exactly one is bound, every other is refused
    at its first call, and the cache drains to quiescence."""
    c = TieredCache(h1(), 64, 64, policy="write_through")
    start = threading.Barrier(threads)
    refusals: list[UsageError] = []
    done: list[int] = []

    def serve(k: int) -> None:
        start.wait()
        try:
            for i in range(20):
                rid = f"t{k}-{i}"
                adm = c.admit(rid, [k, i], 5, 5)
                assert adm is not None
                c.step_done(rid, adm.chunk_tokens)
                c.finish(rid)
                for cmd in c.poll().commands:
                    ack(c, cmd.op_id)
            done.append(k)
        except UsageError as exc:
            refusals.append(exc)

    pool = [threading.Thread(target=serve, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(done) == 1 and len(refusals) == threads - 1, (done, refusals)
    assert all("TieredCache called from thread" in str(e) for e in refusals)
    c.bind_thread()
    drain(c)
    c.check_invariants()
    assert c.quiescent(), c.outstanding()
