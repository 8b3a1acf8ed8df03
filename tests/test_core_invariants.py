"""``check_invariants()`` detects corruption (issue 3, "Page allocators"): build a valid
cache, corrupt one thing, and the error names the invariant (spec/lifecycle.toml
``[invariants]``) and the node."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_helpers import ack, h1, put, src

from kvtier.fsm.cache import TieredPrefixCache
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.spec import load_spec


def valid() -> tuple[TieredPrefixCache, dict]:
    """h1: A=(a,b) backed [0,1], B=(c,d) device child [2,3], X=(x) device [4]."""
    c = TieredPrefixCache(h1(), 8, 8)
    ra = put(c, "ab")
    ack(c, c.writeback(ra.node))
    rb = put(c, "abcd", ra.pages)
    rx = put(c, "x")
    c.check_invariants()
    return c, {"a": ra.node, "b": rb.node, "x": rx.node}


def corrupt_state(c, n):
    n["a"].state = "host"  # still holds device pages


def double_owner(c, n):
    c.device["kv"].release([4])  # X's page goes back to the free list...
    n["b"].dev["kv"][0] = n["a"].dev["kv"][0]  # ...and B claims A's page
    n["x"].dev["kv"] = [2]


def pin_count(c, n):
    n["a"].host_pin += 1


def lock_count(c, n):
    n["b"].lock_ref += 1


def negative(c, n):
    n["x"].borrow_ref = -1


def leak(c, n):
    c.device["kv"].alloc(1)


def free_and_owned(c, n):
    c.device["kv"].release([4])


def root_closed(c, n):
    a = n["a"]
    c.host["kv"].release(a.host["kv"])
    a.host = {}
    a.state = "device"  # consistent on its own, but a host child is added below
    b = n["b"]
    b.state = "backed"
    b.host = {"kv": c.host["kv"].alloc(2)}


def stale_op(c, n):
    n["x"].wb_op = 99


def writing_without_op(c, n):
    x = n["x"]
    x.state = "writing"
    x.pending = {"kv": c.host["kv"].alloc(1)}


def broken_depth(c, n):
    n["b"].depth = 7


def orphan(c, n):
    del n["a"].children["c"]


CASES: list[tuple[str, Callable, str]] = [
    ("state", corrupt_state, "state_matches_resources"),
    ("double owner", double_owner, "conservation"),
    ("pin count", pin_count, "counts_with_receipts"),
    ("lock count", lock_count, "counts_with_receipts"),
    ("negative count", negative, "counts_with_receipts"),
    ("leaked page", leak, "conservation"),
    ("free and owned", free_and_owned, "conservation"),
    ("root-closed host set", root_closed, "root_closed_host"),
    ("stale op", stale_op, "operation_ends_once"),
    ("writing without op", writing_without_op, "writeback_source_immutable"),
    ("depth", broken_depth, "split_preserves_ownership"),
    ("orphan", orphan, "split_preserves_ownership"),
]


@pytest.mark.parametrize(("what", "corrupt", "invariant"), CASES, ids=[c[0] for c in CASES])
def test_corruption_is_named(what, corrupt, invariant):
    c, n = valid()
    corrupt(c, n)
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == invariant, str(exc.value)
    assert invariant in load_spec().invariants


def test_violation_names_the_node():
    c, n = valid()
    n["a"].state = "host"
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.subject == f"node {n['a'].node_id} (host)"
    assert f"node {n['a'].node_id}" in str(exc.value)


def test_checkpoint_corruption():
    c = TieredPrefixCache(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    a = put(c, "a", ckpt=True).node
    a.dev_state["swa"] = a.dev_state["swa"][:3]
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "exact_continuation_state"
    c2 = TieredPrefixCache(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    b = put(c2, "a", ckpt=True).node
    b.pending_state = {"swa": c2.host["swa"].alloc(4)}  # a pending checkpoint outside a writeback
    with pytest.raises(InvariantViolation) as exc:
        c2.check_invariants()
    assert exc.value.invariant == "host_means_acked"


def test_loadback_corruptions_detected():
    c = TieredPrefixCache(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match("ab"), "r1")
    c.check_invariants()
    op_id = lr.command.op_id
    a.lb_op = None  # the node forgot its loadback
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "operation_ends_once"
    a.lb_op = op_id
    c.check_invariants()
    c.release(lr.pin)
    c.unlock(lr.lock)
    c.check_invariants()
    del c._ops[op_id]  # the operation vanished while the node is still loading
    a.host_pin = 0
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "loadback_source_pinned"


def test_borrowed_pages_demoted_detected():
    c = TieredPrefixCache(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    c.borrow([a], "r1")
    c.device["kv"].release(a.dev["kv"])  # a demotion that ignored the borrow
    a.dev = {}
    a.state = "host"
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "borrowed_pages_stay"
