"""Loadback (issue 3, "Loadback"; invariants 4, 10, 11): all-or-nothing device
allocation, the host pin held until the acknowledgement, joining a loadback in flight,
failure freeing the destination pages and shortening the match, and stale matches
(source tests 10, 11, 18); a history-replay loadback without a host checkpoint loads
history only, and the operation's own pin is owned by ``op <id>``."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, h2, keys, put, snapshot, src, state

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import CapacityError, KvtierError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.node import Node
from kvtier.fsm.node.ops import LayerProgress
from kvtier.fsm.records import CacheGroupSpec, Completion, ComponentSpec, Direction, Family


def pairs(cmd):
    return [(t.group, t.src_pages, t.dst_pages) for t in cmd.transfers]


def demoted(units: int = 4, host_units: int = 8, key: str = "abcd"):
    """h1 cache: one node ``key`` written back and demoted (host pages 0..n-1)."""
    c = CacheCore(h1(), units, host_units)
    r = put(c, key)
    ack(c, c.writeback(r.node))
    assert c.evict_device({"kv": len(key)}) == {"kv": len(key)}
    c.poll_commands()
    c.check_invariants()
    return c, r.node


def test_loadback_pins_until_ack_and_returns_device_pages():
    c, a = demoted()
    m = c.match(list("abcd"))
    lr = c.load(m, "r1")
    c.check_invariants()
    cmd = lr.command
    assert (cmd.direction, cmd.request_id, cmd.node_ids, cmd.layers) == (Direction.LOADBACK, "r1", (a.node_id,), (0, 1))
    # the freed pages 0-3 come back reversed (released last, handed out first)
    assert pairs(cmd) == [("kv", (0, 1, 2, 3), (3, 2, 1, 0))]
    assert lr.op_ids == (cmd.op_id,) and lr.device_pages == {"kv": [3, 2, 1, 0]}
    # source test 10: the forward pass's page ids are the transfer's destinations
    assert lr.device_pages["kv"] == list(cmd.transfers[0].dst_pages)
    assert (a.state, a.lb_op, a.host_pin, a.lock_ref) == ("loading", cmd.op_id, 2, 1)
    assert free(c) == {"kv": 0} and free(c, "host") == {"kv": 4}
    assert c.poll_commands() == [cmd]
    # invariant 4: host eviction skips the loading (pinned) node
    assert c.evict_host({"kv": 4}) == {"kv": 0}
    assert c.evict_device({"kv": 4}) == {"kv": 0}
    c.check_invariants()
    (s,) = ack(c, cmd)
    assert (s.ok, s.direction, s.request_id, s.node_ids) == (True, Direction.LOADBACK, "r1", (a.node_id,))
    assert (a.state, a.host_pin, a.lb_op, a.dev, a.host) == ("backed", 1, None, {"kv": [3, 2, 1, 0]}, {"kv": [0, 1, 2, 3]})
    assert c.evict_host({"kv": 4}) == {"kv": 0}  # still the caller's pin
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    assert (a.host_pin, a.lock_ref) == (0, 0)
    assert c.match(list("abcd")).device_units == 4
    assert (c.stats.loadbacks, c.stats.pages_loaded) == (1, 4)


def test_loadback_under_a_device_prefix():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    assert state(c) == {ra.node.node_id: "backed", rb.node.node_id: "host"}
    m = c.match(list("abcdef"))
    lr = c.load(m, "r1")
    c.check_invariants()
    assert pairs(lr.command) == [("kv", (2, 3), (3, 2))] and lr.device_pages == {"kv": [0, 1, 3, 2]}
    assert ra.node.lock_ref == 1 and ra.node.host_pin == 0 and rb.node.host_pin == 2
    ack(c, lr.command)
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()


def test_load_is_all_or_nothing_on_device_pages():
    # h2: group "a" has room, group "b" does not; nothing is allocated, pinned or changed
    c = CacheCore(h2(), {"a": 8, "b": 2}, {"a": 8, "b": 4})
    r = put(c, "xy")
    ack(c, c.writeback(r.node))
    assert c.evict_device({"a": 4}) == {"a": 4, "b": 2}
    blocker = c.alloc_device({"b": 1})
    m = c.match(list("xy"))
    before = snapshot(c)
    with pytest.raises(CapacityError) as exc:
        c.load(m, "r1")
    assert (exc.value.pool, exc.value.group, exc.value.needed, exc.value.free) == ("device", "b", 2, 1)
    assert snapshot(c) == before and r.node.host_pin == 0
    c.check_invariants()
    c.free_device(blocker)
    lr = c.load(m, "r1")
    # b: page 1 went to the blocker and back, so it is handed out first
    assert pairs(lr.command) == [("a", (0, 1, 2, 3), (3, 2, 1, 0)), ("b", (0, 1), (1, 0))]
    c.check_invariants()


def test_load_evicts_other_nodes_but_never_the_hit():
    c = CacheCore(h1(), 4, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    assert c.evict_device({"kv": 2}) == {"kv": 2}  # B demoted
    other = put(c, "z")  # device only, fills the device but 1 page
    m = c.match(list("abcd"))
    assert (m.device_node, m.host_nodes) == (ra.node, (rb.node,))
    with pytest.raises(CapacityError):
        c.load(m, "r1", evict=False)
    lr = c.load(m, "r1")
    c.check_invariants()
    assert other.node.node_id not in {n.node_id for n in c.nodes()}  # dropped for room
    assert ra.node.state == "backed" and rb.node.state == "loading"
    assert lr.device_pages["kv"][:2] == [0, 1]


def test_second_request_joins_the_loadback_in_flight():
    c, a = demoted()
    lr1 = c.load(c.match(list("abcd")), "r1")
    m2 = c.match(list("abcd"))
    assert (m2.device_node, m2.host_nodes, m2.joined_nodes, m2.terminal, m2.host_units) == (c.root, (), (a,), a, 4)
    lr2 = c.load(m2, "r2")
    c.check_invariants()
    assert lr2.command is None and lr2.op_ids == (lr1.command.op_id,)
    assert lr2.pin is not lr1.pin and lr2.pin.owner == "r2" and lr2.lock.owner == "r2"
    assert lr2.device_pages == lr1.device_pages == {"kv": [3, 2, 1, 0]}
    assert (a.host_pin, a.lock_ref, c.stats.loadbacks, c.stats.joined_loadbacks) == (3, 2, 1, 1)
    assert free(c) == {"kv": 0} and len(c.operations()) == 1
    ack(c, lr1.command)
    assert (a.state, a.host_pin) == ("backed", 2)
    for lr in (lr1, lr2):
        c.release(lr.pin)
        c.unlock(lr.lock)
        c.check_invariants()
    assert (a.host_pin, a.lock_ref) == (0, 0)


def test_a_host_hit_joins_a_loadback_in_flight_and_stops_after_it():
    # A = (a, b), B = (c, d) under it, both on the host; r1 loads A only. A match for the
    # whole prompt joins A's loadback and stops there: B would need a loadback behind A's.
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab")
    b = put(c, "abcd", a.pages)
    ack(c, c.writeback(b.node))
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    lr1 = c.load(c.match(list("ab")), "r1")
    assert (a.node.state, b.node.state) == ("loading", "host")
    m = c.match(list("abcd"))
    assert (m.device_node, m.joined_nodes, m.host_nodes, m.terminal, m.host_units) == (
        c.root, (a.node,), (), a.node, 2)
    ack(c, lr1.command)
    c.check_invariants()


def test_a_joined_loadback_of_several_nodes_is_joined_whole():
    # A = (a), B = (b) under it, C = (c) under B, all on the host; r1 loads A and B in one
    # operation. A match for (a, b, c) joins both and stops before C.
    c = CacheCore(h1(), 8, 8)
    a = put(c, "a")
    b = put(c, "ab", a.pages)
    cc = put(c, "abc", b.pages)
    ack(c, c.writeback(cc.node))
    assert c.evict_device({"kv": 3}) == {"kv": 3}
    lr1 = c.load(c.match(list("ab")), "r1")
    assert (a.node.lb_op, b.node.lb_op, cc.node.state) == (lr1.command.op_id, lr1.command.op_id, "host")
    m = c.match(list("abc"))
    assert (m.joined_nodes, m.host_nodes, m.host_units) == ((a.node, b.node), (), 2)
    ack(c, lr1.command)
    c.check_invariants()


def test_a_loadback_in_flight_under_a_device_prefix_is_joined():
    # A = (a) on the device; B = (b) under it on the host, loaded by r1. r2 reads A from the
    # device and joins B's loadback.
    c = CacheCore(h1(), 8, 8)
    a = put(c, "a")
    b = put(c, "ab", a.pages)
    ack(c, c.writeback(b.node))
    c.lock(a.node, "keep-a")  # A stays on the device while B is demoted
    assert c.evict_device({"kv": 1}) == {"kv": 1} and b.node.state == "host"
    lr1 = c.load(c.match(list("ab")), "r1")
    m = c.match(list("ab"))
    assert (m.device_node, m.device_units, m.joined_nodes, m.host_nodes, m.host_units) == (a.node, 1, (b.node,), (), 2)
    ack(c, lr1.command)
    c.check_invariants()


def test_join_then_split_keeps_every_pin():
    c, a = demoted()
    lr1 = c.load(c.match(list("abcd")), "r1")
    lr2 = c.load(c.match(list("abcd")), "r2")
    c.match(list("abx"))  # splits the loading node
    c.check_invariants()
    p = a.parent
    assert (p.state, p.lb_op, p.host_pin, a.host_pin) == ("loading", lr1.command.op_id, 3, 3)
    assert lr2.pin.nodes == [p, a]
    (s,) = ack(c, lr1.command)
    assert s.node_ids == (p.node_id, a.node_id)
    assert (p.state, a.state, p.host_pin, a.host_pin) == ("backed", "backed", 2, 2)
    for lr in (lr1, lr2):
        c.release(lr.pin)
        c.unlock(lr.lock)
    c.check_invariants()
    assert (p.host_pin, a.host_pin, p.lock_ref, a.lock_ref) == (0, 0, 0, 0)


def test_failed_loadback_frees_destination_unpins_and_shortens_match():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    dev_free = free(c)
    lr = c.load(c.match(list("abcd")), "r1")
    assert free(c) == {"kv": dev_free["kv"] - 2}
    (s,) = ack(c, lr.command, ok=False)
    assert (s.ok, s.expired, s.node_ids) == (False, False, (rb.node.node_id,))
    b = rb.node
    assert (b.state, b.dev, b.host, b.lb_op, b.host_pin) == ("host", {}, {"kv": [2, 3]}, None, 1)
    assert free(c) == dev_free and c.stats.loadback_failures == 1
    c.check_invariants()
    # invariant 10: the request recomputes from the last valid prefix (the device part)
    m = c.match(list("abcd"))
    assert (m.device_node, m.device_units) == (ra.node, 2)
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    assert b.host_pin == 0


def test_layer_progress_then_ack():
    c, a = demoted()
    lr = c.load(c.match(list("abcd")), "r1")
    op = lr.command.op_id
    assert c.complete(Completion(op, layer=0)) == [LayerProgress(op, 0)]
    c.check_invariants()
    assert a.state == "loading"
    assert c.complete(Completion(op, layer=1)) == [LayerProgress(op, 1)]
    (s,) = ack(c, lr.command)
    assert s.ok and a.state == "backed"


def test_loadback_with_checkpoint_loads_history_and_state():
    # source test 18: writeback ack, demote, same tokens -> loadback with fh and swa pairs
    c = CacheCore(src(), {"fh": 2, "swa": 8}, {"fh": 2, "swa": 8})
    r = put(c, "a", ckpt=True)
    ack(c, c.writeback(r.node))
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    assert free(c) == {"fh": 2, "swa": 8}
    host_free = free(c, "host")
    m = c.match(list("a"), "state_recovery")
    lr = c.load(m, "r1")
    c.check_invariants()
    assert pairs(lr.command) == [("fh", (0,), (0,)), ("swa", (0, 1, 2, 3), (3, 2, 1, 0))]
    assert lr.device_pages == {"fh": [0], "swa": [3, 2, 1, 0]}
    assert free(c, "host") == host_free and free(c) == {"fh": 1, "swa": 4}
    # the loading terminal's checkpoint counts for a joining state_recovery hit
    m2 = c.match(list("a"), "state_recovery")
    assert (m2.joined_nodes, m2.host_units) == ((r.node,), 1)
    ack(c, lr.command, ok=False)
    assert (r.node.dev, r.node.dev_ckpt, free(c)) == ({}, {}, {"fh": 2, "swa": 8})
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    lr = c.load(c.match(list("a"), "state_recovery"), "r2")
    ack(c, lr.command)
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    assert (r.node.state, r.node.dev_ckpt) == ("backed", {"swa": [0, 1, 2, 3]})
    assert c.match(list("a"), "state_recovery").device_units == 1


def test_a_loading_node_without_a_checkpoint_is_no_hit_end():
    # A = (a) without a checkpoint, B = (a, b) with one; both loaded back by r1. A second
    # request for (a) alone finds no state at A's end: no hit, even though A is loading.
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    ra = put(c, "a")
    rb = put(c, "ab", ra.pages, ckpt=True)
    ack(c, c.writeback(rb.node))
    assert c.evict_device({"fh": 2}) == {"fh": 2, "swa": 4}
    lr = c.load(c.match(list("ab")), "r1")
    assert (ra.node.state, rb.node.state, ra.node.dev_ckpt) == ("loading", "loading", {})
    m = c.match(list("a"))
    assert (m.hit_tokens, m.host_units, m.joined_nodes, m.needs_loadback) == (0, 0, (), False)
    m = c.match(list("ab"))  # the loading terminal's (host) checkpoint does end a hit
    assert (m.hit_tokens, m.host_units, m.joined_nodes) == (8, 2, (ra.node, rb.node))
    ack(c, lr.command)
    c.check_invariants()


def test_history_only_loaded_prefix_extends_on_device():
    # source test 11: host hit of 4 tokens, loadback, extend to 8 tokens -> device hit 8, 2 pages
    fh = CacheGroupSpec("fh", Family.HISTORY, 4, 1, (0, 1), (ComponentSpec("kv", 16),))
    c = CacheCore(CacheLayout("fh", (fh,), 2), 4, 4)
    r = put(c, "a")
    ack(c, c.writeback(r.node))
    assert c.evict_device({"fh": 1}) == {"fh": 1}
    m = c.match(list("ab"))
    assert (m.host_units, m.hit_tokens) == (1, 4)
    lr = c.load(m, "r1")
    ack(c, lr.command)
    res = put(c, "ab", lr.device_pages)
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    m = c.match(list("ab"))
    assert (m.device_units, m.device_tokens, c.device_pages(m.device_node)) == (2, 8, {"fh": [0, 1]})
    assert res.pages == {"fh": [0, 1]}


def test_load_refuses_no_host_hit():
    c = CacheCore(h1(), 4, 4)
    put(c, "ab")
    with pytest.raises(KvtierError):
        c.load(c.match(list("ab")))
    with pytest.raises(KvtierError):
        c.load(c.match(list("zz")))


def test_load_refuses_a_match_made_stale_by_a_split():
    c, a = demoted()
    m = c.match(list("abcd"))
    c.match(list("abx"))  # another request's match splits the host node
    c.check_invariants()
    before = snapshot(c)
    with pytest.raises(KvtierError, match="stale"):
        c.load(m, "r1")
    assert snapshot(c) == before
    c.check_invariants()
    lr = c.load(c.match(list("abcd")), "r1")
    assert lr.command.node_ids == (a.parent.node_id, a.node_id)
    c.check_invariants()


def test_load_refuses_a_match_made_stale_by_a_demotion():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    m = c.match(list("abcd"))
    assert m.device_node is ra.node
    assert c.evict_device({"kv": 2}) == {"kv": 2}  # the device part is demoted too
    before = snapshot(c)
    with pytest.raises(KvtierError, match="stale"):
        c.load(m, "r1")
    assert snapshot(c) == before
    c.check_invariants()


def test_load_refuses_a_match_whose_nodes_changed_state():
    c, a = demoted()
    m = c.match(list("abcd"))
    lr = c.load(m, "r1")
    with pytest.raises(KvtierError, match="stale"):
        c.load(m, "r2")  # A is loading now: the match must be redone (and would join)
    ack(c, lr.command)
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()


def _host_checkpoint(dev: dict[str, int]) -> tuple[CacheCore, Node]:
    """src layout: A = (a) with its checkpoint, written back and demoted (on the host only)."""
    c = CacheCore(src(), dev, {"fh": 4, "swa": 8})
    a = put(c, "a", ckpt=True).node
    ack(c, c.writeback(a))
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4} and a.state == "host"
    return c, a


def test_load_reserves_exactly_history_checkpoint_and_extra_pages():
    c, a = _host_checkpoint({"fh": 4, "swa": 8})
    x = put(c, "x", ckpt=True).node  # fh 1, swa 4: free fh 3, swa 4
    lr = c.load(c.match(list("a")), "r1", extra={"fh": 2, "swa": 0})
    # 1 fh page + 4 swa pages for A and 2 fh pages of its own: everything fits, nothing evicted
    assert (len(lr.device_pages["fh"]), {g: len(p) for g, p in lr.extra.items()}) == (1, {"fh": 2})
    assert x.state == "device" and c.stats.device_evictions == 0 and free(c) == {"fh": 0, "swa": 0}
    ack(c, lr.command)
    c.check_invariants()


def test_load_evicts_exactly_the_checkpoint_shortfall():
    c, a = _host_checkpoint({"fh": 4, "swa": 10})
    x = put(c, "x", ckpt=True).node
    z = put(c, "z", ckpt=True).node  # free: fh 2, swa 2
    lr = c.load(c.match(list("a")), "r1")  # swa short by 2: x (least recently used) goes, z stays
    assert x.node_id not in state(c) and z.state == "device" and c.stats.device_evictions == 1
    ack(c, lr.command)
    c.check_invariants()


def test_load_refusal_names_the_short_group():
    c, a = _host_checkpoint({"fh": 4, "swa": 8})
    put(c, "x", ckpt=True)
    put(c, "y", ckpt=True)  # free: fh 2, swa 0
    before = snapshot(c)
    with pytest.raises(CapacityError) as exc:
        c.load(c.match(list("a")), "r1", evict=False, extra={"fh": 1})  # fh exactly fits, swa is short
    assert str(exc.value) == "device pool of cache group 'swa': need 4 pages, 0 free"
    assert snapshot(c) == before


def test_load_evicts_for_its_extra_pages():
    c, a = _host_checkpoint({"fh": 3, "swa": 12})
    x = put(c, "x").node  # fh 1: free fh 2, swa 8
    lr = c.load(c.match(list("a")), "r1", extra={"fh": 2})  # 1 fh page for A + 2 of its own: x goes
    assert x.node_id not in state(c) and {g: len(p) for g, p in lr.extra.items()} == {"fh": 2}
    ack(c, lr.command)
    c.check_invariants()


def test_load_of_several_nodes_reserves_all_their_pages():
    # A = (a, b) and B = (c, d) under it on the host: loading both needs 4 pages; with 3 free,
    # the unrelated x (1 page) must be evicted first
    c = CacheCore(h1(), 5, 8)
    a = put(c, "ab")
    b = put(c, "abcd", a.pages)
    ack(c, c.writeback(b.node))
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    x = put(c, "x").node  # free: 4
    y = put(c, "y").node  # free: 3
    c.unlock(c.lock(y))  # y more recently used than x
    lr = c.load(c.match(list("abcd")), "r1")
    assert len(lr.device_pages["kv"]) == 4 and x.node_id not in state(c) and y.state == "device"
    ack(c, lr.command)
    c.check_invariants()


def test_a_history_replay_loadback_without_a_host_checkpoint_loads_history_only() -> None:
    """transfers.py:59: with state groups, a loadback loads the terminal's checkpoint only
    when the terminal has one on the host; a history-replay hit ends at a node without
    one, so only its ``fh`` pages move and no ``swa`` page is taken."""
    c = CacheCore(src(), {"fh": 8, "swa": 8}, {"fh": 8, "swa": 8})
    r = put(c, "abcde")
    ack(c, c.writeback(r.node))
    assert c.evict_device({"fh": 5}) == {"fh": 5, "swa": 0}
    m = c.match(list("abcde"), history_replay=True)
    assert (m.host_nodes, m.terminal, m.recompute_tokens) == ((r.node,), r.node, 16)
    assert r.node.host_ckpt == {}
    res = c.load(m, "r1")
    assert res.command is not None
    assert [(t.group, len(t.src_pages), len(t.dst_pages)) for t in res.command.transfers] == [("fh", 5, 5)]
    assert (free(c), r.node.dev_ckpt) == ({"fh": 3, "swa": 8}, {})
    assert c.receipts.get(-res.command.op_id).owner == f"op {res.command.op_id}"
    ack(c, res.command)
    c.release(res.pin)
    c.unlock(res.lock)
    assert (r.node.state, r.node.dev_ckpt, free(c)) == ("backed", {}, {"fh": 3, "swa": 8})
    c.check_invariants()


def test_the_loadback_own_pin_is_owned_by_its_operation() -> None:
    """transfers.py:129: the operation's own pin (receipt id -op_id) names the op."""
    c = CacheCore(h1(), 4, 4, policy="write_through")
    n = put(c, keys("h", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and n.state == "host"
    res = c.load(c.match(keys("h", 2)), "r1")
    assert res.command is not None
    op = res.command.op_id
    own = c.receipts.get(-op)
    assert (own.kind, own.owner, [x.node_id for x in own.nodes]) == ("pin", f"op {op}", [n.node_id])
    assert res.pin.owner == "r1" and n.host_pin == 2
    assert repr(own) == f"<pin receipt {-op} owner='op {op}' nodes=[{n.node_id}]>"
    ack(c, res.command)
    with pytest.raises(KeyError):
        c.receipts.get(-op)
    c.release(res.pin)
    c.unlock(res.lock)
    assert n.host_pin == 0
    c.check_invariants()
