"""kvtier's vLLM spec as a vLLM user configures it: loaded by vLLM's OffloadingSpecFactory
from ``kv_connector_extra_config``, its capacity, its configuration errors, and its metrics
recorded by vLLM's own Prometheus recorder (what ``vllm serve``'s stats logger runs)."""

import pytest
from vllm_guard import require_vllm

require_vllm()

from kvtier.adapters import vllm_stubs  # noqa: E402

vllm_stubs.install()

from vllm.v1.kv_offload.base import OffloadingManager, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvtier.adapters.vllm import KvtierOffloadingSpec  # noqa: E402
from kvtier.adapters.vllm_config import (  # noqa: E402
    kvtier_extra_config,
    make_spec,
    offloading_config,
    prometheus_recorder,
    vllm_config,
)
from kvtier.fsm import ConfigError  # noqa: E402

pytestmark = pytest.mark.vllm

LABELS = {"model_name": "model", "engine": "0"}


def test_vllm_factory_loads_the_spec_from_kv_connector_extra_config() -> None:
    extra = kvtier_extra_config(cpu_bytes_to_use=64 * 4096)
    assert OffloadingSpecFactory.get_spec_cls(extra) is KvtierOffloadingSpec
    spec = make_spec(extra)
    assert spec.num_chunks == 64
    m = spec.get_manager()
    assert isinstance(m, OffloadingManager) and m.num_chunks == 64 and spec.get_manager() is m
    assert m.store_threshold == 1 and m.chain and m.eviction == "lru"
    extra.update(store_threshold=3, kvtier_eviction="lru2", kvtier_chain=False)
    m2 = make_spec(extra).get_manager()
    assert m2.store_threshold == 3 and not m2.chain and m2.core.eviction.name == "lru2"


def test_capacity_counts_keys_of_one_group_vllm_56871() -> None:
    # vLLM #56871: 8 groups of 1 KiB blocks (worker bytes per block: 8 KiB). vLLM's CPU spec
    # divides the budget by 8 KiB per key; a key holds one group's chunk (1 KiB).
    spec = make_spec(kvtier_extra_config(cpu_bytes_to_use=1 << 20), groups=(None,) * 8,
                     worker_kv_bytes_per_block=8 * 1024)
    assert spec.num_chunks == (1 << 20) // 1024 == 1024


@pytest.mark.parametrize("key", ["cpu_bytes_to_use", "num_host_chunks", "store_threshold", "max_tracker_size"])
@pytest.mark.parametrize("value", ["abc", "", "1.5", float("nan"), float("inf"), -4096, True, 2.5, [1], None,
                                   (1 << 53) + 1, "9" * 5000])
def test_a_bad_extra_config_number_names_the_key_the_value_and_the_range(key: str, value: object) -> None:
    extra = {"num_host_chunks": 8} if key != "num_host_chunks" else {}
    extra[key] = value
    if key == "cpu_bytes_to_use":
        del extra["num_host_chunks"]
        if value is None:
            with pytest.raises(ConfigError, match="needs cpu_bytes_to_use"):
                KvtierOffloadingSpec(offloading_config(kvtier_extra_config(**extra)))
            return
    if key == "num_host_chunks" and value is None:
        extra["cpu_bytes_to_use"] = 64 * 4096  # None: the key is absent, the budget counts
        assert KvtierOffloadingSpec(offloading_config(kvtier_extra_config(**extra))).num_chunks == 64
        return
    with pytest.raises(ConfigError) as info:
        KvtierOffloadingSpec(offloading_config(kvtier_extra_config(**extra)))
    text = str(info.value)
    assert f"kv_connector_extra_config[{key!r}]" in text and "must be an integer in" in text
    assert "9" * 100 in text if isinstance(value, str) and len(value) > 40 else repr(value) in text


@pytest.mark.parametrize("value", [64 * 4096, str(64 * 4096), f" {64 * 4096} ", float(64 * 4096), "+262144"])
def test_cpu_bytes_to_use_takes_what_vllms_cpu_spec_takes(value: object) -> None:
    # vLLM's CPU spec reads int(cpu_bytes_to_use): digits from JSON or the command line, integral floats
    assert KvtierOffloadingSpec(offloading_config(kvtier_extra_config(cpu_bytes_to_use=value))).num_chunks == 64
    spec = KvtierOffloadingSpec(offloading_config(kvtier_extra_config(num_host_chunks="8", store_threshold="3",
                                                                      max_tracker_size=1e3)))
    assert (spec.num_chunks, spec.store_threshold, spec.max_tracker_size) == (8, 3, 1000)
    assert KvtierOffloadingSpec.build_metric_definitions({"store_threshold": "3"}) == \
        KvtierOffloadingSpec.build_metric_definitions({"store_threshold": 3})


@pytest.mark.parametrize("extra, match", [
    ({}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 100}, "holds no chunk"),
    ({"num_host_chunks": -1}, "num_host_chunks"),
    ({"num_host_chunks": 8, "eviction_policy": "arc"}, "vLLM's policies"),
    ({"num_host_chunks": 8, "kvtier_eviction": "fifo"}, "kvtier_eviction"),
    ({"num_host_chunks": 8, "store_threshold": "2x"}, "store_threshold"),
    ({"num_host_chunks": 8, "kvtier_chain": "yes"}, "kvtier_chain"),
])
def test_a_bad_extra_config_names_the_key(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KvtierOffloadingSpec(offloading_config(kvtier_extra_config(**extra)))


@pytest.mark.parametrize("threshold", [0, 2])
def test_vllm_prometheus_recorder_observes_every_stats_the_manager_emits(threshold: int) -> None:
    # vllm serve's stats logger: OffloadPromMetrics asserts every metric it is given was declared
    extra = kvtier_extra_config(num_host_chunks=4, store_threshold=threshold)
    recorder, registry = prometheus_recorder(vllm_config(extra))
    m = make_spec(extra).get_manager()
    c = ReqContext(req_id="r")
    a = [make_offload_key(b"a%d" % i, 0) for i in range(3)]
    outs = [m.prepare_store(a[:2], c) for _ in range(max(1, threshold))]  # stored on the last offer
    assert outs[-1] is not None and len(outs[-1].keys_to_store) == 2
    recorder.observe(m.get_stats().data, 0)
    assert registry.get_sample_value("vllm:kv_offload_cpu_cache_write_usage_perc", LABELS) == 0.5
    m.complete_store(a[:2], c)
    m.prepare_load(a[:1], c)
    assert m.prepare_store(a, c) is not None  # a[2]: stored (threshold off) or skipped (first offer)
    m.complete_load(a[:1], c)
    for payload in (m.get_stats(), m.get_stats()):  # the second one has no new samples
        recorder.observe(payload.data, 0)
    pending = 1 if threshold < 2 else 0
    assert registry.get_sample_value("vllm:kv_offload_cpu_cache_usage_perc", LABELS) == pending / 4
    assert registry.get_sample_value("vllm:kv_offload_cpu_allocation_size_count", LABELS) == 1 + pending
    skipped = registry.get_sample_value("vllm:kv_offload_stores_skipped_total", LABELS)
    assert skipped == (None if threshold < 2 else 2 + 1)
