"""The kit's state machine for the vLLM adapter (extras ``vllm`` and ``testing``).

:class:`VllmAdapterMachine` drives :class:`~kvtier.adapters.vllm_manager.KvtierOffloadingManager`
through vLLM's real offloading connector, KV cache manager and requests
(:class:`~kvtier.adapters.vllm_engine.Engine`): requests sharing prefixes are added,
scheduler steps run (chunked prefill, GPU prefix hits, offload lookups, loads and stores
whose jobs complete zero to three steps late, and fail at the campaign's fault rate),
requests are preempted, and aborted while waiting, loading, running or with stores in
flight. After every step the core's invariants and the adapter's records are checked
(every job the workers still hold is a transfer the manager tracks); at the end
everything drains and nothing may be left: no request state, no pin, lock, operation,
reserved or staged page.

``VllmAdapterMachine.configured(groups=(None, 32))`` runs a hybrid model (full attention
plus a sliding window of 32 tokens).
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import rule
from vllm.v1.kv_offload.base import ReqContext  # type: ignore[import-untyped, import-not-found, unused-ignore]

from kvtier.fsm.errors import InvariantViolation

from ..testing.machines import KitMachine, recorded
from ..testing.offload_contract import OffloadContract
from .vllm import GROUP, KvtierOffloadingManager
from .vllm_config import kvtier_extra_config
from .vllm_engine import Engine, SimWorker

__all__ = ["VllmAdapterMachine", "check_drained", "check_engine"]

T = 16  # tokens per block / chunk


def check_drained(manager: KvtierOffloadingManager) -> None:
    """Raise :class:`InvariantViolation` if anything is left after every job completed and
    every request finished."""
    core = manager.core
    manager.check_invariants()
    if manager.in_flight() or manager.tracked_requests():
        raise InvariantViolation("drained", "the vLLM adapter", f"{manager.in_flight()} transfers and "
                                 f"{manager.tracked_requests()} requests still tracked after draining")
    if core.operations():
        raise InvariantViolation("drained", "the vLLM adapter", f"operations still in flight: {sorted(core.operations())}")
    held = 0
    for n in core.nodes():
        if n.lock_ref or n.host_pin or n.borrow_ref:
            raise InvariantViolation("drained", "the vLLM adapter", f"node {n.node_id} still locked/pinned/borrowed")
        if n.state not in ("host", "backed"):
            raise InvariantViolation("drained", "the vLLM adapter", f"node {n.node_id} left in state {n.state!r} "
                                     "(expected an acknowledged host copy)")
        held += len(n.host.get(GROUP, ()))
    if held != manager.host_chunks_used():
        raise InvariantViolation("drained", "the vLLM adapter", f"host pages used {manager.host_chunks_used()} but "
                                 f"nodes hold {held}")
    if core.external_pages(GROUP):
        raise InvariantViolation("drained", "the vLLM adapter", f"staging pages leaked: "
                                 f"{sorted(core.external_pages(GROUP))[:8]}")


def check_engine(engine: Engine) -> None:
    """kvtier's invariants after a step of ``engine`` (an observer for ``Engine.on_step``):
    the core's and the adapter's, and one manager transfer per job the workers hold."""
    m = engine.manager
    assert isinstance(m, KvtierOffloadingManager)
    m.check_invariants()
    if m.in_flight() != len(engine.worker.jobs):
        raise InvariantViolation("adapter_records", "the vLLM adapter", f"{m.in_flight()} transfers tracked, "
                                 f"{len(engine.worker.jobs)} jobs with the workers")


class VllmAdapterMachine(KitMachine):
    """Stateful test of the adapter inside vLLM's connector loop (see module docstring)."""

    kit_invariants = ("check_adapter",)
    #: per KV cache group: None (full attention) or a sliding window in tokens
    groups: ClassVar[tuple[int | None, ...]] = (None,)
    device_blocks: ClassVar[int] = 16
    host_chunks: ClassVar[int] = 12

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0
        self.fail_roll = 0
        self.worker = SimWorker(delay=lambda job: self.delay, fail=lambda job: self.kit_fail(self.fail_roll))
        self.engine = Engine(kvtier_extra_config(num_host_chunks=self.host_chunks), self.device_blocks, T,
                             self.groups, chunk_tokens=2 * T, worker=self.worker, max_model_len=T * 64)
        assert isinstance(self.engine.manager, KvtierOffloadingManager)
        self.manager = self.engine.manager
        # vLLM's manager contract, checked on every call
        self.contract = OffloadContract(self.manager, probe_ctx=ReqContext(req_id="probe"))
        self.next_id = 0

    def _pick(self, i: int, phases: tuple[str, ...]) -> str | None:
        ids = sorted((rid for rid, r in self.engine.reqs.items() if r.phase in phases), key=int)
        return ids[i % len(ids)] if ids else None

    # ------------------------------------------------------------------ rules
    @rule(family=st.integers(0, 2), shared=st.integers(0, 5), own=st.integers(0, 3), tail=st.integers(1, T))
    @recorded
    def add(self, family: int, shared: int, own: int, tail: int) -> None:
        rid = str(self.next_id)
        self.next_id += 1
        blocks = [family * 1000 + i for i in range(shared)] + [10_000 + self.next_id * 10 + i for i in range(own)]
        prompt = [t for b in blocks for t in range(b * T, b * T + T)] + list(range(7, 7 + tail))
        self.engine.add(rid, prompt)

    @rule(steps=st.integers(1, 3), delay=st.integers(0, 3), roll=st.integers(0, 999))
    @recorded
    def step(self, steps: int, delay: int, roll: int) -> None:
        """Scheduler steps; their jobs complete ``delay`` steps late and fail per ``roll``."""
        self.delay, self.fail_roll = delay, roll
        for _ in range(steps):
            self.engine.step()

    @rule(i=st.integers(0, 7), phase=st.sampled_from(["waiting", "loading", "running", "finished"]))
    @recorded
    def abort(self, i: int, phase: str) -> None:
        """Abort a queued, loading or running request; a finished one with stores in
        flight is aborted again (nothing changes)."""
        rid = self._pick(i, (phase,))
        if rid is not None:
            self.engine.abort(rid)

    @rule(i=st.integers(0, 7))
    @recorded
    def preempt(self, i: int) -> None:
        rid = self._pick(i, ("running",))
        if rid is not None:
            self.engine.preempt(rid)

    @rule(i=st.integers(0, 7))
    @recorded
    def complete_mixed(self, i: int) -> None:
        """An engine completes one prepared store whole and part of another in one call: the
        manager must refuse it and settle neither (:meth:`OffloadContract.complete_mixed`)."""
        self.contract.complete_mixed(i)

    # ------------------------------------------------------------------ checks
    def check_adapter(self) -> None:
        check_engine(self.engine)
        self.contract.probe(ReqContext(req_id="probe"))

    def teardown(self) -> None:
        self.delay = 0
        self.fail_roll = 999
        self.worker.fail = lambda job: False
        self.engine.drain()
        check_drained(self.manager)
        self.contract.check_drained()
        super().teardown()
