"""Match and insert (issue 3, "The radix tree and its nodes"): device and host hits,
prefix_reuse vs state_recovery with continuation-state checkpoints (invariant 15),
history_replay, pending host copies, a plain device cache without a host tier, and
insert's duplicates, republish, loading stop, validation and checkpoint rules."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, h2, put, snapshot, src, state

from kvtier.fsm import CacheCore, MatchMode
from kvtier.fsm.errors import KvtierError, UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family


def backed_chain(policy: str = "write_through_selective") -> tuple[CacheCore, object, object]:
    """h1 cache (8 device / 8 host units): A=(a,b) pages 0,1 and B=(c,d) pages 2,3, both backed."""
    c = CacheCore(h1(), 8, 8, policy=policy)
    ra = put(c, "ab")
    ack(c, c.writeback(ra.node))
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    return c, ra.node, rb.node


# ---------------------------------------------------------------------- match
def test_device_hit_then_host_hit_stops_at_first_gap():
    c, a, b = backed_chain()
    rc = put(c, "abcde", {"kv": [0, 1, 2, 3]})
    assert rc.node.dev == {"kv": [4]}
    # C (device only) is dropped, then B (backed) demoted: exactly 3 pages
    assert c.evict_device({"kv": 3}) == {"kv": 3}
    c.check_invariants()
    assert state(c) == {a.node_id: "backed", b.node_id: "host"}
    assert free(c) == {"kv": 6}
    m = c.match(list("abcdef"))
    c.check_invariants()
    assert (m.key_units, m.device_node, m.device_units, m.terminal) == (6, a, 2, b)
    assert (m.host_nodes, m.joined_nodes, m.host_units, m.history_units, m.recompute_tokens) == ((b,), (), 4, 4, 0)
    assert (m.device_tokens, m.hit_tokens, m.needs_loadback, m.alignment) == (4, 8, True, 2)
    # a key diverging inside B splits it and stops at the divergence
    m2 = c.match(list("abcx"))
    c.check_invariants()
    p = b.parent
    assert p is not a and p.parent is a and (p.key, p.state, b.key) == (("c",), "host", ("d",))
    assert (m2.device_node, m2.device_units, m2.host_nodes, m2.terminal, m2.host_units) == (a, 2, (p,), p, 3)


def test_host_hit_only_and_miss():
    c, a, b = backed_chain()
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    c.check_invariants()
    assert state(c) == {a.node_id: "host", b.node_id: "host"}
    m = c.match(list("abcd"))
    assert (m.device_node, m.device_units, m.host_nodes, m.terminal, m.host_units) == (c.root, 0, (a, b), b, 4)
    miss = c.match(list("xyz"))
    assert (miss.device_node, miss.terminal, miss.host_units, miss.history_units, miss.needs_loadback) == (
        c.root, c.root, 0, 0, False)
    c.check_invariants()


def test_match_splits_mid_node_and_exact_boundaries_do_not():
    c, a, b = backed_chain()
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    splits = c.stats.splits
    for key in ("ab", "abcd", "abcdef", "z", ""):
        c.match(list(key))
        c.check_invariants()
    assert c.stats.splits == splits and len(c.nodes()) == 2
    m = c.match(list("abc"))  # ends inside B: B splits at 1 unit
    c.check_invariants()
    assert c.stats.splits == splits + 1 and len(c.nodes()) == 3
    (p,) = [n for n in c.nodes() if n not in (a, b)]
    assert (p.key, p.host, b.key, b.host, b.parent) == (("c",), {"kv": [2]}, ("d",), {"kv": [3]}, p)
    assert (m.host_nodes, m.host_units) == ((a, p), 3)


def test_pending_writeback_invisible_to_host_matching_but_device_matchable():
    # source test 3: PendingHostSnapshotInvisibleUntilWriteBackAck (src fixture: 2 transfers)
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    r = put(c, "a", ckpt=True)
    a = r.node
    assert (a.dev, a.dev_ckpt) == ({"fh": [0]}, {"swa": [0, 1, 2, 3]})
    cmd = c.writeback(a)
    c.check_invariants()
    assert [(t.group, t.src_pages, t.dst_pages) for t in cmd.transfers] == [
        ("fh", (0,), (0,)), ("swa", (0, 1, 2, 3), (0, 1, 2, 3))]
    assert (a.state, a.pending, a.pending_ckpt, a.host, a.host_ckpt) == (
        "writing", {"fh": [0]}, {"swa": [0, 1, 2, 3]}, {}, {})
    assert free(c, "host") == {"fh": 3, "swa": 4}
    m = c.match(list("a"))
    assert (m.device_node, m.device_units, m.host_nodes, m.needs_loadback) == (a, 1, (), False)
    # the writing node can neither be demoted nor dropped, and the reservation is not host-evictable
    assert c.evict_device({"fh": 1}) == {"fh": 0, "swa": 0}
    assert c.evict_host({"fh": 1}) == {"fh": 0, "swa": 0}
    c.check_invariants()
    assert ack(c, cmd)[0].ok
    assert (a.state, a.host, a.host_ckpt, a.pending, a.pending_ckpt) == (
        "backed", {"fh": [0]}, {"swa": [0, 1, 2, 3]}, {}, {})
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    c.check_invariants()
    m = c.match(list("a"), "state_recovery")
    assert (m.device_units, m.host_nodes, m.host_units, m.hit_tokens) == (0, (a,), 1, 4)


def test_no_host_tier_is_a_plain_device_cache():
    for policy in ("write_through", "write_through_selective", "write_back"):
        c = CacheCore(h1(), 3, None, policy=policy)
        assert not c.has_host and c.host is None
        r = put(c, "ab")
        lk = c.lock(r.node)
        c.unlock(lk)
        lk = c.lock(r.node)
        c.unlock(lk)
        assert c.writeback(r.node) is None
        assert c.queued_writebacks() == [] and c.issue_writebacks() == [] and c.poll_commands() == []
        assert c.evict_host({"kv": 1}) == {}
        m = c.match(list("abc"))
        assert (m.device_units, m.host_units, m.needs_loadback) == (2, 2, False)
        with pytest.raises(KvtierError):
            c.load(m)
        # eviction drops (never demotes, never queues a writeback), exactly what is asked
        assert c.evict_device({"kv": 1}) == {"kv": 1}
        c.check_invariants()
        assert [n.key for n in c.nodes()] == [("a",)] and free(c) == {"kv": 2}
        assert c.evict_device({"kv": 1}) == {"kv": 1}
        assert c.nodes() == [] and free(c) == {"kv": 3}
        assert c.poll_commands() == [] and c.operations() == {}
        assert (c.stats.device_evictions, c.stats.demotions, c.stats.writebacks) == (2, 0, 0)


def test_match_mode_validation():
    c = CacheCore(src(), 4, 4)
    with pytest.raises(UsageError, match=r"^match mode must be one of \['prefix_reuse', 'state_recovery'\], got 'sideways'$"):
        c.match(list("a"), "sideways")
    with pytest.raises(UsageError, match="^history_replay applies to prefix_reuse matches only$"):
        c.match(list("a"), MatchMode.STATE_RECOVERY, history_replay=True)


# ---------------------------------------------------------------------- continuation state
def test_prefix_reuse_ends_only_at_exact_checkpoints():
    c = CacheCore(src(), {"fh": 8, "swa": 16}, None)
    ra = put(c, "a", ckpt=True)
    rb = put(c, "abc", ra.pages)  # history only past unit 1
    a, b = ra.node, rb.node
    assert (a.dev_ckpt, b.dev_ckpt) == ({"swa": [0, 1, 2, 3]}, {})
    m = c.match(list("abc"))
    assert (m.device_node, m.device_units, m.terminal, m.host_units, m.history_units) == (a, 1, a, 1, 3)
    assert m.hit_tokens == 4
    # StateRecoveryDoesNotUseEarlierContinuationCheckpoint: miss, not the checkpoint at unit 1
    m = c.match(list("abc"), "state_recovery")
    assert (m.device_node, m.device_units, m.terminal, m.host_units, m.history_units) == (c.root, 0, c.root, 0, 3)
    m = c.match(list("a"), "state_recovery")
    assert (m.device_node, m.device_units) == (a, 1)
    # a key ending beyond the tree: state_recovery misses, prefix_reuse keeps the checkpoint
    assert c.match(list("abcd"), "state_recovery").device_units == 0
    assert c.match(list("abcd")).device_units == 1
    c.check_invariants()
    # the request's terminal checkpoint arrives: both modes hit the whole key
    got = c.alloc_device({"swa": 4})
    r = c.insert(tuple("abc"), {"fh": [0, 1, 2]}, got)
    c.check_invariants()
    assert (r.node, r.duplicates, r.kept, b.dev_ckpt) == (b, {}, {}, {"swa": [4, 5, 6, 7]})
    assert c.match(list("abc"), "state_recovery").device_units == 3
    assert c.match(list("abc")).device_units == 3
    assert c.match(list("ab")).device_units == 1  # splits B; the new fragment has no checkpoint
    c.check_invariants()


def test_prefix_reuse_misses_when_continuation_state_missing():
    # source test 14: history pages without the swa checkpoint -> miss on device and on host
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    a = put(c, "a").node
    m = c.match(list("a"))
    assert (m.device_node, m.device_units, m.host_units, m.history_units) == (c.root, 0, 0, 1)
    ack(c, c.writeback(a))
    assert free(c, "host") == {"fh": 3, "swa": 8}  # nothing to write for swa
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 0}
    c.check_invariants()
    for mode in ("prefix_reuse", "state_recovery"):  # source test 13 for state_recovery
        m = c.match(list("a"), mode)
        assert (m.device_node, m.terminal, m.host_nodes, m.host_units, m.history_units) == (
            c.root, c.root, (), 0, 1)


def test_host_state_recovery_with_exact_terminal_checkpoint():
    # source test 12
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    ra = put(c, "a", ckpt=True)
    rb = put(c, "ab", ra.pages, ckpt=True)
    a, b = ra.node, rb.node
    ack(c, c.writeback(b))  # writes A and B in one op
    assert c.evict_device({"fh": 2}) == {"fh": 2, "swa": 8}
    c.check_invariants()
    m = c.match(list("ab"), "state_recovery")
    assert (m.device_node, m.host_nodes, m.terminal, m.host_units) == (c.root, (a, b), b, 2)
    m = c.match(list("a"), "state_recovery")
    assert (m.host_nodes, m.terminal, m.host_units) == ((a,), a, 1)
    m = c.match(list("abz"))
    assert (m.host_nodes, m.terminal, m.host_units, m.history_units) == ((a, b), b, 2, 2)


def test_history_replay_returns_deeper_history_hit():
    c = CacheCore(src(), {"fh": 8, "swa": 8}, None)
    assert c.layout.replay_span_tokens() == 16  # window 8 on each of 2 layers
    ra = put(c, "a", ckpt=True)
    r = put(c, "abcdefg", ra.pages)
    m = c.match(list("abcdefg"))
    assert (m.device_units, m.history_units, m.recompute_tokens, m.hit_tokens) == (1, 7, 0, 4)
    m = c.match(list("abcdefg"), history_replay=True)
    # 7 units = 28 tokens; recompute 16 to rebuild the state: 12 > 4 tokens from the checkpoint
    assert (m.device_node, m.device_units, m.terminal, m.host_units, m.history_units) == (r.node, 7, r.node, 7, 7)
    assert (m.recompute_tokens, m.hit_tokens) == (16, 12)
    # not worth it: 3 units = 12 tokens - 16 < 4 tokens from the checkpoint
    m = c.match(list("abc"), history_replay=True)
    assert (m.device_units, m.recompute_tokens, m.hit_tokens) == (1, 0, 4)
    # 5 units = 20 tokens - 16 = 4 tokens: not deeper than the checkpoint's 4
    m = c.match(list("abcde"), history_replay=True)
    assert (m.device_units, m.recompute_tokens, m.hit_tokens) == (1, 0, 4)
    m = c.match(list("abcdef"), history_replay=True)
    assert (m.device_units, m.recompute_tokens, m.hit_tokens) == (6, 16, 8)
    c.check_invariants()


def test_history_replay_without_any_checkpoint():
    c = CacheCore(src(), {"fh": 8, "swa": 8}, {"fh": 8, "swa": 8})
    r = put(c, "abcde")
    ack(c, c.writeback(r.node))
    assert c.evict_device({"fh": 5}) == {"fh": 5, "swa": 0}
    assert c.match(list("abcde")).host_units == 0
    m = c.match(list("abcde"), history_replay=True)
    assert (m.device_units, m.host_nodes, m.host_units, m.recompute_tokens, m.hit_tokens) == (
        0, (r.node,), 5, 16, 4)


# ---------------------------------------------------------------------- insert
def test_history_replay_pays_off_from_one_token():
    # one layer with window 7: the replay span is 7 tokens. Two units (8 tokens) of history
    # without any checkpoint give a 1-token hit (recompute 7); one unit (4 tokens) gives none.
    fh = CacheGroupSpec("fh", Family.HISTORY, 4, 1, (0,), (ComponentSpec("kv", 16),))
    swa = CacheGroupSpec("swa", Family.STATE, 2, 1, (0,), (ComponentSpec("kv", 8),), window=7)
    c = CacheCore(CacheLayout("w7", (fh, swa), 1), {"fh": 8, "swa": 8}, None)
    assert c.layout.replay_span_tokens() == 7
    put(c, "ab")
    m = c.match(list("ab"), history_replay=True)
    assert (m.device_units, m.recompute_tokens, m.hit_tokens) == (2, 7, 1)
    m = c.match(list("a"), history_replay=True)
    assert (m.device_units, m.recompute_tokens, m.hit_tokens) == (0, 0, 0)


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


def keys(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


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


def test_keys_equal_but_not_identical_match_inside_a_node() -> None:
    """The radix walk compares units by equality, not only identity: token ids built apart
    (ints above CPython's small-int cache) still match inside a node, where the walk
    compares unit by unit (the query ends inside the node)."""
    c = CacheCore(h1(), 8)
    stored = [int(s) for s in ("1000", "1001", "1002", "1003")]
    put(c, stored)
    query = [int(s) for s in ("1000", "1001", "1002")]
    assert all(a is not b for a, b in zip(stored, query))
    assert c.match(query).device_units == 3
