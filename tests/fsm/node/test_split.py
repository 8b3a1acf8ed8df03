"""Splits (issue 3, "Split"; invariant 6): locks, pins, borrows and in-flight operations
stay valid on both fragments; an acknowledgement of an operation submitted before the
split applies to every fragment; splits at 0 or at the full length are no-ops
(source tests 8 and 9)."""

from __future__ import annotations

from core_helpers import ack, free, h1, h2, put, src, state

from kvtier.fsm import CacheCore
from kvtier.fsm.node import Node
from kvtier.fsm.node.tree import RadixTree
from kvtier.fsm.records import Completion

#: The node fields a split sets on the new prefix fragment itself: its identity, its key and
#: place in the tree, its share of the pages, and the checkpoint that stays at the suffix end.
#: Every other field is state the prefix fragment shares with the original node.
SPLIT_SETS = frozenset({"node_id", "key", "parent", "children", "depth", "dev", "host", "pending",
                        "dev_ckpt", "host_ckpt", "pending_ckpt", "_refs", "chunk_checkpoint"})


def test_split_keeps_pages_identity_and_lock():
    c = CacheCore(h2(), {"a": 16, "b": 8}, {"a": 16, "b": 8})
    r = put(c, "wxyz")
    a = r.node
    lk = c.lock(a)
    r2 = put(c, "wxq", {"a": [0, 1, 2, 3], "b": [0, 1]})
    p = a.parent
    assert c.stats.splits == 1 and r2.node.parent is p and p.parent is c.root
    assert (p.key, p.depth, p.dev, p.state) == (("w", "x"), 2, {"a": [0, 1, 2, 3], "b": [0, 1]}, "device")
    # the suffix keeps its identity, depth and pages
    assert (a.key, a.depth, a.dev, a.node_id) == (("y", "z"), 4, {"a": [4, 5, 6, 7], "b": [2, 3]}, 1)
    assert (p.lock_ref, a.lock_ref, p.hit_count, p.last_access >= a.last_access) == (1, 1, 1, True)
    c.unlock(lk)
    c.check_invariants()
    assert (p.lock_ref, a.lock_ref) == (0, 0)


def test_split_keeps_borrow_and_pending_writeback():
    # source test 8: PendingSnapshotPartialSplitPreservesSuffixIdentityAndBorrowedPages
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    r = put(c, "abcd", ckpt=True)
    a = r.node
    rcpt = c.borrow([a], "r1")
    cmd = c.writeback(a)
    c.match(list("ab"))  # split at 2 units
    c.check_invariants()
    p = a.parent
    assert (p.state, p.wb_op, a.state, a.wb_op) == ("writing", cmd.op_id, "writing", cmd.op_id)
    assert (p.pending, a.pending) == ({"fh": [0, 1]}, {"fh": [2, 3]})
    assert (p.dev, a.dev, a.depth) == ({"fh": [0, 1]}, {"fh": [2, 3]}, 4)
    # the checkpoint stays at the suffix end
    assert (p.dev_ckpt, p.pending_ckpt, a.dev_ckpt, a.pending_ckpt) == (
        {}, {}, {"swa": [0, 1, 2, 3]}, {"swa": [0, 1, 2, 3]})
    assert rcpt.nodes == [p, a] and (p.borrow_ref, a.borrow_ref) == (1, 1)
    (s,) = ack(c, cmd)
    assert s.node_ids == (p.node_id, a.node_id)  # the ack covers the whole original range
    assert (p.state, a.state, p.host, a.host, a.host_ckpt) == (
        "backed", "backed", {"fh": [0, 1]}, {"fh": [2, 3]}, {"swa": [0, 1, 2, 3]})
    # borrowed: neither fragment is demoted
    assert c.evict_device({"fh": 4}) == {"fh": 0, "swa": 0}
    c.release(rcpt)
    c.check_invariants()
    assert c.evict_device({"fh": 4}) == {"fh": 4, "swa": 4}
    assert state(c) == {p.node_id: "host", a.node_id: "host"}
    m = c.match(list("abcd"), "state_recovery")
    assert (m.host_nodes, m.host_units) == ((p, a), 4)


def test_split_then_writeback_failure_rolls_back_both_fragments():
    c = CacheCore(h1(), 8, 8)
    a = put(c, "abcd").node
    cmd = c.writeback(a)
    assert free(c, "host") == {"kv": 4}
    c.match(list("abc"))
    p = a.parent
    (s,) = ack(c, cmd, ok=False)
    assert (s.ok, s.node_ids) == (False, (p.node_id, a.node_id))
    assert state(c) == {p.node_id: "device", a.node_id: "device"}
    assert (p.pending, a.pending, p.wb_op, a.wb_op) == ({}, {}, None, None)
    assert free(c, "host") == {"kv": 8}


