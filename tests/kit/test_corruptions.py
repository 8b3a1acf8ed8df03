"""The corruptions of the misuse machine (kvtier.testing.corruptions): each one, on
prepared cache states, is caught by the check it names (invariant and message), so the
fuzz's ``corrupt`` rule proves every raising check of fsm/node/invariants.py and fsm/request/fence.py
sees what it claims to."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.fsm import Completion, Direction
from kvtier.fsm.lifecycle.spec import load_spec
from kvtier.testing import _views as views
from kvtier.testing.base import kit_layout
from kvtier.testing.corruptions import (
    CORRUPTIONS,
    GROWN_LEVELS,
    Corruption,
    NotApplicable,
    check_corruptions,
    grown,
    spoiled_copy,
    try_corruption,
)
from kvtier.tiered import TieredCache

VARIANTS = range(4)


def _deliver(c: TieredCache) -> None:
    """Poll and complete every command handed out, successfully."""
    for cmd in c.poll().commands:
        if cmd.direction is Direction.LOADBACK:
            for layer in cmd.layers:
                c.complete(Completion(cmd.op_id, 0, True, layer))
        c.complete(Completion(cmd.op_id, 0, True))


def _serve(c: TieredCache, rid: str, units: Sequence[str], finish: bool = True, deliver: bool = True) -> None:
    """Admit ``rid``, (deliver its loadback,) compute its whole prompt with a
    checkpoint, publish, finish."""
    align = c.layout.alignment
    a = c.admit(rid, list(units), prompt_tokens=len(units) * align + 1, chunk_tokens=8 * align)
    assert a is not None
    if deliver:
        _deliver(c)
    c.step_done(rid, len(units) * align + 1 - a.start_token, checkpoint=True)
    if finish:
        c.finish(rid)


def _node(c: TieredCache, key: str) -> object:
    return next(n for n in views.nodes(c.core).values() if n.key == tuple(key))


def _states() -> dict[str, TieredCache]:
    """Prepared states: ``device`` (one published prefix, no host copy), ``host`` (host
    chains, a backed parent over a device child) and ``busy`` (a loadback and a
    writeback in flight, requests loading, running owing a pass, running settled, and
    finished)."""
    out: dict[str, TieredCache] = {}
    c = TieredCache(kit_layout(True), 32, 16, world_size=1)
    align = c.layout.alignment
    _serve(c, "r0", "abc")
    out["device"] = spoiled_copy(c)
    c.core.writeback(_node(c, "abc"))  # type: ignore[arg-type]
    _deliver(c)
    _serve(c, "r1", "abcde")
    c.core.writeback(_node(c, "de"))  # type: ignore[arg-type]
    _deliver(c)
    _serve(c, "r2", "xy")
    _serve(c, "r3", "xyzw")
    c.core.evict_device({"kv": 10})  # abc and de: host only
    out["host"] = spoiled_copy(c)
    assert c.admit("r4", list("abc"), prompt_tokens=3 * align + 1, chunk_tokens=8 * align) is not None  # loads abc
    assert c.admit("r5", list("xyzwq"), prompt_tokens=5 * align + 1, chunk_tokens=8 * align) is not None
    _serve(c, "r6", "mn", finish=False, deliver=False)
    c.core.writeback(_node(c, "zw"))  # type: ignore[arg-type]
    c.poll()  # the loadback and the writeback are handed out, not completed
    _serve(c, "r7", "pq", deliver=False)
    out["busy"] = c
    small = TieredCache(kit_layout(True), 4, 2, world_size=2)  # the misuse machine's smallest
    for level in range(GROWN_LEVELS):
        out[f"grown{level}"] = grown(small, level)
    return out


STATES = _states()


def test_the_prepared_states_are_what_the_corruptions_need() -> None:
    busy = STATES["busy"]
    nodes = {"".join(map(str, n.key)): n.state for n in views.nodes(busy.core).values()}
    assert nodes == {"abc": "loading", "de": "host", "xy": "backed", "zw": "writing", "mn": "device",
                     "pq": "device"}
    assert sorted(op.direction.value for op in views.ops(busy.core).values()) == ["loadback", "writeback"]
    reqs = {rid: (r.state, r.settled) for rid, r in views.requests(busy).items()}
    assert reqs == {"r4": ("loading", False), "r5": ("running", False), "r6": ("running", True),
                    "r7": ("finished", True)}
    host = {"".join(map(str, n.key)): n.state for n in views.nodes(STATES["host"].core).values()}
    assert host == {"abc": "host", "de": "host", "xy": "backed", "zw": "device"}
    for c in STATES.values():
        c.check_invariants()


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_grown_copies_hold_a_chain_written_back_evicted_and_loading(state: bool, world: int) -> None:
    c = TieredCache(kit_layout(state), 4, 2, world_size=world)
    levels = [{"".join(map(str, n.key)): n.state for n in views.nodes(grown(c, level).core).values()}
              for level in range(GROWN_LEVELS)]
    assert levels == [{}, {"~p": "writing", "~q": "writing", "~d": "device"},
                      {"~p": "backed", "~q": "backed", "~d": "device"}, {"~p": "host", "~q": "host", "~d": "device"},
                      {"~p": "loading", "~q": "host", "~d": "device"}]
    loading = grown(c, 4)
    assert [op.direction.value for op in views.ops(loading.core).values()] == ["loadback"]
    assert {rid: (r.state, r.settled) for rid, r in views.requests(loading).items()} == {
        "~3": ("loading", False), "~4": ("running", True)}
    assert views.nodes(c.core) == {} and not views.requests(c)  # the cache itself: untouched


def test_growth_stops_where_the_copy_is_full() -> None:
    c = TieredCache(kit_layout(False), 4, 2, world_size=1)
    align = c.layout.alignment
    assert c.admit("big", list("abc"), prompt_tokens=3 * align + 1, chunk_tokens=3 * align + 1) is not None
    g = grown(c, 4)  # no room for ~p: it waits, holding nothing
    assert views.nodes(g.core) == {}
    assert {rid: r.state for rid, r in views.requests(g).items()} == {"big": "running", "~1": "waiting"}


def test_every_corruption_names_an_invariant_of_the_spec_once() -> None:
    assert {c.invariant for c in CORRUPTIONS} <= set(load_spec().invariants)
    assert len({c.name for c in CORRUPTIONS}) == len(CORRUPTIONS)


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=[c.name for c in CORRUPTIONS])
def test_each_corruption_is_caught_by_the_check_it_names(corruption: Corruption) -> None:
    applied = []
    for state, cache in STATES.items():
        for v in VARIANTS:
            exc = try_corruption(cache, corruption, v)
            if exc is None:
                continue
            applied.append((state, v))
            assert exc.invariant == corruption.invariant, (state, v, str(exc))
            assert corruption.says in str(exc), (state, v, str(exc))
    assert applied, f"{corruption.name!r} applies to none of the prepared states"


def test_the_cache_itself_is_untouched() -> None:
    for cache in STATES.values():
        before = repr([(n.node_id, n.state, n.dev, n.host, n.lock_ref, n.borrow_ref, n.host_pin)
                       for _, n in sorted(views.nodes(cache.core).items())])
        assert check_corruptions(cache, 0) > 0
        cache.check_invariants()
        after = repr([(n.node_id, n.state, n.dev, n.host, n.lock_ref, n.borrow_ref, n.host_pin)
                      for _, n in sorted(views.nodes(cache.core).items())])
        assert after == before


def test_check_corruptions_counts_those_that_apply() -> None:
    busy = STATES["busy"]
    expected = sum(try_corruption(busy, c, 1) is not None for c in CORRUPTIONS)
    assert check_corruptions(busy, 1) == expected
    assert expected >= len(CORRUPTIONS) - 3  # all but the host chain, no host tier, owed-by-nothing ones


def test_a_layout_without_state_groups_gets_its_checkpoint_checks_on_a_companion() -> None:
    wrong_size = next(c for c in CORRUPTIONS if c.name == "a checkpoint of the wrong size")
    plain = TieredCache(kit_layout(False), 4, 2, world_size=2)
    assert try_corruption(grown(plain, 1), wrong_size, 0) is None  # no state group: nothing to spoil
    assert check_corruptions(plain, 0, [wrong_size]) == 1  # the companion's
    assert check_corruptions(STATES["busy"], 0, [wrong_size]) == 1  # its own only


def test_a_corruption_caught_as_another_invariant_fails_the_rule() -> None:
    first = CORRUPTIONS[0]
    wrong = Corruption(first.name, "conservation", first.says, first.spoil)
    with pytest.raises(AssertionError, match="must violate 'conservation'"):
        check_corruptions(STATES["busy"], 0, [wrong])


def test_a_corruption_nothing_sees_fails_the_rule() -> None:
    def harmless(c: TieredCache, v: int) -> None:
        c.core.tick()

    with pytest.raises(AssertionError, match="went unnoticed"):
        check_corruptions(STATES["busy"], 0, [Corruption("harmless", "conservation", "", harmless)])


def test_a_corruption_that_does_not_apply_is_skipped() -> None:
    def needs_more(c: TieredCache, v: int) -> None:
        raise NotApplicable()

    assert check_corruptions(STATES["busy"], 0, [Corruption("n/a", "conservation", "", needs_more)]) == 0
