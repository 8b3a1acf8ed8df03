"""``check_invariants()`` detects corruption (issue 3, "Page allocators"): build a valid
cache, corrupt one thing, and the error names the invariant (spec/lifecycle.toml
``[invariants]``) and the node: among them a child filed under another key than its first
unit and a loadback whose own pin does not list exactly its nodes (the node-resource pairs
are in test_invariants_resources.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_helpers import ack, h1, put, src, violation

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node import Node
from kvtier.fsm.lifecycle.spec import load_spec


def valid() -> tuple[CacheCore, dict]:
    """h1: A=(a,b) backed [0,1], B=(c,d) device child [2,3], X=(x) device [4]."""
    c = CacheCore(h1(), 8, 8)
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


def host_on_device_node(c, n):
    n["x"].host["kv"] = c.host["kv"].alloc(1)


def short_page_list(c, n):
    n["b"].dev["kv"] = n["b"].dev["kv"][:1]


def pin_without_host(c, n):
    n["x"].host_pin = 1


def stale_loadback(c, n):
    n["x"].lb_op = 42


def borrow_count(c, n):
    n["x"].borrow_ref = 1


def bad_link_key(c, n):
    n["b"].key = ("z", "d")


def bad_link_parent(c, n):
    n["b"].parent = n["x"]


def empty_key(c, n):
    n["b"].key = ()


def _detach(c, node):
    c.tree.unlink(node)  # out of the tree, bypassing its lifecycle event and its receipts


def lock_on_removed(c, n):
    c.lock(n["x"], "r1")
    _detach(c, n["x"])


def borrow_on_removed(c, n):
    c.borrow([n["x"]], "r1")
    _detach(c, n["x"])


def pin_on_removed(c, n):
    ack(c, c.writeback(n["x"]))
    c.pin([n["x"]], "r1")
    _detach(c, n["x"])


def claims_foreign_op(c, n):
    n["b"].wb_op = c.writeback(n["x"]).op_id


def op_on_removed(c, n):
    c.writeback(n["x"])
    _detach(c, n["x"])


def writeback_node_not_writing(c, n):
    c.writeback(n["x"])
    n["x"].state = "device"
    n["x"].wb_op = None


def writeback_source_moved(c, n):
    c.writeback(n["x"])
    n["x"].dev["kv"] = [5]


def device_under_host(c, n):
    a = n["a"]
    c.device["kv"].release(a.dev["kv"])
    a.dev = {}
    a.state = "host"


def caller_page_in_tree(c, n):
    got = c.alloc_device({"kv": 1}, evict=False)["kv"]
    assert got == [5]
    c.device["kv"].release(n["x"].dev["kv"])
    n["x"].dev["kv"] = got


def host_leak(c, n):
    c.host["kv"].alloc(1)


def loading_a():
    """h1: A=(a,b) in host, loaded back by op 2 for r1 (pinned, locked), device pages [1, 0]."""
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
    assert (lr.command.op_id, a.state, a.dev) == (2, "loading", {"kv": [1, 0]})
    c.check_invariants()
    return c, {"a": a, "op": lr.command.op_id}


def readable_under_loading(c, n):
    a = n["a"]
    child = Node(99, ("c",), a)
    child.state = "device"
    child.dev = {"kv": c.device["kv"].alloc(1)}
    c.tree.link(child)


def loadback_node_forgot(c, n):
    n["a"].lb_op = None


def loadback_vanished(c, n):
    c.optable.remove(c.optable.get(n["op"]))


def loadback_unpinned(c, n):
    n["a"].host_pin = 0


def with_checkpoint():
    """src: A=(a) on device with its swa checkpoint (4 pages)."""
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    return c, {"a": put(c, "a", ckpt=True).node}


def host_checkpoint_on_device(c, n):
    n["a"].host_ckpt = {"swa": c.host["swa"].alloc(4)}


def checkpoint_extra_group(c, n):
    n["a"].dev_ckpt["fh"] = c.device["fh"].alloc(1)


def short_checkpoint(c, n):
    n["a"].dev_ckpt["swa"] = n["a"].dev_ckpt["swa"][:3]


def pending_checkpoint(c, n):
    n["a"].pending_ckpt = {"swa": c.host["swa"].alloc(4)}


def device_checkpoint_on_host():
    c, n = with_checkpoint()
    a = n["a"]
    ack(c, c.writeback(a))
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    assert a.state == "host"
    return c, n


def device_checkpoint_without_pages(c, n):
    n["a"].dev_ckpt = {"swa": c.device["swa"].alloc(4)}


def writing_with_a_lost_op(c, n):
    writing_without_op(c, n)
    n["x"].wb_op = 99


def writeback_node_claims_another_op(c, n):
    c.writeback(n["x"])
    n["x"].wb_op = 98


def borrowed_then_demoted(c, n):
    a = n["a"]
    c.borrow([a], "r1")
    c.device["kv"].release(a.dev["kv"])  # a demotion that ignored the borrow
    a.dev = {}
    a.state = "host"


def _a_back_to_device_only(c, n):
    a = n["a"]
    c.host["kv"].release(a.host["kv"])
    a.host = {}
    a.state = "device"


def child_written_before_parent(c, n):
    assert c.writeback(n["b"]).node_ids == (n["b"].node_id,)  # legal while A is backed...
    _a_back_to_device_only(c, n)  # ...but A has lost its host copy


def child_in_another_parents_writeback(c, n):
    assert c.writeback(n["b"]).node_ids == (n["b"].node_id,)
    _a_back_to_device_only(c, n)
    assert c.writeback(n["a"]).node_ids == (n["a"].node_id,)  # A written back by another operation than B


def loadback_source_moved(c, n):
    n["a"].host["kv"] = [5, 6]  # (checked before conservation)


def many_free_and_owned(c, n):
    put(c, "qrs")  # device pages 5, 6, 7: eight pages owned
    c.device["kv"].release(range(8))


#: (what, corrupt, setup, invariant, subject, detail): one row per check of check_invariants().
CASES: list[tuple[str, Callable, Callable, str, str, str]] = [
    ("state", corrupt_state, valid, "state_matches_resources", "node 1 (host)",
     "holds device_pages but state 'host' declares ['host_pages']"),
    ("short page list", short_page_list, valid, "state_matches_resources", "node 2 (device)",
     "dev pages of 'kv': 1 for 2 units"),
    ("host pages on a device node", host_on_device_node, valid, "host_means_acked", "node 3 (device)",
     "holds host_pages but state 'device' declares ['device_pages', 'shared_read']"),
    ("double owner", double_owner, valid, "conservation", "node 2 (device)",
     "device page 0 of 'kv' also owned by node 1"),
    ("caller page in the tree", caller_page_in_tree, valid, "conservation", "the cache",
     "device page 5 of 'kv': caller and node 3"),
    ("pin count", pin_count, valid, "counts_with_receipts", "node 1 (backed)", "pin count 1 but 0 receipts"),
    ("lock count", lock_count, valid, "counts_with_receipts", "node 2 (device)", "lock count 1 but 0 receipts"),
    ("borrow count", borrow_count, valid, "counts_with_receipts", "node 3 (device)",
     "borrow count 1 but 0 receipts"),
    ("negative count", negative, valid, "counts_with_receipts", "node 3 (device)", "a negative count"),
    ("leaked page", leak, valid, "conservation", "the cache", "device pool of 'kv': 6 pages allocated but 5 owned"),
    ("leaked host page", host_leak, valid, "conservation", "the cache",
     "host pool of 'kv': 3 pages allocated but 2 owned"),
    ("free and owned", free_and_owned, valid, "conservation", "the cache", "device pages [4] of 'kv' free and owned"),
    ("root-closed host set", root_closed, valid, "root_closed_host", "node 2 (backed)", "parent 1 is device"),
    ("device under host", device_under_host, valid, "state_matches_resources", "node 2 (device)",
     "device set not root-closed: on device under parent 1 in host"),
    ("stale op", stale_op, valid, "operation_ends_once", "node 3 (device)",
     "holds writeback_op but state 'device' declares ['device_pages', 'shared_read']"),
    ("stale loadback op", stale_loadback, valid, "operation_ends_once", "node 3 (device)",
     "holds loadback_op but state 'device' declares ['device_pages', 'shared_read']"),
    ("pin without host copy", pin_without_host, valid, "loadback_source_pinned", "node 3 (device)",
     "holds host_pin but state 'device' declares ['device_pages', 'shared_read']"),
    ("writing without op", writing_without_op, valid, "writeback_source_immutable", "node 3 (writing)",
     "state 'writing' declares writeback_op but the node has none"),
    ("writing with a lost op", writing_with_a_lost_op, valid, "writeback_source_immutable", "node 3 (writing)",
     "its writeback op 99 is not in flight"),
    ("writeback node claims another op", writeback_node_claims_another_op, valid, "operation_ends_once",
     "node 3 (writing)", "in writeback op 2 but not writing it"),
    ("borrowed then demoted", borrowed_then_demoted, valid, "borrowed_pages_stay", "node 1 (host)",
     "borrowed by 1 but has no device pages"),
    ("child written before its parent", child_written_before_parent, valid, "root_closed_host", "node 2 (writing)",
     "parent 1 is device"),
    ("child in another writeback than its parent", child_in_another_parents_writeback, valid, "root_closed_host",
     "node 2 (writing)", "parent 1 is writing"),
    ("loadback source moved", loadback_source_moved, loading_a, "loadback_source_pinned", "node 1 (loading)",
     "op 2 copies pages of 'kv' its nodes no longer hold"),
    ("many free and owned", many_free_and_owned, valid, "conservation", "the cache",
     "device pages [0, 1, 2, 3, 4] of 'kv' free and owned"),
    ("depth", broken_depth, valid, "split_preserves_ownership", "node 2 (device)", "depth 7 != 2 + 2"),
    ("orphan", orphan, valid, "split_preserves_ownership", "the cache", "tree and node index disagree: [2]"),
    ("link key", bad_link_key, valid, "split_preserves_ownership", "node 2 (device)", "tree links are inconsistent"),
    ("link parent", bad_link_parent, valid, "split_preserves_ownership", "node 2 (device)",
     "tree links are inconsistent"),
    ("empty key", empty_key, valid, "split_preserves_ownership", "node 2 (device)", "tree links are inconsistent"),
    ("lock on a removed node", lock_on_removed, valid, "counts_with_receipts", "node 3 (device)",
     "<lock receipt 4 owner='r1' node=3> holds a node that left the tree"),
    ("borrow on a removed node", borrow_on_removed, valid, "borrowed_pages_stay", "node 3 (device)",
     "<borrow receipt 4 owner='r1' nodes=[3]> holds a node that left the tree"),
    ("pin on a removed node", pin_on_removed, valid, "counts_with_receipts", "node 3 (backed)",
     "<pin receipt 4 owner='r1' nodes=[3]> holds a node that left the tree"),
    ("node claims another op", claims_foreign_op, valid, "split_preserves_ownership", "node 2 (device)",
     "claims op 2, which does not list it"),
    ("op on a removed node", op_on_removed, valid, "operation_ends_once", "node 3 (writing)",
     "op 2 holds a node that left the tree"),
    ("writeback node not writing", writeback_node_not_writing, valid, "operation_ends_once", "node 3 (device)",
     "in writeback op 2 but not writing it"),
    ("writeback source moved", writeback_source_moved, valid, "writeback_source_immutable", "node 3 (writing)",
     "op 2 copies pages of 'kv' its nodes no longer hold"),
    ("readable under loading", readable_under_loading, loading_a, "state_matches_resources", "node 99 (device)",
     "readable under unreadable parent 1 in loading"),
    ("loadback node forgot its op", loadback_node_forgot, loading_a, "operation_ends_once", "node 1 (loading)",
     "in loadback op 2 but not loading it"),
    ("loadback vanished", loadback_vanished, loading_a, "loadback_source_pinned", "node 1 (loading)",
     "its loadback op 2 is not in flight"),
    ("loadback unpinned", loadback_unpinned, loading_a, "loadback_source_pinned", "node 1 (loading)",
     "state 'loading' declares host_pin but the node has none"),
    ("host checkpoint on device", host_checkpoint_on_device, with_checkpoint, "host_means_acked", "node 1 (device)",
     "a host checkpoint without a visible host copy"),
    ("device checkpoint on host", device_checkpoint_without_pages, device_checkpoint_on_host,
     "state_matches_resources", "node 1 (host)", "a device checkpoint without device pages"),
    ("checkpoint in a history group", checkpoint_extra_group, with_checkpoint, "exact_continuation_state",
     "node 1 (device)", "dev_ckpt covers ['fh', 'swa'], not every state group"),
    ("short checkpoint", short_checkpoint, with_checkpoint, "exact_continuation_state", "node 1 (device)",
     "dev_ckpt of 'swa' has 3 pages"),
    ("pending checkpoint", pending_checkpoint, with_checkpoint, "host_means_acked", "node 1 (device)",
     "a pending checkpoint outside a writeback"),
]


@pytest.mark.parametrize(("what", "corrupt", "setup", "invariant", "subject", "detail"), CASES,
                         ids=[c[0] for c in CASES])
def test_corruption_is_named(what, corrupt, setup, invariant, subject, detail):
    c, n = setup()
    corrupt(c, n)
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert (exc.value.invariant, exc.value.subject) == (invariant, subject), str(exc.value)
    assert str(exc.value) == f"invariant {invariant!r} violated by {subject}: {detail}"
    assert invariant in load_spec().invariants


def test_violation_names_the_node():
    c, n = valid()
    n["a"].state = "host"
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.subject == f"node {n['a'].node_id} (host)"
    assert f"node {n['a'].node_id}" in str(exc.value)


def test_loadback_corruptions_detected():
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
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
    c.optable.remove(c.optable.get(op_id))  # the operation vanished while the node is still loading
    a.host_pin = 0
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "loadback_source_pinned"


def test_borrowed_pages_demoted_detected():
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    c.borrow([a], "r1")
    c.device["kv"].release(a.dev["kv"])  # a demotion that ignored the borrow
    a.dev = {}
    a.state = "host"
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert exc.value.invariant == "borrowed_pages_stay"


def test_a_child_filed_under_another_key_than_its_first_unit_breaks_the_tree_links() -> None:
    """invariants.py:98: a node whose first unit is not the key its parent files it under
    (here its second unit is) breaks ``split_preserves_ownership``."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, ("a", "b")).node
    n.key = ("x", "a")  # filed under "a"
    assert violation(c) == ("split_preserves_ownership", "invariant 'split_preserves_ownership' violated by "
                             "node 1 (device): tree links are inconsistent")
    n.key = ("a", "b")
    c.check_invariants()


def test_a_loadback_whose_own_pin_does_not_list_exactly_its_nodes_is_reported() -> None:
    """invariants.py:148-151: a loadback's own pin (receipt ``-op_id``) must list exactly its
    nodes; one that lists none breaks ``loadback_source_pinned``, naming the op."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, ("a", "b")).node
    ack(c, c.writeback(n))
    c.evict_device({"kv": 8})
    assert n.state == "host"
    res = c.load(c.match(("a", "b")), "r1")
    assert res.command is not None and n.state == "loading"
    op_id = res.command.op_id
    pin = c.receipts.get(-op_id)
    assert pin.nodes == [n] and pin.owner == f"op {op_id}"
    pin.nodes = []
    assert violation(c) == ("loadback_source_pinned", f"invariant 'loadback_source_pinned' violated by node 1 "
                             f"(loading): loadback op {op_id} does not pin exactly its nodes")
    pin.nodes = [n]
    c.check_invariants()
