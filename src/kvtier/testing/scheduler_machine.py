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

:class:`WatchedCache` records what the scheduler asks of the cache, so that the machine checks
what a correct scheduler does, beyond what the cache refuses:

- every request the cache sends back to ``waiting`` (its loadback failed) is admitted again
  or aborted by the cache; the scheduler's own safety net, aborting every live request as
  ``"scheduler stalled"`` when none is queued, running or in flight, never fires (a request
  that is in no queue is lost: ``model_liveness``);
- a forward result flags a checkpoint exactly when the request's token count after it is at
  a unit boundary (``model_checkpoint``: a flag from the chunk's length, say, drops
  checkpoints or claims one mid-unit);
- the scheduler's documented choices (``model_scheduler_policy``): admissions in arrival
  order, a request sent back to waiting first; resumes in retraction order; each
  retraction's victim (:meth:`WatchedCache._check_victim`); a resume starts at the request's
  own terminal exactly (the tokens it had when retracted) or at a unit boundary before it;
  a request finishes when it produced exactly ``max(1, output_tokens)`` tokens: the most KV
  it ever had then covers its prompt and every output token but the last (one decode token
  too many or too few fails);
- every poll issues tree writebacks into exactly the room ``max_writebacks_in_flight`` leaves
  beside the writebacks in flight (loadbacks never count), unless none is ready
  (``model_writeback_queue``, :func:`~kvtier.testing.facade_models.check_quota`);
- :class:`~kvtier.scheduler.RunStats` and the cache's operator counters against independent
  counts (``model_counters``, :mod:`kvtier.testing.counter_model`); its bytes and pages
  moved per direction against the commands handed out (pages times each group's page bytes
  from the layout), its prefill and decode tokens against the forward passes the executor
  saw, classed by the KV each request must (re)compute (``model_scheduler_stats``);
- the run ends within ``2 x`` (prompt + output tokens) + :data:`_MAX_IDLE` iterations, far
  below the scheduler's own bound of 16 per token (a retraction livelock fails quickly, so
  that its shrinking stays quick too).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, deque
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvtier.fsm import Completion
from kvtier.fsm.request.batch import OK, SHORT, ForwardResult

from ..scheduler import InstantExecutor, ReferenceScheduler, SchedRequest, SchedulerStalled
from ..tiered import TieredCache
from .base import FAULT_LEVEL, KitMachine, kit_layout, recorded
from .counter_model import CounterModel
from .drain import check_core_drained, evict_to_full_pools
from .facade_models import check_quota, writebacks_in_flight
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

    def forward(self, cache: TieredCache, batch: Any) -> None:
        """The forward pass moves nothing; the machine's model counts the batch's tokens."""
        watch = getattr(cache, "kit_forward", None)
        if watch is not None:
            watch(batch)


