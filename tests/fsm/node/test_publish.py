"""Publishing (kvtier.fsm.node.publish, ``CacheCore.insert``): new nodes with multi-group page
counts, duplicates adopting the canonical pages, host nodes republished as backed, wrong
counts or foreign pages changing nothing, a page given twice, checkpoint adoption and
chunk checkpoints (dropped by a deeper one unless borrowed, settled by a second one),
inserts stopping at a loading node, and the anchor fast path checked unit by unit and
group by group."""

from __future__ import annotations

import pytest
from core_helpers import ack, backed_chain, free, h1, h2, keys, put, snapshot, src

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family


def test_insert_new_nodes_multi_group_page_counts():
    c = CacheCore(h2(), {"a": 12, "b": 6}, None)
    r = put(c, "xy")
    assert (r.published_units, r.pages, r.duplicates, r.kept) == (
        2, {"a": [0, 1, 2, 3], "b": [0, 1]}, {}, {})
    assert r.created == (r.node,) and r.node.state == "device" and r.node.depth == 2
    assert c.external_pages("a") == frozenset() and free(c) == {"a": 8, "b": 4}
    r2 = put(c, "xyz", r.pages)
    assert (r2.pages, r2.duplicates, r2.created) == ({"a": [0, 1, 2, 3, 4, 5], "b": [0, 1, 2]}, {}, (r2.node,))
    assert r2.node.parent is r.node and r2.node.dev == {"a": [4, 5], "b": [2]}


def test_insert_duplicates_adopt_canonical_pages():
    c = CacheCore(h2(), {"a": 12, "b": 6}, None)
    r = put(c, "xy")
    # a second request computed the same prefix (and one more unit) in its own pages
    own = c.alloc_device({"a": 6, "b": 3})
    assert own == {"a": [4, 5, 6, 7, 8, 9], "b": [2, 3, 4]}
    r2 = c.insert(tuple("xyz"), own)
    c.check_invariants()
    assert r2.duplicates == {"a": [4, 5, 6, 7], "b": [2, 3]}
    assert r2.pages == {"a": [0, 1, 2, 3, 8, 9], "b": [0, 1, 4]}
    assert r2.node.dev == {"a": [8, 9], "b": [4]} and r2.kept == {}
    assert c.external_pages("a") == frozenset({4, 5, 6, 7}) and c.external_pages("b") == frozenset({2, 3})
    c.free_device(r2.duplicates)
    c.check_invariants()
    assert free(c) == {"a": 6, "b": 3}
    # canonical pages mixed with own ones: only the own ones in a published range come back
    own = c.alloc_device({"a": 2})
    r3 = c.insert(tuple("xy"), {"a": [0, 1] + own["a"], "b": [0, 1]})
    assert r3.duplicates == {"a": own["a"]} and r3.created == () and r3.node is r.node
    c.free_device(r3.duplicates)
    c.check_invariants()


def test_insert_republishes_host_node_as_backed():
    c, a, b = backed_chain()
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    own = c.alloc_device({"kv": 3})
    assert own == {"kv": [1, 0, 3]}  # B's pages 2,3 were freed first, then A's 0,1
    r = c.insert(tuple("abc"), own)
    c.check_invariants()
    p = b.parent  # B split at 1 unit: the prefix fragment is republished, B's rest stays on host
    assert r.created == () and r.node is p and p.parent is a
    assert (a.state, p.state, b.state) == ("backed", "backed", "host")
    assert (p.key, b.key) == (("c",), ("d",))
    assert (a.dev, p.dev, b.dev) == ({"kv": [1, 0]}, {"kv": [3]}, {})
    assert (a.host, p.host, b.host) == ({"kv": [0, 1]}, {"kv": [2]}, {"kv": [3]})
    assert r.duplicates == {} and r.pages == {"kv": [1, 0, 3]} and c.external_pages("kv") == frozenset()
    m = c.match(list("abcd"))
    assert (m.device_node, m.device_units, m.host_nodes, m.host_units) == (p, 3, (b,), 4)


def test_insert_republish_keeps_unrepublished_suffix_on_host():
    c, a, b = backed_chain()
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    own = c.alloc_device({"kv": 2})
    r = c.insert(tuple("ab"), own)
    c.check_invariants()
    assert (r.node, r.created, r.duplicates, a.state, b.state) == (a, (), {}, "backed", "host")
    assert a.dev == own and a.host == {"kv": [0, 1]}
    m = c.match(list("abcd"))
    assert (m.device_node, m.host_nodes, m.host_units) == (a, (b,), 4)


