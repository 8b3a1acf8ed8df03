"""The misuse machine's added hostile calls (kvtier.testing.misuse_cases, issue 12): every
variant of every case, on a prepared live cache (with and without a state group, one and
two ranks), is refused with its error class and a message naming the offending value, and
changes nothing; the machine runs them; and an accepted call, or one refused otherwise,
fails the machine."""

from __future__ import annotations

import pytest

from kvtier.fsm.errors import KvtierError, UsageError
from kvtier.testing.misuse_cases import MORE_CASES, VARIANTS, Variant, run_variant
from kvtier.testing.misuse_machine import CASES, MisuseMachine, fingerprint

ALL = [(name, i) for name, variants in VARIANTS.items() for i in range(len(variants))]


def prepared(state: bool, world: int) -> MisuseMachine:
    """A misuse machine's cache after ordinary calls: a request admitted, its forward pass
    returned, transfers delivered, a node locked and unlocked."""
    m = MisuseMachine()
    m.setup(state=state, world=world, dev_units=6, host_units=4)
    m.admit(req=0, key=["a", "b"])
    m.forward(req=0, finish=False)
    m.pump(ok=True)
    m.use_and_release(i=0, borrow=False)
    m.admit(req=1, key=["a", "b", "c"])
    m.cache.check_invariants()
    return m


@pytest.mark.parametrize(("state", "world"), [(False, 1), (True, 2)])
@pytest.mark.parametrize(("name", "i"), ALL, ids=[f"{n}-{i}" for n, i in ALL])
def test_each_variant_is_refused_naming_the_value_and_changes_nothing(name: str, i: int, state: bool,
                                                                       world: int) -> None:
    m = prepared(state, world)
    variant = VARIANTS[name][i]
    before = fingerprint(m.cache)
    with pytest.raises(KvtierError) as info:
        variant.call(m)
    assert isinstance(info.value, variant.error), repr(info.value)
    assert variant.expected(m) in str(info.value), str(info.value)
    assert fingerprint(m.cache) == before
    m.cache.check_invariants()


def test_the_messages_name_the_values() -> None:
    """Spot checks of whole messages (the fragments above are parts of these)."""
    m = prepared(False, 1)
    expected = {
        ("borrow or pin not a list", 1): "pin takes a list of nodes, got 5",
        ("a page allocator asked directly", 0): "device pool of group 'kv': page count must be an int >= 0, got -1",
        ("a page allocator asked directly", 3): ("invariant 'conservation' violated by device pool of group 'kv': "
                                                 "release of pages that are not allocated (or twice): [1000000]"),
        ("admit with too few unit keys", 0): "request 'hostile': 12 prompt tokens need 3 unit keys, got 1",
        ("free pages of an unknown group", 0): "free_device: unknown cache group 'nogroup'",
        ("an int check with an open lower bound", 0): "hostile: tokens must be an int <= 3, got 'x'",
        ("load a stale match", 0): ("load: match is stale (nodes [1] changed state or were split since the "
                                    "match)"),
    }
    for (name, i), message in expected.items():
        with pytest.raises(KvtierError) as info:
            VARIANTS[name][i].call(m)
        assert str(info.value) == message


def test_the_machine_runs_them() -> None:
    assert CASES[-len(MORE_CASES):] == MORE_CASES
    m = prepared(True, 1)
    start = m.refused
    for k in range(len(CASES) - len(MORE_CASES), len(CASES)):
        for v in range(max(len(x) for x in VARIANTS.values())):
            m._hostile(k, v)
    assert m.refused - start == len(MORE_CASES) * max(len(x) for x in VARIANTS.values())


def test_an_accepted_or_misnamed_refusal_fails_the_machine() -> None:
    m = prepared(False, 1)
    with pytest.raises(AssertionError, match="accepted; expected UsageError"):
        run_variant(m, Variant(lambda m: None, UsageError, "x"))
    with pytest.raises(AssertionError, match="which does not say 'nobody'"):
        run_variant(m, Variant(lambda m: m.cache.core.free_device({"nogroup": [1]}), UsageError, "nobody"))
    with pytest.raises(AssertionError, match="refused with UnknownOperation"):
        run_variant(m, Variant(lambda m: m.cache.core.poison(999), UsageError, "poison"))
