"""Exact values of fsm/ that the mutation run (bench/mutation, issue 12) left unchecked in
``spec.py``, ``checks.py``, ``fetch.py``, ``l3options.py``, ``l3checks.py`` and ``errors.py``,
session 6 (helper G): the defaults of the public spec records (``LifecycleSpec.calls`` is an
empty dict, ``Specification.l3`` is None and adds no lifecycle), and the exact text of the
spec's refusals."""

from __future__ import annotations

import pytest

from kvtier.fsm import ConfigError
from kvtier.fsm.spec import LifecycleSpec, Specification, load_spec, parse_spec
from test_spec import MINIMAL


# ------------------------------------------------------------------ spec.py
def test_a_lifecycle_built_without_calls_accepts_no_call() -> None:
    """spec.py:84: ``LifecycleSpec.calls`` defaults to an empty dict (``[<lifecycle>.calls]``
    may be absent), a fresh one per record."""
    node = load_spec().node
    a = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial,
                      node.states, node.transitions, node.guards, node.resources)
    b = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial,
                      node.states, node.transitions, node.guards, node.resources)
    assert a.calls == {} and type(a.calls) is dict
    assert a.calls is not b.calls


def test_a_specification_built_without_l3_has_two_lifecycles() -> None:
    """spec.py:138: ``Specification.l3`` defaults to None (a spec without ``[l3]``), and
    ``lifecycles`` then holds only the node and request lifecycles."""
    full = load_spec()
    spec = Specification(full.version, full.node, full.request, full.invariants)
    assert spec.l3 is None
    assert spec.lifecycles == (full.node, full.request)
    assert full.l3 is not None and full.lifecycles == (full.node, full.request, full.l3)


def test_a_call_naming_an_undeclared_state_is_refused_with_the_exact_message() -> None:
    """spec.py:180: the whole message, naming the lifecycle, the call and the state."""
    text = MINIMAL.replace('[request.guards.ok]\ndoc = "G"\n',
                           '[request.guards.ok]\ndoc = "G"\n\n[request.calls]\nreserve = ["a", "zz"]\n')
    with pytest.raises(ConfigError) as exc:
        parse_spec(text)
    assert str(exc.value) == "spec [request]: call 'reserve' lists undeclared state 'zz'"
