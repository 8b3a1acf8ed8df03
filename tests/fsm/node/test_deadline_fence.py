"""The deadline fence (spec ``[transfer]``, invariant ``copy_fence``): an operation whose
deadline passes after its command was handed out fails for its nodes and requests at once,
but no page its copy may still read or write is freed or reused until every rank's late
acknowledgement says the copy ended; then its pages come back exactly once. One that
expires before it was handed out is taken back and freed at once."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, put, snapshot, violation

from kvtier.fsm import CacheCore, Completion
from kvtier.fsm.errors import IllegalTransition, UsageError
from kvtier.fsm.lifecycle.machines import transfer_lifecycle
from kvtier.fsm.node.ops import Settled
from kvtier.fsm.records import Direction


def expired_writeback(world: int = 1) -> tuple[CacheCore, object, object]:
    """h1 cache (8 device / 8 host units), node A=(a,b) on device pages 0,1; its writeback
    (to host pages 0,1) handed out and expired."""
    c = CacheCore(h1(), 8, 8, world_size=world, op_deadline_steps=1)
    a = put(c, "ab").node
    cmd = c.writeback(a)
    assert c.poll_commands() == [cmd]
    assert c.advance_step() == []
    (s,) = c.advance_step()
    assert s == Settled(cmd.op_id, Direction.WRITEBACK, False, None, (a.node_id,), True)
    c.check_invariants()
    return c, a, cmd


def test_an_expired_writeback_keeps_its_host_pages_and_its_source_until_the_copy_ended() -> None:
    c, a, cmd = expired_writeback()
    # the node took the failure: back on the device, nothing published
    assert (a.state, a.host, a.pending) == ("device", {}, {})
    # but the host reservation stays fenced and the device source is borrowed by the operation
    assert free(c, "host") == {"kv": 6} and c.fenced_ops() == (cmd.op_id,)
    assert c.optable.fenced_op(cmd.op_id).fenced_host == {"kv": [0, 1]}
    assert a.borrow_ref == 1 and not c.evictable_on_device(a)
    assert c.evict_device({"kv": 2}) == {"kv": 0} and a.dev == {"kv": [0, 1]}
    # a new writeback of the same node cannot take the fenced host pages
    again = c.writeback(a)
    assert again is not None and again.transfers[0].dst_pages == (2, 3)
    ack(c, again)
    assert a.state == "backed" and a.host == {"kv": [2, 3]}
    # the late acknowledgement (a success) publishes nothing and releases the fence, once
    assert c.complete(Completion(cmd.op_id, 0, True)) == []
    c.check_invariants()
    assert (a.host, a.borrow_ref, c.fenced_ops(), free(c, "host")) == ({"kv": [2, 3]}, 0, (), {"kv": 6})
    assert sorted(c.host["kv"].free_pages())[:2] == [0, 1]
    assert (c.stats.fences_released, c.stats.absorbed_late_completions) == (1, 1)
    before = snapshot(c)
    assert c.complete(Completion(cmd.op_id, 0, True)) == []  # a repeat: absorbed, nothing freed twice
    assert snapshot(c) == before and (c.stats.fences_released, c.stats.absorbed_late_completions) == (1, 2)


def test_the_fence_waits_for_every_rank_and_counts_ranks_that_acked_before_the_deadline() -> None:
    c = CacheCore(h1(), 8, 8, world_size=3, op_deadline_steps=1)
    a = put(c, "ab").node
    cmd = c.writeback(a)
    c.poll_commands()
    assert c.complete(Completion(cmd.op_id, 1, True)) == []  # rank 1 finished in time
    c.advance_step(2)
    assert c.complete(Completion(cmd.op_id, 0, False)) == []  # a late failure ends rank 0's copy too
    c.check_invariants()
    assert c.fenced_ops() == (cmd.op_id,) and free(c, "host") == {"kv": 6}
    assert c.complete(Completion(cmd.op_id, 2, True)) == []
    c.check_invariants()
    assert (c.fenced_ops(), free(c, "host"), a.borrow_ref, c.stats.fences_released) == ((), {"kv": 8}, 0, 1)


def test_an_expired_loadback_keeps_its_device_pages_and_its_pin_until_the_copy_ended() -> None:
    c = CacheCore(h1(), 8, 8, op_deadline_steps=1)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    c.poll_commands()
    assert c.evict_device({"kv": 2}) == {"kv": 2} and a.state == "host"
    lr = c.load(c.match(list("ab")), "r1")
    assert c.poll_commands() == [lr.command] and sorted(lr.command.transfers[0].dst_pages) == [0, 1]
    c.advance_step(2)
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    # the node is back on the host; its destination pages and the operation's pin stay
    assert (a.state, a.dev, a.host_pin, free(c)) == ("host", {}, 1, {"kv": 6})
    assert sorted(c.optable.fenced_op(lr.command.op_id).fenced_dev["kv"]) == [0, 1]
    assert c.evict_host({"kv": 2}) == {"kv": 0}  # the copy may still read the host copy
    # a new allocation of the whole free device pool gets other pages
    got = c.alloc_device({"kv": 6}, evict=False)
    assert not {0, 1} & set(got["kv"])
    c.free_device(got)
    before = snapshot(c)
    assert c.complete(Completion(lr.command.op_id, 0, True, layer=1)) == []  # a late layer: nothing
    assert snapshot(c) == before
    assert c.complete(Completion(lr.command.op_id, 0, True)) == []
    c.check_invariants()
    assert (a.state, a.host_pin, free(c), c.fenced_ops(), c.stats.fences_released) == ("host", 0, {"kv": 8}, (), 1)


def test_an_operation_expiring_before_it_was_handed_out_is_taken_back_and_freed_at_once() -> None:
    c = CacheCore(h1(), 8, 8, op_deadline_steps=1)
    a = put(c, "ab").node
    cmd = c.writeback(a)
    (s,) = c.advance_step(2)
    assert (s.op_id, s.ok, s.expired) == (cmd.op_id, False, True)
    assert c.poll_commands() == []  # never handed out: no engine ever copies it
    assert (c.fenced_ops(), free(c, "host"), a.borrow_ref) == ((), {"kv": 8}, 0)
    c.check_invariants()


def test_a_completion_from_a_rank_out_of_range_for_a_fenced_operation_changes_nothing() -> None:
    c, a, cmd = expired_writeback(world=2)
    before = snapshot(c)
    with pytest.raises(UsageError, match=r"^completion for op 1: rank 2 outside world size 2$"):
        c.complete(Completion(cmd.op_id, 2, True))
    assert snapshot(c) == before and c.optable.fenced_op(cmd.op_id).confirmed == set()


def test_an_illegal_transfer_event_raises_and_changes_nothing() -> None:
    c, a, cmd = expired_writeback()
    op = c.optable.fenced_op(cmd.op_id)
    lc = transfer_lifecycle()
    for event in ("settle", "expire"):
        with pytest.raises(IllegalTransition):
            lc.fire(op, event)
        assert op.state == "fenced"
    c.complete(Completion(cmd.op_id, 0, True))
    assert op.state == "ended"
    with pytest.raises(IllegalTransition):
        lc.fire(op, "copy_ended")  # released once: a second release is illegal
    assert op.state == "ended" and c.stats.fences_released == 1


def test_the_invariant_checker_names_copy_fence_when_a_fenced_page_is_freed_or_the_source_let_go() -> None:
    c, a, cmd = expired_writeback()
    c.host["kv"].release([0])  # a fenced page back on the free list
    inv, msg = violation(c)
    assert inv == "copy_fence" and "host page 0 of 'kv' is free but fenced op 1's copy" in msg

    c, a, cmd = expired_writeback()
    c.receipts.release(c.receipts.get(-cmd.op_id))  # the source no longer held
    assert violation(c)[0] == "copy_fence"

    c, a, cmd = expired_writeback()
    c.optable.fenced_op(cmd.op_id).fenced_host["kv"].pop()  # a destination page left the fence
    assert violation(c)[0] in ("copy_fence", "conservation")
