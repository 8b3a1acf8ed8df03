"""The error hierarchy: exact messages and attributes, so a scheduler can log and branch on them."""

from __future__ import annotations

import pytest
from transitions import MachineError

from kvtier.fsm.errors import (
    CapacityError,
    ConfigError,
    DuplicateCompletion,
    GuardRejected,
    IllegalTransition,
    InvariantViolation,
    KvtierError,
    LifecycleError,
    SpecNameError,
    UnknownOperation,
    UsageError,
)


def test_illegal_transition_names_everything() -> None:
    e = IllegalTransition("node", "node 7", "host", "demote")
    assert (e.lifecycle, e.subject, e.state, e.event) == ("node", "node 7", "host", "demote")
    assert str(e) == ("node 7: event 'demote' refused in state 'host': "
                      "the node lifecycle has no transition for this event from this state")
    assert isinstance(e, LifecycleError) and isinstance(e, MachineError) and isinstance(e, KvtierError)


def test_guard_rejected_lists_its_guards() -> None:
    e = GuardRejected("request", "request 'r1'", "running", "finish", ("settled", "!has_loadback"))
    assert e.guards == ("settled", "!has_loadback")
    assert (e.lifecycle, e.subject, e.state, e.event) == ("request", "request 'r1'", "running", "finish")
    assert str(e) == ("request 'r1': event 'finish' refused in state 'running': "
                      "guard 'settled' and '!has_loadback' rejected it")
    one = GuardRejected("node", "node 2", "device", "evict", ("unlocked",))
    assert str(one).endswith(": guard 'unlocked' rejected it")


def test_invariant_violation_message_and_attributes() -> None:
    e = InvariantViolation("conservation", "device pool 'kv'", "3 pages lost")
    assert (e.invariant, e.subject) == ("conservation", "device pool 'kv'")
    assert str(e) == "invariant 'conservation' violated by device pool 'kv': 3 pages lost"
    assert isinstance(e, AssertionError) and isinstance(e, KvtierError)


def test_unknown_operation_prints_its_message_not_a_key_repr() -> None:
    assert str(UnknownOperation("op 9 was never issued")) == "op 9 was never issued"
    assert str(UnknownOperation()) == "unknown operation"
    assert isinstance(UnknownOperation(), KeyError)


def test_capacity_error_names_pool_group_and_counts() -> None:
    e = CapacityError("host", "kv", 5, 2)
    assert (e.pool, e.group, e.needed, e.free) == ("host", "kv", 5, 2)
    assert str(e) == "host pool of cache group 'kv': need 5 pages, 2 free"


@pytest.mark.parametrize("cls, base", [(ConfigError, ValueError), (DuplicateCompletion, ValueError),
                                       (CapacityError, KvtierError), (LifecycleError, KvtierError),
                                       (UsageError, ValueError), (SpecNameError, AttributeError)])
def test_errors_keep_their_builtin_bases(cls: type, base: type) -> None:
    assert issubclass(cls, base) and issubclass(cls, KvtierError)


def test_usage_configuration_and_spec_name_errors_are_distinct() -> None:
    """Misuse of a call is a UsageError, a bad configuration a ConfigError, a misspelt
    lifecycle name a SpecNameError; none of them catches another, none is a lifecycle refusal."""
    kinds = (UsageError, ConfigError, SpecNameError)
    for a in kinds:
        for b in kinds:
            assert issubclass(a, b) == (a is b)
        assert not issubclass(a, LifecycleError) and not issubclass(a, MachineError)
    assert str(UsageError("reserve: tokens must be an int >= 0, got -1")) == "reserve: tokens must be an int >= 0, got -1"
