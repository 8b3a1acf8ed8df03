"""The kit's state machine for the vLLM adapter (extras ``vllm`` and ``testing``).

:class:`VllmAdapterMachine` drives :class:`~kvtier.adapters.vllm.KvtierOffloadingManager`
through vLLM's own ``KVCacheManager`` with the call order of vLLM's connector scheduler
(:class:`~kvtier.adapters.vllm_kit.ConnectorDriver`): requests sharing prefixes are added,
admitted (GPU hit, offload lookups, loads), computed in chunks (stores), preempted and
re-admitted, finished, and aborted while queued, running or preempted; transfer jobs
complete in any order or fail (failed stores are ``complete_store(success=False)``,
failed loads make the request recompute). After every step the core's invariants and
the adapter's records are checked; at the end everything drains and nothing may be
left: no request state, no pin, lock, operation, reserved or staged page.

``VllmAdapterMachine.configured(groups=(None, 32))`` runs a hybrid model (full attention
plus a sliding window of 32 tokens).
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from .vllm import GROUP, KvtierOffloadingManager
from .vllm_kit import ConnectorDriver
from kvtier.fsm.errors import InvariantViolation
from ..testing.machines import KitMachine, recorded

__all__ = ["VllmAdapterMachine", "check_drained"]

T = 16  # tokens per block / chunk


def check_drained(manager: KvtierOffloadingManager) -> None:
    """Raise :class:`InvariantViolation` if anything is left after every job completed and
    every request finished."""
    core = manager.core
    manager.check_invariants()
    if manager.in_flight() or manager.tracked_requests():
        raise InvariantViolation("drained", "the vLLM adapter", f"{manager.in_flight()} transfers and {manager.tracked_requests()} "
                                 "requests still tracked after draining")
    if core.operations():
        raise InvariantViolation("drained", "the vLLM adapter", f"operations still in flight: {sorted(core.operations())}")
    held = 0
    for n in core.nodes():
        if n.lock_ref or n.host_pin or n.borrow_ref:
            raise InvariantViolation("drained", "the vLLM adapter", f"node {n.node_id} still locked/pinned/borrowed")
        if n.state not in ("host", "backed"):
            raise InvariantViolation("drained", "the vLLM adapter", f"node {n.node_id} left in state {n.state!r} (expected an "
                                     "acknowledged host copy)")
        held += len(n.host.get(GROUP, ()))
    if held != manager.host_chunks_used():
        raise InvariantViolation("drained", "the vLLM adapter", f"host pages used {manager.host_chunks_used()} but nodes hold {held}")
    if core.external_pages(GROUP):
        raise InvariantViolation("drained", "the vLLM adapter", f"staging pages leaked: {sorted(core.external_pages(GROUP))[:8]}")


class VllmAdapterMachine(KitMachine):
    """Stateful test of the adapter under vLLM's call sequence (see module docstring)."""

    kit_invariants = ("check_adapter",)
    #: per KV cache group: None (full attention) or a sliding window in tokens
    groups: ClassVar[tuple[int | None, ...]] = (None,)
    device_blocks: ClassVar[int] = 24
    host_chunks: ClassVar[int] = 10

    def __init__(self) -> None:
        super().__init__()
        tpc = {g: T for g, w in enumerate(self.groups) if w is None}
        sparse = [g for g, w in enumerate(self.groups) if w is not None]
        self.manager = KvtierOffloadingManager(self.host_chunks, tokens_per_chunk=tpc, sliding_window_groups=sparse)
        self.driver = ConnectorDriver(self.manager, self.device_blocks, T, self.groups, max_model_len=T * 64)
        self.next_id = 0

    def _pick(self, i: int, states: tuple[str, ...]) -> str | None:
        ids = sorted((rid for rid, r in self.driver.reqs.items() if r.status in states), key=int)
        return ids[i % len(ids)] if ids else None

    # ------------------------------------------------------------------ rules
    @rule(family=st.integers(0, 2), shared=st.integers(0, 5), own=st.integers(0, 3), tail=st.integers(1, T))
    @recorded
    def add(self, family: int, shared: int, own: int, tail: int) -> None:
        rid = str(self.next_id)
        self.next_id += 1
        blocks = [family * 1000 + i for i in range(shared)] + [10_000 + self.next_id * 10 + i for i in range(own)]
        prompt = [t for b in blocks for t in range(b * T, b * T + T)] + list(range(7, 7 + tail))
        self.driver.add(rid, prompt)

    @rule(i=st.integers(0, 7))
    @recorded
    def admit(self, i: int) -> None:
        rid = self._pick(i, ("waiting", "preempted"))
        if rid is not None:
            self.driver.admit(rid)

    @rule(i=st.integers(0, 7), tokens=st.sampled_from([T, 2 * T, 3 * T, 1000]))
    @recorded
    def compute(self, i: int, tokens: int) -> None:
        rid = self._pick(i, ("running",))
        if rid is not None:
            self.driver.compute(rid, tokens)

    @precondition(lambda self: bool(self.driver.jobs))
    @rule(i=st.integers(0, 7), roll=st.integers(0, 999))
    @recorded
    def complete(self, i: int, roll: int) -> None:
        jobs = sorted(self.driver.jobs)
        self.driver.complete(jobs[i % len(jobs)], ok=not self.kit_fail(roll))

    @rule(i=st.integers(0, 7))
    @recorded
    def finish(self, i: int) -> None:
        rid = self._pick(i, ("running",))
        if rid is not None and self.driver.reqs[rid].computed >= self.driver.reqs[rid].req.num_tokens:
            self.driver.finish(rid)

    @rule(i=st.integers(0, 7), which=st.sampled_from(["waiting", "running", "preempted"]))
    @recorded
    def abort(self, i: int, which: str) -> None:
        rid = self._pick(i, (which,))
        if rid is not None:
            self.driver.finish(rid, aborted=True)

    @rule()
    @recorded
    def abort_untracked(self) -> None:
        self.driver.abort_untracked(f"u{self.next_id}", [1, 2, 3])
        self.next_id += 1

    @rule(i=st.integers(0, 7))
    @recorded
    def preempt(self, i: int) -> None:
        rid = self._pick(i, ("running",))
        if rid is not None:
            self.driver.preempt(rid)

    # ------------------------------------------------------------------ checks
    def check_adapter(self) -> None:
        self.manager.check_invariants()
        pins = sum(1 for r in self.manager._reqs.values() for ld in r.loads if ld.pin is not None)
        loads = sum(1 for j in self.driver.jobs.values() if not j.is_store)
        if self.manager.in_flight() != len(self.driver.jobs):
            raise InvariantViolation("adapter_records", "the vLLM adapter", f"{self.manager.in_flight()} transfers tracked, "
                                     f"{len(self.driver.jobs)} jobs in flight")
        if pins > loads:
            raise InvariantViolation("adapter_records", "the vLLM adapter", f"{pins} pins for {loads} loads in flight")

    @invariant()
    def hit_keys_readable(self) -> None:
        # every key the manager reports HIT has an acknowledged host copy
        for node in self.manager.core.nodes():
            if node.state == "writing" and not node.wb_op:
                raise InvariantViolation("adapter_records", "the vLLM adapter", f"node {node.node_id} writing without an operation")

    def teardown(self) -> None:
        self.driver.drain()
        check_drained(self.manager)
        super().teardown()

