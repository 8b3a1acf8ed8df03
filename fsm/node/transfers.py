"""Operations on the node side: starting a loadback (host to device) or a writeback
(device to host), each validated and reserved all or nothing before any node event fires
(invariant ``atomic_admission``), handing their commands out, and ending them (a completion, a withdrawal
or a deadline settles one) through the nodes' events.

A deadline cannot stop a copy an engine already runs, so an operation that expires after
its command was handed out is *fenced* (spec ``[transfer]``; invariant ``copy_fence``): its
nodes and requests take the failure at once, but its destination pages stay with the
operation, off every free list, and its source pages stay pinned (a loadback: its own pin)
or borrowed (a writeback), until every rank's engine confirms the copy ended (its late
acknowledgement, ok or failed); only then do they go back to their pools, exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import CapacityError, UsageError
from .match import MatchResult, has_checkpoint
from ..lifecycle.machines import transfer_lifecycle
from ..lifecycle.names import DEVICE_READABLE, HOST_VISIBLE, NODE_EVENT as EV, NODE_STATE as NS
from ..lifecycle.names import TRANSFER_EVENT as TE
from .node import Node, PageMap
from .ops import LayerProgress, Operation, Settled
from .optable import ABSORBED, PENDING
from ..records import Completion, Direction, GroupTransfer, TransferCommand
from .reclaim import Reclaimer
from .results import LoadResult
from .store import NodeStore
from .writeback import WritePolicy

__all__ = ["Mover"]

_Transfers = dict[str, tuple[list[int], list[int]]]


class Mover:
    """``load`` and writeback submission over one node core's ``store``; ``reclaimer``
    makes room for them (device eviction before a loadback, host eviction before a writeback)."""

    def __init__(self, store: NodeStore, reclaimer: Reclaimer) -> None:
        self.store = store
        self.reclaimer = reclaimer
        self.outbox: list[TransferCommand] = []  # commands not yet handed out by poll_commands
        self._layers: tuple[int, ...] = tuple(range(store.layout.num_layers))  # every command moves every layer

    # -- loadback ------------------------------------------------------------------
    def load(self, match: MatchResult, owner: str | None = None, *, evict: bool = True,
             extra: Mapping[str, int] | None = None) -> LoadResult:
        """Load back the host part of ``match`` (all or nothing; invariant ``atomic_admission``).

        Pins the host copies first (invariant ``loadback_source_pinned``), then allocates device pages (evicting
        if allowed, with the device part of the hit held out of the eviction), then moves
        the nodes to ``loading`` and returns the command. Nodes already loading are
        joined: the caller gets its own pin on them and waits for their operation. The
        caller's lock covers the whole hit. ``extra`` (group -> pages) allocates the
        caller's own pages in the same reservation (returned in :attr:`LoadResult.extra`).

        Raises:
            UsageError: no host tier, no loadback needed, a stale match, or a bad ``extra``
                (nothing changes).
            CapacityError: device pages short after eviction; nothing changed.
        """
        host_nodes, joined = self._check(match)
        store = self.store
        if extra:
            store.ledger.check_need(extra)
        terminal = match.terminal
        ckpt_node = terminal if (store.ckpt_groups and terminal in host_nodes
                                 and has_checkpoint(terminal.host_ckpt, len(store.ckpt_groups))) else None
        need = {g: 0 for g in store.device}
        for n in host_nodes:
            for g in store.history_groups:
                need[g] += len(n.host.get(g, ()))
        if ckpt_node is not None:
            for g in store.ckpt_groups:
                need[g] += len(ckpt_node.host_ckpt[g])
        for g, k in (extra or {}).items():
            need[g] += k
        pin = store.receipts.take("pin", joined + host_nodes, owner)
        hold = store.receipts.hold(match.device_node)  # the device part of the hit stays
        try:
            short = store.ledger.device_short(need)
            if short and evict:
                self.reclaimer.evict_device(short)
        finally:
            store.receipts.unlock(hold, None)
        short = store.ledger.device_short(need)
        if short:
            g = next(iter(short))
            free = store.device[g].free
            store.receipts.release(pin)
            raise CapacityError("device", g, need[g], free)
        op_ids = sorted({n.lb_op for n in joined if n.lb_op is not None})
        command = self._submit_load(host_nodes, ckpt_node, owner) if host_nodes else None
        if command is not None:
            op_ids.append(command.op_id)
        if joined:
            store.stats.joined_loadbacks += 1
        own = store.ledger.alloc_for_callers(extra or {})
        store.tree.members("lock", [terminal])
        lock = store.receipts.lock(terminal, owner, store.tick())
        return LoadResult(command, tuple(op_ids), pin, lock, store.tree.page_table(terminal, store.history_groups), own)

    def _check(self, match: MatchResult) -> tuple[list[Node], list[Node]]:
        """The host nodes to load and the loading nodes to join; raises if ``match`` is stale."""
        store = self.store
        if store.host is None or not match.needs_loadback:
            raise UsageError("load: the match has no host hit to load back")
        host_nodes = list(match.host_nodes)
        joined = list(match.joined_nodes)
        stale = [n.node_id for n in host_nodes if n.state != NS.host or not store.tree.has(n)]
        stale += [n.node_id for n in joined if n.state != NS.loading]
        # the hit must still hang together: a split or a demotion since the match breaks the chain
        prev = match.device_node
        if prev is not store.root and (prev.state not in DEVICE_READABLE or not store.tree.has(prev)):
            stale.append(prev.node_id)
        for n in sorted(joined + host_nodes, key=lambda x: x.depth):
            if n.parent is not prev:
                stale.append(n.node_id)
            prev = n
        if stale:
            raise UsageError(f"load: match is stale (nodes {stale} changed state or were split since the match)")
        return host_nodes, joined

    def _submit_load(self, host_nodes: list[Node], ckpt_node: Node | None, owner: str | None) -> TransferCommand:
        store = self.store
        op_id = store.optable.new_id()
        transfers: _Transfers = {}
        for n in host_nodes:
            for g in store.history_groups:
                src = n.host.get(g, [])
                n.dev[g] = self._move(transfers, g, src, store.device[g].alloc(len(src)))
            n.lb_op = op_id
            store.trigger(n, EV.loadback_submit)
        if ckpt_node is not None:
            for g in store.ckpt_groups:
                src = ckpt_node.host_ckpt[g]
                ckpt_node.dev_ckpt[g] = self._move(transfers, g, src, store.device[g].alloc(len(src)))
        command = self.command(op_id, Direction.LOADBACK, transfers, owner, host_nodes)
        store.receipts.take("pin", host_nodes, f"op {op_id}", receipt_id=-op_id)  # the operation's own pin
        store.optable.add(Operation(command, list(host_nodes), ckpt_node))
        store.stats.loadbacks += 1
        store.stats.pages_loaded += command.pages
        return command

    @staticmethod
    def _move(transfers: _Transfers, group: str, src: list[int], dst: list[int]) -> list[int]:
        s, d = transfers.setdefault(group, ([], []))
        s.extend(src)
        d.extend(dst)
        return dst

    def command(self, op_id: int, direction: Direction, transfers: _Transfers, owner: str | None,
                nodes: Sequence[Node]) -> TransferCommand:
        """Record and return the command of a new operation (it waits in the outbox)."""
        # the core's own ids and counters: no per-command record re-validation
        command = TransferCommand.trusted(
            op_id, direction,
            tuple(GroupTransfer.trusted(g, tuple(s), tuple(d)) for g, (s, d) in transfers.items() if s),
            self._layers, owner, tuple(n.node_id for n in nodes), self.store.optable.deadline())
        self.outbox.append(command)
        return command

    # -- commands and completions ----------------------------------------------------
    def pending(self) -> tuple[TransferCommand, ...]:
        """Commands created and not yet handed out by :meth:`poll` (a snapshot)."""
        return tuple(self.outbox)

    def poll(self) -> list[TransferCommand]:
        """Commands created since the last poll, loadbacks first (then by op id)."""
        out = sorted(self.outbox, key=lambda c: (c.direction is not Direction.LOADBACK, c.op_id))
        self.outbox.clear()
        for c in out:
            op = self.store.optable.get(c.op_id)
            if op is not None:
                op.handed_out = True
        return out

    def complete(self, completion: Completion) -> list[Settled | LayerProgress]:
        """Take one rank's completion (:meth:`kvtier.fsm.node.core.CacheCore.complete` says
        what comes back); a late or duplicate one for a settled operation is absorbed, and
        a fenced operation's acknowledgements release its fence once every rank sent one."""
        store = self.store
        fenced = store.optable.fenced_op(completion.op_id)
        if fenced is not None:
            done = store.optable.confirm(fenced, completion)  # (raises before recording anything)
            store.stats.absorbed_late_completions += 1
            if done:
                self.release_fence(fenced)
            return []
        outcome = store.optable.classify(completion)
        if outcome == ABSORBED:
            store.stats.absorbed_late_completions += 1
            return []
        if outcome == PENDING:
            return []
        if isinstance(outcome, Operation):
            return [self.settle(outcome, outcome.ok)]
        assert isinstance(outcome, int)
        op = store.optable.get(completion.op_id)
        assert op is not None
        for n in op.nodes:
            store.trigger(n, EV.loadback_layer_done)
        return [LayerProgress(op.op_id, outcome)]

    def withdraw(self, op_id: int) -> Settled | None:
        """Fail operation ``op_id`` at once if its command is still in the outbox (it is
        never handed out); ``None`` when it was handed out already or is not in flight."""
        op = self.store.optable.get(op_id)
        if op is None or op.handed_out:
            return None
        self.outbox.remove(op.command)
        self.store.stats.withdrawn_ops += 1
        return self.settle(op, False)

    def expire(self, steps: int) -> list[Settled]:
        """Advance the scheduler step by ``steps`` (checked) and fail every operation whose
        deadline passed: one still in the outbox is taken back (no copy ever starts), one
        handed out is fenced (module docstring)."""
        out = []
        for op in self.store.optable.expire(steps):
            self.store.stats.expired_ops += 1
            if not op.handed_out:
                self.outbox.remove(op.command)
            out.append(self.settle(op, False, expired=True))
        return out

    def settle(self, op: Operation, ok: bool, expired: bool = False) -> Settled:
        """End ``op`` (success only if ``ok``): publish or free the host reservation of a
        writeback, keep or free the device pages of a loadback, each node through its event.
        An ``expired`` operation whose command was handed out is fenced instead of freeing
        (its ``[transfer]`` event ``expire``; :meth:`release_fence` frees)."""
        store = self.store
        transfer_lifecycle().fire(op, TE.expire if expired else TE.settle)
        fence = expired and op.handed_out
        store.optable.remove(op)
        if fence:
            store.optable.fence(op)
        if op.direction is Direction.WRITEBACK:
            for n in reversed(op.nodes):  # deepest first
                if ok:
                    n.host, n.pending = n.pending, {}
                    n.host_ckpt, n.pending_ckpt = n.pending_ckpt, {}
                    n.reloaded = False
                elif fence:  # the copy may still write the reservation: the operation keeps it
                    _keep(op.fenced_host, n.pending, n.pending_ckpt)
                    n.pending, n.pending_ckpt = {}, {}
                else:
                    store.ledger.release_host(n.pending, n.pending_ckpt)
                    n.pending, n.pending_ckpt = {}, {}
                n.wb_op = None
                store.trigger(n, EV.writeback_ack if ok else EV.writeback_fail)
            if fence:  # and may still read the device pages: no eviction until it ended
                store.receipts.take("borrow", list(op.nodes), f"op {op.op_id}", receipt_id=-op.op_id)
            if not ok:
                store.stats.writeback_failures += 1
                store.writebacks.drop_children_of(op.nodes)  # they would break invariant ``root_closed_host``
        else:
            if not fence:  # a fenced copy may still read the host pages: the pin stays
                store.receipts.release(store.receipts.get(-op.op_id))  # the operation's own pin
            for n in reversed(op.nodes):
                n.lb_op = None
                n.reloaded = ok
                if not ok:
                    if fence:  # the copy may still write the destination: the operation keeps it
                        _keep(op.fenced_dev, n.dev)
                    else:
                        store.ledger.release_device(n.dev)
                    n.dev = {}
                    if n is op.checkpoint:
                        if fence:
                            _keep(op.fenced_dev, n.dev_ckpt)
                        else:
                            store.ledger.release_device(n.dev_ckpt)
                        n.dev_ckpt = {}
                store.trigger(n, EV.loadback_ack if ok else EV.loadback_fail)
            if not ok:
                store.stats.loadback_failures += 1
        return Settled(op.op_id, op.direction, ok, op.command.request_id,
                       tuple(n.node_id for n in op.nodes), expired)

    def release_fence(self, op: Operation) -> None:
        """Every rank confirmed the fenced ``op``'s copy ended (``[transfer]`` event
        ``copy_ended``): its destination pages go back to their pools and its pin or borrow
        on the source is released, exactly once."""
        store = self.store
        transfer_lifecycle().fire(op, TE.copy_ended)
        store.optable.unfence(op)
        store.ledger.release_device(op.fenced_dev)
        if op.fenced_host:
            store.ledger.release_host(op.fenced_host)
        op.fenced_dev, op.fenced_host = {}, {}
        store.receipts.release(store.receipts.get(-op.op_id))
        store.stats.fences_released += 1

    # -- writeback -----------------------------------------------------------------
    def writeback(self, node: Node, owner: str | None) -> TransferCommand | None:
        """Write back, as one operation owned by ``owner``, every node on the path to
        ``node`` that is only on the device and whose parent is (or will be, in the same
        operation) on the host; nodes behind a writeback in flight elsewhere are queued as
        tree writebacks instead (invariant ``root_closed_host``). Host pages are reserved all or nothing,
        evicting unpinned host leaves off this path if short."""
        # The device-only nodes of a path are consecutive and end it (the device set is
        # root-closed, and a host-visible or writing node's parent is host-visible or in the
        # same writeback), so the run is that chain when its first node's parent is the root
        # or on the host; behind a writeback in flight elsewhere it waits in the queue.
        run: list[Node] = []
        for n in reversed(node.path()):
            if n.state != NS.device:
                continue
            p = n.parent
            assert p is not None
            if run or p.parent is None or p.state in HOST_VISIBLE:
                run.append(n)
            else:
                self.store.writebacks.want(n)
        return self.submit_writeback(run, owner) if run else None

    def submit_writeback(self, run: list[Node], owner: str | None, host_only: bool = False) -> TransferCommand | None:
        """Write back ``run`` (device nodes, parent first, the first one's parent on the
        host) as one operation; reserves host pages all or nothing, evicting host leaves
        off the run's paths if short. Returns ``None`` if the host cannot take it."""
        store = self.store
        assert store.host is not None
        need: dict[str, int] = {}
        for n in run:
            for pm in (n.dev, n.dev_ckpt):
                for g, pages in pm.items():
                    need[g] = need.get(g, 0) + len(pages)
        short = store.ledger.host_short(need)
        if short:  # never the run's ancestors: the run hangs from their host copies (root_closed_host)
            self.reclaimer.evict_host(short, protect=[a for n in run for a in n.path()], host_only=host_only)
        if store.ledger.host_short(need):
            return None
        op_id = store.optable.new_id()
        transfers: _Transfers = {}
        for n in run:
            n.wb_op = op_id
            n.pending = self._reserve(transfers, n.dev)
            n.pending_ckpt = self._reserve(transfers, n.dev_ckpt)
            store.trigger(n, EV.writeback_submit)
            store.writebacks.submitted(n)
        command = self.command(op_id, Direction.WRITEBACK, transfers, owner, run)
        store.optable.add(Operation(command, list(run)))
        store.stats.writebacks += 1
        store.stats.pages_written += command.pages
        return command

    def issue_writebacks(self, limit: int | None = None) -> list[TransferCommand]:
        """Submit queued tree writebacks whose parent is on the host, at most ``limit``
        operations. Every such node goes into one batched operation (one command, one
        ack: fewer, larger copies); if the host cannot hold the batch, nodes are submitted
        one by one and those that still do not fit leave the queue (:class:`WritebackQueue`
        says which nodes stay queued)."""
        store = self.store
        if store.host is None or (limit is not None and limit < 1):
            return []
        ready = store.writebacks.ready()
        if not ready:
            return []
        # under write_back a writeback exists to let a device copy go: taking another node's
        # host copy for it (making that one device-only again) would only move the problem
        host_only = store.policy is WritePolicy.WRITE_BACK
        cmd = self.submit_writeback(ready, None, host_only)
        if cmd is not None:
            return [cmd]
        out: list[TransferCommand] = []
        for n in ready:  # (still device nodes: host eviction below only touches host copies)
            if limit is not None and len(out) >= limit:
                break
            p = n.parent
            assert p is not None
            if not (p.parent is None or p.state in HOST_VISIBLE):
                continue  # an earlier submission's host eviction took the parent's copy: wait
            one = self.submit_writeback([n], None, host_only)
            if one is None:
                store.writebacks.give_up(n)  # host full: write_back now drops it
                store.eviction.touch(n)
            else:
                out.append(one)
        return out

    def _reserve(self, transfers: _Transfers, src_map: PageMap) -> PageMap:
        host = self.store.host
        assert host is not None
        return {g: self._move(transfers, g, src, host[g].alloc(len(src))) for g, src in src_map.items()}


def _keep(into: dict[str, list[int]], *maps: PageMap) -> None:
    """Add the pages of ``maps`` to a fence's ``into`` (group -> pages)."""
    for pm in maps:
        for g, pages in pm.items():
            into.setdefault(g, []).extend(pages)
