"""The raw transfer-operation machine: legal and illegal events fired at the spec's
``[transfer]`` lifecycle directly, on plain records (where its rejections are exercised;
the core and the engine machines drive its transitions on real operations)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.lifecycle.machines import Lifecycle, transfer_lifecycle
from kvtier.fsm.lifecycle.spec import load_spec

from .base import KitMachine, recorded
from .raw_machines import _fire_as_spec_says

__all__ = ["TransferLifecycleMachine"]

_TRANSFER = load_spec().transfer
_EVENTS = _TRANSFER.events if _TRANSFER is not None else ("-",)
_STATES = _TRANSFER.state_names if _TRANSFER is not None else ("-",)


class _RawOperation:
    __slots__ = ("state", "label", "handed_out")

    def __init__(self, label: int) -> None:
        self.state = "in_flight"
        self.label = label
        self.handed_out = False


class TransferLifecycleMachine(KitMachine):
    """Random events with random guard inputs at plain operations driven through the raw
    ``[transfer]`` machine: the result must be exactly the spec's (first candidate whose
    guards hold; otherwise a refusal that changes nothing)."""

    kit_invariants = ("check_states",)

    def __init__(self) -> None:
        super().__init__()
        self.machine: Lifecycle = transfer_lifecycle()
        self.ops = [_RawOperation(i) for i in range(2)]
        self.swept: set[str] = set()

    def _fire(self, index: int, event: str, handed_out: bool) -> None:
        op = self.ops[index % len(self.ops)]
        op.handed_out = handed_out
        if not _fire_as_spec_says(self.machine, op, event, f"operation {op.label}"):
            return
        if op.state not in self.swept:  # once per state per run: every refused event from it
            self.swept.add(op.state)
            for e in self.machine.spec.events:
                if not self.machine.allowed(op.state, e):
                    self._fire(index, e, handed_out)

    @rule(index=st.integers(0, 1), event=st.sampled_from(_EVENTS), handed_out=st.booleans())
    @recorded
    def fire(self, index: int, event: str, handed_out: bool) -> None:
        self._fire(index, event, handed_out)

    @rule(index=st.integers(0, 1), state=st.sampled_from(range(len(_STATES))))
    @recorded
    def jump(self, index: int, state: int) -> None:
        """Put an operation in any state of the spec."""
        self.ops[index % len(self.ops)].state = _STATES[state % len(_STATES)]

    def check_states(self) -> None:
        names = set(self.machine.spec.state_names)
        for op in self.ops:
            if op.state not in names:
                raise InvariantViolation("state_matches_resources", f"operation {op.label}",
                                         f"unknown state {op.state}")