def test_insert_wrong_counts_or_foreign_pages_change_nothing():
    c = CacheCore(src(), {"fh": 8, "swa": 12}, None)
    r = put(c, "ab", ckpt=True)
    own = c.alloc_device({"fh": 1, "swa": 4})
    before = snapshot(c)
    assert own == {"fh": [2], "swa": [4, 5, 6, 7]}
    bad_calls = [  # (arguments, the exact refusal)
        (dict(pages={"fh": [0, 1]}),  # 2 pages for 3 units
         "insert: group 'fh' needs 3 pages for 3 units, got 2"),
        (dict(pages={"fh": [0, 1, own["fh"][0], 7]}),  # 4 pages for 3 units
         "insert: group 'fh' needs 3 pages for 3 units, got 4"),
        (dict(pages={"fh": [0, 1, own["fh"][0]], "swa": own["swa"]}),  # pages for a state group
         "insert: pages given for non-history groups ['swa']"),
        (dict(pages={"fh": [0, 1, 6]}),  # page 6 is free, not the caller's
         "insert: pages [6] of group 'fh' are not held by the caller"),
        (dict(pages={"fh": [1, 0, own["fh"][0]]}),  # tree pages at the wrong positions
         "insert: page 1 of group 'fh' at unit 0 is neither the caller's nor node 1's"),
        (dict(pages={"fh": [0, 1, 0]}),  # a tree page as the caller's own
         "insert: the page table of group 'fh' lists a page twice"),
        (dict(pages={"fh": [0, 1, own["fh"][0]]}, checkpoint={"swa": own["swa"][:3]}),
         "insert: checkpoint of 'swa' needs 4 pages, got 3"),
        (dict(pages={"fh": [0, 1, own["fh"][0]]}, checkpoint={"swa": [8, 9, 10, 11]}),  # free pages
         "insert: pages [8, 9, 10, 11] of group 'swa' are not held by the caller"),
        (dict(pages={"fh": [0, 1, own["fh"][0]]}, checkpoint={"nope": own["swa"]}),
         "insert: checkpoint for unknown state group 'nope'"),
    ]
    for kw, message in bad_calls:
        with pytest.raises(UsageError) as exc:
            c.insert(tuple("abc"), kw["pages"], kw.get("checkpoint"))
        assert str(exc.value) == message
        assert snapshot(c) == before, kw
        c.check_invariants()
    assert r.node.dev == {"fh": [0, 1]}


def test_insert_refuses_a_page_given_twice():
    c = CacheCore(h1(), 4, None)
    own = c.alloc_device({"kv": 1})
    before = snapshot(c)
    with pytest.raises(UsageError, match="^insert: the page table of group 'kv' lists a page twice$"):
        c.insert(("x", "y"), {"kv": own["kv"] * 2})
    assert snapshot(c) == before
    c.check_invariants()
    c2 = CacheCore(src(), {"fh": 4, "swa": 8}, None)
    got = c2.alloc_device({"fh": 1, "swa": 2})
    before = snapshot(c2)
    with pytest.raises(UsageError, match="^insert: the page table of group 'swa' lists a page twice$"):
        c2.insert(("x",), {"fh": got["fh"]}, {"swa": got["swa"] * 2})
    assert snapshot(c2) == before
    c2.check_invariants()


def test_insert_checkpoint_adoption_and_duplicate_checkpoint():
    c = CacheCore(src(), {"fh": 4, "swa": 12}, None)
    r = put(c, "a", ckpt=True)
    assert (r.node.dev_ckpt, r.node.chunk_checkpoint, c.external_pages("swa")) == (
        {"swa": [0, 1, 2, 3]}, False, frozenset())
    got = c.alloc_device({"swa": 4})
    r2 = c.insert(("a",), {"fh": [0]}, got)
    c.check_invariants()
    assert r2.duplicates == {"swa": [4, 5, 6, 7]} and r.node.dev_ckpt == {"swa": [0, 1, 2, 3]}
    c.free_device(r2.duplicates)
    assert free(c) == {"fh": 3, "swa": 8}
    c.check_invariants()


