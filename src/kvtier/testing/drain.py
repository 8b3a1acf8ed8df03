"""The drain every example of the kit's machines ends with (:meth:`KitMachine.kit_drain`).

After the last step a machine completes or fails every transfer and store operation it has
in flight, finishes or aborts every request and releases every receipt its own rules took;
then :func:`check_core_drained` requires that nothing is held, in flight or queued on any
tier (operations, commands, locks, pins, borrows, device pages outside the tree, host pages
reserved by L3 gets), :func:`check_l3_drained` the same of an L3 tier
(store operations, unpolled commands, prefetches, put pins; with leases ended), and
:func:`evict_to_full_pools` that the whole tree can be evicted: every device and host pool
is then back at its capacity. A leak of one receipt, pin, lease or page fails here as
``model_drain``, naming what was left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.fsm import CacheCore
from kvtier.fsm.l3 import L3Tier

from . import _views as views
from .models import ModelViolation, liveness_bound

__all__ = ["check_core_drained", "check_l3_drained", "evict_to_full_pools", "core_left"]


def core_left(core: CacheCore) -> dict[str, Any]:
    """What ``core`` still holds or owes, by kind (empty when drained)."""
    left: dict[str, Any] = {
        "operations": sorted(views.ops(core)),
        "commands": sorted(c.op_id for c in views.outbox(core)),
        "locks": sorted(views.locks(core)),
        "pins and borrows": sorted(views.receipts(core)),
        "device pages outside the tree": {g: sorted(core.external_pages(g)) for g in core.device
                                          if core.external_pages(g)},
        "reserved host pages (L3 gets)": sorted(op for op, _ in core.fetches.items()),
        "held or moving nodes": sorted(n.node_id for n in views.nodes(core).values()
                                       if (n.lock_ref, n.borrow_ref, n.host_pin) != (0, 0, 0)
                                       or n.state not in ("device", "backed", "host")),
    }
    return {k: v for k, v in left.items() if v}


def check_core_drained(core: CacheCore, subject: str) -> None:
    """Raise ``model_drain`` if ``core`` holds or owes anything (:func:`core_left`)."""
    left = core_left(core)
    if left:
        raise ModelViolation("model_drain", subject, f"after the drain: {left}")


def check_l3_drained(tier: L3Tier, subject: str) -> None:
    """Raise ``model_drain`` if ``tier`` holds or owes anything, leases included (the drain
    ends them with ``expire(inf)`` first)."""
    out = tier.outstanding()
    if not out.quiescent or out.leases or tier.objects:
        raise ModelViolation("model_drain", subject, f"after the drain: {out}, objects {sorted(tier.objects)}")


def evict_to_full_pools(core: CacheCore, settle: Callable[[], None], subject: str) -> None:
    """Evict the whole tree: rounds of "evict every device page, ``settle`` (issue the
    writebacks that queued and complete every transfer successfully), evict every device
    page again, evict every host-only copy (every host copy once the device is empty)",
    until the tree is empty; then no writeback may be queued and every device and host pool
    must be at its capacity (a writeback queued for lack of host room is cache work, not a
    leak, until its node is gone)."""
    everything = {g: a.capacity for g, a in core.device.items()}
    for _ in range(liveness_bound(len(views.nodes(core))) + 2):
        if not views.nodes(core):
            break
        core.evict_device(everything)  # demotes backed nodes; queues the writebacks write_back needs
        settle()
        core.evict_device(everything)  # demotes what those writebacks backed
        if core.host is not None:  # host-only copies go; backed ones wait for their demotion
            device_empty = all(a.free == a.capacity for a in core.device.values())
            core.evict_host({g: a.capacity for g, a in core.host.items()}, host_only=not device_empty)
    left = sorted(f"{n.node_id} ({n.state})" for n in views.nodes(core).values())
    left += [f"queued writeback of {nid}" for nid in sorted(views.writeback_queue(core))]
    short = {f"{tier} {g}": f"{a.free}/{a.capacity}" for tier, pools in (("device", core.device),
                                                                      ("host", core.host or {}))
             for g, a in pools.items() if a.free != a.capacity}
    if left or short:
        raise ModelViolation("model_drain", subject, f"the tree could not be evicted to full pools: nodes left "
                                                     f"{left}, pools not full (free/capacity) {short}")
