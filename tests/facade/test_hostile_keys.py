"""Generated hostile unit keys, batches and sizes for the facade's inputs.

Families, not single cases: every kind of key whose ``hash``, ``==`` or truth raises x
every call that takes keys (``admit`` fresh and again while waiting, ``step_done``, a
``step`` batch at every position) x a tree that holds keys of the same kind; a unit count or
prompt over ``max_request_tokens`` spelt every way (``range``, list, tuple) refused before
the keys are read; every non-name given to ``preset``. Every refusal asserts the exact
error class, a message naming the value, and that nothing changed (every public view).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hostile_api_helpers import drain, h1, refused, view

from kvtier.fsm import ConfigError, UsageError
from kvtier.fsm.presets import preset
from kvtier.tiered import DEFAULT_MAX_REQUEST_TOKENS, ForwardResult, TieredCache


class Boom(Exception):
    """What a hostile key raises (not a kvtier error, not a TypeError)."""


class RaisingEq:
    """Hashes alike (every lookup collides), ``==`` raises."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise Boom("eq")


class RaisingHash:
    def __hash__(self) -> int:
        raise Boom("hash")


class RaisingForeignEq:
    """Equal to itself; ``==`` with anything else raises."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        raise Boom("foreign eq")


class Truthless:
    def __bool__(self) -> bool:
        raise Boom("bool")


class RaisingTruthEq:
    """``==`` returns an object whose truth raises."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> Any:
        return Truthless()


KEYS: dict[str, tuple[Callable[[], object], str]] = {
    "eq-raises": (RaisingEq, "a unit key's == raised Boom: eq"),
    "hash-raises": (RaisingHash, "a unit key's hash raised Boom: hash"),
    "foreign-eq-raises": (RaisingForeignEq, "a unit key's == raised Boom: foreign eq"),
    "truth-of-eq-raises": (RaisingTruthEq, "a unit key's == raised Boom: bool"),
    "tuple-holding-eq-raises": (lambda: ("t", RaisingEq()), "a unit key's == raised Boom: eq"),
}


def warm(kind: str) -> TieredCache:
    """A cache whose tree holds ``abcd`` and whose ``w`` waits (pages short); ``x``, ``y``
    and ``z`` run with a 3-token pass owed."""
    c = TieredCache(h1(), 12, 16, policy="write_through")
    c.admit("seed", list("abcd"), 9, 9)
    c.step_done("seed", 9)
    c.finish("seed")
    drain(c)
    for rid in "xyz":
        assert c.admit(rid, [rid], 3, 3) is not None
    assert c.admit("w", list("abcdefgh"), 17, 17) is None  # short of device pages: waiting
    assert c.state("w") == "waiting"
    return c


@pytest.mark.parametrize("kind", sorted(KEYS))
@pytest.mark.parametrize("at", [0, 1, 3])
def test_admit_refuses_a_key_whose_hash_or_eq_raises(kind: str, at: int) -> None:
    make, fragment = KEYS[kind]
    c = warm(kind)
    keys: list[object] = list("abcd")
    keys.insert(at, make())
    refused(c, lambda: c.admit("n", keys, 9, 9), UsageError, "request 'n': units", fragment)
    assert "n" not in [v.request_id for v in c.requests()]  # not left tracked in waiting
    # and again for a request already waiting: it stays waiting, its keys as they were
    refused(c, lambda: c.admit("w", keys, 9, 9), UsageError, "request 'w': units", fragment)
    assert c.state("w") == "waiting" and c.unit_keys("w") == tuple("abcdefgh")


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_step_done_refuses_a_new_unit_whose_hash_or_eq_raises(kind: str) -> None:
    make, fragment = KEYS[kind]
    c = warm(kind)
    refused(c, lambda: c.step_done("x", 3, new_units=[make()]), UsageError, "step_done new_units", fragment)
    assert c.request("x").owed_forward == 1


@pytest.mark.parametrize("kind", sorted(KEYS))
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_batch_never_escapes_half_applied(kind: str, at: int) -> None:
    """The hostile item is refused before it changes anything, with its error in the
    outcome; the others are applied exactly as in a batch without it."""
    make, fragment = KEYS[kind]
    c, plain = warm(kind), warm(kind)
    items = [ForwardResult(rid, 3) for rid in "xyz"]
    bad = items.copy()
    bad[at] = ForwardResult("xyz"[at], 3, (make(),))
    out = c.step(results=bad)
    assert out.result_status == tuple("refused" if i == at else "ok" for i in range(3))
    err = out.errors[("results", at)]
    assert type(err) is UsageError and fragment in str(err), str(err)
    assert c.request("xyz"[at]).owed_forward == 1
    expected = plain.step(results=[f for i, f in enumerate(items) if i != at])
    assert expected.ok
    assert view(c) == view(plain)
    c.check_invariants()


