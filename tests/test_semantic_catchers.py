"""The tests that catch the semantic mutants of issue 12 (tests/broken/make_patches.py,
``SEMANTIC``): realistic lifecycle bugs, each named in the test that catches it.

Every test here passes on the code as it is. ``tests/test_semantic_mutants.py`` applies
each mutant to a temporary copy of the package and checks that its designated tests
(these, a sequence of ``tests/regressions/semantic/`` replayed by
:func:`test_sequence_passes`, or an existing test) then fail.

Layouts: ``h1`` (history ``kv``, 2 tokens per page, alignment 2, 2 layers) and ``src``
(history ``fh`` plus a continuation-state group ``swa`` of 4 pages per checkpoint), from
tests/core_helpers.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from core_helpers import ack, fake_async_engine, h1, put, src
from kvtier.tiered import TieredCache
from kvtier.fsm import CacheCore, Completion, Direction
from kvtier.fsm.node.ops import LayerProgress
from kvtier.testing.sequence import EventSequence, replay

SEMANTIC_SEQUENCES = Path(__file__).parent / "regressions" / "semantic"
_SEQUENCES = sorted(SEMANTIC_SEQUENCES.glob("*.json"))


def test_the_package_under_test_is_the_one_expected() -> None:
    """Run first by tests/test_semantic_mutants.py in a patched copy: proves the copy is imported."""
    import kvtier

    want = os.environ.get("KVTIER_EXPECT_PACKAGE_UNDER")
    assert want is None or kvtier.__file__.startswith(want), (kvtier.__file__, want)


@pytest.mark.parametrize("path", _SEQUENCES, ids=lambda p: p.stem)
def test_sequence_passes(path: Path) -> None:
    """A saved kit sequence (tests/regressions/semantic/) has its expected outcome."""
    seq = EventSequence.load(path)
    result = replay(seq)
    assert result.matches(seq.expect), result.describe() + "\n" + result.detail


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _on_host(core: CacheCore, key: list[str]) -> Any:
    """Publish ``key`` as one node, write it back and demote it: a ``host`` node."""
    node = put(core, key).node
    cmd = core.writeback(node)
    assert cmd is not None
    ack(core, cmd)
    core.poll_commands()
    units = len(key)
    core.evict_device({g: units * p for g, p in core.pages_per_unit.items()})
    assert node.state == "host", node.state
    return node


def _facade_host_hit(world: int = 1, **kw: Any) -> TieredCache:
    """A facade on h1 whose tree holds ``a b`` on the host only (2 units)."""
    cache = TieredCache(h1(), 8, 8, world_size=world, policy="write_back", **kw)
    _on_host(cache.core, ["a", "b"])
    return cache


# ------------------------------------------------------------------------------------------
# node core
# ------------------------------------------------------------------------------------------
def test_deeper_chunk_checkpoint_keeps_one_being_written() -> None:
    """s01: a deeper chunk checkpoint never drops an ancestor's checkpoint that a
    writeback in flight reads (invariant 3)."""
    core = CacheCore(src(), 16, 16, policy="write_back")
    a = put(core, ["a"], ckpt=True, chunk=True).node
    kept = {g: list(p) for g, p in a.dev_ckpt.items()}
    cmd = core.writeback(a)
    assert cmd is not None and a.state == "writing"
    deeper = put(core, ["a", "b"], {"fh": a.dev["fh"]}, ckpt=True, chunk=True).node
    assert deeper.parent is a and a.dev_ckpt == kept, "the checkpoint a writeback reads was dropped"
    ack(core, cmd)
    assert a.state == "backed" and len(a.host_ckpt["swa"]) == 4
    # once written, the next deeper chunk checkpoint may drop it
    put(core, ["a", "b", "c"], {"fh": a.dev["fh"] + deeper.dev["fh"]}, ckpt=True, chunk=True)
    assert a.dev_ckpt == {} and deeper.dev_ckpt == {}


def test_exclusive_host_tier_keeps_pinned_duplicates() -> None:
    """s03: an exclusive host tier drops duplicate (loaded-back) host copies first, but
    never one that is pinned (invariant 4) or has a host child (invariant 9)."""
    core = CacheCore(h1(), 8, 8, policy="write_back", exclusive=True)
    node = _on_host(core, ["a"])
    res = core.load(core.match(["a"]), "r")
    assert res.command is not None
    ack(core, res.command)
    assert node.state == "backed" and node.reloaded and node.host_pin == 1
    freed = core.evict_host({"kv": 1})
    core.check_invariants()
    assert freed == {"kv": 0} and node.state == "backed" and node.host
    core.release(res.pin)
    core.unlock(res.lock)
    assert core.evict_host({"kv": 1}) == {"kv": 1} and node.state == "device"
    core.check_invariants()


def test_split_of_a_loading_node_pins_both_fragments() -> None:
    """s04: cutting a loading node gives the new prefix fragment the loadback's own pin
    too; once the loadback settles no pin is left (invariants 4-6)."""
    core = CacheCore(h1(), 8, 8, policy="write_back")
    node = _on_host(core, ["a", "b"])
    res = core.load(core.match(["a", "b"]), "r")
    assert res.command is not None and node.state == "loading"
    core.match(["a", "c"])  # diverges after one unit: splits the loading node
    prefix = node.parent
    assert prefix is not None and prefix.state == "loading" and prefix.host_pin == 2
    core.check_invariants()
    ack(core, res.command)
    core.release(res.pin)
    assert (prefix.host_pin, node.host_pin) == (0, 0)
    core.check_invariants()


def test_reuse_counts_distinct_requests() -> None:
    """s05: a node's reuse count grows once per distinct request, not per lock."""
    core = CacheCore(h1(), 8, 8, policy="write_through_selective", write_threshold=2)
    node = put(core, ["a"]).node
    for _ in range(3):  # one request re-locking its path at every publish
        core.unlock(core.lock(node, "r1"))
    assert node.hit_count == 1 and core.queued_writebacks() == []
    core.unlock(core.lock(node, "r2"))
    assert node.hit_count == 2 and core.queued_writebacks() == [node.node_id]


