"""Matching (kvtier.fsm.node.match, ``CacheCore.match``): device and host hits stopping at the
first gap, prefix_reuse vs state_recovery with continuation-state checkpoints (invariant
15), history_replay, pending host copies, a plain device cache without a host tier, and
unit keys compared by equality inside a node."""

from __future__ import annotations

import pytest
from core_helpers import ack, backed_chain, free, h1, put, src, state

from kvtier.fsm import CacheCore, MatchMode
from kvtier.fsm.errors import KvtierError, UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family


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
