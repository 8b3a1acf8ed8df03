"""Completions and receipts (issue 3, "Completions"; invariants 5, 7): acknowledgement
only after every rank and success only if all succeeded, per-rank layer progress,
duplicate and unknown completions refused without change, deadlines failing the
operation and absorbing the late real completion, receipts released exactly once, a
failed acknowledgement settling with ``ok`` exactly False, and withdrawals of operations
never handed out, each counted once."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, keys, put, snapshot, state

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import ConfigError, DuplicateCompletion, KvtierError, UnknownOperation, UsageError
from kvtier.fsm.node.ops import LayerProgress, Settled
from kvtier.fsm.records import Completion, Direction


def tp2(**kw):
    return CacheCore(h1(), 8, 8, world_size=2, **kw)


def loading(c: CacheCore):
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
    c.check_invariants()
    return a, lr


def test_world_size_validation():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError):
            CacheCore(h1(), 4, 4, world_size=bad)
    for bad in (0, -3, 1.5):
        with pytest.raises(ConfigError):
            CacheCore(h1(), 4, 4, op_deadline_steps=bad)


def test_ack_only_after_every_rank():
    c = tp2()
    a = put(c, "ab").node
    cmd = c.writeback(a)
    assert c.complete(Completion(cmd.op_id, rank=1)) == []
    c.check_invariants()
    assert a.state == "writing" and free(c, "host") == {"kv": 6}
    out = c.complete(Completion(cmd.op_id, rank=0))
    c.check_invariants()
    assert out == [Settled(cmd.op_id, Direction.WRITEBACK, True, None, (a.node_id,), False)]
    assert a.state == "backed"


def test_success_only_if_every_rank_succeeded():
    c = tp2()
    a = put(c, "ab").node
    cmd = c.writeback(a)
    assert c.complete(Completion(cmd.op_id, rank=0, ok=False)) == []
    assert a.state == "writing"
    (s,) = c.complete(Completion(cmd.op_id, rank=1, ok=True))
    c.check_invariants()
    assert (s.ok, a.state, a.host, free(c, "host")) == (False, "device", {}, {"kv": 8})


def test_layer_progress_per_rank():
    c = tp2()
    a, lr = loading(c)
    op = lr.command.op_id
    assert c.complete(Completion(op, rank=0, layer=0)) == []
    assert c.complete(Completion(op, rank=1, layer=1)) == [LayerProgress(op, 0)]
    assert c.complete(Completion(op, rank=0, layer=1)) == [LayerProgress(op, 1)]
    c.check_invariants()
    assert a.state == "loading"
    before = snapshot(c)
    with pytest.raises(DuplicateCompletion):
        c.complete(Completion(op, rank=0, layer=1))
    with pytest.raises(DuplicateCompletion):
        c.complete(Completion(op, rank=1, layer=1))
    with pytest.raises(UsageError, match=rf"^op {op}: layer 2 outside 0\.\.1$"):
        c.complete(Completion(op, rank=0, layer=2))  # the model has 2 layers
    with pytest.raises(UsageError, match=rf"^completion for op {op}: rank 2 outside world size 2$"):
        c.complete(Completion(op, rank=2))
    assert snapshot(c) == before
    assert c.complete(Completion(op, rank=0)) == []
    with pytest.raises(DuplicateCompletion):
        c.complete(Completion(op, rank=0, layer=0))  # after that rank's ack
    (s,) = c.complete(Completion(op, rank=1))
    assert s.ok and a.state == "backed"
    c.check_invariants()


def test_failed_layer_fails_the_operation():
    c = tp2()
    a, lr = loading(c)
    op = lr.command.op_id
    assert c.complete(Completion(op, rank=0, layer=0, ok=False)) == []
    assert c.complete(Completion(op, rank=1, layer=0)) == [LayerProgress(op, 0)]
    (s,) = ack(c, op)
    assert not s.ok and a.state == "host" and free(c) == {"kv": 8}


def test_layer_completion_on_a_writeback_is_refused():
    c = tp2()
    cmd = c.writeback(put(c, "ab").node)
    before = snapshot(c)
    with pytest.raises(UsageError, match=rf"^op {cmd.op_id} is a writeback: layer completions are for loadbacks$"):
        c.complete(Completion(cmd.op_id, rank=0, layer=0))
    assert snapshot(c) == before


def test_duplicate_ack_changes_nothing():
    c = tp2()
    cmd = c.writeback(put(c, "ab").node)
    c.complete(Completion(cmd.op_id, rank=0))
    before = snapshot(c)
    with pytest.raises(DuplicateCompletion):
        c.complete(Completion(cmd.op_id, rank=0))
    with pytest.raises(DuplicateCompletion):
        c.complete(Completion(cmd.op_id, rank=0, ok=False))
    assert snapshot(c) == before
    c.check_invariants()


def test_unknown_and_settled_operations():
    c = CacheCore(h1(), 8, 8)
    before = snapshot(c)
    with pytest.raises(UnknownOperation, match="never issued"):
        c.complete(Completion(42))
    assert snapshot(c) == before
    cmd = c.writeback(put(c, "ab").node)
    ack(c, cmd)
    before = snapshot(c)
    assert c.stats.absorbed_late_completions == 0
    # a settled operation's late or duplicate completion is absorbed and counted by op id
    assert c.complete(Completion(cmd.op_id)) == []
    assert c.complete(Completion(cmd.op_id, ok=False)) == []
    assert snapshot(c) == before and c.stats.absorbed_late_completions == 2
    c.check_invariants()
    # an id past the last one issued was never issued, even after others settled
    with pytest.raises(UnknownOperation, match=rf"^completion for op {cmd.op_id + 1}: never issued$"):
        c.complete(Completion(cmd.op_id + 1))
    with pytest.raises(UnknownOperation, match="^completion for op 0: never issued$"):
        c.complete(Completion(0))
    assert snapshot(c) == before and c.stats.absorbed_late_completions == 2
    # without a host tier there are no operations at all
    with pytest.raises(UnknownOperation):
        CacheCore(h1(), 4, None).complete(Completion(1))


def test_deadline_fails_writeback_and_absorbs_late_completions():
    c = tp2(op_deadline_steps=2)
    a = put(c, "ab").node
    cmd = c.writeback(a)
    assert cmd.deadline_step == 2
    assert c.complete(Completion(cmd.op_id, rank=0)) == []
    assert c.advance_step() == [] and c.advance_step() == []
    c.check_invariants()
    (s,) = c.advance_step()
    c.check_invariants()
    assert s == Settled(cmd.op_id, Direction.WRITEBACK, False, None, (a.node_id,), True)
    assert (a.state, a.host, a.pending, free(c, "host")) == ("device", {}, {}, {"kv": 8})
    assert (c.stats.expired_ops, c.stats.writeback_failures) == (1, 1)
    before = snapshot(c)
    assert c.complete(Completion(cmd.op_id, rank=1)) == []  # the late real one: absorbed, counted
    assert c.complete(Completion(cmd.op_id, rank=0)) == []
    assert snapshot(c) == before and c.stats.absorbed_late_completions == 2
    assert c.advance_step() == []  # it ends exactly once
    c.check_invariants()


def test_deadline_fails_loadback():
    c = CacheCore(h1(), 8, 8, op_deadline_steps=1)
    a = put(c, "ab").node
    c.advance_step(3)
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
    assert lr.command.deadline_step == 4
    assert c.advance_step() == []
    (s,) = c.advance_step()
    assert (s.ok, s.expired, s.direction, s.request_id) == (False, True, Direction.LOADBACK, "r1")
    assert (a.state, a.dev, a.host_pin, free(c)) == ("host", {}, 1, {"kv": 8})
    c.check_invariants()
    assert c.complete(Completion(lr.command.op_id, layer=1)) == []
    assert c.stats.absorbed_late_completions == 1
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()


def test_completion_after_the_request_let_go_still_settles():
    c = CacheCore(h1(), 8, 8)
    a, lr = loading(c)
    c.release(lr.pin)  # the request is gone (aborted) before the ack
    c.unlock(lr.lock)
    c.check_invariants()
    assert (a.state, a.host_pin) == ("loading", 1)  # the operation's own pin remains
    (s,) = ack(c, lr.command)
    assert (s.ok, s.request_id, a.state, a.host_pin) == (True, "r1", "backed", 0)
    assert c.evict_host({"kv": 2}) == {"kv": 2}
    c.check_invariants()


# ---------------------------------------------------------------------- receipts
def test_receipts_release_exactly_once():
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    lk = c.lock(a, "r1")
    b = c.borrow([a], "r1")
    p = c.pin([a], "r1")
    assert (a.lock_ref, a.borrow_ref, a.host_pin) == (1, 1, 1)
    c.unlock(lk)
    c.release(b)
    c.release(p)
    c.check_invariants()
    before = snapshot(c)
    with pytest.raises(KvtierError):
        c.unlock(lk)
    with pytest.raises(KvtierError):
        c.release(b)
    with pytest.raises(KvtierError):
        c.release(p)
    assert snapshot(c) == before
    assert (a.lock_ref, a.borrow_ref, a.host_pin) == (0, 0, 0)
    # a receipt of another cache is refused too
    other = CacheCore(h1(), 8, 8)
    o = put(other, "ab").node
    olk = other.lock(o)
    with pytest.raises(KvtierError):
        c.unlock(olk)
    assert o.lock_ref == 1 and a.lock_ref == 0
    c.check_invariants()


def test_counts_with_several_receipts():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    locks = [c.lock(rb.node, f"r{i}") for i in range(3)]
    assert (ra.node.lock_ref, rb.node.lock_ref) == (3, 3)
    c.unlock(locks[1])
    assert (ra.node.lock_ref, rb.node.lock_ref) == (2, 2)
    for lk in (locks[0], locks[2]):
        c.unlock(lk)
    c.check_invariants()
    assert (ra.node.lock_ref, rb.node.lock_ref) == (0, 0)


def test_pin_and_borrow_refuse_wrong_nodes():
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    before = snapshot(c)
    with pytest.raises(KvtierError):
        c.pin([a])  # no host copy
    assert snapshot(c) == before
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    before = snapshot(c)
    with pytest.raises(KvtierError):
        c.borrow([a])  # no device pages
    assert snapshot(c) == before and state(c) == {a.node_id: "host"}
    c.check_invariants()


def test_advance_step_refuses_a_non_positive_step():
    c = CacheCore(h1(), 4, 4, op_deadline_steps=2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(UsageError, match=rf"^advance_step: steps must be an int >= 1, got {bad!r}$"):
            c.advance_step(bad)  # type: ignore[arg-type]
    assert c.step == 0


# ------------------------------------------------------------------ withdraw
def test_each_withdrawal_counts_once_and_only_unpolled_ops_are_withdrawn() -> None:
    c = CacheCore(h1(), 8, 8, policy="write_through")
    a = put(c, keys("a", 2)).node
    b = put(c, keys("b", 2)).node
    (cmd,) = c.issue_writebacks()  # both parents are the root: one batched operation
    assert cmd.node_ids == (a.node_id, b.node_id)
    c2 = CacheCore(h1(), 8, 8, policy="write_through")
    x = put(c2, keys("x", 2)).node
    (cx,) = c2.issue_writebacks()
    y = put(c2, keys("y", 2)).node
    (cy,) = c2.issue_writebacks()
    assert (cx.node_ids, cy.node_ids) == ((x.node_id,), (y.node_id,))
    assert c2.stats.withdrawn_ops == 0
    sx = c2.withdraw(cx.op_id)
    assert sx is not None and (sx.op_id, sx.ok, sx.node_ids) == (cx.op_id, False, (x.node_id,))
    assert c2.stats.withdrawn_ops == 1
    sy = c2.withdraw(cy.op_id)
    assert sy is not None and (sy.op_id, sy.ok, sy.node_ids) == (cy.op_id, False, (y.node_id,))
    assert c2.stats.withdrawn_ops == 2
    assert c2.poll_commands() == []  # never handed out
    assert c2.withdraw(cx.op_id) is None and c2.stats.withdrawn_ops == 2  # settled: not in flight
    assert (x.state, y.state, free(c2, "host")) == ("device", "device", {"kv": 8})
    c2.check_invariants()
    # handed out already: not withdrawn (the caller poisons it instead), nothing counted
    assert c.poll_commands() == [cmd]
    assert c.withdraw(cmd.op_id) is None
    assert c.stats.withdrawn_ops == 0 and c.ops_in_flight() == 1
    assert c.withdraw(10_000) is None and c.stats.withdrawn_ops == 0  # unknown op id
    c.check_invariants()


# ------------------------------------------------------------------ optable
def test_a_failed_acknowledgement_settles_with_ok_false_exactly() -> None:
    """A rank's failed acknowledgement makes the operation's ``ok`` the bool False: the
    Settled record says False (not merely falsy), and a failed loadback leaves its node
    with ``reloaded`` False."""
    from kvtier.fsm import Completion, Direction

    c = CacheCore(h1(), 4, 4, policy="write_through", world_size=2)
    n = put(c, keys("a", 2)).node
    (cmd,) = c.issue_writebacks()
    assert c.complete(Completion(cmd.op_id, rank=0, ok=False)) == []
    assert c.optable.get(cmd.op_id).ok is False
    (s,) = c.complete(Completion(cmd.op_id, rank=1, ok=True))
    assert (s.op_id, s.direction, s.ok, s.request_id, s.node_ids, s.expired) == (
        cmd.op_id, Direction.WRITEBACK, False, None, (n.node_id,), False)
    assert s.ok is False and n.state == "device"
    again = c.writeback(n)  # written again, this time on both ranks
    assert again is not None
    ack(c, again)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and n.state == "host"
    load = c.load(c.match(keys("a", 2)), "r1")
    assert load.command is not None
    assert c.complete(Completion(load.command.op_id, rank=1, ok=False)) == []
    (s,) = c.complete(Completion(load.command.op_id, rank=0, ok=True))
    assert (s.direction, s.ok) == (Direction.LOADBACK, False) and s.ok is False
    assert n.reloaded is False and n.state == "host"
    c.release(load.pin)
    c.unlock(load.lock)
    c.check_invariants()
