"""kvtier's vLLM worker: moves offload chunks between vLLM's KV tensors and a host pool
with kvtier's :class:`~kvtier.transfer.TransferEngine` (extra ``kvtier[vllm]``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Direction, Family, GroupTransfer, TransferCommand

__all__ = ["KvtierOffloadingWorker"]


def _slots(spec: Any) -> list[int]:
    """Host chunk slots of a ``CPULoadStoreSpec`` (``block_ids``: chunk indices)."""
    return [int(x) for x in spec.block_ids]


class KvtierOffloadingWorker(OffloadingWorker):  # type: ignore[misc, unused-ignore]
    """Moves offload chunks between vLLM's KV tensors and a host pool with kvtier's
    :class:`~kvtier.transfer.TransferEngine`.

    One engine per vLLM KV cache group, all sharing one host pool: host page ``s * b + i``
    is GPU block ``i`` of chunk slot ``s`` (``b`` = blocks per chunk); a page holds one
    block of every tensor the group uses (one kvtier "layer" per tensor reference, in
    vLLM's order), so a slot can hold a chunk of any group.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` (``tensors``: ``[num_blocks, ...]``
            tensors; ``group_data_refs``: per group, one reference per tensor it uses).
        num_chunks: host chunk slots.
        blocks_per_chunk: GPU blocks per offload chunk.
        backend: kvtier backend name (``"auto"``, ``"cpu"``, ``"fake-async"``, ``"torch"``,
            ``"numba"``).
        host_pin: pin the host pool (default: when CUDA is available).

    Raises:
        ConfigError: groups whose references differ in count or page bytes (a shared slot
            could not hold every group's chunk), or bad sizes.
    """

    def __init__(self, kv_caches: Any, num_chunks: int, blocks_per_chunk: int = 1, *,
                 backend: str = "auto", host_pin: bool | None = None) -> None:
        from kvtier.transfer import DevicePool, HostPool, TransferEngine

        refs = [list(r) for r in kv_caches.group_data_refs]
        if not refs or not refs[0]:
            raise ConfigError("kvtier worker: vLLM passed no KV cache groups")
        def rows(rs: list[Any]) -> list[int]:  # bytes of one block row (padding included)
            return [int(kv_caches.tensors[r.tensor_idx].tensor[0].nbytes) for r in rs]

        shape = rows(refs[0])
        for g, rs in enumerate(refs):
            if rows(rs) != shape:
                raise ConfigError(f"kvtier worker: KV cache group {g} uses pages of {rows(rs)} "
                                  f"bytes, group 0 uses {shape}; groups must match to share host slots")
        if len(set(shape)) != 1:
            raise ConfigError(f"kvtier worker: a group's tensors must share one page size, got {shape}")
        self.blocks_per_chunk = blocks_per_chunk
        layers = tuple(range(len(shape)))
        self.spec = CacheGroupSpec("blocks", Family.HISTORY, 1, 1, layers, (ComponentSpec("kv", shape[0]),))
        self.host = HostPool([self.spec], {"blocks": num_chunks * blocks_per_chunk}, pin=host_pin, reserve_bytes=0)
        self.engines: list[Any] = []
        for rs in refs:
            tensors = {}
            for layer, ref in enumerate(rs):
                tensors[("blocks", "kv", layer)] = kv_caches.tensors[ref.tensor_idx].tensor
            device = DevicePool.register([self.spec], tensors)
            self.engines.append(TransferEngine([self.spec], self.host, device, backend))
        self._jobs: dict[int, set[int]] = {}  # job id -> engines still to acknowledge
        self._ok: dict[int, bool] = {}
        self._layers: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._t0: dict[int, float] = {}

    def _submit(self, job_id: int, direction: Direction, host_pages: Sequence[int], gpu: Any) -> bool:
        sizes = list(gpu.group_sizes)
        blocks = [int(b) for b in gpu.block_ids]
        b = self.blocks_per_chunk
        starts = list(itertools.accumulate([0] + sizes))
        cursor = 0
        per_engine: dict[int, tuple[list[int], list[int]]] = {}
        for g, n in enumerate(sizes):
            if not n:
                continue
            gb = blocks[starts[g]:starts[g] + n]
            first = int(gpu.block_indices[g]) % b  # the first chunk may start mid-chunk
            pages: list[int] = []
            while len(pages) < n:
                slot = host_pages[cursor]
                cursor += 1
                pages.extend(slot * b + i for i in range(first, b))
                first = 0
            per_engine[g] = (pages[:n], gb)
        self._jobs[job_id] = set(per_engine)
        self._ok[job_id] = True
        self._layers[job_id] = -1
        self._bytes[job_id] = 0
        self._t0[job_id] = time.perf_counter()
        for g, (hp, gb) in per_engine.items():
            src, dst = (gb, hp) if direction is Direction.WRITEBACK else (hp, gb)
            eng = self.engines[g]
            cmd = TransferCommand(op_id=job_id, direction=direction,
                                  transfers=(GroupTransfer("blocks", tuple(src), tuple(dst)),),
                                  layers=self.spec.layers, request_id=None, node_ids=())
            eng.submit(cmd)
            eng.flush()
            self._bytes[job_id] += len(hp) * self.spec.components[0].page_bytes * len(self.spec.layers)
        if not per_engine:
            self._jobs[job_id] = set()
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, Direction.WRITEBACK, _slots(dst_spec), src_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._submit(job_id, Direction.LOADBACK, _slots(src_spec), dst_spec)

    def _poll(self) -> None:
        for g, eng in enumerate(self.engines):
            for c in eng.poll_completions():
                if c.op_id not in self._jobs:
                    continue
                if c.layer is not None:
                    self._layers[c.op_id] = max(self._layers[c.op_id], c.layer)  # (per engine: lower bound below)
                    continue
                self._ok[c.op_id] = self._ok[c.op_id] and c.ok
                self._jobs[c.op_id].discard(g)

    def layers_done(self, job_id: int) -> int:
        """Highest layer index (vLLM tensor reference) complete for load ``job_id`` on
        some group's engine so far; -1 if none (layer-wise completion)."""
        self._poll()
        return self._layers.get(job_id, -1)

    def get_finished(self) -> list[TransferResult]:
        self._poll()
        out = []
        for job_id in [j for j, pending in self._jobs.items() if not pending]:
            del self._jobs[job_id]
            self._layers.pop(job_id, None)
            secs = time.perf_counter() - self._t0.pop(job_id)
            out.append(TransferResult(job_id=job_id, success=self._ok.pop(job_id),
                                      transfer_size=self._bytes.pop(job_id), transfer_time=secs))
        return out

    def wait(self, job_ids: set[int]) -> None:
        if any(j in self._jobs for j in job_ids):
            for eng in self.engines:
                eng.synchronize()

    def shutdown(self) -> None:
        for eng in self.engines:
            eng.synchronize()