def test_chunk_checkpoint_dropped_by_deeper_one():
    c = CacheCore(src(), {"fh": 8, "swa": 16}, None)
    ra = put(c, "a", ckpt=True, chunk=True)
    a = ra.node
    assert (a.chunk_checkpoint, free(c)) == (True, {"fh": 7, "swa": 12})
    lk = c.lock(a)  # the inserting request's own lock does not keep it
    rb = put(c, "ab", ra.pages, ckpt=True)
    assert (a.dev_ckpt, a.chunk_checkpoint, rb.node.dev_ckpt) == ({}, False, {"swa": [4, 5, 6, 7]})
    assert free(c) == {"fh": 6, "swa": 12}
    c.unlock(lk)
    c.check_invariants()
    assert c.match(list("a")).device_units == 0 and c.match(list("ab")).device_units == 2
    # a final (non-chunk) checkpoint is kept
    rx = put(c, "x", ckpt=True)
    put(c, "xy", rx.pages, ckpt=True)
    # A's dropped checkpoint pages 0-3 are reused (released last, handed out first)
    assert rx.node.dev_ckpt == {"swa": [3, 2, 1, 0]} and free(c) == {"fh": 4, "swa": 4}
    c.check_invariants()


def test_borrowed_chunk_checkpoint_is_not_dropped():
    c = CacheCore(src(), {"fh": 8, "swa": 8}, None)
    ra = put(c, "a", ckpt=True, chunk=True)
    rcpt = c.borrow([ra.node])
    put(c, "ab", ra.pages, ckpt=True)
    assert ra.node.dev_ckpt == {"swa": [0, 1, 2, 3]} and ra.node.chunk_checkpoint
    c.release(rcpt)
    c.check_invariants()


def test_a_second_checkpoint_settles_the_chunk_flag():
    c = CacheCore(src(), {"fh": 4, "swa": 16}, None)
    a = put(c, "a", ckpt=True, chunk=True).node
    for chunk, flag in ((True, True), (False, False), (True, False)):
        got = c.alloc_device({"swa": 4})
        res = c.insert(("a",), {"fh": [0]}, got, chunk_checkpoint=chunk)
        # the first checkpoint stays; a final one only clears the chunk flag
        assert (a.dev_ckpt, a.chunk_checkpoint, res.duplicates) == ({"swa": [0, 1, 2, 3]}, flag, got)
        c.free_device(res.duplicates)
    c.check_invariants()


def test_chunk_checkpoints_shared_or_backed():
    c = CacheCore(src(), {"fh": 8, "swa": 16}, {"fh": 8, "swa": 16})
    ra = put(c, "a", ckpt=True, chunk=True)
    a = ra.node
    ack(c, c.writeback(a))
    assert (a.state, a.chunk_checkpoint) == ("backed", True)
    locks = [c.lock(a, "r1"), c.lock(a, "r2")]  # two requests still use A
    rab = put(c, "ab", ra.pages, ckpt=True)
    assert a.dev_ckpt == {"swa": [0, 1, 2, 3]} and a.chunk_checkpoint  # kept: r2 may need it
    c.unlock(locks.pop())
    put(c, "abc", rab.pages, ckpt=True)
    assert (a.dev_ckpt, a.chunk_checkpoint) == ({}, False)  # backed, one lock: dropped
    c.unlock(locks.pop())
    c.check_invariants()


def test_a_stopped_insert_keeps_its_checkpoint_even_under_a_device_prefix():
    # A = (a) on the device, B = (b) under it loading for r1: an insert of (a, b) with a
    # checkpoint stops at B; the checkpoint is for (a, b), so A must not adopt it.
    c = CacheCore(src(), {"fh": 4, "swa": 16}, {"fh": 4, "swa": 16})
    ra = put(c, "a")
    rb = put(c, "ab", ra.pages, ckpt=True)
    ack(c, c.writeback(rb.node))
    keep = c.lock(ra.node, "keep-a")
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4} and rb.node.state == "host"
    lr = c.load(c.match(list("ab")), "r1")
    got = c.alloc_device({"swa": 4})
    res = c.insert(("a", "b"), {"fh": ra.pages["fh"] + lr.device_pages["fh"][1:]}, got)
    assert (res.node, res.published_units, ra.node.dev_ckpt, res.kept) == (ra.node, 1, {}, got)
    c.free_device(res.kept)
    ack(c, lr.command)
    c.unlock(keep)
    c.check_invariants()