class WatchedCache(TieredCache):
    """The cache, recording the scheduler's calls for the machine's checks (module doc)."""

    def kit_watch(self, requests: list[SchedRequest]) -> None:
        self.sent_back: set[str] = set()  # sent back to waiting, not admitted since
        self.stalled: list[str] = []  # aborted by the scheduler's "scheduler stalled" net
        self.bad_flags: list[str] = []
        self.bad_policy: list[str] = []  # choices the scheduler documents, made otherwise
        # the policy model: the scheduler's queues and requests as its docstrings state them
        self.waiting_q: deque[str] = deque(r.request_id for r in sorted(requests, key=lambda r: (r.arrival_s,
                                                                                             r.request_id)))
        self.retracted_q: deque[str] = deque()
        self.prompt = {r.request_id: r.prompt_tokens for r in requests}
        self.output = {r.request_id: max(1, r.output_tokens) for r in requests}
        self.bad_finish: list[str] = []  # finishes at a decoded count other than asked
        self.high: dict[str, int] = {}  # the most tokens of KV it ever had
        self.tokens: dict[str, int] = {}
        self.kv_target: dict[str, int] = {}
        self.order: dict[str, int] = {}
        self.batched: set[str] = set()  # got a token or chunk this scheduler iteration
        self.short: str | None = None  # the last request short of a decode token this iteration
        self.finished: set[str] = set()
        self.reasons: Counter[str] = Counter()
        self.hits = Counter[str]()
        self.retractions = 0
        self.at_retract: dict[str, int] = {}  # tokens with KV when it was retracted
        self.computed: Counter[str] = Counter()  # forward tokens: "prefill" / "decode"

    def kit_forward(self, batch: Any) -> None:
        """A forward pass over ``batch`` ((request id, tokens with KV, tokens computed)):
        a request below the KV it must (re)compute prefills, one at or past it decodes."""
        for rid, tokens, n in batch:
            self.computed["prefill" if tokens < self.kv_target.get(rid, self.prompt[rid]) else "decode"] += n

    def kit_iteration(self) -> None:
        """A new scheduler iteration begins (``on_step``)."""
        self.batched = set()
        self.short = None

    def poll(self) -> Any:
        writing = writebacks_in_flight(self)
        out = super().poll()
        check_quota(self, writing)
        for e in out.events:
            rid = e.request_id
            if e.state == "waiting":
                self.sent_back.add(rid)
                if rid in self.at_retract and self.tokens.get(rid, 0) > self.kv_target.get(rid, 0):
                    self.kv_target[rid] = self.tokens[rid]  # decoded since its resume: it recomputes that too
                self.tokens[rid] = 0
                if rid not in self.waiting_q:
                    self.waiting_q.appendleft(rid)  # it recomputes from the start: first in line
            elif e.state == "aborted":
                self.sent_back.discard(rid)
                self.reasons[e.reason or "unknown"] += 1
                for q in (self.waiting_q, self.retracted_q):
                    if rid in q:
                        q.remove(rid)
        return out

    def admit(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        self.sent_back.discard(request_id)
        if self.waiting_q and self.waiting_q[0] != request_id:
            self.bad_policy.append(f"admits {request_id!r} before {self.waiting_q[0]!r}, first in the waiting queue "
                                   f"(FIFO; a request sent back first)")
        adm = super().admit(request_id, *args, **kwargs)
        if adm is not None:
            if request_id in self.waiting_q:
                self.waiting_q.remove(request_id)
            self.order[request_id] = self._next_order()
            self.tokens[request_id] = adm.start_token
            self.kv_target[request_id] = max(self.prompt[request_id], self.kv_target.get(request_id, 0))
            self.batched.add(request_id)
            self.hits["hit"] += adm.hit_tokens
            self.hits["device"] += adm.device_hit_tokens
            self.hits["history"] += adm.history_hit_tokens
        return adm

    def _next_order(self) -> int:
        self.hits["admitted"] += 1
        return self.hits["admitted"]

    def resume(self, request_id: str, chunk_tokens: int) -> Any:
        if self.retracted_q and self.retracted_q[0] != request_id:
            self.bad_policy.append(f"resumes {request_id!r} before {self.retracted_q[0]!r}, retracted first (FIFO)")
        adm = super().resume(request_id, chunk_tokens)
        if adm is not None:
            had = self.at_retract.get(request_id)
            start = adm.start_token
            if had is not None and not (start == had or (start < had and start % self.layout.alignment == 0)):
                self.bad_policy.append(f"resumes {request_id!r} at token {start}: retracted at {had}, it resumes "
                                       f"at its own terminal exactly or recomputes from a unit boundary before it")
            if request_id in self.retracted_q:
                self.retracted_q.remove(request_id)
            self.tokens[request_id] = adm.start_token
            self.batched.add(request_id)
        return adm

    def reserve(self, request_id: str, tokens: int) -> Any:
        out = super().reserve(request_id, tokens)
        if out is not None:
            self.batched.add(request_id)
        return out

    def retract(self, request_id: str) -> Any:
        self._check_victim(request_id)
        out = super().retract(request_id)
        self.at_retract[request_id] = self.request(request_id).tokens
        self.retractions += 1
        self.retracted_q.append(request_id)
        if self.tokens.get(request_id, 0) >= self.kv_target.get(request_id, 0):
            self.kv_target[request_id] = self.tokens.get(request_id, 0)  # decoding: recompute what it had
        return out

    def _check_victim(self, victim: str) -> None:
        """The retraction the scheduler documents (``Retractions._decode_short``): for the
        request short of a decode token, the newest-admitted decoding request not in the
        batch; when that is the short request itself, the newest running prefill instead
        (older ones too), else the short request."""
        short = self.short
        if short is None:
            self.bad_policy.append(f"retracts {victim!r} while no decode token is short of pages")
            return
        cands = [rid for rid in self.order if rid not in self.batched and rid in self.tokens
                 and self.state(rid) == "running"]
        decoding = [rid for rid in cands if self.tokens[rid] >= self.kv_target[rid]]
        if not decoding:
            self.bad_policy.append(f"retracts {victim!r} for {short!r} with no decoding request to retract")
            return
        want = max(decoding, key=self.order.__getitem__)
        if want == short:
            prefills = [rid for rid in cands if self.tokens[rid] < self.kv_target[rid]]
            want = max(prefills, key=self.order.__getitem__) if prefills else short
        if victim != want:
            self.bad_policy.append(f"retracts {victim!r} for {short!r}'s decode token; the documented victim is "
                                   f"{want!r} (newest admitted: {sorted(cands, key=self.order.__getitem__)})")

    def finish(self, request_id: str) -> Any:
        # the prefill yields the first output token and every decode token one more, so a
        # request that produced its ``max(1, output_tokens)`` tokens holds the KV of its
        # prompt and of every output token but the last one
        want = self.prompt[request_id] + self.output[request_id] - 1
        have = max(self.high.get(request_id, 0), self.request(request_id).tokens)  # (KV lost and recomputed too)
        if have != want and len(self.bad_finish) < 4:
            self.bad_finish.append(f"finishes {request_id!r} with KV for {have} tokens: prompt "
                                   f"{self.prompt[request_id]} + {self.output[request_id]} output tokens asked "
                                   f"({want} tokens of KV at the last token)")
        out = super().finish(request_id)
        self.finished.add(request_id)
        return out

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        if reason == "scheduler stalled":
            self.stalled.append(request_id)
        super().abort(request_id, reason)

    def step(self, results: Any = (), reserve: Any = (), **kwargs: Any) -> Any:
        out = super().step(results, reserve, **kwargs)
        align = self.layout.alignment
        for item in results:
            r = ForwardResult(*item) if isinstance(item, tuple) and not isinstance(item, ForwardResult) else item
            if not r.computed_tokens or self.state(r.request_id) not in ("running", "loading"):
                continue
            self.tokens[r.request_id] = self.tokens.get(r.request_id, 0) + r.computed_tokens
            tokens = self.request(r.request_id).tokens
            self.high[r.request_id] = max(self.high.get(r.request_id, 0), tokens)
            if bool(r.checkpoint) != (tokens % align == 0):
                self.bad_flags.append(f"{r.request_id!r} at {tokens} tokens (+{r.computed_tokens}) "
                                      f"{'flags' if r.checkpoint else 'does not flag'} a checkpoint")
        for item, status in zip(reserve, out.reserve_status):
            rid = item[0] if isinstance(item, tuple) else item.request_id
            if status == OK:
                self.batched.add(rid)
            elif status == SHORT:
                self.short = rid
                break
        return out


#: iterations without progress before the run counts as stalled (small: an example stays quick)
_MAX_IDLE = 200
_UNITS = st.lists(st.sampled_from("abc"), min_size=1, max_size=6)


class SchedulerMachine(KitMachine):
    """The reference scheduler with random arrivals and a faulty executor (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: WatchedCache | None = None
        self.executor: FaultyExecutor | None = None
        self.requests: list[SchedRequest] = []
        self.budget = 16
        self.t = 0.0

    @initialize(device=st.integers(3, 12), host=st.one_of(st.none(), st.integers(3, 16)),
                policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
                world=st.sampled_from([1, 2]), budget=st.sampled_from([4, 8, 16, 64]), seed=st.integers(0, 1 << 16),
                faults=FAULT_LEVEL, late=st.integers(0, 3), wb_limit=st.sampled_from([1, 2]))
    @recorded
    def setup(self, device: int, host: int | None, policy: str, world: int, budget: int, seed: int,
              faults: int | None = None, late: int = 0, wb_limit: int = 2) -> None:
        self.kit_fault_level(faults)
        self.cache = WatchedCache(kit_layout(), device, host, policy=policy if host is not None else "write_through",
                                 world_size=world, op_deadline_steps=None, max_writebacks_in_flight=wb_limit)
        self.counters = CounterModel(self.cache)
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
        cache.kit_watch(self.requests)
        sched = ReferenceScheduler(cache, executor, token_budget=self.budget, max_idle_steps=_MAX_IDLE)
        bound = 2 * sum(r.prompt_tokens + max(1, r.output_tokens) for r in self.requests) + _MAX_IDLE
        iterations = [0]

        def count() -> None:
            cache.kit_iteration()
            if cache.bad_policy or cache.bad_finish:
                raise ModelViolation("model_scheduler_policy", "the reference scheduler",
                                     (cache.bad_policy or cache.bad_finish)[0])
            iterations[0] += 1
            if iterations[0] > bound:
                raise SchedulerStalled(f"the run passed the machine's bound of {bound:,} iterations (2 per token "
                                       f"of work plus {_MAX_IDLE})", iterations[0],
                                       [r.request_id for r in self.requests if not r.done])

        try:
            stats = sched.run(self.requests, on_step=count)
        except SchedulerStalled as exc:
            raise ModelViolation("model_liveness", "the reference scheduler", str(exc)) from None
        if cache.stalled:
            raise ModelViolation("model_liveness", "the reference scheduler",
                                 f"requests {cache.stalled} were in no queue, running or in flight (aborted as "
                                 f"'scheduler stalled'): a request sent back to waiting "
                                 f"({sorted(cache.sent_back)} never admitted again) or retracted was lost")
        if cache.sent_back:
            raise ModelViolation("model_liveness", "the reference scheduler",
                                 f"requests {sorted(cache.sent_back)} were sent back to waiting and never admitted "
                                 f"again")
        if cache.bad_flags:
            raise ModelViolation("model_checkpoint", "the reference scheduler",
                                 f"a checkpoint flag does not follow the token count: {cache.bad_flags[:3]}")
        if cache.bad_policy:
            raise ModelViolation("model_scheduler_policy", "the reference scheduler", cache.bad_policy[0])
        if cache.bad_finish:
            raise ModelViolation("model_scheduler_policy", "the reference scheduler", cache.bad_finish[0])
        cache.check_invariants()
        self._check_run_stats(stats)
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
        cache.poll()
        self.counters.check_drained()

    def _check_run_stats(self, stats: Any) -> None:
        """The scheduler's :class:`~kvtier.scheduler.RunStats` counters against the model's
        counts of the calls it made and the events the cache reported (``model_counters``)."""
        cache = self.cache
        assert cache is not None
        model = self.counters
        want = {"finished": len(cache.finished), "aborts": sum(cache.reasons.values()),
                "abort_reasons": dict(cache.reasons), "retractions": cache.retractions,
                "prompt_tokens": sum(r.prompt_tokens for r in self.requests),
                "hit_tokens": cache.hits["hit"], "device_hit_tokens": cache.hits["device"],
                "host_hit_tokens": cache.hits["hit"] - cache.hits["device"],
                "history_hit_tokens": cache.hits["history"],
                "loadback_pages": model.pages["loadback"], "writeback_pages": model.pages["writeback"]}
        for k, v in want.items():
            if getattr(stats, k) != v:
                raise ModelViolation("model_counters", "the reference scheduler's RunStats",
                                     f"{k} is {getattr(stats, k)}, the model counts {v}")
        moved = {"loadback_bytes": model.bytes["loadback"], "writeback_bytes": model.bytes["writeback"],
                 "loadback_pages": model.pages["loadback"], "writeback_pages": model.pages["writeback"],
                 "prefill_tokens": cache.computed["prefill"], "decode_tokens": cache.computed["decode"]}
        for k, v in moved.items():
            if getattr(stats, k) != v:
                raise ModelViolation("model_scheduler_stats", "the reference scheduler's RunStats",
                                     f"{k} is {getattr(stats, k)}: the commands handed out and the forward "
                                     f"passes add up to {v}")
