"""vLLM offloading configurations built the way vLLM builds them, for the kit, the tests
and ``bench/`` (extra ``vllm``).

vLLM's ``OffloadingConnector`` turns its ``VllmConfig`` into an ``OffloadingConfig``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``,
``build_offloading_config``) and hands it to ``OffloadingSpecFactory.create_spec``, which
loads the spec named by ``kv_connector_extra_config`` (``spec_name``,
``spec_module_path``). ``build_offloading_config`` reads the model config (from a model
hub), so this module builds the same ``OffloadingConfig`` from explicit sizes instead;
:func:`make_spec` then goes through vLLM's factory exactly as a served engine does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload.config import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # type: ignore[import-untyped, import-not-found, unused-ignore]

__all__ = ["KVTIER_SPEC", "kvtier_extra_config", "make_spec", "offloading_config", "prometheus_recorder",
           "vllm_config"]

#: ``kv_connector_extra_config`` keys that select kvtier's spec (``vllm serve
#: --kv-transfer-config``, docs/vllm.md)
KVTIER_SPEC: dict[str, str] = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.adapters.vllm"}


def kvtier_extra_config(**extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for kvtier's spec plus ``extra`` (e.g.
    ``num_host_chunks=64``, ``store_threshold=2``)."""
    return {**KVTIER_SPEC, **extra}


def offloading_config(extra_config: Mapping[str, Any], *, tokens_per_block: int = 16,
                      groups: Sequence[int | None] = (None,), worker_kv_bytes_per_block: int = 4096,
                      enable_events: bool = False, blocks_per_chunk: int = 1, world_size: int = 1,
                      max_model_len: int = 0) -> Any:
    """The ``OffloadingConfig`` vLLM would build for a model whose KV cache groups are
    ``groups`` (per group ``None``: full attention, or a sliding window in chunks).

    Args:
        extra_config: ``kv_connector_extra_config``.
        tokens_per_block: tokens per GPU block (= per block hash).
        groups: per KV cache group, ``None`` or its sliding window in offload chunks.
        worker_kv_bytes_per_block: KV bytes one worker holds per block, all groups.
        enable_events: vLLM's ``enable_kv_cache_events``.
        blocks_per_chunk: GPU blocks per offload chunk.
        world_size: workers (tensor-parallel ranks).
        max_model_len: longest request in tokens (0: unknown).
    """
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block, (f"layer.{g}",), g, w) for g, w in enumerate(groups)),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block, enable_kv_cache_events=enable_events,
        extra_config=dict(extra_config), engine_id="engine-0",
        model=OffloadingModelConfig("model", "float16", max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def make_spec(extra_config: Mapping[str, Any], **config: Any) -> Any:
    """The spec vLLM's ``OffloadingSpecFactory`` creates for ``extra_config`` (keyword
    arguments: :func:`offloading_config`'s). The factory's logging imports
    ``vllm.distributed``: on a ``--no-deps`` install, :mod:`kvtier.adapters.vllm_stubs`
    stands in for the serving packages it names (nothing is shadowed on a full install)."""
    from . import vllm_stubs

    vllm_stubs.install()
    return OffloadingSpecFactory.create_spec(offloading_config(extra_config, **config))


def vllm_config(extra_config: Mapping[str, Any], block_tokens: int = 16) -> Any:
    """A ``VllmConfig`` on the CPU device with the ``OffloadingConnector`` configured by
    ``extra_config`` and GPU prefix caching on (no model: its config needs a model hub;
    :mod:`kvtier.adapters.vllm_stubs` stands in for the serving packages on a ``--no-deps``
    install)."""
    from . import vllm_stubs

    vllm_stubs.install()
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig  # type: ignore[import-untyped, import-not-found, unused-ignore]

    return VllmConfig(device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(block_size=block_tokens, enable_prefix_caching=True),
                      kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                          kv_connector_extra_config=dict(extra_config)))


def prometheus_recorder(config: Any) -> tuple[Any, Any]:
    """vLLM's own Prometheus recorder for the KV connector of ``config`` (``KVConnectorProm``:
    for the ``OffloadingConnector`` it builds ``OffloadPromMetrics`` from the spec's metric
    definitions, as ``vllm serve``'s stats logger does), on a registry of its own; returns
    (recorder, registry). ``recorder.observe(stats.data, 0)`` records one stats payload,
    engine 0 labelled ``model_name="model"``, ``engine="0"``."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # type: ignore[import-untyped, import-not-found, unused-ignore]

    registry = CollectorRegistry()

    class Recorder(KVConnectorProm):  # type: ignore[misc, unused-ignore]
        _gauge_cls = partial(Gauge, registry=registry)  # type: ignore[assignment, unused-ignore]
        _counter_cls = partial(Counter, registry=registry)  # type: ignore[assignment, unused-ignore]
        _histogram_cls = partial(Histogram, registry=registry)  # type: ignore[assignment, unused-ignore]

    return Recorder(config, ["model_name", "engine"], {0: ["model", "0"]}), registry
