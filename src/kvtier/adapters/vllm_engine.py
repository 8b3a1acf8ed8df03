"""A small engine loop around vLLM 0.33's real offloading connector (extras ``vllm`` and
``testing``).

:class:`Engine` runs vLLM's own ``OffloadingConnectorScheduler``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``), built from a
spec that vLLM's ``OffloadingSpecFactory`` creates from ``kv_connector_extra_config``, with
vLLM's real ``KVCacheManager``, ``Request`` and block hasher. Each :meth:`Engine.step` is
one scheduler step in the order of vLLM's ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``:
``schedule`` then ``update_from_output``): running requests first (chunked prefill,
preemption of the newest when the GPU is full), then waiting ones (GPU prefix hit,
``get_num_new_matched_tokens``, ``allocate_slots``, ``update_state_after_alloc``, an
asynchronous load parks the request until it lands), ``build_connector_meta`` (store jobs,
flushes), the forward pass (a request whose prompt is done samples one token and finishes:
``request_finished`` next step), then the worker's output (``update_connector_output``).

The worker is simulated (:class:`SimWorker`): a job completes a number of steps after it
was submitted (late acks), a flushed job at once; a load can fail (the loaded blocks are
invalid: the request recomputes them, as ``_update_requests_with_invalid_blocks`` does) and
a store can fail (the manager is told ``success=False`` through :class:`ManagerProbe`,
which also times every manager call: the scheduler-side time). Metadata only: no bytes move.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import vllm_stubs

vllm_stubs.install()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_sliding_window_size_in_chunks  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.sampling_params import SamplingParams  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.v1.kv_cache_interface import (  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: E402

from .vllm_config import make_spec, vllm_config  # noqa: E402
from .vllm_probe import ManagerProbe, block_hasher  # noqa: E402

__all__ = ["Engine", "EngineRequest", "SimJob", "SimWorker", "cpu_extra_config"]


@dataclass
class SimJob:
    """One transfer job handed to the simulated worker."""

    job_id: int
    req_id: str
    is_store: bool
    due: int  # step after which it is reported done
    fail: bool
    slots: tuple[int, ...]  # host chunk slots (a store's destination, a load's source)
    gpu_blocks: tuple[int, ...]


class SimWorker:
    """The workers' side of the connector, simulated (metadata only).

    Args:
        delay: steps a job takes (0: reported in the step that submitted it).
        fail: whether a job fails.
    """

    def __init__(self, delay: Callable[[SimJob], int] = lambda job: 0,
                 fail: Callable[[SimJob], bool] = lambda job: False) -> None:
        self.delay = delay
        self.fail = fail
        self.jobs: dict[int, SimJob] = {}
        self.failed = 0

    def submit(self, meta: Any, step: int, reqs: dict[str, EngineRequest]) -> None:
        for jobs, is_store in ((meta.load_jobs, False), (meta.store_jobs, True)):
            for job_id, job in jobs.items():
                host = job.dst_spec if is_store else job.src_spec
                gpu = job.src_spec if is_store else job.dst_spec
                sj = SimJob(job_id, job.req_id, is_store, step, False, tuple(int(x) for x in host.block_ids),
                            tuple(int(x) for x in gpu.block_ids))
                sj.due = step + self.delay(sj)
                sj.fail = self.fail(sj)
                self.jobs[job_id] = sj
        for job_id in meta.jobs_to_flush:  # the workers wait for these before the forward pass
            if job_id in self.jobs:
                self.jobs[job_id].due = step

    def done(self, step: int) -> list[SimJob]:
        out = [j for j in self.jobs.values() if j.due <= step]
        for j in out:
            del self.jobs[j.job_id]
        return sorted(out, key=lambda j: j.job_id)


@dataclass
class EngineRequest:
    """An engine request: vLLM's ``Request`` and where the engine has it."""

    req: Any
    phase: str = "waiting"  # waiting, loading, running, finished
    local: int = -1  # GPU prefix hit tokens at the first admission (-1: not admitted yet)
    external: int = 0  # tokens loaded from the offload tier at the first admission
    admissions: list[tuple[int, int]] = field(default_factory=list)  # (local, external) per admission
    load_failed: bool = False
    load_start: int = 0
    resumed: bool = False  # preempted, to be scheduled again as a resumed request
    free_after_load: bool = False  # aborted while loading: blocks freed when the load lands