def test_lru_goes_by_release_time() -> None:
    """s06: LRU stamps a path when it is released, so the prefix held longest is the
    most recently used."""
    core = CacheCore(h1(), 8)
    a = put(core, ["a"]).node
    b = put(core, ["b"]).node
    la = core.lock(a, "long")
    lb = core.lock(b, "short")
    core.unlock(lb)
    core.unlock(la)  # "long" ran until now
    assert core.evict_device({"kv": 1}) == {"kv": 1}
    assert [n.key for n in core.nodes()] == [("a",)] and b.state != "device"


def test_layer_progress_waits_for_every_rank() -> None:
    """s07: a loadback's layer is ready only when every rank has loaded it."""
    core = CacheCore(h1(), 8, 8, policy="write_back", world_size=2)
    _on_host(core, ["a"])
    res = core.load(core.match(["a"]), "r")
    assert res.command is not None
    op = res.command.op_id
    assert core.complete(Completion(op, 0, True, 1)) == []  # rank 0 is fast
    assert core.optable.layers_done(op) == -1
    assert core.complete(Completion(op, 1, True, 0)) == [LayerProgress(op, 0)]
    assert core.complete(Completion(op, 1, True, 1)) == [LayerProgress(op, 1)]


def test_queued_child_is_issued_after_its_parent() -> None:
    """s08: a node queued while its parent's writeback is in flight waits for it and is
    then issued (nothing queued is lost)."""
    core = CacheCore(h1(), 8, 8, policy="write_through")
    a = put(core, ["a"]).node
    first = core.issue_writebacks()
    assert [c.node_ids for c in first] == [(a.node_id,)]
    b = put(core, ["a", "b"], {"kv": a.dev["kv"]}).node
    assert core.issue_writebacks() == [] and core.queued_writebacks() == [b.node_id]
    ack(core, first[0])
    assert [c.node_ids for c in core.issue_writebacks()] == [(b.node_id,)]


