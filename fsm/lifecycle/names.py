"""Lifecycle names and state sets, built from the spec (``spec/lifecycle.toml``).

Code names states and events through these objects, never as bare strings: a
misspelt name (``NODE_EVENT.demot``) raises :class:`SpecNameError` where it is used,
instead of surfacing later as an :class:`IllegalTransition`. The state sets are derived
from each state's declared ``resources``, so the spec alone says what a state holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..errors import SpecNameError
from .spec import load_spec

__all__ = [
    "Names", "NODE_STATE", "NODE_EVENT", "REQUEST_STATE", "REQUEST_EVENT", "REQUEST_CALL",
    "DEVICE_RESIDENT", "DEVICE_READABLE", "HOST_VISIBLE", "HOST_PENDING", "TERMINAL", "L3_STATE", "L3_EVENT",
    "TRANSFER_STATE", "TRANSFER_EVENT",
]


class Names:
    """A closed set of names: ``names.x`` is ``"x"`` if declared, else :class:`SpecNameError`.

    Args:
        what: what the names are, for messages (e.g. ``"node event"``).
        names: the declared names (each a valid Python identifier).
    """

    def __init__(self, what: str, names: Iterable[str]) -> None:
        object.__setattr__(self, "_what", what)
        declared = tuple(names)
        object.__setattr__(self, "_declared", frozenset(declared))
        for n in declared:
            object.__setattr__(self, n, n)

    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        raise SpecNameError(f"the spec declares no {self._what} {name!r}; declared: {sorted(self._declared)}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self._what} names are read-only")

    def __contains__(self, name: object) -> bool:
        declared: frozenset[str] = object.__getattribute__(self, "_declared")
        return name in declared

    def __iter__(self) -> Iterator[str]:
        declared: frozenset[str] = object.__getattribute__(self, "_declared")
        return iter(sorted(declared))


_SPEC = load_spec()

#: Node-residency states and events.
NODE_STATE = Names("node state", _SPEC.node.state_names)
NODE_EVENT = Names("node event", _SPEC.node.events)
#: Request states and events.
REQUEST_STATE = Names("request state", _SPEC.request.state_names)
REQUEST_EVENT = Names("request event", _SPEC.request.events)
#: Facade calls whose accepted request states the spec declares (``[request.calls]``).
REQUEST_CALL = Names("request call", _SPEC.request.calls)

#: Node states that hold device pages (``device_pages``).
DEVICE_RESIDENT = _SPEC.node.states_holding("device_pages")
#: Node states whose device pages every request may read (``shared_read``).
DEVICE_READABLE = _SPEC.node.states_holding("shared_read")
#: Node states with a visible, acknowledged host copy (``host_pages``).
HOST_VISIBLE = _SPEC.node.states_holding("host_pages")
#: Node states with a pending host reservation being written (``pending_host``).
HOST_PENDING = _SPEC.node.states_holding("pending_host")
#: Request states no transition leaves.
TERMINAL = _SPEC.request.terminal_states

assert _SPEC.l3 is not None
#: L3 object states and events (``[l3]``).
L3_STATE = Names("l3 state", _SPEC.l3.state_names)
L3_EVENT = Names("l3 event", _SPEC.l3.events)

assert _SPEC.transfer is not None
#: Transfer operation states and events (``[transfer]``).
TRANSFER_STATE = Names("transfer state", _SPEC.transfer.state_names)
TRANSFER_EVENT = Names("transfer event", _SPEC.transfer.events)