class Engine:
    """vLLM's offloading connector, KV cache manager and requests in a scheduler loop.

    Args:
        extra_config: ``kv_connector_extra_config`` (kvtier's spec:
            :func:`~kvtier.adapters.vllm_config.kvtier_extra_config`; without
            ``spec_name``, vLLM's own CPU spec).
        device_blocks: GPU blocks of the ``KVCacheManager`` (plus vLLM's null block).
        block_tokens: tokens per GPU block (= per offload chunk).
        groups: per KV cache group, ``None`` (full attention) or a sliding window in tokens.
        chunk_tokens: chunked prefill: tokens per request per step (``None``: the whole prompt).
        step_tokens: token budget of one step, all requests.
        worker: the simulated worker (default: every job done in the step it is submitted).
        max_model_len: longest request in tokens.
        hasher: vLLM's request block hasher to use (default: sha256, as vLLM's).
    """

    def __init__(self, extra_config: dict[str, Any], device_blocks: int, block_tokens: int = 16,
                 groups: Sequence[int | None] = (None,), chunk_tokens: int | None = None,
                 step_tokens: int = 1 << 30, worker: SimWorker | None = None, max_model_len: int = 1 << 20,
                 hasher: Callable[[Any], Any] | None = None) -> None:
        self.T = block_tokens
        specs = []
        for i, w in enumerate(groups):
            kw: dict[str, Any] = dict(block_size=block_tokens, num_kv_heads=1, head_size=1, dtype=torch.float32)
            spec: Any = FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(**kw, sliding_window=w)
            specs.append(KVCacheGroupSpec([f"layer.{i}"], spec))
        cfg = KVCacheConfig(num_blocks=device_blocks + 1, kv_cache_tensors=[], kv_cache_groups=specs)
        self.kvm = KVCacheManager(cfg, max_model_len=max_model_len, scheduler_block_size=block_tokens,
                                  hash_block_size=block_tokens, enable_caching=True)
        page = sum(s.kv_cache_spec.page_size_bytes for s in specs)
        windows = [get_sliding_window_size_in_chunks(s.kv_cache_spec, block_tokens) for s in specs]
        self.spec = make_spec(extra_config, tokens_per_block=block_tokens, groups=windows,
                              worker_kv_bytes_per_block=page, max_model_len=max_model_len)
        self.vllm_config = vllm_config(extra_config, block_tokens)
        self.connector = OffloadingConnectorScheduler(self.spec, self.vllm_config, cfg)
        self.manager = self.connector.manager
        self.probe = ManagerProbe(self.manager)
        self.connector.manager = self.probe
        self.worker = worker if worker is not None else SimWorker()
        self.hasher = hasher if hasher is not None else block_hasher("sha256", block_tokens)
        self.chunk = chunk_tokens
        self.step_tokens = step_tokens
        self.sp = SamplingParams(max_tokens=1)
        self.reqs: dict[str, EngineRequest] = {}
        self.running: list[EngineRequest] = []
        self.waiting: list[EngineRequest] = []
        self.finished_ids: set[str] = set()
        self.preempted_ids: set[str] = set()
        self.recving: set[str] = set()
        self.force_preempt: set[str] = set()
        self.step_no = 0
        self.kvm_s = self.hash_s = 0.0
        self.on_step: list[Callable[[Engine], None]] = []

    # -------------------------------------------------------------- requests
    def add(self, req_id: str, prompt: Sequence[int]) -> EngineRequest:
        """Scheduler.add_request: a new waiting request (``on_new_request``)."""
        t = time.perf_counter()
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=self.sp,
                      pooling_params=None, block_hasher=self.hasher)
        self.hash_s += time.perf_counter() - t
        r = EngineRequest(req)
        self.connector.on_new_request(req)
        self.reqs[req_id] = r
        self.waiting.append(r)
        return r

    def abort(self, req_id: str) -> None:
        """Scheduler.finish_requests(FINISHED_ABORTED) on a request in any phase."""
        r = self.reqs[req_id]
        if r.phase == "finished":
            return
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        loading = r.phase == "loading" and req_id not in self.recving
        r.req.status = RequestStatus.FINISHED_ABORTED
        self._free(r, delay_blocks=loading)

    def preempt(self, req_id: str) -> None:
        """Preempt a running request at the start of the next step."""
        self.force_preempt.add(req_id)

    def _free(self, r: EngineRequest, delay_blocks: bool = False) -> None:
        """Scheduler._free_request: request_finished, then the blocks (unless a load is
        still writing them), and the id goes to the next step's finished_req_ids."""
        r.phase = "finished"
        self.connector.request_finished(r.req)
        self.finished_ids.add(r.req.request_id)
        if delay_blocks:
            r.free_after_load = True
        else:
            self._kvm("free", r.req)

    def _kvm(self, name: str, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return getattr(self.kvm, name)(*args, **kw)
        finally:
            self.kvm_s += time.perf_counter() - t

    def _preempt(self, r: EngineRequest) -> None:
        """Scheduler._preempt_request."""
        self.running.remove(r)
        self._kvm("free", r.req)
        r.req.status = RequestStatus.PREEMPTED
        r.req.num_computed_tokens = 0
        r.req.num_preemptions += 1
        r.phase = "waiting"
        r.resumed = True
        self.waiting.insert(0, r)
        self.preempted_ids.add(r.req.request_id)

    def _want(self, r: EngineRequest, budget: int) -> int:
        left = int(r.req.num_tokens - r.req.num_computed_tokens)
        return max(0, min(left, budget, self.chunk if self.chunk is not None else left))

    # -------------------------------------------------------------- a step
    def _landed(self, r: EngineRequest) -> None:
        """Scheduler._update_waiting_for_remote_kv: a load landed (or failed)."""
        req = r.req
        if r.load_failed:
            r.load_failed = False
            req.num_computed_tokens = r.load_start  # the loaded blocks are invalid
            if req.num_computed_tokens:
                self._kvm("cache_blocks", req, req.num_computed_tokens)
            else:
                self._kvm("free", req)
        else:
            self._kvm("cache_blocks", req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1
        req.status = RequestStatus.WAITING
        r.phase = "waiting"

    def _admit(self, r: EngineRequest, budget: int, out: dict[str, Any]) -> int | None:
        """One waiting request through Scheduler.schedule's waiting loop; returns the
        tokens it was scheduled, 0 when it waits (a load, or the connector deferred it),
        None when the GPU has no room (the loop stops)."""
        req = r.req
        rid = req.request_id
        if r.phase == "loading":
            if rid not in self.recving:
                return 0
            self.recving.discard(rid)
            self._landed(r)
        ext, is_async = 0, False
        if req.num_computed_tokens == 0:
            blocks, n_local, _ = self._kvm("get_computed_blocks", req)
            matched, is_async = self.connector.get_num_new_matched_tokens(req, n_local)
            if matched is None:
                return 0
            ext = int(matched)
        else:
            blocks, n_local = self.kvm.empty_kv_cache_blocks, 0
        computed = req.num_computed_tokens + n_local + ext
        n_new = 0 if is_async else max(0, min(req.num_tokens - computed, budget,
                                              self.chunk if self.chunk is not None else budget))
        new = self._kvm("allocate_slots", req, n_new, num_new_computed_tokens=n_local, new_computed_blocks=blocks,
                        num_external_computed_tokens=ext, delay_cache_blocks=is_async)
        if new is None:
            return None
        self.connector.update_state_after_alloc(req, self.kvm.get_blocks(rid), ext)
        if req.num_computed_tokens == 0:
            r.admissions.append((n_local, ext))
            if r.local < 0:
                r.local, r.external = n_local, ext
        req.num_computed_tokens = computed
        if is_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            r.phase = "loading"
            r.load_start = n_local
            return 0
        self.waiting.remove(r)
        self.running.append(r)
        req.status = RequestStatus.RUNNING
        r.phase = "running"
        ids = self.kvm.get_blocks(rid).get_block_ids()
        if r.resumed:
            r.resumed = False
            out["resumed"].add(rid)
            out["cached"].append((rid, ids))
        else:
            out["new"].append(NewRequestData.from_request(req, ids))
        return n_new

    def step(self) -> None:
        """One scheduler step (see the module docstring)."""
        out: dict[str, Any] = {"new": [], "cached": [], "resumed": set()}
        sched: dict[str, int] = {}
        budget = self.step_tokens
        for rid in sorted(self.force_preempt):
            r = self.reqs.get(rid)
            if r is not None and r in self.running:
                self._preempt(r)
        self.force_preempt.clear()
        preempted = bool(self.preempted_ids)
        i = 0
        while i < len(self.running):  # running requests: chunked prefill
            r = self.running[i]
            n = self._want(r, budget)
            if n == 0:
                i += 1
                continue
            blocks = self._kvm("allocate_slots", r.req, n)
            while blocks is None:  # the GPU is full: preempt the newest running request
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
                blocks = self._kvm("allocate_slots", r.req, n)
            if blocks is None:
                continue
            sched[r.req.request_id] = n
            out["cached"].append((r.req.request_id, blocks.get_block_ids()))
            budget -= n
            i += 1
        if not preempted:  # (vLLM admits no waiting request in a step that preempted)
            holding = [r for r in self.waiting if r.phase == "loading" or r.req.num_computed_tokens > 0]
            for r in holding + [r for r in self.waiting if r not in holding]:  # kv_holding_waiting first
                if budget <= 0:
                    break
                got = self._admit(r, budget, out)
                if got is None:
                    break
                if got:
                    sched[r.req.request_id] = got
                    budget -= got
        cached = out["cached"]
        so = SchedulerOutput(
            scheduled_new_reqs=out["new"],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[rid for rid, _ in cached], resumed_req_ids=out["resumed"],
                new_token_ids=[[] for _ in cached], all_token_ids={}, new_block_ids=[ids for _, ids in cached],
                num_computed_tokens=[self.reqs[rid].req.num_computed_tokens for rid, _ in cached],
                num_output_tokens=[0 for _ in cached]),
            num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=self.finished_ids,
            free_encoder_mm_hashes=[], preempted_req_ids=self.preempted_ids,
            num_common_prefix_blocks=[0] * len(self.kvm.kv_cache_config.kv_cache_groups))
        self.finished_ids, self.preempted_ids = set(), set()
        meta = self.connector.build_connector_meta(so)
        self.worker.submit(meta, self.step_no, self.reqs)
        for rid, n in sched.items():  # the forward pass; a finished prompt samples one token
            r = self.reqs[rid]
            r.req.num_computed_tokens += n
            if r.req.num_computed_tokens >= r.req.num_tokens:
                r.req.append_output_token_ids(0)
                self.running.remove(r)
                r.req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._free(r)
        self._worker_output()
        self.step_no += 1
        for observer in self.on_step:
            observer(self)

    def _worker_output(self) -> None:
        """Scheduler.update_from_output's connector part: the jobs the workers finished."""
        done = self.worker.done(self.step_no)
        for j in done:
            if j.is_store and j.fail:
                self.probe.fail_store(j.slots)
        self.worker.failed += sum(j.fail for j in done)
        invalid = {b for j in done if not j.is_store and j.fail for b in j.gpu_blocks}
        out = KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(
            completed_jobs={j.job_id: 1 for j in done}), finished_recving={j.req_id for j in done if not j.is_store},
            invalid_block_ids=invalid)
        self.connector.update_connector_output(out)
        for j in done:
            if j.is_store:
                continue
            r = self.reqs[j.req_id]
            if r.free_after_load:
                r.free_after_load = False
                self._kvm("free", r.req)
            elif r.phase == "loading":
                self.recving.add(j.req_id)
                r.load_failed = r.load_failed or j.fail

    def busy(self) -> bool:
        """Requests not finished, jobs in flight, or finished ids not yet reported."""
        return bool(self.running or self.waiting or self.worker.jobs or self.finished_ids)

    def drain(self, max_steps: int = 10_000) -> None:
        """Step until every request finished and every job completed.

        Raises:
            RuntimeError: still busy after ``max_steps`` steps (a request that can never
                be scheduled: more blocks than the GPU has).
        """
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_steps} steps: {len(self.running)} running, "
                           f"{len(self.waiting)} waiting, {len(self.worker.jobs)} jobs")

    def run(self, req_id: str, prompt: Sequence[int]) -> tuple[int, int]:
        """Add a request, drain, and return its (GPU hit, offload hit) tokens."""
        r = self.add(req_id, prompt)
        self.drain()
        return r.local, r.external


def cpu_extra_config(num_chunks: int, block_tokens: int = 16, groups: Sequence[int | None] = (None,)) -> dict[str, Any]:
    """``kv_connector_extra_config`` giving vLLM's own CPU spec (the control) ``num_chunks``
    chunks for an :class:`Engine` of ``block_tokens`` and ``groups``: its budget is per
    chunk of all groups, rounded up to its alignment (``vllm/v1/kv_offload/cpu/spec.py``)."""
    from vllm.utils.math_utils import round_up  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # type: ignore[import-untyped, import-not-found, unused-ignore]

    kw: dict[str, Any] = dict(block_size=block_tokens, num_kv_heads=1, head_size=1, dtype=torch.float32)
    page = sum((FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(**kw, sliding_window=w)).page_size_bytes
               for w in groups)
    return {"cpu_bytes_to_use": num_chunks * round_up(page, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)}