def test_insert_publishes_nothing_beyond_a_loading_node():
    # A = (a, b) loading for r1, B = (c, d) under it still on the host: an insert of the
    # whole prefix stops at A; B is not republished and the caller keeps all its pages.
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab")
    b = put(c, "abcd", a.pages)
    ack(c, c.writeback(b.node))
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    lr = c.load(c.match(list("ab")), "r1")
    own = c.alloc_device({"kv": 2})["kv"]
    res = c.insert(tuple("abcd"), {"kv": lr.device_pages["kv"] + own})
    assert (a.node.state, b.node.state, b.node.dev) == ("loading", "host", {})
    assert (res.published_units, res.created, res.kept) == (0, (), {"kv": own})
    c.free_device(res.kept)
    ack(c, lr.command)
    c.check_invariants()


def test_insert_checkpoint_is_not_a_chunk_checkpoint_by_default():
    c = CacheCore(src(), {"fh": 4, "swa": 8}, None)
    got = c.alloc_device({"fh": 1, "swa": 4})
    res = c.insert(("a",), {"fh": got["fh"]}, {"swa": got["swa"]})  # no chunk_checkpoint argument
    assert res.node.chunk_checkpoint is False
    assert put(c, "ab", ckpt=True, chunk=True).node.chunk_checkpoint is True


def test_insert_refuses_a_checkpoint_missing_a_state_group():
    fh = CacheGroupSpec("fh", Family.HISTORY, 4, 1, (0,), (ComponentSpec("kv", 16),))
    s1 = CacheGroupSpec("s1", Family.STATE, 2, 1, (0,), (ComponentSpec("kv", 8),), window=4)
    s2 = CacheGroupSpec("s2", Family.STATE, 4, 1, (0,), (ComponentSpec("kv", 8),), window=4)
    c = CacheCore(CacheLayout("two-states", (fh, s1, s2), 1), {"fh": 4, "s1": 4, "s2": 4}, None)
    got = c.alloc_device({"fh": 1, "s1": 2})
    before = snapshot(c)
    with pytest.raises(UsageError) as exc:
        c.insert(("a",), {"fh": got["fh"]}, {"s1": got["s1"]})
    assert str(exc.value) == "insert: a checkpoint needs every state group ['s1', 's2'], got ['s1']"
    assert snapshot(c) == before


def test_insert_stops_at_loading_node_and_keeps_caller_pages():
    c, a, b = backed_chain()
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    m = c.match(list("abcd"))
    lr = c.load(m, "r1")
    c.check_invariants()
    assert b.state == "loading" and lr.device_pages == {"kv": [0, 1, 3, 2]}
    own = c.alloc_device({"kv": 1})
    assert own == {"kv": [4]}
    # the caller's table: canonical A, canonical (loading) B, then its own page
    res = c.insert(tuple("abcde"), {"kv": lr.device_pages["kv"] + own["kv"]})
    c.check_invariants()
    assert (res.node, res.published_units, res.created, res.duplicates) == (a, 2, (), {})
    assert res.pages == {"kv": [0, 1]}
    assert res.kept == {"kv": [4]}  # only the caller's own pages; B's pages are the tree's
    c.free_device(res.kept)
    c.check_invariants()
    # the checkpoint of a stopped insert stays the caller's too (src fixture)
    c2 = CacheCore(src(), {"fh": 4, "swa": 12}, {"fh": 4, "swa": 8})
    r = put(c2, "a", ckpt=True)
    ack(c2, c2.writeback(r.node))
    assert c2.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    lr2 = c2.load(c2.match(list("a")), "r1")
    got = c2.alloc_device({"fh": 1, "swa": 4})
    res = c2.insert(("a", "b"), {"fh": lr2.device_pages["fh"] + got["fh"]}, {"swa": got["swa"]})
    c2.check_invariants()
    assert (res.node, res.published_units, res.kept) == (c2.root, 0, {"fh": got["fh"], "swa": got["swa"]})


# ------------------------------------------------------------------ publish: the anchor fast path
def test_an_anchor_whose_pages_are_not_the_callers_is_ignored() -> None:
    """The caller's pages for the anchor's range are its own copies, not the anchor's
    canonical pages: the anchor is ignored, the whole key is walked and those copies come
    back as duplicates."""
    c = CacheCore(h1(), 16)
    n = put(c, keys("a", 4)).node
    lk = c.lock(n, "r")
    mine = c.alloc_device({"kv": 6}, evict=False)["kv"]
    res = c.insert(keys("a", 4) + ("x", "y"), {"kv": mine}, anchor=n)
    assert res.duplicates == {"kv": mine[:4]} and res.kept == {}
    assert res.pages == {"kv": n.dev["kv"] + mine[4:]} and res.published_units == 6
    c.unlock(lk)
    c.check_invariants()


