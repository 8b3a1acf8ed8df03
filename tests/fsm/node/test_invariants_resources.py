"""The node-resource checks of ``check_invariants()`` (kvtier.fsm.node.invariants: ``_HOLDS``,
``_OPTIONAL``) name the exact invariant for every (resource, holds / lacks) pair a bug can
produce, and accept the states that legally hold an optional resource (the other checks
are in the tests of kvtier.fsm.node.invariants). Each case builds a valid core, breaks one node
in one way and asserts the whole message: invariant, subject and detail."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_helpers import ack, h1, put, violation

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node import Node
from kvtier.fsm.lifecycle.spec import load_spec


def test_a_resource_held_against_the_nodes_state_names_its_invariant() -> None:
    """invariants.py:31-37 (``_HOLDS``): a node holding a resource its state does not
    declare, or lacking one it declares, is reported under that resource's invariant:
    pending host pages on a device node or missing on a writing one and missing host pages
    on a host node break ``state_matches_resources``; a loading node without its loadback
    op breaks ``loadback_source_pinned``; an L3 get's op on a node not being fetched, or a
    fetching node without one, breaks ``l3_get_invisible``. Each corruption is undone
    before the next."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, ("a", "b")).node
    assert (n.node_id, n.state) == (1, "device")
    n.pending = {"kv": [7]}
    assert violation(c) == ("state_matches_resources", "invariant 'state_matches_resources' violated by node 1 "
                             "(device): holds pending_host but state 'device' declares ['device_pages', 'shared_read']")
    n.pending = {}
    cmd = c.writeback(n)
    assert cmd is not None and n.state == "writing"
    pending, n.pending = n.pending, {}
    assert violation(c) == ("state_matches_resources", "invariant 'state_matches_resources' violated by node 1 "
                             "(writing): state 'writing' declares pending_host but the node has none")
    n.pending = pending
    ack(c, cmd)
    assert n.state == "backed"
    n.state = "loading"  # no loadback op (nor pin) behind it
    assert violation(c) == ("loadback_source_pinned", "invariant 'loadback_source_pinned' violated by node 1 "
                             "(loading): state 'loading' declares loadback_op but the node has none")
    n.state = "backed"
    c.evict_device({"kv": 8})
    assert n.state == "host"
    host, n.host = n.host, {}
    assert violation(c) == ("state_matches_resources", "invariant 'state_matches_resources' violated by node 1 "
                             "(host): state 'host' declares host_pages but the node has none")
    n.host = host
    c.check_invariants()
    n.fetch_op = 5  # an L3 get's op on a node not being fetched
    assert violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 1 (host): "
                             "holds fetch_op but state 'host' declares ['host_pages']")
    n.fetch_op = None
    [f] = c.fetches.reserve(c.root, ["f0"], 900)
    assert (f.node_id, f.state, f.fetch_op) == (2, "fetching", 900)
    f.fetch_op = None
    assert violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 2 (fetching): "
                             "state 'fetching' declares fetch_op but the node has none")
    f.fetch_op = 900
    c.check_invariants()


_DEVICE = "['device_pages', 'shared_read']"


def valid() -> tuple[CacheCore, dict[str, Node]]:
    """h1: A=(a,b) backed (node 1), B=(c,d) device child (node 2), X=(x) device (node 3)."""
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    ack(c, c.writeback(ra.node))
    rb = put(c, "abcd", ra.pages)
    rx = put(c, "x")
    c.check_invariants()
    assert [(n.node_id, n.state) for n in (ra.node, rb.node, rx.node)] == [(1, "backed"), (2, "device"),
                                                                           (3, "device")]
    return c, {"a": ra.node, "b": rb.node, "x": rx.node}


def hosted() -> tuple[CacheCore, dict[str, Node]]:
    """h1: A=(a,b) host only (node 1), X=(x) device (node 2)."""
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    x = put(c, "x").node
    c.check_invariants()
    assert [(n.node_id, n.state) for n in (a, x)] == [(1, "host"), (2, "device")]
    return c, {"a": a, "x": x}


def loading() -> tuple[CacheCore, dict[str, Node]]:
    """h1: A=(a,b) loaded back from the host by op 2 (node 1, loading, pinned by the op and by r1)."""
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
    assert lr.command is not None and (lr.command.op_id, a.state, a.host_pin) == (2, "loading", 2)
    c.check_invariants()
    return c, {"a": a}


def fetching() -> tuple[CacheCore, dict[str, Node]]:
    """h1: F=(f) fetching for L3 get 40 (node 1, host pages reserved), X=(x) device (node 2)."""
    c = CacheCore(h1(), 8, 8)
    (f,) = c.fetches.reserve(c.root, ["f"], 40)
    x = put(c, "x").node
    c.check_invariants()
    assert [(n.node_id, n.state, n.fetch_op) for n in (f, x)] == [(1, "fetching", 40), (2, "device", None)]
    return c, {"f": f, "x": x}


def backed_without_host_pages(c: CacheCore, n: dict[str, Node]) -> None:
    n["a"].host = {}


def host_without_host_pages(c: CacheCore, n: dict[str, Node]) -> None:
    n["a"].host = {}


def device_with_pending_pages(c: CacheCore, n: dict[str, Node]) -> None:
    assert c.host is not None
    n["x"].pending = {"kv": c.host["kv"].alloc(1)}


def writing_without_pending_pages(c: CacheCore, n: dict[str, Node]) -> None:
    assert c.writeback(n["x"]) is not None
    n["x"].pending = {}


def loading_whose_op_settled_and_forgotten(c: CacheCore, n: dict[str, Node]) -> None:
    a = n["a"]
    op = c.optable.get(a.lb_op)
    assert op is not None
    c.optable.remove(op)  # the loadback left the table...
    a.lb_op = None  # ...and the node forgot it, but stayed loading


