"""The writeback queue's split rule (spec: a queue entry stays with both fragments of a
split), checked by the core and facade machines (``check_split_queue``): a split that leaves
the head fragment of a queued node unqueued is caught, which no other check saw (the tail
then leaves the queue as "its parent is device-only", a legal exit)."""

from __future__ import annotations

from typing import Any

from kvtier.fsm.node.writeback import WritebackQueue
from kvtier.testing.fuzz import campaign


def test_a_split_that_leaves_a_queued_nodes_head_unqueued_is_caught(monkeypatch: Any) -> None:
    monkeypatch.setattr(WritebackQueue, "on_split", lambda self, node, prefix: None)
    res = campaign(steps=3000, seed_value=1, progress=False, mix={"core": 1.0})
    assert res.failure is not None and res.failure_result is not None
    assert res.failure_result.invariant == "model_writeback_queue"
    assert "head fragment" in res.failure_result.message


def test_the_correct_queue_passes_the_same_campaign() -> None:
    res = campaign(steps=3000, seed_value=1, progress=False, mix={"core": 1.0})
    assert res.ok, res.report(full_coverage=False)
