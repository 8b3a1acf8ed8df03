"""CacheStats counts every event exactly once: one scenario touches every counter."""

from __future__ import annotations

import dataclasses

import pytest
from core_helpers import ack, h1, put, state

from kvtier.fsm import CacheStats, CacheCore
from kvtier.fsm.errors import UsageError
from kvtier.fsm.records import Completion


def test_every_counter_counts_each_event_once() -> None:
    c = CacheCore(h1(), 8, 8, op_deadline_steps=1)

    def counts() -> dict[str, int]:
        return {k: v for k, v in dataclasses.asdict(c.stats).items() if v}

    a = put(c, "ab").node  # trigger 1: create
    ack(c, c.writeback(a))  # 2, 3: submit, ack; 2 pages written
    put(c, "ac", {"kv": a.dev["kv"][:1]})  # 4: split (a)(b); 5: create (c)
    assert counts() == {"writebacks": 1, "pages_written": 2, "splits": 1, "triggers": 5}
    x = put(c, "x").node  # 6
    ack(c, c.writeback(x), ok=False)  # 7, 8: a failed writeback
    cmd = c.writeback(x)  # 9
    assert cmd is not None
    assert [s.expired for s in c.advance_step(2)] == [True]  # 10: failed by its deadline
    assert c.complete(Completion(cmd.op_id, 0, True)) == []  # late: absorbed
    ack(c, c.writeback(x))  # 11, 12
    assert counts() == {"writebacks": 4, "writeback_failures": 2, "expired_ops": 1, "absorbed_late_completions": 1,
                        "pages_written": 5, "splits": 1, "triggers": 12}
    # (c) has no host copy and is dropped; x, (b), (a) are demoted: 13-16
    assert c.evict_device({"kv": 8}) == {"kv": 4}
    assert sorted(state(c).values()) == ["host"] * 3
    first = c.load(c.match(list("ab")), "r1")  # 17, 18: (a) and (b) start loading
    joined = c.load(c.match(list("ab")), "r2")  # joins the loadback in flight
    ack(c, first.command)  # 19, 20
    for r in (first, joined):
        c.release(r.pin)
        c.unlock(r.lock)
    assert c.evict_device({"kv": 8}) == {"kv": 2}  # 21, 22: demote (a), (b) again
    failed = c.load(c.match(list("x")), "r3")  # 23
    ack(c, failed.command, ok=False)  # 24
    c.release(failed.pin)
    c.unlock(failed.lock)
    assert c.evict_host({"kv": 8}) == {"kv": 3}  # 25-27: x, (b), (a) leave the tree
    q = put(c, "q").node  # 28
    ack(c, c.writeback(q))  # 29, 30
    assert c.evict_host({"kv": 1}) == {"kv": 1} and q.state == "device"  # 31: drop the host copy
    assert counts() == {
        "demotions": 5, "device_evictions": 1, "host_evictions": 3, "host_drops": 1, "writebacks": 5,
        "writeback_failures": 2, "loadbacks": 2, "loadback_failures": 1, "joined_loadbacks": 1, "expired_ops": 1,
        "absorbed_late_completions": 1, "pages_written": 6, "pages_loaded": 3, "splits": 1, "triggers": 31}
    assert c.stats.extra == {}


def test_stats_start_at_zero() -> None:
    s = CacheStats()
    assert all(v == 0 for k, v in dataclasses.asdict(s).items() if k != "extra") and s.extra == {}
    assert CacheStats().extra is not s.extra  # not shared between caches


def test_splits_are_counted_each_time() -> None:
    c = CacheCore(h1(), 8, None)
    assert put(c, "abc").node.dev == {"kv": [0, 1, 2]}
    put(c, "abx", {"kv": [0, 1]})  # (a, b) | (c), (x)
    put(c, "ay", {"kv": [0]})  # (a) | (b), (y)
    assert c.stats.splits == 2
    assert sorted(n.key for n in c.nodes()) == [("a",), ("b",), ("c",), ("x",), ("y",)]


def test_joined_loadbacks_are_counted_each_time() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    first = c.load(c.match(list("ab")), "r1")
    joins = [c.load(c.match(list("ab")), r) for r in ("r2", "r3")]
    assert (c.stats.loadbacks, c.stats.joined_loadbacks) == (1, 2)
    assert all(j.command is None and j.op_ids == (first.command.op_id,) for j in joins)


def test_failures_settle_with_ok_false_and_are_counted_each_time() -> None:
    c = CacheCore(h1(), 8, 8, world_size=2)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    failures = []
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    for _ in range(2):  # the failed loadback leaves A on the host: load it again
        assert a.state == "host"
        lr = c.load(c.match(list("ab")), "r1")
        op = lr.command.op_id
        c.complete(Completion(op, 0, False, 0))  # a failed layer fails the whole loadback
        c.complete(Completion(op, 1, True))
        (settled,) = c.complete(Completion(op, 0, True))
        failures.append(settled.ok)
        c.release(lr.pin)
        c.unlock(lr.lock)
    assert failures == [False, False] and all(ok is False for ok in failures)
    assert c.stats.loadback_failures == 2
    w = put(c, "x").node
    cmd = c.writeback(w)
    c.poison(cmd.op_id)
    c.complete(Completion(cmd.op_id, 0, True))
    (settled,) = c.complete(Completion(cmd.op_id, 1, True))
    assert settled.ok is False and w.state == "device"


def test_a_failed_writeback_drops_only_its_own_queued_children() -> None:
    c = CacheCore(h1(), 8, 8, policy="write_back")
    a = put(c, "a")
    child = put(c, "ab", a.pages).node
    other = put(c, "x").node
    other_child = put(c, "xy", {"kv": other.dev["kv"]}).node
    cmd_a = c.writeback(a.node, "r1")
    cmd_x = c.writeback(other, "r2")
    c.writebacks.want(child)
    c.writebacks.want(other_child)
    ack(c, cmd_a, ok=False)  # A's copy failed: its child can never be written now
    assert c.queued_writebacks() == [other_child.node_id]
    ack(c, cmd_x)
    c.check_invariants()


def test_advance_step_refuses_bad_counts() -> None:
    c = CacheCore(h1(), 8, 8)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(UsageError) as exc:
            c.advance_step(bad)  # type: ignore[arg-type]
        assert str(exc.value) == f"advance_step: steps must be an int >= 1, got {bad!r}"
    assert c.step == 0


def test_expired_operations_are_counted_each_time() -> None:
    c = CacheCore(h1(), 8, 8, op_deadline_steps=1)
    cmds = [c.writeback(put(c, k).node) for k in "xy"]
    assert all(cmd is not None for cmd in cmds)
    assert len(c.advance_step(2)) == 2 and c.stats.expired_ops == 2
