"""vLLM's offloading metrics for kvtier's manager (extra ``kvtier[vllm]``).

``vllm serve`` logs stats by default: every scheduler step its ``OffloadPromMetrics``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py``) observes the
manager's ``get_stats()`` and asserts that each metric it is given was declared by the
spec's ``build_metric_definitions``. :func:`metric_definitions` declares the ones
:func:`manager_stats` emits, with vLLM's names and meanings (those of its CPU spec,
``vllm/v1/kv_offload/cpu/spec.py``), so dashboards built for vLLM's CPU tier read kvtier's
the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
)

__all__ = ["ALLOCATION_SIZE", "CONFIG_INFO_KEYS", "READ_USAGE", "STORES_SKIPPED", "USAGE", "WRITE_USAGE",
           "manager_stats", "metric_definitions"]

#: vLLM's metric names (``vllm.v1.kv_offload.cpu.common.CPUOffloadingMetrics``)
STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
WRITE_USAGE = "vllm:kv_offload_cpu_cache_write_usage_perc"
READ_USAGE = "vllm:kv_offload_cpu_cache_read_usage_perc"
#: labels of ``vllm:kv_offload_config_info`` that kvtier's manager fills
CONFIG_INFO_KEYS = ("kvtier_host_chunks", "kvtier_eviction")


def metric_definitions(store_threshold: int) -> dict[str, Any]:
    """The Prometheus metrics kvtier's manager emits (``OffloadingSpec.build_metric_definitions``):
    three usage gauges, the allocation-size histogram and, with ``store_threshold >= 2``,
    the stores-skipped counter."""
    out: dict[str, Any] = {
        USAGE: OffloadingGaugeMetadata(documentation=(
            "Fraction of the kvtier host tier's chunks held by active transfers: being stored or "
            "pinned by loads (0.0 = idle, 1.0 = saturated; stores are refused when it stays high).")),
        WRITE_USAGE: OffloadingGaugeMetadata(documentation=(
            "Fraction of the kvtier host tier's chunks reserved by stores not yet completed.")),
        READ_USAGE: OffloadingGaugeMetadata(documentation=(
            "Fraction of the kvtier host tier's chunks pinned by loads not yet completed.")),
        ALLOCATION_SIZE: OffloadingHistogramMetadata(
            documentation="Chunks each prepare_store call asked the kvtier host tier for (refused calls too).",
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)),
    }
    if store_threshold >= 2:
        out[STORES_SKIPPED] = OffloadingCounterMetadata(
            documentation="Chunks kvtier did not store because they were offered fewer than store_threshold times.")
    return out


def manager_stats(num_chunks: int, writing: int, pinned: int, allocation_sizes: Sequence[int],
                  stores_skipped: int | None) -> Any:
    """An ``OffloadingConnectorStats`` with the metrics of :func:`metric_definitions`.

    Args:
        num_chunks: host capacity in chunks (0: every gauge reads 0.0).
        writing: chunks reserved by stores in flight.
        pinned: distinct chunks pinned by loads in flight.
        allocation_sizes: chunks asked for by each prepare_store call since the last stats.
        stores_skipped: chunks skipped by the store threshold since the last stats, or
            ``None`` when the threshold is off.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        OffloadingConnectorStats,
    )

    stats = OffloadingConnectorStats()
    write = writing / num_chunks if num_chunks else 0.0
    read = pinned / num_chunks if num_chunks else 0.0
    stats.set_gauge(USAGE, write + read)
    for size in allocation_sizes:
        stats.observe_histogram(ALLOCATION_SIZE, size)
    stats.set_gauge(WRITE_USAGE, write)
    stats.set_gauge(READ_USAGE, read)
    if stores_skipped is not None:
        stats.increase_counter(STORES_SKIPPED, stores_skipped)
    return stats