def test_host_node_split_stays_on_suffix():
    # source test 9: HostSnapshotPartialSplitStaysOnSuffix
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    a = put(c, "abcd", ckpt=True).node
    ack(c, c.writeback(a))
    assert c.evict_device({"fh": 4}) == {"fh": 4, "swa": 4}
    pin = c.pin([a], "r1")
    c.match(list("abz"))
    c.check_invariants()
    p = a.parent
    assert (p.state, p.host, p.host_ckpt, p.host_pin) == ("host", {"fh": [0, 1]}, {}, 1)
    assert (a.state, a.host, a.host_ckpt, a.host_pin, a.depth) == (
        "host", {"fh": [2, 3]}, {"swa": [0, 1, 2, 3]}, 1, 4)
    assert pin.nodes == [p, a]
    c.release(pin)
    c.check_invariants()
    assert (p.host_pin, a.host_pin) == (0, 0)


def test_split_of_loading_node_ack_and_failure_apply_to_every_fragment():
    for ok in (True, False):
        c = CacheCore(h1(), 4, 4)
        a = put(c, "abcd").node
        ack(c, c.writeback(a))
        assert c.evict_device({"kv": 4}) == {"kv": 4}
        lr = c.load(c.match(list("abcd")), "r1")
        c.match(list("a"))  # split at 1 unit
        c.check_invariants()
        p = a.parent
        assert (p.state, p.lb_op, p.host_pin, p.lock_ref) == ("loading", lr.command.op_id, 2, 1)
        assert (p.dev, a.dev) == ({"kv": [3]}, {"kv": [2, 1, 0]})
        assert c.complete(Completion(lr.command.op_id, layer=1)) != []
        (s,) = ack(c, lr.command, ok=ok)
        assert s.node_ids == (p.node_id, a.node_id) and s.ok is ok
        want = "backed" if ok else "host"
        assert state(c) == {p.node_id: want, a.node_id: want}
        assert (p.host_pin, a.host_pin) == (1, 1)
        assert free(c) == ({"kv": 0} if ok else {"kv": 4})
        c.release(lr.pin)
        c.unlock(lr.lock)
        c.check_invariants()


def test_split_of_queued_writeback_queues_both_fragments():
    c = CacheCore(h1(), 8, 8, policy="write_through")
    a = put(c, "abcd").node
    assert c.queued_writebacks() == [a.node_id]
    c.match(list("ab"))
    p = a.parent
    assert c.queued_writebacks() == sorted([a.node_id, p.node_id])
    (cmd_p,) = c.issue_writebacks()
    assert cmd_p.node_ids == (p.node_id,)
    assert c.issue_writebacks() == []  # the suffix waits for its new parent's ack
    ack(c, cmd_p)
    (cmd_a,) = c.issue_writebacks()
    assert cmd_a.node_ids == (a.node_id,)
    ack(c, cmd_a)
    c.check_invariants()
    assert state(c) == {p.node_id: "backed", a.node_id: "backed"}


def test_split_at_zero_or_full_length_is_a_no_op():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    cmd = c.writeback(rb.node, "r1")
    lk = c.lock(rb.node)
    ids = sorted(n.node_id for n in c.nodes())
    for key in ("ab", "abcd", "abcdef", "abx", "x", ""):
        c.match(list(key))
        c.check_invariants()
    for key in ("ab", "abcd"):
        put(c, key, {"kv": [0, 1, 2, 3][: len(key)]})
    assert c.stats.splits == 0 and sorted(n.node_id for n in c.nodes()) == ids
    assert (ra.node.key, rb.node.key) == (("a", "b"), ("c", "d"))
    c.unlock(lk)
    ack(c, cmd)
    c.check_invariants()


def test_split_gives_the_prefix_fragment_every_shared_field_of_the_node():
    # every slot of Node outside SPLIT_SETS, so that a field added later is covered too
    shared = [f for f in Node.__slots__ if f not in SPLIT_SETS]
    assert {"state", "lock_ref", "host_pin", "wb_op", "lb_op", "fetch_op", "reloaded"} <= set(shared)
    tree = RadixTree({"kv": 2}, iter(range(1, 100)))
    node = tree.new_leaf(tree.root, ("a", "b", "c"))
    tree.link(node)
    node.dev = {"kv": [0, 1, 2, 3, 4, 5]}
    values = {f: object() for f in shared}
    for f, v in values.items():
        setattr(node, f, v)
    prefix = tree.cut(node, 1)
    assert {f: getattr(prefix, f) for f in shared} == values
    assert {f: getattr(node, f) for f in shared} == values
    assert (prefix.key, prefix.dev, node.key, node.dev) == (("a",), {"kv": [0, 1]}, ("b", "c"), {"kv": [2, 3, 4, 5]})
    assert (prefix.parent, node.parent, prefix.chunk_checkpoint) == (tree.root, prefix, False)