# ------------------------------------------------------------------------------------------
# request lifecycle
# ------------------------------------------------------------------------------------------
def test_layer_ready_is_exact() -> None:
    """s12: after layer 0 of the loadback, layer 0 is readable and layer 1 is not."""
    cache = _facade_host_hit()
    adm = cache.admit("r", ["a", "b"], prompt_tokens=5, chunk_tokens=2)
    assert adm is not None and adm.loadback_op is not None and cache.state("r") == "loading"
    op = adm.loadback_op
    cache.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    assert not cache.layer_ready("r", 0)
    cache.complete(Completion(op, 0, True, 0))
    assert cache.layer_ready("r", 0) and not cache.layer_ready("r", 1)
    cache.complete(Completion(op, 0, True, 1))
    assert cache.layer_ready("r", 1)


def test_joined_loadback_layers_from_the_slowest_rank() -> None:
    """s13: a request joining a loadback in flight reads a layer only once every rank
    loaded it, whatever the fastest rank did before it joined."""
    cache = _facade_host_hit(world=2)
    adm = cache.admit("r0", ["a", "b"], prompt_tokens=5, chunk_tokens=2)
    assert adm is not None and adm.loadback_op is not None
    op = adm.loadback_op
    cache.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    cache.complete(Completion(op, 0, True, 1))  # rank 0 has every layer, rank 1 none
    joined = cache.admit("r1", ["a", "b"], prompt_tokens=5, chunk_tokens=2)
    assert joined is not None and op in joined.wait_ops and cache.state("r1") == "loading"
    assert not cache.layer_ready("r1", 0) and not cache.layer_ready("r0", 0)
    cache.complete(Completion(op, 1, True, 0))
    assert cache.layer_ready("r1", 0) and not cache.layer_ready("r1", 1)


def test_aborted_request_writeback_is_not_published() -> None:
    """s15: an aborted request's own writeback in flight fails whatever its ranks report:
    its KV is never published on the host."""
    cache = TieredCache(h1(), 8, 8, policy="write_back")
    assert cache.admit("r", ["a", "b"], prompt_tokens=4, chunk_tokens=4) is not None
    cache.step_done("r", 4)
    cache.retract("r")
    assert cache.state("r") == "retracting"
    (cmd,) = [c for c in cache.poll().commands if c.direction is Direction.WRITEBACK]
    cache.abort("r")
    cache.complete(Completion(cmd.op_id, 0, True))
    assert cache.state("r") == "aborted"
    assert [n.state for n in cache.core.nodes()] == ["device"]
    cache.check_invariants()


def test_whole_prompt_is_never_reused() -> None:
    """s16: a fully cached, aligned prompt still computes its last unit (the first
    logits come from its last token)."""
    cache = TieredCache(h1(), 8)
    assert cache.admit("r0", ["a", "b"], prompt_tokens=4, chunk_tokens=4) is not None
    cache.step_done("r0", 4)
    cache.finish("r0")
    adm = cache.admit("r1", ["a", "b"], prompt_tokens=4, chunk_tokens=4)
    assert adm is not None and adm.start_token == 2 and adm.chunk_tokens == 2


def test_deferred_frees_wait_for_their_pass() -> None:
    """s18: with overlapped scheduling, the copies a publish gives back are freed only
    after the pass reserved before them returns (invariant 16)."""
    cache = TieredCache(h1(), 16)
    for rid in ("r0", "r1"):  # both compute the same prompt
        assert cache.admit(rid, ["a", "b"], prompt_tokens=5, chunk_tokens=4) is not None
    cache.step_done("r0", 4)  # r0 publishes a b
    mine = set(cache.page_table("r1")["kv"][:2])
    cache.reserve("r1", 1)  # r1's next pass is out before its first one returns
    cache.step_done("r1", 4)  # r1's copies of a b are duplicates now
    deferred = set(cache.request("r1").deferred_pages.get("kv", ()))
    assert deferred == mine and mine <= cache.core.external_pages("kv")
    cache.check_invariants()
    cache.step_done("r1", 1)
    assert not mine & cache.core.external_pages("kv")


def test_overlapped_reserve_starts_after_the_pass_out() -> None:
    """s22: a pass reserved while the previous one is out starts where that one ends."""
    cache = TieredCache(h1(), 16)
    assert cache.admit("r", ["a", "b", "c"], prompt_tokens=7, chunk_tokens=2) is not None
    assert cache.request("r").reserved_tokens == 2
    cache.reserve("r", 2)
    assert cache.request("r").reserved_tokens == 4 and len(cache.page_table("r")["kv"]) == 2
    cache.step_done("r", 2)
    cache.step_done("r", 2)
    assert cache.request("r").tokens == 4


