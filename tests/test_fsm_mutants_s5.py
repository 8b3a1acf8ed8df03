"""Exact values of fsm/ that the mutation run (bench/mutation, issue 12) found unchecked,
session 5: withdrawals counted one each, device eviction under ``write_back`` summing the
pages it pledged, and host-only host eviction sparing a ``backed`` node unless the host
tier is exclusive *and* the node was loaded back; admission with history replay reserving
nothing for a chunk that ends inside the replay span, and a chunk checkpoint skipped, not
evicted for, when the device pool is full."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, put, src, state

from kvtier.fsm import CacheCore
from kvtier.tiered import TieredCache


def keys(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


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


# ------------------------------------------------------------------ host_only eviction
@pytest.mark.parametrize("exclusive", [False, True])
def test_host_only_eviction_spares_a_backed_node_that_was_never_loaded_back(exclusive: bool) -> None:
    c = CacheCore(h1(), 8, 8, policy="write_through", exclusive=exclusive)
    n = put(c, keys("a", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    assert (n.state, n.reloaded, c.exclusive) == ("backed", False, exclusive)
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}
    assert n.state == "backed" and n.host == {"kv": [0, 1]} and c.stats.host_drops == 0
    assert c.evict_host({"kv": 2}) == {"kv": 2}  # without host_only it is dropped
    assert n.state == "device" and c.stats.host_drops == 1
    c.check_invariants()


@pytest.mark.parametrize("exclusive", [False, True])
def test_host_only_eviction_drops_a_reloaded_copy_only_when_exclusive(exclusive: bool) -> None:
    c = CacheCore(h1(), 4, 4, policy="write_through", exclusive=exclusive)
    hot = put(c, keys("h", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and hot.state == "host"
    load = c.load(c.match(keys("h", 2)), "r1")
    assert load.command is not None
    ack(c, load.command)
    c.release(load.pin)
    c.unlock(load.lock)
    assert (hot.state, hot.reloaded) == ("backed", True)
    assert c.evict_host({"kv": 2}, host_only=True) == ({"kv": 2} if exclusive else {"kv": 0})
    assert hot.state == ("device" if exclusive else "backed")
    assert c.stats.host_drops == (1 if exclusive else 0)
    c.check_invariants()


# ------------------------------------------------------------------ request lifecycle
def _pools(c: TieredCache) -> dict[str, int]:
    return {g: a.free for g, a in c.core.device.items()}


def test_history_replay_chunk_inside_the_span_reserves_no_history_page() -> None:
    """src(): align 4, span 16. B's history hit is 7 units (28 tokens), it starts at 12
    (28 - 16) and its chunk of 4 tokens ends at 16, well inside the 7 pages it reads:
    its need for ``fh`` is 4 - 7 < 0 pages, so it takes none (only its 4 ``swa`` state
    pages)."""
    c = TieredCache(src(), 32, None, history_replay=True)
    a = c.admit("A", list("abcdefgh"), prompt_tokens=33, chunk_tokens=33)
    assert a is not None
    c.step_done("A", a.chunk_tokens, checkpoint=True)
    c.finish("A")
    assert _pools(c) == {"fh": 24, "swa": 28}
    b = c.admit("B", list("abcdefgz"), prompt_tokens=33, chunk_tokens=4)
    assert b is not None
    assert (b.start_token, b.chunk_tokens, b.recompute_tokens, b.history_hit_tokens) == (12, 4, 16, 28)
    assert b.page_table == {"fh": [0, 1, 2, 3, 4, 5, 6], "swa": [3, 2, 1, 0]}
    assert c.request("B").own_pages == {"swa": [3, 2, 1, 0]}
    assert _pools(c) == {"fh": 24, "swa": 24}
    c.check_invariants()


def test_a_chunk_checkpoint_is_skipped_not_evicted_for_when_the_device_is_full() -> None:
    """B's pass asks for a checkpoint with every ``swa`` page taken (A's published
    checkpoint and B's own state pages): publishing skips the checkpoint rather than
    evict A's unlocked node for it."""
    c = TieredCache(src(), {"fh": 32, "swa": 8}, None)
    a = c.admit("A", list("abcd"), prompt_tokens=17, chunk_tokens=17)
    assert a is not None
    assert c.step_done("A", 17, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.finish("A")
    b = c.admit("B", list("wxyz"), prompt_tokens=17, chunk_tokens=17)
    assert b is not None and b.page_table == {"fh": [4, 5, 6, 7, 8], "swa": [3, 2, 1, 0]}
    assert _pools(c) == {"fh": 23, "swa": 0}
    assert c.step_done("B", 17, checkpoint=True) == {}
    nodes = {n.key: (n.dev, n.dev_ckpt) for n in c.core.nodes()}
    assert nodes == {tuple("abcd"): ({"fh": [0, 1, 2, 3]}, {"swa": [4, 5, 6, 7]}),
                     tuple("wxyz"): ({"fh": [4, 5, 6, 7]}, {})}
    assert _pools(c) == {"fh": 23, "swa": 0}
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
