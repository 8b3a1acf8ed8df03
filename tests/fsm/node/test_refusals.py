"""Every refusal of the core's public calls: the exact error type and message, and
nothing changed (the scheduler can catch, log and carry on): among them ``walk`` of a key
that is not a sequence of unit keys and ``evict_host`` of unknown groups or bad counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from core_helpers import ack, h1, put, snapshot, src, state

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import ConfigError, DuplicateCompletion, UnknownOperation, UsageError
from kvtier.fsm.records import Completion


def ack_all(c: CacheCore) -> None:
    """Write back every device node and acknowledge it."""
    for n in c.nodes():
        cmd = c.writeback(n)
        if cmd is not None:
            ack(c, cmd)


def refused(c: CacheCore, call: Callable[[], Any], error: type[Exception], message: str) -> None:
    before = snapshot(c)
    with pytest.raises(error) as exc:
        call()
    assert type(exc.value) is error
    assert str(exc.value) == message
    assert snapshot(c) == before
    c.check_invariants()


def test_match_lock_borrow_pin_refusals() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    refused(c, lambda: c.match(list("ab"), "nope"), UsageError,
            "match mode must be one of ['prefix_reuse', 'state_recovery'], got 'nope'")
    refused(c, lambda: c.match(list("ab"), "state_recovery", history_replay=True), UsageError,
            "history_replay applies to prefix_reuse matches only")
    lock = c.lock(a)
    c.unlock(lock)
    refused(c, lambda: c.unlock(lock), UsageError,
            "<lock receipt 2 owner=None node=1> was already released or is unknown (counts_with_receipts)")
    refused(c, lambda: c.pin([a], "r"), UsageError, "pin: nodes [1] have no visible host copy")
    borrow = c.borrow([a], "r")
    c.release(borrow)
    refused(c, lambda: c.release(borrow), UsageError,
            "<borrow receipt 3 owner='r' nodes=[1]> was already released or is unknown (counts_with_receipts)")


def test_insert_refusals() -> None:
    c = CacheCore(h1(), 8, 8)
    put(c, "ab")
    mine = c.alloc_device({"kv": 3})["kv"]
    assert mine == [2, 3, 4]
    refused(c, lambda: c.insert(("q", "r"), {"kv": mine[:1]}), UsageError,
            "insert: group 'kv' needs 2 pages for 2 units, got 1")
    refused(c, lambda: c.insert(("q",), {"kv": mine[:1], "zz": [1]}), UsageError,
            "insert: pages given for non-history groups ['zz']")
    refused(c, lambda: c.insert(("q", "r"), {"kv": [2, 2]}), UsageError,
            "insert: the page table of group 'kv' lists a page twice")
    refused(c, lambda: c.insert(("q",), {"kv": [7]}), UsageError,
            "insert: pages [7] of group 'kv' are not held by the caller")
    refused(c, lambda: c.insert(("a", "b", "c"), {"kv": [7, 1, 2]}), UsageError,
            "insert: page 7 of group 'kv' at unit 0 is neither the caller's nor node 1's")
    refused(c, lambda: c.insert(("a", "b", "c"), {"kv": [0, 7, 2]}), UsageError,
            "insert: page 7 of group 'kv' at unit 1 is neither the caller's nor node 1's")
    refused(c, lambda: c.insert(("q",), {"kv": mine[:1]}, {"swa": [1]}), UsageError,
            "insert: checkpoint for unknown state group 'swa'")


def test_checkpoint_refusals() -> None:
    c = CacheCore(src(), {"fh": 4, "swa": 8}, {"fh": 4, "swa": 8})
    got = c.alloc_device({"fh": 1, "swa": 4})
    refused(c, lambda: c.insert(("a",), {"fh": got["fh"]}, {"swa": got["swa"][:3]}), UsageError,
            "insert: checkpoint of 'swa' needs 4 pages, got 3")
    refused(c, lambda: c.insert(("a",), {"fh": got["fh"]}, {"swa": [got["swa"][0]] * 4}), UsageError,
            "insert: the page table of group 'swa' lists a page twice")


def test_completion_and_loadback_refusals() -> None:
    c = CacheCore(h1(), 8, 8, world_size=2)
    a = put(c, "ab").node
    refused(c, lambda: c.load(c.match(list("ab")), "r"), UsageError, "load: the match has no host hit to load back")
    cmd = c.writeback(a)
    assert cmd is not None and cmd.op_id == 1
    refused(c, lambda: c.complete(Completion(99, 0, True)), UnknownOperation, "completion for op 99: never issued")
    refused(c, lambda: c.complete(Completion(1, 2, True)), UsageError,
            "completion for op 1: rank 2 outside world size 2")
    refused(c, lambda: c.complete(Completion(1, 0, True, layer=0)), UsageError,
            "op 1 is a writeback: layer completions are for loadbacks")
    c.complete(Completion(1, 0, True))
    refused(c, lambda: c.complete(Completion(1, 0, True)), DuplicateCompletion,
            "op 1: completion from rank 0 layer None arrived twice (or after its ack)")
    c.complete(Completion(1, 1, True))
    before = snapshot(c)  # a settled operation's late or duplicate completion is absorbed, counted by op id
    assert c.complete(Completion(1, 1, True)) == [] and c.complete(Completion(1, 0, False)) == []
    assert snapshot(c) == before and c.stats.absorbed_late_completions == 2
    refused(c, lambda: c.complete(Completion(2, 0, True)), UnknownOperation, "completion for op 2: never issued")
    refused(c, lambda: c.poison(99), UnknownOperation, "poison: op 99 is not in flight")
    refused(c, lambda: c.complete(1), UsageError, "complete() takes a Completion, got 1")  # type: ignore[arg-type]
    assert c.evict_device({"kv": 2}) == {"kv": 2} and a.state == "host"
    refused(c, lambda: c.borrow([a], "r"), UsageError, "borrow: nodes [1] have no device pages")
    m = c.match(list("ab"))
    lr = c.load(m, "r")
    assert lr.command.op_id == 2
    refused(c, lambda: c.complete(Completion(2, 0, True, layer=5)), UsageError, "op 2: layer 5 outside 0..1")
    refused(c, lambda: c.complete(Completion(2, 0, True, layer=-1)), ConfigError,
            "completion for op 2: layer must be an int >= 0, got -1")
    c.complete(Completion(2, 0, True, layer=0))
    refused(c, lambda: c.complete(Completion(2, 0, True, layer=0)), DuplicateCompletion,
            "op 2: completion from rank 0 layer 0 arrived twice (or after its ack)")
    refused(c, lambda: c.load(m, "r2"), UsageError,
            "load: match is stale (nodes [1] changed state or were split since the match)")


def test_values_that_are_not_this_trees_nodes_or_receipts_are_refused() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    other = CacheCore(h1(), 8, 8)
    stranger = put(other, "ab").node
    for call, message in [
        (lambda: c.lock(None), "lock: None is not a node of this cache's tree"),  # type: ignore[arg-type]
        (lambda: c.lock(stranger), "lock: <node 1 device depth=2 units=2> is not a node of this cache's tree"),
        (lambda: c.lock(c.root), "lock: <node 0 root depth=0 units=0> is not a node of this cache's tree"),
        (lambda: c.borrow(a), f"borrow takes a list of nodes, got {a!r}"),  # type: ignore[arg-type]
        (lambda: c.borrow([]), "borrow: no nodes given"),
        (lambda: c.pin([None]), "pin: None is not a node of this cache's tree"),  # type: ignore[list-item]
        (lambda: c.pin(None), "pin takes a list of nodes, got None"),  # type: ignore[arg-type]
        (lambda: c.writeback(None), "writeback: None is not a node of this cache's tree"),  # type: ignore[arg-type]
        (lambda: c.release(None), "release takes a pin or borrow receipt (NodeReceipt), got None"),  # type: ignore[arg-type]
        (lambda: c.unlock(None), "unlock takes a LockReceipt, got None"),  # type: ignore[arg-type]
    ]:
        refused(c, call, UsageError, message)
    refused(c, lambda: c.match(None), UsageError,  # type: ignore[arg-type]
            "match: key must be a sequence of unit keys (not a str or bytes), got None")
    # a str or bytes is a sequence of characters, not of unit keys: an engine passing one has a bug
    refused(c, lambda: c.match("ab"), UsageError,
            "match: key must be a sequence of unit keys (not a str or bytes), got 'ab'")
    refused(c, lambda: c.match(b"ab"), UsageError,
            "match: key must be a sequence of unit keys (not a str or bytes), got b'ab'")
    refused(c, lambda: c.insert("q", {"kv": [5]}), UsageError,
            "insert: key must be a non-empty sequence of unit keys (not a str or bytes), got 'q'")
    refused(c, lambda: c.match([["x"]]), UsageError,  # type: ignore[list-item]
            "match: unit keys must be hashable, got ['x']")
    refused(c, lambda: c.insert((), {"kv": []}), UsageError,
            "insert: key must be a non-empty sequence of unit keys (not a str or bytes), got ()")
    refused(c, lambda: c.insert(("q",), [5]), UsageError,  # type: ignore[arg-type]
            "insert: pages must be a mapping group -> page ids, got [5]")


def test_receipts_are_marked_released_and_foreign_ones_refused() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    lock = c.lock(a, "r")
    c.unlock(lock)
    borrow = c.borrow([a], "r")
    c.release(borrow)
    assert (lock.released, borrow.released) == (True, True)
    other = CacheCore(h1(), 8, 8)
    foreign = other.borrow([put(other, "ab").node], "r")
    refused(c, lambda: c.release(foreign), UsageError,
            "<borrow receipt 2 owner='r' nodes=[1]> was already released or is unknown (counts_with_receipts)")
    assert foreign.released is False and a.borrow_ref == 0


def test_a_loading_node_may_be_borrowed() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack_all(c)
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
    assert a.state == "loading"
    receipt = c.borrow([a], "r1")
    assert a.borrow_ref == 1
    c.release(receipt)
    c.check_invariants()
    assert lr.command is not None


def test_insert_over_a_host_node_refuses_a_page_not_the_callers() -> None:
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack_all(c)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and a.state == "host"
    refused(c, lambda: c.insert(("a", "b"), {"kv": [6, 7]}), UsageError,
            "insert: page 6 of group 'kv' at unit 0 is neither the caller's nor node 1's")


@pytest.mark.parametrize("key", ["ab", b"ab", 5, None])
def test_walk_refuses_a_key_that_is_not_a_sequence_of_unit_keys(key: Any) -> None:
    """Was: "ab" walked the units 'a', 'b' and split node ('a', 'b', 'c') silently (b"ab"
    walked ints 97, 98); 5 and None raised a bare TypeError."""
    c = CacheCore(h1(), 8, 8)
    put(c, "abc")
    before = snapshot(c)
    with pytest.raises(UsageError) as exc:
        c.walk(key)
    assert type(exc.value) is UsageError
    assert str(exc.value) == f"walk: key must be a sequence of unit keys (not a str or bytes), got {key!r}"
    assert snapshot(c) == before
    assert [n.key for n in c.nodes()] == [("a", "b", "c")]
    c.check_invariants()
    # the same units as a list are walked, splitting the node where the key ends
    assert [n.key for n in c.walk(list("ab"))] == [("a", "b")]
    c.check_invariants()


@pytest.mark.parametrize("need, message", [
    ({"zz": 1}, "unknown cache group 'zz'; groups: ['kv']"),
    ({"kv": 1, "zz": 1}, "unknown cache group 'zz'; groups: ['kv']"),
    ({"kv": -1}, "page count for group 'kv' must be an int >= 0, got -1"),
    ({"kv": 1.5}, "page count for group 'kv' must be an int >= 0, got 1.5"),
    ({"kv": True}, "page count for group 'kv' must be an int >= 0, got True"),
    ({"kv": "2"}, "page count for group 'kv' must be an int >= 0, got '2'"),
])
@pytest.mark.parametrize("host", [8, None])
def test_evict_host_refuses_unknown_groups_and_bad_counts(need: dict[str, Any], message: str,
                                                          host: int | None) -> None:
    """Was: a bare KeyError for an unknown group ({} with no host tier), {'kv': 0} for
    -1, 1.5 and True, a bare TypeError for '2'. Refused as evict_device refuses them,
    before any eviction: with {"kv": 1, "zz": 1} the host leaf ('a', 'b') stays."""
    c = CacheCore(h1(), 8, host)
    put(c, "ab")
    if host is not None:
        ack(c, c.writeback(c.nodes()[0]))
        assert c.evict_device({"kv": 2}) == {"kv": 2}
        assert state(c) == {1: "host"}
    before = snapshot(c)
    with pytest.raises(UsageError) as exc:
        c.evict_host(need)
    assert type(exc.value) is UsageError
    assert str(exc.value) == message
    assert snapshot(c) == before
    c.check_invariants()
    # the same call with a good need frees the host copy (none without a host tier)
    assert c.evict_host({"kv": 2}) == ({"kv": 2} if host is not None else {})
    assert state(c) == ({} if host is not None else {1: "device"})
    c.check_invariants()
