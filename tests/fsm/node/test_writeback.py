"""Write policies and writebacks (issue 3, "Write policies"; invariants 1-3, 11):
write_through, write_through_selective (threshold 2), write_back (eviction queues the
writeback and frees nothing now), a child queued until its parent's acknowledgement,
a parent's failure dropping the child's queued writeback, and failure freeing the
reservation, publishing nothing and keeping the device pages (source tests 3, 4, 16, 17, 20);
``write_back`` eviction summing the pages each queued leaf pledges, a writeback
acknowledgement clearing ``reloaded``, ``limit=0`` submitting nothing, and the one-by-one
pass going on past a node whose parent lost its host copy."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, keys, put, snapshot, src, state

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import CapacityError, ConfigError
from kvtier.fsm.records import Direction


def pairs(cmd):
    return [(t.group, t.src_pages, t.dst_pages) for t in cmd.transfers]


def test_policy_validation():
    with pytest.raises(ConfigError):
        CacheCore(h1(), 4, 4, policy="write_sometimes")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError):
            CacheCore(h1(), 4, 4, write_threshold=bad)
    assert CacheCore(h1(), 4, 4).write_threshold == 2
    assert CacheCore(h1(), 4, 4).policy.value == "write_through_selective"


def test_write_through_child_waits_for_parent_ack():
    c = CacheCore(h1(), 8, 8, policy="write_through")
    ra = put(c, "ab")
    a = ra.node
    assert c.queued_writebacks() == [a.node_id]
    (cmd_a,) = c.issue_writebacks()
    c.check_invariants()
    assert (cmd_a.direction, cmd_a.request_id, cmd_a.node_ids, pairs(cmd_a)) == (
        Direction.WRITEBACK, None, (a.node_id,), [("kv", (0, 1), (0, 1))])
    assert cmd_a.layers == (0, 1) and cmd_a.deadline_step is None
    b = put(c, "abc", ra.pages).node
    assert c.queued_writebacks() == [b.node_id]
    assert c.issue_writebacks() == []  # parent still writing
    assert (b.state, c.queued_writebacks()) == ("device", [b.node_id])
    (settled,) = ack(c, cmd_a)
    assert (settled.op_id, settled.ok, settled.node_ids, settled.request_id, settled.expired) == (
        cmd_a.op_id, True, (a.node_id,), None, False)
    assert a.state == "backed" and a.host == {"kv": [0, 1]}
    (cmd_b,) = c.issue_writebacks()
    c.check_invariants()
    assert (b.state, pairs(cmd_b), c.queued_writebacks()) == ("writing", [("kv", (2,), (2,))], [])
    assert c.poll_commands() == [cmd_a, cmd_b] and c.poll_commands() == []
    ack(c, cmd_b)
    assert state(c) == {a.node_id: "backed", b.node_id: "backed"}
    assert free(c, "host") == {"kv": 5} and free(c) == {"kv": 5}
    assert (c.stats.writebacks, c.stats.pages_written) == (2, 3)


def test_parent_writeback_failure_drops_queued_child():
    c = CacheCore(h1(), 8, 8, policy="write_through")
    ra = put(c, "ab")
    (cmd_a,) = c.issue_writebacks()
    b = put(c, "abc", ra.pages).node
    assert c.queued_writebacks() == [b.node_id]
    (settled,) = ack(c, cmd_a, ok=False)
    assert not settled.ok
    assert c.queued_writebacks() == [] and c.issue_writebacks() == []  # invariant 1
    assert state(c) == {ra.node.node_id: "device", b.node_id: "device"}
    assert free(c, "host") == {"kv": 8} and c.stats.writeback_failures == 1
    c.check_invariants()


def test_write_through_selective_threshold():
    c = CacheCore(h1(), 8, 8)  # threshold 2
    r = put(c, "ab")
    assert c.queued_writebacks() == [] and r.node.hit_count == 0
    c.unlock(c.lock(r.node))
    assert (r.node.hit_count, c.queued_writebacks()) == (1, [])
    c.check_invariants()
    lk = c.lock(r.node)
    assert (r.node.hit_count, c.queued_writebacks()) == (2, [r.node.node_id])
    (cmd,) = c.issue_writebacks()
    assert pairs(cmd) == [("kv", (0, 1), (0, 1))] and r.node.state == "writing"
    c.check_invariants()
    c.unlock(lk)
    ack(c, cmd)
    assert r.node.state == "backed"
    c3 = CacheCore(h1(), 8, 8, write_threshold=3)
    r3 = put(c3, "ab")
    for _ in range(2):
        c3.unlock(c3.lock(r3.node))
    assert c3.queued_writebacks() == []
    c3.unlock(c3.lock(r3.node))
    assert c3.queued_writebacks() == [r3.node.node_id]
    c3.check_invariants()


def test_selective_queues_parent_and_child_parent_first():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abc", ra.pages)
    c.unlock(c.lock(rb.node))
    c.unlock(c.lock(rb.node))
    assert c.queued_writebacks() == sorted([ra.node.node_id, rb.node.node_id])
    (cmd_a,) = c.issue_writebacks()
    assert cmd_a.node_ids == (ra.node.node_id,)
    ack(c, cmd_a)
    (cmd_b,) = c.issue_writebacks()
    assert cmd_b.node_ids == (rb.node.node_id,)
    ack(c, cmd_b)
    c.check_invariants()


def test_write_back_eviction_of_a_deep_leaf_frees_after_one_writeback_round():
    # regression (issue 15): eviction picks a leaf under a chain of device-only nodes and
    # queues the chain; the chain used to go one node per round (a parent's ack before its
    # child was submitted), so an admission retried after one round was still short and
    # bench/bookkeeping.py refused it. The chain now goes in one operation.
    c = CacheCore(h1(), 6, 8, policy="write_back")
    a = put(c, "ab")
    b = put(c, "abcd", a.pages)
    d = put(c, "abcdef", b.pages)
    with pytest.raises(CapacityError):
        c.alloc_device({"kv": 2})
    assert c.queued_writebacks() == sorted(n.node.node_id for n in (a, b, d))
    (cmd,) = c.issue_writebacks()
    assert cmd.node_ids == (a.node.node_id, b.node.node_id, d.node.node_id)
    assert pairs(cmd) == [("kv", (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5))]
    ack(c, cmd)
    assert c.alloc_device({"kv": 2}) == {"kv": [5, 4]}  # the deepest leaf is demoted (freed last page first)
    assert (d.node.state, c.stats.demotions, free(c, "host")) == ("host", 1, {"kv": 2})
    c.check_invariants()


def test_write_back_eviction_queues_and_frees_nothing_now():
    c = CacheCore(h1(), 4, 8, policy="write_back")
    a = put(c, "ab").node
    b = put(c, "cd").node
    assert c.queued_writebacks() == [] and free(c) == {"kv": 0}
    before_free = free(c)
    with pytest.raises(CapacityError):
        c.alloc_device({"kv": 1})
    c.check_invariants()
    assert free(c) == before_free and state(c) == {a.node_id: "device", b.node_id: "device"}
    # one queued leaf covers the page asked for: the newer one is not queued
    assert c.queued_writebacks() == [a.node_id]
    assert c.evict_device({"kv": 4}) == {"kv": 0}
    assert c.queued_writebacks() == [a.node_id, b.node_id]
    cmds = c.issue_writebacks()  # both nodes' parents are the root: one batched operation
    assert [pairs(x) for x in cmds] == [[("kv", (0, 1, 2, 3), (0, 1, 2, 3))]]
    assert cmds[0].node_ids == (a.node_id, b.node_id)
    for cmd in cmds:
        ack(c, cmd)
    # now eviction demotes the last unit of the oldest, A (split off: exact eviction)
    assert c.alloc_device({"kv": 1}) == {"kv": [1]}
    c.check_invariants()
    assert state(c) == {a.parent.node_id: "backed", a.node_id: "host", b.node_id: "backed"}
    assert c.stats.demotions == 1 and c.external_pages("kv") == frozenset({1})


def test_request_writeback_of_a_chain_is_one_operation():
    c = CacheCore(h1(), 8, 8, policy="write_back")
    ra = put(c, "ab")
    rb = put(c, "abc", ra.pages)
    cmd = c.writeback(rb.node, "r1")
    c.check_invariants()
    assert (cmd.request_id, cmd.node_ids, pairs(cmd)) == (
        "r1", (ra.node.node_id, rb.node.node_id), [("kv", (0, 1, 2), (0, 1, 2))])
    (settled,) = ack(c, cmd)
    assert (settled.request_id, settled.node_ids, settled.ok) == ("r1", (ra.node.node_id, rb.node.node_id), True)
    assert state(c) == {ra.node.node_id: "backed", rb.node.node_id: "backed"}
    assert c.writeback(rb.node, "r1") is None  # nothing left to write


def test_request_writeback_behind_an_inflight_one_is_queued():
    c = CacheCore(h1(), 8, 8, policy="write_back")
    ra = put(c, "ab")
    cmd_a = c.writeback(ra.node)
    rb = put(c, "abc", ra.pages)
    assert c.writeback(rb.node, "r1") is None
    assert (rb.node.state, c.queued_writebacks()) == ("device", [rb.node.node_id])
    c.check_invariants()
    ack(c, cmd_a)
    (cmd_b,) = c.issue_writebacks()
    assert cmd_b.node_ids == (rb.node.node_id,) and cmd_b.request_id is None
    ack(c, cmd_b)
    c.check_invariants()


def test_a_chain_behind_an_inflight_writeback_is_queued_whole_parent_first():
    c = CacheCore(h1(), 8, 8, policy="write_back")
    ra = put(c, "ab")
    cmd_a = c.writeback(ra.node)
    rb = put(c, "abc", ra.pages)
    rc = put(c, "abcd", rb.pages)
    assert c.writeback(rc.node, "r1") is None
    assert (rb.node.state, rc.node.state) == ("device", "device")
    assert c.queued_writebacks() == [rb.node.node_id, rc.node.node_id]
    ack(c, cmd_a)
    issued = []
    while c.queued_writebacks():
        for cmd in c.issue_writebacks():
            issued.append(cmd.node_ids)
            ack(c, cmd)
    assert issued[0][0] == rb.node.node_id and [n for ids in issued for n in ids] == [rb.node.node_id, rc.node.node_id]
    assert (rb.node.state, rc.node.state) == ("backed", "backed")
    c.check_invariants()


def test_failed_writeback_frees_reservation_publishes_nothing_keeps_device():
    # source tests 4 and 20
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    a = put(c, "a", ckpt=True).node
    dev_before = free(c)
    cmd = c.writeback(a)
    assert free(c, "host") == {"fh": 3, "swa": 4}
    (settled,) = ack(c, cmd, ok=False)
    assert (settled.ok, settled.expired) == (False, False)
    assert (a.state, a.pending, a.pending_ckpt, a.host, a.host_ckpt) == ("device", {}, {}, {}, {})
    assert (a.dev, a.dev_ckpt) == ({"fh": [0]}, {"swa": [0, 1, 2, 3]})
    assert free(c, "host") == {"fh": 4, "swa": 8} and free(c) == dev_before
    assert c.operations() == {}
    # a same-prefix request gets a device hit and no loadback
    m = c.match(list("a"))
    assert (m.device_units, m.needs_loadback) == (1, False)
    # the host has nothing: dropping the device copy leaves nothing to match
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    c.check_invariants()
    assert c.match(list("a")).host_units == 0 and c.nodes() == []


def test_writeback_with_host_full_changes_nothing():
    c = CacheCore(h1(), 8, 1, policy="write_back")
    r = put(c, "ab")
    before = snapshot(c)
    assert c.writeback(r.node) is None
    assert snapshot(c) == before
    c.check_invariants()


def test_writeback_does_not_evict_the_parent_host_copy():
    # the parent is the only host leaf; evicting it for the child would break invariant 1
    c = CacheCore(h1(), 8, 1, policy="write_back")
    ra = put(c, "a")
    ack(c, c.writeback(ra.node))
    assert free(c, "host") == {"kv": 0}
    rb = put(c, "ab", ra.pages)
    before = snapshot(c)
    assert c.writeback(rb.node) is None
    c.check_invariants()
    assert snapshot(c) == before
    assert (ra.node.state, rb.node.state) == ("backed", "device")
    c.issue_writebacks()
    c.check_invariants()


def test_host_eviction_for_writeback_skips_pinned_nodes():
    # source test 16: HostWriteBackPrunesOnlyUnpinnedPagedCacheHostSnapshots
    c = CacheCore(h1(), 8, 2, policy="write_back")
    rx = put(c, "xy")
    ack(c, c.writeback(rx.node))
    assert free(c, "host") == {"kv": 0}
    ry = put(c, "zw")
    pin = c.pin([rx.node], "r1")
    before = snapshot(c)
    assert c.writeback(ry.node) is None
    assert snapshot(c) == before  # nothing pruned, no pending reservation
    c.check_invariants()
    c.release(pin)
    cmd = c.writeback(ry.node)
    c.check_invariants()
    assert (rx.node.state, rx.node.host, ry.node.state, ry.node.pending) == (
        "device", {}, "writing", {"kv": [1, 0]})
    assert pairs(cmd) == [("kv", (2, 3), (1, 0))] and c.stats.host_drops == 1


def test_host_eviction_frees_several_snapshots_for_one_allocation():
    # source test 17: two 1-page host snapshots pruned for one 2-page writeback
    c = CacheCore(h1(), 8, 2, policy="write_back")
    r1 = put(c, "p")
    r2 = put(c, "q")
    ack(c, c.writeback(r1.node))
    ack(c, c.writeback(r2.node))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    assert state(c) == {r1.node.node_id: "host", r2.node.node_id: "host"}
    r3 = put(c, "st")
    cmd = c.writeback(r3.node)
    c.check_invariants()
    assert state(c) == {r3.node.node_id: "writing"} and c.stats.host_evictions == 2
    assert sorted(cmd.transfers[0].dst_pages) == [0, 1]


def test_batched_tree_writeback_falls_back_to_one_node_at_a_time_within_the_limit():
    # three queued device leaves, room for two pages on the host: the batch of three does not
    # fit, so nodes go one by one; with limit=1 only one operation is issued per call
    c = CacheCore(h1(), 8, 3, policy="write_back")
    p = put(c, "p")
    ack(c, c.writeback(p.node, "r0"))  # a backed parent: its children may be written back
    nodes = [put(c, k).node for k in "xy"] + [put(c, "pz", p.pages).node]
    for n in nodes:
        c.writebacks.want(n)
    (first,) = c.issue_writebacks(limit=1)
    assert first.node_ids == (nodes[0].node_id,) and c.queued_writebacks() == [n.node_id for n in nodes[1:]]
    ack(c, first)
    cmds = c.issue_writebacks()
    assert [cmd.node_ids for cmd in cmds] == [(nodes[1].node_id,)]  # the last one does not fit
    assert c.queued_writebacks() == [] and nodes[2].state == "device"
    ack(c, cmds[0])
    c.check_invariants()


def test_a_queued_node_written_back_by_a_request_leaves_the_queue():
    c = CacheCore(h1(), 8, 8, policy="write_back")
    a = put(c, "a").node
    b = put(c, "b").node
    c.writebacks.want(a)
    c.writebacks.want(b)
    ack(c, c.writeback(a, "r1"))  # a request wrote A back meanwhile
    (cmd,) = c.issue_writebacks()
    assert cmd.node_ids == (b.node_id,) and c.queued_writebacks() == []
    ack(c, cmd)
    c.check_invariants()


def test_a_queued_child_whose_parent_will_not_be_written_is_dropped():
    c = CacheCore(h1(), 8, 0, policy="write_back")  # a host tier without room
    a = put(c, "a")
    b = put(c, "ab", a.pages)
    c.writebacks.want(a.node)
    c.writebacks.want(b.node)
    assert c.issue_writebacks() == []  # A does not fit and leaves the queue; B waits for A
    assert c.queued_writebacks() == [b.node.node_id]
    assert c.issue_writebacks() == [] and c.queued_writebacks() == []  # A will never be written
    c.check_invariants()


def test_write_back_never_takes_another_nodes_host_copy_for_a_writeback():
    c = CacheCore(h1(), 8, 1, policy="write_back")
    x = put(c, "x").node
    ack(c, c.writeback(x, "r1"))  # the host's only page holds x's copy
    y = put(c, "y").node
    c.writebacks.want(y)
    assert c.issue_writebacks() == []  # y is refused rather than making x device-only again
    assert (x.state, y.state, c.queued_writebacks()) == ("backed", "device", [])
    wt = CacheCore(h1(), 8, 1, policy="write_through")
    x2 = put(wt, "x").node
    ack(wt, wt.writeback(x2))
    y2 = put(wt, "y").node
    wt.writebacks.want(y2)
    (cmd,) = wt.issue_writebacks()  # other policies may take it
    assert cmd.node_ids == (y2.node_id,) and x2.state == "device"
    c.check_invariants()
    wt.check_invariants()


def test_a_writeback_evicts_exactly_its_host_shortfall():
    # host of 3 pages: two host-only nodes and one free page; a 2-page writeback evicts one
    c = CacheCore(h1(), 8, 3, policy="write_through")
    olds = []
    for k in "pq":
        n = put(c, k).node
        ack(c, c.writeback(n))
        olds.append(n)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and [n.state for n in olds] == ["host", "host"]
    r = put(c, "xy")
    cmd = c.writeback(r.node)
    assert cmd is not None and c.stats.host_evictions == 1
    assert (olds[0].node_id in state(c), olds[1].state) == (False, "host")  # the older one went
    ack(c, cmd)
    c.check_invariants()


# ------------------------------------------------------------------ write_back pledges
def test_write_back_eviction_sums_the_pages_of_every_queued_leaf() -> None:
    """Each queued leaf pledges its pages (2 here); the demand (4) is met by two leaves,
    so the third is not queued."""
    c = CacheCore(h1(), 6, 8, policy="write_back")
    a, b, d = (put(c, keys(p, 2)).node for p in "abd")
    assert c.evict_device({"kv": 4}) == {"kv": 0}  # queued, freed later
    assert c.queued_writebacks() == [a.node_id, b.node_id]
    assert state(c) == {a.node_id: "device", b.node_id: "device", d.node_id: "device"}
    c.check_invariants()


def test_a_writeback_ack_clears_reloaded_even_on_a_node_a_loadback_brought_back() -> None:
    """transfers.py:163: a writeback acknowledgement makes the host copy the node's own
    (``reloaded`` False): with an exclusive host tier, host-only eviction then spares it.
    The node here was loaded back (reloaded True), lost its host copy to an exclusive
    host eviction (state device, the flag kept) and was written back again."""
    c = CacheCore(h1(), 4, 4, policy="write_through", exclusive=True)
    n = put(c, keys("h", 2)).node
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    assert (n.state, n.reloaded) == ("backed", False) and n.reloaded is False
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}  # its own copy: spared
    assert c.evict_device({"kv": 2}) == {"kv": 2} and n.state == "host"
    res = c.load(c.match(keys("h", 2)), "r1")
    assert res.command is not None
    ack(c, res.command)
    c.release(res.pin)
    c.unlock(res.lock)
    assert (n.state, n.reloaded) == ("backed", True)
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 2}  # a duplicate: dropped
    assert (n.state, n.reloaded) == ("device", True)
    cmd = c.writeback(n, "r2")
    assert cmd is not None and cmd.node_ids == (n.node_id,)
    ack(c, cmd)
    assert (n.state, n.reloaded) == ("backed", False) and n.reloaded is False
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}
    assert n.state == "backed" and c.stats.host_drops == 1
    c.check_invariants()


def test_issue_writebacks_with_limit_zero_submits_nothing() -> None:
    """transfers.py:249: a limit below 1 submits no operation, even when the whole batch
    would fit; the queue stays as it was."""
    c = CacheCore(h1(), 8, 8, policy="write_through")
    a = put(c, keys("a", 2)).node
    b = put(c, keys("b", 2)).node
    assert c.queued_writebacks() == [a.node_id, b.node_id]
    assert c.issue_writebacks(limit=0) == []
    assert c.issue_writebacks(limit=-1) == []
    assert (c.queued_writebacks(), c.ops_in_flight(), c.poll_commands()) == ([a.node_id, b.node_id], 0, [])
    assert (a.state, b.state, free(c, "host"), c.stats.writebacks) == ("device", "device", {"kv": 8}, 0)
    (cmd,) = c.issue_writebacks(limit=1)  # the batch is one operation
    assert cmd.node_ids == (a.node_id, b.node_id)
    c.check_invariants()


def test_one_by_one_writebacks_skip_a_node_whose_parent_lost_its_host_copy_and_go_on() -> None:
    """transfers.py:267: the batch of three queued nodes does not fit the host; one by one,
    N1's writeback takes the tail of P's host copy (P is split), so N2 (below P) waits, and
    N3 (below R) is still written back, taking the rest of P's copy.

    h1: one page per unit. Host 6 pages: P (2) and R (2) backed, 2 free. Queued, all at
    depth 3, in this order: N1 (3 units under the root), N2 (1 unit under P), N3 (1 unit
    under R). The batch (5 pages, P and R protected) is refused; N1 needs 3, evicts 1 page
    (P's last unit), N2's parent is now device-only, N3 needs 1 and evicts P's first unit."""
    c = CacheCore(h1(), 16, 6, policy="write_through")
    p = put(c, ["p0", "p1"]).node
    r = put(c, ["r0", "r1"]).node
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    assert (p.state, r.state, free(c, "host")) == ("backed", "backed", {"kv": 2})
    lk = c.lock(r, "keep-r-recent")  # P is the least recently used host leaf
    c.unlock(lk)
    n1 = put(c, ["a0", "a1", "a2"]).node
    n2 = put(c, ["p0", "p1", "q0"], {"kv": p.dev["kv"]}).node
    n3 = put(c, ["r0", "r1", "c0"], {"kv": r.dev["kv"]}).node
    assert (n1.depth, n2.depth, n3.depth) == (3, 3, 3)
    assert (n2.parent, n3.parent) == (p, r)
    assert c.queued_writebacks() == [n1.node_id, n2.node_id, n3.node_id]
    out = c.issue_writebacks()
    assert [cmd.node_ids for cmd in out] == [(n1.node_id,), (n3.node_id,)]
    assert (n1.state, n2.state, n3.state) == ("writing", "device", "writing")
    assert p.state == "device" and p.key == ("p1",) and p.parent is not None
    p_head = p.parent
    assert (p_head.key, p_head.state) == (("p0",), "device")
    assert r.state == "backed" and c.stats.host_drops == 2
    assert c.queued_writebacks() == [n2.node_id]
    assert free(c, "host") == {"kv": 0}
    for cmd in out:
        ack(c, cmd)
    assert (n1.state, n3.state) == ("backed", "backed")
    c.check_invariants()