@pytest.mark.parametrize("units", [range(10**8), range(10**12)], ids=["1e8", "1e12"])
def test_admit_refuses_too_many_units_before_reading_them(units: range) -> None:
    c = warm("eq-raises")
    limit = DEFAULT_MAX_REQUEST_TOKENS // 2
    tracemalloc.start()
    try:
        refused(c, lambda: c.admit("n", units, 9, 9), UsageError,  # type: ignore[arg-type]
                f"{len(units)} unit keys, more than max_request_tokens {DEFAULT_MAX_REQUEST_TOKENS} "
                f"holds ({limit} units of 2 tokens)")
        assert tracemalloc.get_traced_memory()[1] < 50_000_000
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("limit", [2, 9, 64])
@pytest.mark.parametrize("spelling", [list, tuple, range])
def test_max_request_tokens_bounds_prompt_and_units_inclusively(limit: int, spelling: Callable[[int], Any]) -> None:
    c = TieredCache(h1(), 64, 64, max_request_tokens=limit)
    units = limit // 2
    keys = spelling(range(units)) if spelling is not range else range(units)
    assert c.admit("ok", keys, max(1, units * 2), 1) is not None  # at the limit: accepted
    refused(c, lambda: c.admit("n", list(range(units + 1)), 1, 1), UsageError,
            f"{units + 1} unit keys, more than max_request_tokens {limit}")
    refused(c, lambda: c.admit("n", [], limit + 1, 1), UsageError,
            f"prompt_tokens {limit + 1} above max_request_tokens {limit}")


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", None, True], ids=repr)
def test_max_request_tokens_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        TieredCache(h1(), 8, 8, max_request_tokens=bad)  # type: ignore[arg-type]
    assert type(info.value) is ConfigError and f"max_request_tokens must be an int >= 1, got {bad!r}" in str(info.value)


@pytest.mark.parametrize("name", [["llama-3-8b"], None, 5, b"llama-3-8b", ("llama-3-8b",), {"a": 1}], ids=repr)
def test_preset_refuses_a_name_that_is_not_a_str(name: object) -> None:
    with pytest.raises(ConfigError) as info:
        preset(name)  # type: ignore[arg-type]
    assert type(info.value) is ConfigError
    assert f"model preset must be a name (str), one of ['deepseek-v3', 'deepseek-v4', 'llama-3-8b'], got {name!r}" \
        in str(info.value)


class Picky:
    """Passes the probe (equal to itself, False against a foreign object) but raises when
    compared with another Picky: only the radix tree's own comparison finds it."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        if other is self or not isinstance(other, Picky):
            return other is self
        raise Boom("picky")


@pytest.mark.parametrize("waiting", [False, True])
def test_admit_undoes_its_record_when_the_tree_finds_a_raising_key(waiting: bool) -> None:
    """A key the probe passes that raises in the tree's match: the match changes nothing
    before its last comparison, and admit puts the request's record back as it was."""
    c = TieredCache(h1(), 12, 16, policy="write_through")
    c.admit("seed", [Picky(), "b"], 5, 5)
    c.step_done("seed", 5)
    c.finish("seed")
    drain(c)
    rid = "w" if waiting else "n"
    if waiting:
        c.admit("x", list("xyzuv"), 11, 11)  # holds the device: w waits
        assert c.admit("w", list("abcdefgh"), 17, 17) is None and c.state("w") == "waiting"
    refused(c, lambda: c.admit(rid, [Picky(), "b"], 5, 5), UsageError,
            f"request {rid!r}: a unit key raised Boom in the radix tree: picky")
    if waiting:
        assert c.state("w") == "waiting" and c.unit_keys("w") == tuple("abcdefgh")
    else:
        assert "n" not in [v.request_id for v in c.requests()]


class Unreadable(list):  # type: ignore[type-arg]
    """A list of keys whose iteration raises."""

    def __iter__(self) -> Any:
        raise Boom("iter")


@pytest.mark.parametrize("call", ["admit", "step_done"])
def test_keys_that_cannot_be_read_are_refused(call: str) -> None:
    c = warm("eq-raises")
    keys = Unreadable("abcd")
    if call == "admit":
        refused(c, lambda: c.admit("n", keys, 9, 9), UsageError, "the unit keys could not be read: Boom: iter")
    else:
        refused(c, lambda: c.step_done("x", 3, new_units=keys), UsageError,
                "step_done new_units: the unit keys could not be read: Boom: iter")
