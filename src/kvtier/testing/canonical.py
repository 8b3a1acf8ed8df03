"""The canonical abstraction of a facade machine's state, by which ``kvtier verify``
merges states that behave the same (:meth:`~kvtier.testing.machines.FacadeMachine.kit_canonical`).

Two states with the same canonical value must have the same future: the same steps
enabled, each leading to states with equal canonical values, and the same outcome of every
invariant and model check (the checks read only what the value keeps, up to the renamings
below). Each abstraction and why it keeps that:

- **Nodes by prefix**; node ids only by their order (eviction and the writeback queue
  break ties by node id).
- **Page ids renumbered** per pool and group by first appearance. The core never orders
  pages by id: a page is handed out by its place in the free list, which is kept (as the
  order of the renumbered ids; the trailing run of ids no one references, all alike, as a
  count), so a consistent renaming of every page id behaves the same up to that renaming.
- **Op ids by their order**, not their values: some steps take operations in id order
  (withdrawals, poll's commands, the delivery order), new ids exceed all live ones and no
  id is reused.
- **Clock stamps by their order** (``last_access``; ``prev_use`` too under ``lru2``, the
  only policy that reads it): eviction compares stamps only with each other and a new
  stamp exceeds every stamp in the state. Deadlines are kept relative to the current step.
- **Reuse counts** (``hit_count`` capped at the threshold, with ``last_owner``, which
  decides whether the next lock counts) only under ``write_through_selective``, the only
  reader; ``reloaded`` only with an exclusive host tier.
- **Page content**: only allocated pages', and only content named after a prefix: every
  check compares a page with the content it must hold and a copy moves what it reads, so a
  page never written and one holding garbage are alike. A page back in its pool holds
  garbage in the machine itself (:meth:`FacadeMachine._scrub_freed`), so leaving free
  pages out drops nothing (stale but correct bytes would hide a use after free).
- **Unreported request events** are left out. Nothing reads them but the check of poll's
  answer (every event names a state of the spec), which :meth:`CanonicalState.value`
  makes in every state instead; ``kit_actions`` polls only when poll hands out commands or
  issues writebacks, never just to report.
- **Ended requests with nothing owed count as forgotten** (poll forgets them): their id
  can only be admitted again, which makes a new record either way. The layer model's
  entries count only for requests that may read without a new admission: a ``waiting``,
  ``retracted`` or ended request reaches a reading state only by an admission or a
  resumption, which resets them (found by ``check_merges``).
- **Request fields nothing reads later**: ``has_loadback`` and ``has_own_writeback`` are
  set right before the only reads (the guards of the event fired next); ``hit_tokens``,
  ``reason``, counters and statistics are only reported.
- **The kit's records**: an aborted request's writebacks only while in flight (the model
  checks one when it settles; ids are not reused), the layer model of live requests.
- The eviction index's heap (stale entries included) is left out: the policy re-files
  whatever can become a victim (``EvictionPolicy``: a node yielded and not evicted is
  forgotten until touched), so candidates follow from the nodes; the fuzz's eviction-order
  model checks that rule.

Not merged: two requests with the same prompt. Swapping them is not a symmetry of the
facade, which breaks ties by request id (an operation's waiters are woken in id order), so
a state and its mirror image may have different futures.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvtier.fsm import Direction, WritePolicy
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.lifecycle.machines import request_lifecycle
from kvtier.fsm.node import Node
from kvtier.fsm.request import TERMINAL

from . import _views as views
from .content import node_prefix
from .facade_steps import FacadeSteps

__all__ = ["CanonicalState"]


class CanonicalState:
    """Canonical abstraction of a facade machine's state (see the module docstring for each
    abstraction and why it is sound): :meth:`value` is hashable; raises
    :class:`~kvtier.fsm.errors.InvariantViolation` when an unreported request event names
    a state the spec does not have."""

    def __init__(self, m: FacadeSteps) -> None:
        self.m = m
        self.pages: dict[tuple[str, str, int], int] = {}
        self.ops: dict[int, int] = {}
        self.nodes: dict[int, tuple[Hashable, ...]] = {}

    def page(self, pool: str, g: str, p: int) -> int:
        k = (pool, g, p)
        if k not in self.pages:
            self.pages[k] = sum(1 for x in self.pages if x[0] == pool and x[1] == g)
        return self.pages[k]

    def pmap(self, pool: str, pm: Mapping[str, Sequence[int]]) -> tuple[Any, ...]:
        return tuple((g, tuple(self.page(pool, g, p) for p in ps)) for g, ps in sorted(pm.items()))

    def op(self, op_id: int | None) -> int | None:
        if op_id is None:
            return None
        if op_id not in self.ops:
            self.ops[op_id] = len(self.ops)
        return self.ops[op_id]

    def node(self, n: Node) -> tuple[Hashable, ...]:
        return self.nodes.get(n.node_id) or node_prefix(n)

    def value(self) -> Hashable:
        m = self.m
        core = m.cache.core
        nodes, op_table, wb_queue = views.nodes(core), views.ops(core), views.writeback_queue(core)
        lru2 = core.eviction.name == "lru2"
        stamps = sorted({n.last_access for n in nodes.values()} | ({n.prev_use for n in nodes.values()} if lru2 else set()))
        ids = sorted(nodes)
        thr = core.write_threshold
        # op ids keep their relative order (some steps take ops in id order), not their values
        for o in sorted(set(op_table) | set(m.xfer.queues) | set(m.xfer.commands)
                        | {c.op_id for c in views.outbox(core)}):
            self.op(o)
        selective = core.policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        tree: list[Any] = []

        def walk(n: Node) -> None:
            for key in sorted(n.children, key=repr):
                c = n.children[key]
                self.nodes[c.node_id] = node_prefix(c)
                tree.append((self.nodes[c.node_id], c.state, self.pmap("d", c.dev), self.pmap("h", c.host),
                             self.pmap("h", c.pending), self.pmap("d", c.dev_ckpt), self.pmap("h", c.host_ckpt),
                             self.pmap("h", c.pending_ckpt), c.lock_ref, c.borrow_ref, c.host_pin,
                             (min(c.hit_count, thr), c.last_owner) if selective else None,
                             stamps.index(c.last_access), stamps.index(c.prev_use) if lru2 else None,
                             ids.index(c.node_id),
                             self.op(c.wb_op), self.op(c.lb_op), c.chunk_checkpoint, c.node_id in wb_queue,
                             c.reloaded and core.exclusive))
                walk(c)

        walk(core.root)
        ops = []
        for op_id in sorted(op_table, key=lambda o: (self.op(o) is None, self.op(o) or 0, o)):
            op = op_table[op_id]
            cmd = op.command
            dl = None if cmd.deadline_step is None else cmd.deadline_step - core.step
            src_pool, dst_pool = ("d", "h") if cmd.direction is Direction.WRITEBACK else ("h", "d")
            ops.append((self.op(op_id), cmd.direction.value, cmd.request_id, dl,
                        tuple((t.group, tuple(self.page(src_pool, t.group, p) for p in t.src_pages),
                               tuple(self.page(dst_pool, t.group, p) for p in t.dst_pages)) for t in cmd.transfers),
                        tuple(self.node(n) for n in op.nodes), tuple(sorted(op.acked)), op.ok,
                        tuple(sorted(op.layers.items())), tuple(sorted(op.seen, key=repr)),
                        None if op.checkpoint is None else self.node(op.checkpoint)))
        reqs = []
        # an ended request with nothing owed is as good as forgotten (poll forgets it): its id
        # may only be admitted again, which makes a new record either way
        requests = {rid: r for rid, r in views.requests(m.cache).items() if not (r.state in TERMINAL and r.settled)}
        for rid in sorted(requests):
            r = requests[rid]
            reqs.append((rid, r.state, tuple(r.units), r.prompt_tokens, r.tokens, r.reserved,
                         self.pmap("d", r.canon), self.pmap("d", r.own), r.published,
                         None if r.lock is None else self.node(r.lock.node),
                         tuple(tuple(self.node(n) for n in p.nodes) for p in r.pins),
                         tuple(sorted(self.op(o) or 0 for o in r.ops)), r.owed_forward,
                         tuple(sorted((self.op(o), v) for o, v in r.layers.items())), r.poisoned, r.retract_ckpt,
                         r.layers_failed, r.room, None if r.ckpt_borrow is None else
                         tuple(self.node(n) for n in r.ckpt_borrow.nodes), self.pmap("d", r.ckpt_pages),
                         tuple((n - r.results, self.pmap("d", pm)) for n, pm in r.deferred)))
        outbox = tuple(self.op(c.op_id) for c in views.outbox(core))
        queues = tuple(sorted((self.op(op), tuple(tuple((c.rank, c.layer) for c in q) for q in qs))
                              for op, qs in m.xfer.queues.items()))
        expired = tuple(sorted(self.op(op) or 0 for op in m.expired if op in m.xfer.queues))
        # the kit's own records: an aborted request's writebacks in flight (the model checks
        # none is published when it settles; op ids are never reused, so a settled one's entry
        # is never read again) and the per-rank layer model (checked against layer_ready)
        poisoned = tuple(sorted((self.op(op) or 0, rid, tuple(sorted((g, tuple(sorted(self.page("h", g, p) for p in ps)))
                                                                      for g, ps in dst.items())),
                                 tuple(self.node(n) for n in ns)) for op, (rid, dst, ns) in sorted(m.poisoned.items()) if op in op_table))
        # the layer model's entries of a request that cannot read before it is admitted
        # again (waiting, retracted, ended: the spec leaves those states for a reading one
        # only by an admission or a resumption, which resets them) are left out
        lm = m.layer_model
        reading = {rid for rid, r in requests.items() if r.state not in ("waiting", "retracted", *TERMINAL)}
        layers = (tuple(sorted((self.op(op) or 0, tuple(sorted(rk.items()))) for op, rk in sorted(lm.progress.items()))),
                  tuple(sorted(self.op(op) or 0 for op in sorted(lm.failed_ops))),
                  tuple(sorted((rid, tuple(sorted(self.op(op) or 0 for op in sorted(ops))))
                               for rid, ops in lm.waits.items() if rid in reading and ops)),
                  tuple(sorted(rid for rid in lm.failed if rid in reading)))
        # the free lists in O(pages ever allocated), never O(capacity). In allocation order a
        # free list is the ids never allocated, then the freed ones; an id seen nowhere else
        # in the state is fresh, so the leading run of fresh ids (every never-allocated one,
        # then freed ones until the first id seen elsewhere) is kept as its length: the same
        # equivalence as numbering every free id, at the cost of the freed ones only
        free = []
        allocators = {"d": core.device, "h": core.host or {}}
        for pool, allocs in allocators.items():
            for g, a in sorted(allocs.items()):
                fresh, freed = a.free_state()
                rest: list[int] = []
                for p in freed:
                    if not rest and (pool, g, p) not in self.pages:
                        fresh += 1
                    else:
                        rest.append(self.page(pool, g, p))
                free.append((pool, g, fresh, tuple(rest)))
        store = []
        # bytes of allocated pages only: a free page's stale content is never read before
        # written. Of an allocated page, what matters is the content named after its prefix,
        # or none: every check compares a page with the content it must hold, and a copy moves
        # what it reads, so a page never written and one a failed copy left garbage in are
        # the same ("invalid")
        for pool, data in (("d", m.xfer.dev), ("h", m.xfer.host)):
            for (g, p), v in data.items():
                if (pool, g, p) in self.pages and not allocators[pool][g].is_free(p):
                    garbage = isinstance(v, tuple) and len(v) == 2 and v[0] == "garbage"
                    if not garbage:
                        store.append((pool, g, self.pages[(pool, g, p)], repr(v)))
        # unreported request events are left out: what they say is read by nothing but the
        # check of poll's answer, made here instead, in every state (each names a state of
        # the spec), and whether there are any by nothing (kit_actions polls when a poll does
        # more than report them)
        names = request_lifecycle().spec.state_names
        for e in views.request_events(m.cache):
            if e.state not in names:
                raise InvariantViolation("state_matches_resources", f"request {e.request_id!r}",
                                         f"reported in unknown state {e.state!r}")
        fenced = tuple(sorted((rid, self.pmap("d", own)) for rid, own in m.fenced.items()))
        return (tuple(tree), tuple(ops), tuple(reqs), outbox, queues, expired, tuple(free),
                tuple(sorted(store)), fenced, poisoned, layers)

