"""Completion routing: settled operations and layer progress reach the requests that wait.

:class:`CompletionRouter` turns the node core's :class:`~kvtier.fsm.node.ops.Settled` and
:class:`~kvtier.fsm.node.ops.LayerProgress` records into request events (``loadback_ack``,
``loadback_fail``, ``writeback_ack``, ``writeback_fail``) and answers
:meth:`CompletionRouter.layer_ready`.

A loadback that fails (or expires) while the request's forward pass is out sends it to
``fenced``: it lets go of its pins and stops waiting, but keeps its own pages and its lock
until the pass returns (invariant ``forward_fence``); no layer reads as ready from then
on (invariant ``failure_not_success``).
"""

from __future__ import annotations

from ..lifecycle.names import REQUEST_CALL as RC, REQUEST_EVENT as RE, REQUEST_STATE as RS
from ..node.node import DEVICE_READABLE
from ..node.ops import LayerProgress, Settled
from .forward import ForwardResults
from ..records import Direction
from .request import CALLS, Request
from .table import RequestTable

__all__ = ["CompletionRouter"]


class CompletionRouter:
    """Routes the core's completion outcomes to the requests of ``table``."""

    def __init__(self, table: RequestTable, forward: ForwardResults) -> None:
        self.table = table
        self.core = table.core
        self.forward = forward
        self.aborted_by_scheduler = 0

    def on_core_event(self, ev: Settled | LayerProgress) -> None:
        """Apply one outcome of :meth:`complete` / :meth:`advance_step` of the core."""
        t = self.table
        if isinstance(ev, LayerProgress):
            for rid in t.waiters(ev.op_id):
                r = t.get(rid)
                r.layers[ev.op_id] = ev.layer
            return
        t.counters.operation_settled(ev.direction.value, ev.ok, ev.expired)
        for r in t.settled_waiters(ev.op_id):
            if ev.direction is Direction.LOADBACK:
                self._loadback_settled(r, ev.ok)
            else:
                self._writeback_settled(r, ev.ok)

    def _loadback_settled(self, r: Request, ok: bool) -> None:
        t = self.table
        if r.state == RS.aborting:
            if not ok:  # its pass may still be out: keep what its lock holds (forward_fence)
                r.layers_failed = True
                self._keep_held_prefix(r)
            t.fire(r, RE.loadback_ack if ok else RE.loadback_fail)
            return
        if r.state != RS.loading:
            return
        if ok:
            ops = self.core.operations()
            if any(op in ops and ops[op].direction is Direction.LOADBACK for op in r.ops):
                return  # another loadback it joined is still in flight
            for pin in r.pins:
                self.core.release(pin)
            r.pins = []
            t.fire(r, RE.loadback_ack)
            self.forward.publish(r, checkpoint=False)
            return
        # failed: unpin and stop waiting now; the pages stay until any pass out returns
        for pin in r.pins:
            self.core.release(pin)
        r.pins = []
        t.stop_waiting(r)
        r.layers_failed = True
        if not r.settled:
            self._keep_held_prefix(r)
        t.fire(r, RE.loadback_fail)

    def _keep_held_prefix(self, r: Request) -> None:
        """After a failed loadback its table keeps only the canonical pages of the locked
        path's leading device-readable nodes, which its lock holds (the failed nodes'
        destination pages went back to the pool; a joined loadback may still fail)."""
        if r.lock is None:
            return
        keep = dict.fromkeys(r.canon, 0)
        for n in reversed(r.lock.node.path()):
            if n.state not in DEVICE_READABLE:
                break
            for g in keep:
                keep[g] += len(n.dev.get(g, ()))
        for g, k in keep.items():
            r.canon[g] = r.canon[g][:k]
        self.table.set_room(r)

    def _writeback_settled(self, r: Request, ok: bool) -> None:
        t = self.table
        if r.state == RS.retracting and not ok:
            r.reason = "retract writeback failed"
            self.aborted_by_scheduler += 1
        if r.state in (RS.finishing, RS.retracting, RS.aborting):
            t.fire(r, RE.writeback_ack if ok else RE.writeback_fail)

    def layer_ready(self, r: Request, layer: int) -> bool:
        """Whether ``r``'s forward pass may read ``layer``: ``r`` is in a state with readable
        pages, no loadback it waited on failed (settled as failed, or still in flight with a
        failed completion from any rank), and every loadback it waits on has completed that
        layer on every rank (or it waits on none)."""
        if r.state not in CALLS[RC.layer_ready] or r.layers_failed:
            return False
        optable = self.core.optable
        for op_id, done in r.layers.items():
            if done < layer:
                return False
            op = optable.get(op_id)
            if op is not None and not op.ok:  # a rank reported this loadback failed: its pages are garbage
                return False
        return True
