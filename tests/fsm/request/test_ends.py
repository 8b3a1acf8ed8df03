"""How a request stops (kvtier.fsm.request_ends): finish without its writeback, retract
publishing the exact continuation state (and adding it to a unit published without one),
the checkpoint a request ends with kept under a deeper one, an aborted request marked
poisoned, a retracted one holding nothing, and every failed retract writeback counted as
a scheduler abort."""

from __future__ import annotations

import pytest
from core_helpers import h1
from facade_helpers import ack

from kvtier.tiered import TieredCache


def test_a_retracted_request_holds_no_own_page_and_no_room() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    r = c.table.get("a")
    assert (r.room, r.own) == (10, {"kv": [4]})
    c.retract("a")
    assert (r.state, r.room, r.own, r.reserved) == ("retracted", 0, {"kv": []}, 9)


@pytest.mark.parametrize("n", [1, 2])
def test_every_failed_retract_writeback_counts_as_a_scheduler_abort(n: int) -> None:
    c = TieredCache(h1(), 12, 12, policy="write_back")
    rids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        c.admit(rid, [f"{rid}{u}" for u in range(2)], prompt_tokens=5, chunk_tokens=5)
        c.step_done(rid, 5)
        c.retract(rid)
    cmds = c.poll().commands
    assert len(cmds) == n
    for cmd in cmds:
        ack(c, cmd.op_id, ok=False)
    assert [c.request(rid).reason for rid in rids] == ["retract writeback failed"] * n
    assert c.aborted_by_scheduler == n


# ----------------------------------------------------------------------------- request_ends
def test_finish_without_finish_writeback_issues_none_and_returns_no_checkpoint() -> None:
    c = TieredCache(h1(), 12, 12, policy="write_back", finish_writeback=False)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    assert c.finish("a") == {}
    assert c.state("a") == "finished"
    assert c.poll().commands == ()


def test_retract_publishes_the_exact_continuation_state_at_its_terminal() -> None:
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    assert c.retract("a") == {"swa": [4, 5, 6, 7]}
    assert c.state("a") == "retracted"


@pytest.mark.parametrize("end", ["finish", "retract"])
def test_the_checkpoint_a_request_ends_with_survives_a_deeper_one(end: str) -> None:
    """The checkpoint published when a request finishes or retracts is a final one, not a
    chunk checkpoint: a deeper checkpoint published later by another request leaves it."""
    from core_helpers import src

    c = TieredCache(src(), 32, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9, checkpoint=end == "finish")
    adopted = c.finish("a") if end == "finish" else c.retract("a")
    assert adopted == ({} if end == "finish" else {"swa": [4, 5, 6, 7]})
    b = c.admit("b", list("abcdefgh"), prompt_tokens=25, chunk_tokens=8)
    assert b is not None and (b.start_token, b.checkpoint_pages) == (8, {"swa": [4, 5, 6, 7]})
    deeper = c.step_done("b", 8, checkpoint=True)
    assert sorted(deeper["swa"]) == [8, 9, 10, 11]
    ckpts = {n.key: n.dev_ckpt for n in c.core.nodes()}
    assert ckpts == {("a", "b"): {"swa": [4, 5, 6, 7]}, ("c", "d"): deeper}


def test_an_aborted_request_is_marked_poisoned() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    r = c.table.get("a")
    assert r.poisoned is False
    c.abort("a", "gone")
    assert (r.state, r.reason, r.poisoned) == ("aborting", "gone", True)


def test_retract_adds_the_checkpoint_to_a_unit_published_without_one() -> None:
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    assert c.step_done("a", 5) == {}
    assert c.table.get("a").published == 1
    assert c.retract("a") == {"swa": [4, 5, 6, 7]}
    assert {n.key: n.dev_ckpt for n in c.core.nodes()} == {("a",): {"swa": [4, 5, 6, 7]}}
