"""How a request stops: finish, retract (preempt) and abort.

:class:`Ender` publishes what a finishing or retracted request computed, starts its own
writeback, and lets go of its pages: at once when nothing is owed, else when the last
owed item retires. ``finish`` and ``retract`` are refused while a forward result is owed
(the spec's ``settled`` guard raises :class:`~kvtier.fsm.errors.GuardRejected` naming it,
and nothing changes); ``abort`` is deferred instead (``aborting``). No page a request owns
or reads is released while it owes a forward result or has a transfer in flight
(invariant ``forward_fence``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..lifecycle.names import REQUEST_EVENT as RE
from ..node.node import PageMap
from ..node.ops import Settled
from .forward import ForwardResults
from ..records import Direction, TransferCommand
from .request import Request
from .table import RequestTable

__all__ = ["Ender"]


class Ender:
    """Finish, retract and abort for the requests of ``table``.

    Args:
        table: the request table.
        forward: publishes a request's full units before it stops.
        finish_writeback: write back a finished request's pages that lack a host copy.
    """

    def __init__(self, table: RequestTable, forward: ForwardResults, finish_writeback: bool) -> None:
        self.table = table
        self.core = table.core
        self.forward = forward
        self.finish_writeback = finish_writeback

    def finish(self, r: Request) -> PageMap:
        """Publish, write back its own pages (``finish_writeback``), end; see
        :meth:`kvtier.TieredCache.finish`.

        Raises:
            IllegalTransition: not running; GuardRejected (``settled``): a forward result
                is owed. Nothing changes.
        """
        self.table.check(r, RE.finish)
        adopted = self.forward.publish(r, checkpoint=r.retract_ckpt, final=True)
        cmd = None
        if self.finish_writeback and r.lock is not None and self.core.store.host is not None:
            cmd = self.core.writeback(r.lock.node, r.request_id)  # (no host tier: nothing to write)
        r.has_own_writeback = cmd is not None
        self.table.fire(r, RE.finish)
        self._wait_own(r, cmd)
        return adopted

    def retract(self, r: Request) -> PageMap:
        """Publish full units and the exact continuation state at its terminal, write back
        what resuming needs, free its own pages (no pass is out: it is settled); see
        :meth:`kvtier.TieredCache.retract`.

        Raises:
            IllegalTransition: not running; GuardRejected (``settled``): a forward result
                is owed. Nothing changes.
        """
        self.table.check(r, RE.retract)
        adopted = self.forward.publish(r, checkpoint=True, final=True)
        cmd = self.core.writeback(r.lock.node, r.request_id) if r.lock is not None else None
        r.has_own_writeback = cmd is not None
        self.table.free_own(r)
        r.reserved = r.tokens
        self.table.fire(r, RE.retract)
        self._wait_own(r, cmd)
        return adopted

    def _wait_own(self, r: Request, cmd: TransferCommand | None) -> None:
        """The event's own writeback: ``settled`` was checked before it (the guard is about
        what was owed when the call came); from now on the request waits on it."""
        if cmd is not None:
            self.table.wait(r, cmd.op_id)

    def abort(self, r: Request, reason: str) -> list[Settled]:
        """Abort at once if it owes nothing, else once every forward result and its own
        operations have retired (its own writebacks then count as failed). An own
        writeback whose command ``poll`` has not handed out yet is withdrawn: it fails at
        once and is never handed out; one already handed out is poisoned (it fails
        whatever its ranks report).

        Returns:
            The withdrawn operations' settlements, for the caller to route (after the
            ``abort`` event, so that the request takes them in ``aborting``).

        Raises:
            IllegalTransition: already ended or aborting; nothing changes.
        """
        self.table.check(r, RE.abort)
        r.reason = reason
        ops = self.core.operations()
        own = [op for op in sorted(r.ops) if op in ops and ops[op].direction is Direction.WRITEBACK]
        for op in own:
            self.core.poison(op)
        r.poisoned = True
        self.table.fire(r, RE.abort)
        withdrawn = [self.core.withdraw(op) for op in own]
        return [s for s in withdrawn if s is not None]

    def abort_victim(self, blocked: Sequence[str], reason: str) -> str | None:
        """Abort one deterministic victim among ``blocked`` (the largest token count, ties
        to the smallest id), only when no operation and no forward result is owed by
        anyone; see :meth:`kvtier.TieredCache.abort_victim`.

        Raises:
            UsageError: an unknown request id in ``blocked``.
        """
        victims = [self.table.get(b) for b in blocked]
        if not victims or self.core.operations() or self.table.owes_forward():
            return None
        victim = min(victims, key=lambda r: (-max(r.tokens, r.prompt_tokens), r.request_id))
        self.abort(victim, reason)  # nothing in flight: nothing withdrawn
        return victim.request_id
