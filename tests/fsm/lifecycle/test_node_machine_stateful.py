"""Stateful test of the raw node-residency machine on a small tree of plain nodes.

Random legal and illegal events on random nodes, with locks, borrows and pins taken
and released. After every step: each node's resources agree with what its state
declares in the spec, the host set is root-closed (invariant 1), the device set is
root-closed, and counts are never negative. A refused event changes nothing.
"""

from __future__ import annotations

from hypothesis import settings

from kvtier.testing.machines import NodeLifecycleMachine


class NodeMachineTest(NodeLifecycleMachine):
    """The kit's raw node machine (kvtier.testing.machines.NodeLifecycleMachine)."""


TestNodeMachine = NodeMachineTest.TestCase
TestNodeMachine.settings = settings(TestNodeMachine.settings, max_examples=max(300, TestNodeMachine.settings.max_examples), stateful_step_count=60)
