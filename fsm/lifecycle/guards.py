"""The one registry of guard functions, by the names the spec uses.

A guard takes the subject (a radix node or a request record) and returns a bool. The
transitions machines call these same functions as their conditions, and the
lifecycle wrapper calls them to name the guard that rejected an event.

Node guards read these attributes of the node: ``lock_ref``, ``borrow_ref``,
``host_pin`` (ints), ``parent_on_host``, ``parent_on_device``, ``parent_readable``, ``has_device_child``,
``has_host_child`` (bools; the core's node computes them from the tree).
Request guards read ``has_loadback``, ``has_own_writeback`` and ``settled`` (bools).
L3 object guards read ``host_visible``, ``store_answered`` and ``lease_holds`` (bools).
Transfer operation guards read ``handed_out`` (bool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Guard", "NODE_GUARDS", "REQUEST_GUARDS", "L3_GUARDS", "TRANSFER_GUARDS", "GUARDS"]

Guard = Callable[[Any], bool]

NODE_GUARDS: dict[str, Guard] = {
    "parent_on_host": lambda n: bool(n.parent_on_host),
    "parent_on_device": lambda n: bool(n.parent_on_device),
    "parent_readable": lambda n: bool(n.parent_readable),
    "unlocked": lambda n: n.lock_ref == 0,
    "unborrowed": lambda n: n.borrow_ref == 0,
    "unpinned": lambda n: n.host_pin == 0,
    "has_device_child": lambda n: bool(n.has_device_child),
    "has_host_child": lambda n: bool(n.has_host_child),
}

REQUEST_GUARDS: dict[str, Guard] = {
    "has_loadback": lambda r: bool(r.has_loadback),
    "has_own_writeback": lambda r: bool(r.has_own_writeback),
    "settled": lambda r: bool(r.settled),
}

#: L3 object guards (:class:`kvtier.fsm.l3.L3Object` computes them).
L3_GUARDS: dict[str, Guard] = {
    "host_visible": lambda o: bool(o.host_visible),
    "store_answered": lambda o: bool(o.store_answered),
    "lease_holds": lambda o: bool(o.lease_holds),
}

#: Transfer operation guards (:class:`kvtier.fsm.node.ops.Operation` computes them).
TRANSFER_GUARDS: dict[str, Guard] = {
    "handed_out": lambda op: bool(op.handed_out),
}

#: Guards per lifecycle name.
GUARDS: dict[str, dict[str, Guard]] = {"node": NODE_GUARDS, "request": REQUEST_GUARDS, "l3": L3_GUARDS,
                                       "transfer": TRANSFER_GUARDS}