def test_an_anchor_off_the_keys_prefix_is_ignored() -> None:
    """An anchor whose path is not the key's prefix (here: ('x', 'a') against a key that
    starts ('a', 'x', 'a')) is ignored even when the pages match its path: the full walk
    then finds the anchor's pages are not the caller's for that range."""
    import pytest as _pytest

    from kvtier.fsm.errors import UsageError

    c = CacheCore(h1(), 16)
    n = put(c, ("x", "a")).node
    lk = c.lock(n, "r")
    mine = c.alloc_device({"kv": 2}, evict=False)["kv"]
    before = sorted((x.key, x.state) for x in c.nodes())
    with _pytest.raises(UsageError, match="not held by the caller"):
        c.insert(("a", "x", "a", "b"), {"kv": n.dev["kv"] + mine}, anchor=n)
    assert sorted((x.key, x.state) for x in c.nodes()) == before
    c.unlock(lk)
    c.check_invariants()


def test_an_anchor_three_nodes_deep_is_checked_unit_by_unit() -> None:
    """Path ('a',) -> ('b', 'c') -> ('c',): a key ('a', 'b', 'c', 'z', ...) shares the
    first two nodes but not the third (its unit 3 is 'z'), so the anchor is ignored and
    the anchor's last page, not the caller's, is refused."""
    import pytest as _pytest

    from kvtier.fsm.errors import UsageError

    c = CacheCore(h1(), 16)
    put(c, ("a", "b", "c", "c"))
    c.walk(("a", "x"))  # a walk splits where the key diverges
    c.walk(("a", "b", "c", "y"))
    anchor = c.match(("a", "b", "c", "c")).device_node
    assert [x.key for x in reversed(anchor.path())] == [("a",), ("b", "c"), ("c",)]
    lk = c.lock(anchor, "r")
    mine = c.alloc_device({"kv": 2}, evict=False)["kv"]
    with _pytest.raises(UsageError, match="not held by the caller"):
        c.insert(("a", "b", "c", "z", "q", "r"), {"kv": c.device_pages(anchor)["kv"] + mine}, anchor=anchor)
    c.unlock(lk)
    c.check_invariants()


def test_an_anchor_two_nodes_deep_is_checked_at_each_nodes_offset() -> None:
    """Path ('a', 'a') -> ('b',): the key ('a', 'a', 'c', 'b', 'z') has 'b' only at unit 3,
    not at unit 2 where the anchor's second node sits, so the anchor is ignored and the
    anchor's page is refused as not the caller's."""
    import pytest as _pytest

    from kvtier.fsm.errors import UsageError

    c = CacheCore(h1(), 16)
    put(c, ("a", "a", "b"))
    c.walk(("a", "a", "x"))  # a walk splits where the key diverges
    anchor = c.match(("a", "a", "b")).device_node
    assert [x.key for x in reversed(anchor.path())] == [("a", "a"), ("b",)]
    lk = c.lock(anchor, "r")
    mine = c.alloc_device({"kv": 2}, evict=False)["kv"]
    before = sorted((x.key, x.state) for x in c.nodes())
    with _pytest.raises(UsageError, match="not held by the caller"):
        c.insert(("a", "a", "c", "b", "z"), {"kv": c.device_pages(anchor)["kv"] + mine}, anchor=anchor)
    assert sorted((x.key, x.state) for x in c.nodes()) == before
    c.unlock(lk)
    c.check_invariants()


def test_insert_checks_every_history_group_of_a_node_it_walks() -> None:
    """h2(): one unit is 2 ``a`` pages and 1 ``b`` page. The caller's ``a`` pages for the
    existing unit are the canonical ones, its ``b`` page is neither the canonical one nor
    its own: refused, even though ``a`` passed first."""
    import pytest as _pytest
    from core_helpers import h2, snapshot

    from kvtier.fsm.errors import UsageError

    c = CacheCore(h2(), 8)
    n = put(c, ("u",)).node
    mine = c.alloc_device({"a": 2, "b": 1}, evict=False)
    stray = next(p for p in range(8) if p not in n.dev["b"] and p not in mine["b"])
    before = snapshot(c)
    with _pytest.raises(UsageError, match=rf"page {stray} of group 'b' at unit 0 is neither the caller's nor node {n.node_id}'s"):
        c.insert(("u", "v"), {"a": n.dev["a"] + mine["a"], "b": [stray] + mine["b"]})
    assert snapshot(c) == before
    c.check_invariants()
