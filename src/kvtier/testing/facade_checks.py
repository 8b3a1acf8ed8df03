"""The facade machine's invariant checks (:mod:`kvtier.testing.facade_machine`, listed in its
``kit_invariants``): the cache's own, invariant 12 for the tree and for what running
requests read, the request records, ``layer_ready`` against the per-rank model, and the
facade's read-only views.
"""

from __future__ import annotations

from typing import Any

from kvtier.fsm.errors import InvariantViolation, UsageError

from . import _views as views
from .base import TERMINAL
from .content import check_tree_bytes
from .facade_steps import FacadeSteps
from .models import ModelViolation, check_split_queue
from .view_model import check_facade_views


class FacadeChecks(FacadeSteps):
    """The named invariant checks, each raising InvariantViolation or ModelViolation."""

    # -- invariants --------------------------------------------------------------------
    def check_layer_ready(self) -> None:
        """Model: ``layer_ready`` of every request and layer agrees with the per-rank model."""
        if not hasattr(self, "cache"):
            return
        ops = views.ops(self.cache.core)
        for rid, r in views.requests(self.cache).items():
            for layer in range(self.cache.layout.num_layers):
                want = self.layer_model.expect(rid, r.state, layer, self.world, ops)
                got = self.sched.layer_ready(rid, layer)
                if got != want:
                    raise ModelViolation("model_layer_ready", f"request {rid!r} ({r.state})",
                                         f"layer_ready(layer {layer}) is {got}, the per-rank model says {want} "
                                         f"(progress {self.layer_model.progress}, waits "
                                         f"{sorted(self.layer_model.waits.get(rid, ()))})")

    def check_ended_views(self) -> None:
        """Model: the facade forgets an ended request once a poll reported it (``_poll``
        records which, in order); ``request(rid)`` then still answers, with its terminal
        state, for the last ``ended_history`` requests forgotten (an id admitted again is
        live, and no longer counts among them), and raises UsageError for the others."""
        if not hasattr(self, "cache"):
            return
        now = views.requests(self.cache)
        for rid in sorted(self.forgotten - set(now)):  # (an id admitted again is live)
            try:
                state = self.cache.request(rid).state
            except UsageError:
                state = None
            if (state is not None) != (rid in self.remembered) or (state is not None and state not in TERMINAL):
                raise ModelViolation("model_views", f"request({rid!r})",
                                     f"answers {state!r} for a forgotten request; it must answer for "
                                     f"{self.remembered} (the last {views.ended_history(self.cache)} forgotten and "
                                     f"not admitted since, oldest first)")

    def check_writeback_split(self) -> None:
        """Model: a queue entry stays with both fragments of a split (:func:`check_split_queue`)."""
        if not hasattr(self, "cache"):
            return
        core = self.cache.core
        after = views.writeback_queue(core)
        live = views.nodes(core)
        before: dict[int, Any] = getattr(self, "_wb_queued", {})
        live_before: set[int] = getattr(self, "_wb_live", set())
        check_split_queue(live_before, before, after, lambda nid: views.writeback_refused(core, nid))
        self._wb_queued, self._wb_live = after, set(live)

    def check_counters(self) -> None:
        """Model: every operator counter of ``cache.stats()`` against the counts the
        :class:`~kvtier.testing.counter_model.CounterModel` keeps of the calls and events
        (``model_counters``)."""
        counters = getattr(self, "counters", None)
        if counters is not None:
            counters.check()

    def check_writeback_quota(self) -> None:
        """Model: tree writebacks (no request owns them) in flight never pass the cache's
        ``max_writebacks_in_flight`` (a poll issues them only into the room the writebacks
        in flight leave; a request's own finish or retract writeback is not held back)."""
        if not hasattr(self, "cache"):
            return
        limit = self.cache.max_writebacks_in_flight
        tree = sorted(o.command.op_id for o in views.ops(self.cache.core).values()
                      if o.command.direction.value == "writeback" and o.command.request_id is None)
        if len(tree) > limit:
            raise ModelViolation("model_writeback_queue", "the cache",
                                 f"{len(tree)} tree writebacks in flight {tree}, max_writebacks_in_flight {limit}")

    def check_views(self) -> None:
        """Model: the facade's read-only answers (:mod:`kvtier.testing.view_model`)."""
        if hasattr(self, "cache"):
            check_facade_views(self.cache)

    def check_cache_invariants(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    def check_loaded_equals_written(self) -> None:
        if hasattr(self, "cache"):
            check_tree_bytes(self.cache.core, self.xfer.dev, self.xfer.host)

    def check_requests_read_written(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid, r in views.requests(self.cache).items():
            if r.state == "running":
                self._check_read(rid, r.tokens)

    def check_request_records(self) -> None:
        if not hasattr(self, "cache"):
            return
        ops = views.ops(self.cache.core)
        reqs = views.requests(self.cache)
        for rid, r in reqs.items():
            if r.owed_forward < 0:
                raise InvariantViolation("counts_with_receipts", f"request {rid!r}", "owes a negative count")
            for op in r.ops:
                if op not in ops:
                    raise InvariantViolation("operation_ends_once", f"request {rid!r}",
                                             f"waits on op {op}, which already ended")
            if r.state in ("finishing", "retracting") and not r.ops:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         f"{r.state} without its own writeback in flight")
            if r.state == "aborting" and r.settled:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         "aborting with nothing owed: never released")
            if r.state == "loading" and not r.ops:
                raise InvariantViolation("operation_ends_once", f"request {rid!r}",
                                         "loading without a loadback to wait on")
            if r.state == "loading" and not r.pins:
                raise InvariantViolation("loadback_source_pinned", f"request {rid!r}", "loading without a pin")
            if r.state in TERMINAL and r.ops:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         f"{r.state} with operations {sorted(r.ops)} still in flight")
        for rid, own in list(self.fenced.items()):
            fenced = reqs.get(rid)
            if fenced is None or fenced.state != "aborting":
                del self.fenced[rid]
                continue
            for g, pages in own.items():
                if not set(pages) <= set(fenced.own.get(g, ())):
                    raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                             f"aborting with work in flight but its pages of {g!r} were released")
        core = self.cache.core
        held = {i for r in reqs.values() for i in r.receipts()}
        leaked = (set(views.locks(core)) | set(views.receipts(core))) - held
        if leaked:
            raise InvariantViolation("atomic_admission", "the facade",
                                     f"receipts {sorted(leaked)} are held by no request (a reservation not rolled back)")

    def check_passes_out(self) -> None:
        """Model: every request owes exactly the forward results of the passes the engine
        has out (admitted, resumed or reserved, no result reported yet)."""
        if not hasattr(self, "cache"):
            return
        for rid, r in views.requests(self.cache).items():
            if r.owed_forward != self.passes_out.get(rid, 0):
                raise ModelViolation("model_passes", f"request {rid!r} ({r.state})",
                                     f"owes {r.owed_forward} forward results; the engine has "
                                     f"{self.passes_out.get(rid, 0)} passes out")