def device_with_fetch_op(c: CacheCore, n: dict[str, Node]) -> None:
    n["x"].fetch_op = 40


def fetching_without_fetch_op(c: CacheCore, n: dict[str, Node]) -> None:
    n["f"].fetch_op = None


def writing_pinned(c: CacheCore, n: dict[str, Node]) -> None:
    assert c.writeback(n["x"]) is not None
    n["x"].host_pin = 1  # a pin on a copy not yet visible (checked before the pin receipts)


def host_node_pinned_without_receipt(c: CacheCore, n: dict[str, Node]) -> None:
    n["a"].host_pin = 1  # allowed by the node's state (an optional pin), not by the receipts


def one_unit_key_changed(c: CacheCore, n: dict[str, Node]) -> None:
    n["x"].key = ("y",)  # filed under "x" by its parent, keyed "y": one unit, so no second unit to compare


def loadback_left_with_no_node_and_no_pin(c: CacheCore, n: dict[str, Node]) -> None:
    """Op 2 forgets its only node and its own pin is released: the pin (none) and the
    nodes (none) agree, and what catches it is the source check (no node holds the pages)."""
    a = n["a"]
    op = c.optable.get(2)
    assert op is not None and op.nodes == [a]
    c.receipts.release(c.receipts.get(-2))
    op.nodes.clear()
    a.lb_op = None


def loadback_pin_lost_its_node(c: CacheCore, n: dict[str, Node]) -> None:
    c.receipts.get(-2).nodes.clear()  # op 2's own pin no longer names node 1 (the counts are checked later)


#: (what, corrupt, setup, invariant, subject, detail)
CASES: list[tuple[str, Callable[..., None], Callable[[], tuple[CacheCore, dict[str, Node]]], str, str, str]] = [
    ("backed without host pages", backed_without_host_pages, valid, "state_matches_resources", "node 1 (backed)",
     "state 'backed' declares host_pages but the node has none"),
    ("host without host pages", host_without_host_pages, hosted, "state_matches_resources", "node 1 (host)",
     "state 'host' declares host_pages but the node has none"),
    ("device with pending pages", device_with_pending_pages, valid, "state_matches_resources", "node 3 (device)",
     f"holds pending_host but state 'device' declares {_DEVICE}"),
    ("writing without pending pages", writing_without_pending_pages, valid, "state_matches_resources",
     "node 3 (writing)", "state 'writing' declares pending_host but the node has none"),
    ("loading without its loadback op", loading_whose_op_settled_and_forgotten, loading, "loadback_source_pinned",
     "node 1 (loading)", "state 'loading' declares loadback_op but the node has none"),
    ("device with a fetch op", device_with_fetch_op, valid, "l3_get_invisible", "node 3 (device)",
     f"holds fetch_op but state 'device' declares {_DEVICE}"),
    ("fetching without its fetch op", fetching_without_fetch_op, fetching, "l3_get_invisible", "node 1 (fetching)",
     "state 'fetching' declares fetch_op but the node has none"),
    ("writing node pinned", writing_pinned, valid, "loadback_source_pinned", "node 3 (writing)",
     "holds host_pin but state 'writing' declares ['device_pages', 'shared_read', 'pending_host', 'writeback_op']"),
    ("link key of one unit", one_unit_key_changed, valid, "split_preserves_ownership", "node 3 (device)",
     "tree links are inconsistent"),
    ("loadback with neither nodes nor pin", loadback_left_with_no_node_and_no_pin, loading, "loadback_source_pinned",
     "the cache", "op 2 copies pages of 'kv' its nodes no longer hold"),
    ("loadback pin lost its node", loadback_pin_lost_its_node, loading, "loadback_source_pinned", "node 1 (loading)",
     "loadback op 2 does not pin exactly its nodes"),
    ("host node pinned without a receipt", host_node_pinned_without_receipt, hosted, "counts_with_receipts",
     "node 1 (host)", "pin count 1 but 0 receipts"),
]


@pytest.mark.parametrize(("what", "corrupt", "setup", "invariant", "subject", "detail"), CASES,
                         ids=[c[0] for c in CASES])
def test_resource_corruption_is_named(what: str, corrupt: Callable[..., None],
                                      setup: Callable[[], tuple[CacheCore, dict[str, Node]]],
                                      invariant: str, subject: str, detail: str) -> None:
    c, n = setup()
    corrupt(c, n)
    with pytest.raises(InvariantViolation) as exc:
        c.check_invariants()
    assert (exc.value.invariant, exc.value.subject) == (invariant, subject), str(exc.value)
    assert str(exc.value) == f"invariant {invariant!r} violated by {subject}: {detail}"
    assert invariant in load_spec().invariants


def test_pins_on_visible_host_copies_are_legal() -> None:
    """A pin is optional on every state with a visible host copy (backed, host; a loading
    node declares it): pinned backed and host nodes pass, and the pin shows."""
    c, n = valid()
    c.pin([n["a"]], "r1")
    c.check_invariants()
    h, m = hosted()
    h.pin([m["a"]], "r1")
    h.pin([m["a"]], "r2")
    h.check_invariants()
    assert (n["a"].state, n["a"].host_pin, m["a"].state, m["a"].host_pin) == ("backed", 1, "host", 2)


def test_a_key_equal_to_its_childrens_dict_key_is_consistent() -> None:
    """The tree walk compares a child's first unit with its key in the parent's children
    dict as the dict does (identity first, then equality): an equal but distinct object
    is a consistent link."""
    c = CacheCore(h1(), 8, 8)
    u = put(c, ["unit"]).node
    same = "".join(["un", "it"])
    assert same == u.key[0] and same is not u.key[0]
    u.key = (same,)
    c.check_invariants()
