"""kvtier's vLLM worker: bytes moved between vLLM's KV tensors and the host pool by kvtier's
TransferEngine (CPU backend), and the layouts it refuses."""

import pytest
from vllm_guard import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from kvtier.adapters.vllm import KvtierOffloadingWorker  # noqa: E402
from kvtier.fsm import ConfigError  # noqa: E402

pytestmark = pytest.mark.vllm


def test_worker_moves_bytes_with_the_transfer_engine_and_reports_layers() -> None:
    blocks, page = 8, 64
    tensors = [torch.randint(0, 255, (blocks, page), dtype=torch.uint8).to(torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
    w = KvtierOffloadingWorker(caches, num_chunks=4, blocks_per_chunk=1, backend="cpu", host_pin=False)
    before = [t[[2, 5]].clone() for t in tensors]
    assert w.submit_store(7, GPULoadStoreSpec([2, 5], group_sizes=[2], block_indices=[0]), CPULoadStoreSpec([3, 0]))
    w.wait({7})
    (res,) = w.get_finished()
    assert res.job_id == 7 and res.success and res.transfer_size == 2 * 2 * page
    for t in tensors:
        t[[2, 5]] = 0
    assert w.submit_load(8, CPULoadStoreSpec([3, 0]), GPULoadStoreSpec([6, 1], group_sizes=[2], block_indices=[0]))
    w.wait({8})
    assert w.layers_done(8) in (-1, 1)
    (res,) = w.get_finished()
    assert res.job_id == 8 and res.success
    for t, b in zip(tensors, before):
        assert torch.equal(t[[6, 1]], b)


def test_worker_refuses_groups_that_cannot_share_host_slots() -> None:
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(torch.zeros(4, 64, dtype=torch.int8), 64),
                 CanonicalKVCacheTensor(torch.zeros(4, 32, dtype=torch.int8), 32)],
        group_data_refs=[[CanonicalKVCacheRef(0, 64)], [CanonicalKVCacheRef(1, 32)]])
    with pytest.raises(ConfigError, match="groups must match"):
        KvtierOffloadingWorker(caches, num_chunks=2, backend="cpu", host_pin=False)