# ------------------------------------------------------------------------------------------
# facade
# ------------------------------------------------------------------------------------------
def test_poll_issues_tree_writebacks_at_quota_one() -> None:
    """s23: with one writeback allowed in flight and none in flight, poll issues the
    queued tree writeback."""
    cache = TieredCache(h1(), 8, 8, policy="write_through", max_writebacks_in_flight=1)
    assert cache.admit("r", ["a"], prompt_tokens=3, chunk_tokens=2) is not None
    cache.step_done("r", 2)
    out = cache.poll()
    assert [c.direction for c in out.commands] == [Direction.WRITEBACK]
    cache.complete(Completion(out.commands[0].op_id, 0, True))
    assert [n.state for n in cache.core.nodes()] == ["backed"]


def test_in_flight_counts_passes_out() -> None:
    """s25: in_flight() is true while a forward result is owed, even with no transfer."""
    cache = TieredCache(h1(), 8)
    assert cache.admit("r", ["a"], prompt_tokens=3, chunk_tokens=2) is not None
    assert cache.in_flight()
    cache.step_done("r", 2)
    assert not cache.in_flight()


# ------------------------------------------------------------------------------------------
# transfer/
# ------------------------------------------------------------------------------------------
def _engine(chunk_layers: int) -> Any:
    return fake_async_engine(chunk_layers)


def _loadback(op: int) -> Any:
    from kvtier.fsm import GroupTransfer, TransferCommand

    return TransferCommand(op, Direction.LOADBACK, (GroupTransfer("kv", (1, 2), (3, 4)),), ())


def test_failed_issue_waits_for_half_issued_copies() -> None:
    """s26: a chunk that raises after part of it was issued fails the op, but the failed
    acknowledgement waits until what was issued has finished (its pages are in use)."""
    eng = _engine(chunk_layers=4)
    fake = eng.backend
    real = fake.run_chunk

    def half_issued(*a: Any, **k: Any) -> Any:
        real(*a, **k)  # the copies are queued on the stream...
        raise RuntimeError("launch failed")  # ...then the issue fails

    fake.run_chunk = half_issued
    eng.submit(_loadback(1))
    eng.flush()
    assert len(fake.pending()) == 1
    assert eng.poll_completions() == [], "the failure was acknowledged with a copy still running"
    fake.complete_all()
    assert eng.poll_completions() == [Completion(1, 0, False)]


def test_layers_are_reported_only_after_their_chunk() -> None:
    """s27: a chunk's layers are reported once that chunk completed, never before."""
    eng = _engine(chunk_layers=4)
    eng.submit(_loadback(1))
    eng.flush()
    assert eng.poll_completions() == []
    eng.backend.complete(1, 0)
    assert eng.poll_completions() == [Completion(1, 0, True, 3)]
    eng.backend.complete_all()
    assert eng.poll_completions() == [Completion(1, 0, True, 7), Completion(1, 0, True)]


def test_wait_layer_waits_for_the_chunk_holding_the_layer() -> None:
    """s28: the first layer of a chunk is readable only once that chunk completed."""
    from kvtier.transfer import NotReadyError

    eng = _engine(chunk_layers=2)
    eng.submit(_loadback(1))
    eng.flush()
    eng.backend.complete(1, 0)
    eng.wait_layer(1, 1)
    with pytest.raises(NotReadyError):
        eng.wait_layer(1, 2)
    eng.backend.complete(1, 1)
    eng.wait_layer(1, 3)


def test_failed_chunk_layers_are_never_reported() -> None:
    """s29: after a chunk's copy fails, neither its layers nor later chunks' are reported."""
    eng = _engine(chunk_layers=2)
    eng.submit(_loadback(1))
    eng.flush()
    eng.backend.complete_next()
    eng.backend.fail_next()
    eng.backend.complete_all()
    assert eng.poll_completions() == [Completion(1, 0, True, 1), Completion(1, 0, False)]
