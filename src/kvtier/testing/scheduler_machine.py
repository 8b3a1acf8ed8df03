"""The scheduler machine: the reference scheduler (:mod:`kvtier.scheduler`) over a
:class:`~kvtier.tiered.TieredCache`, with an executor whose transfers fail, come late and
complete out of order.

Each example draws a cache (capacities in units, or no host tier; write policy; ranks), the
scheduler's token budget and the executor's behaviour; every step adds arrivals (prompts
over a small alphabet that share and fork prefixes, output lengths, gaps between arrival
times). Small caches make the scheduler retract under decode pressure, resume, and abort
victims when nothing fits. At the end of the example the scheduler runs every request to
its end, and the drain requires: no stall, every request finished or aborted, the cache's
invariants, ``quiescent()``, nothing left on the core and the tree evictable to full pools
(:mod:`kvtier.testing.drain`).

:class:`FaultyExecutor` moves no bytes: each collect hands out the completions of the
transfers submitted so far, except those it holds back for one to ``late`` more collects,
interleaving operations and ranks in a seeded random order (each operation's layers in
order, then its acknowledgement, on each rank), and failing an operation's acknowledgement
on one rank with the example's fault rate.
"""

from __future__ import annotations

import hashlib
import random

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvtier.fsm import Completion

from ..scheduler import InstantExecutor, ReferenceScheduler, SchedRequest, SchedulerStalled
from ..tiered import TieredCache
from .base import FAULT_LEVEL, KitMachine, kit_layout, recorded
from .drain import check_core_drained, evict_to_full_pools
from .models import ModelViolation

__all__ = ["FaultyExecutor", "SchedulerMachine"]


class FaultyExecutor(InstantExecutor):
    """Completions late, out of order and failing (see the module doc)."""

    def __init__(self, world_size: int, seed: int, fail_rate: float, late: int) -> None:
        super().__init__(world_size, layer_chunk=1)
        self.seed, self.fail_rate, self.late = seed, fail_rate, late
        self._held: list[tuple[int, list[Completion]]] = []  # (collects left, completions of one op and rank)
        self._round = 0
        self.failed = 0

    def _draw(self, *parts: object) -> int:
        digest = hashlib.sha256(":".join(map(str, (self.seed, *parts))).encode()).digest()
        return int.from_bytes(digest[:4], "big")

    def collect(self) -> list[Completion]:
        self._round += 1
        queues: dict[tuple[int, int], list[Completion]] = {}
        for c in super().collect():
            queues.setdefault((c.op_id, c.rank), []).append(c)
        for (op, rank), q in queues.items():
            if rank == 0 and self._draw("fail", op) % 1000 < int(round(self.fail_rate * 1000)):
                q[-1] = Completion(op, rank, False, None)
                self.failed += 1
            wait = self._draw("late", op, rank) % (self.late + 1) if self.late else 0
            self._held.append((wait, q))
        ready = [q for wait, q in self._held if wait == 0]
        self._held = [(wait - 1, q) for wait, q in self._held if wait > 0]
        rng = random.Random(self._draw("order", self._round))
        out: list[Completion] = []
        while ready:
            q = ready[rng.randrange(len(ready))]
            out.append(q.pop(0))
            if not q:
                ready.remove(q)
        return out

    def idle(self) -> bool:
        return not self._held and not self._pending


#: iterations without progress before the run counts as stalled (small: an example stays quick)
_MAX_IDLE = 200
_UNITS = st.lists(st.sampled_from("abc"), min_size=1, max_size=6)


class SchedulerMachine(KitMachine):
    """The reference scheduler with random arrivals and a faulty executor (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: TieredCache | None = None
        self.executor: FaultyExecutor | None = None
        self.requests: list[SchedRequest] = []
        self.budget = 16
        self.t = 0.0

    @initialize(device=st.integers(3, 12), host=st.one_of(st.none(), st.integers(3, 16)),
                policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
                world=st.sampled_from([1, 2]), budget=st.sampled_from([4, 8, 16, 64]), seed=st.integers(0, 1 << 16),
                faults=FAULT_LEVEL, late=st.integers(0, 3))
    @recorded
    def setup(self, device: int, host: int | None, policy: str, world: int, budget: int, seed: int,
              faults: int | None = None, late: int = 0) -> None:
        self.kit_fault_level(faults)
        self.cache = TieredCache(kit_layout(), device, host, policy=policy if host is not None else "write_through",
                                 world_size=world, op_deadline_steps=None)
        self.executor = FaultyExecutor(world, seed, self.kit_rate, late)
        self.budget = budget

    @rule(units=_UNITS, tail=st.integers(0, 3), output=st.integers(0, 12), gap=st.sampled_from([0.0, 0.0, 0.01, 1.0]))
    @recorded
    def arrive(self, units: list[str], tail: int, output: int, gap: float) -> None:
        """A request arrives ``gap`` seconds after the previous one: the prompt ``units``
        plus ``tail`` tokens of a unit not full, then ``output`` tokens to generate."""
        align = kit_layout().alignment
        self.requests.append(SchedRequest(f"s{len(self.requests)}", self.t, len(units) * align + tail, output,
                                          tuple(units)))
        self.t += gap

    def kit_drain(self) -> None:
        """Run every request to its end, then the drain's checks (module doc)."""
        cache, executor = self.cache, self.executor
        if cache is None or executor is None:
            return
        sched = ReferenceScheduler(cache, executor, token_budget=self.budget, max_idle_steps=_MAX_IDLE)
        try:
            stats = sched.run(self.requests)
        except SchedulerStalled as exc:
            raise ModelViolation("model_liveness", "the reference scheduler", str(exc)) from None
        cache.check_invariants()
        ended = stats.finished + stats.aborts
        if ended != len(self.requests):
            raise ModelViolation("model_drain", "the reference scheduler",
                                 f"{ended} of {len(self.requests)} requests ended ({stats.finished} finished, "
                                 f"{stats.aborts} aborted)")
        for _ in range(8):  # what is still in flight once every request ended (late completions)
            if executor.idle():
                break
            for c in executor.collect():
                cache.complete(c)
            executor.submit(cache.poll().commands)
        cache.poll()
        if not cache.quiescent():
            raise ModelViolation("model_drain", "the reference scheduler's cache", f"{cache.outstanding()}")
        check_core_drained(cache.core, "the reference scheduler's cache")

        def settle() -> None:
            for _ in range(8):
                executor.submit(cache.poll().commands)
                if executor.idle():
                    return
                for c in executor.collect():
                    cache.complete(c)

        executor.fail_rate = 0.0
        evict_to_full_pools(cache.core, settle, "the reference scheduler's cache")
