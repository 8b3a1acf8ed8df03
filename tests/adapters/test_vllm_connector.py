"""kvtier inside vLLM 0.33's real offloading connector: vLLM's OffloadingConnectorScheduler,
KVCacheManager, Request and block hasher in a scheduler loop (kvtier.adapters.vllm_engine)
with a simulated worker (late acks, failed loads and stores), chunked prefill, preemption
and aborts; kvtier's invariants after every step, and the hit tokens compared with vLLM's
own CPU manager on the same sequence."""

import pytest
from vllm_guard import require_vllm

require_vllm()

from kvtier.adapters.vllm_config import kvtier_extra_config, prometheus_recorder  # noqa: E402
from kvtier.adapters.vllm_engine import Engine, SimJob, SimWorker, cpu_extra_config  # noqa: E402
from kvtier.adapters.vllm_machine import check_drained, check_engine  # noqa: E402

pytestmark = pytest.mark.vllm

T = 16
MANAGERS = ("kvtier", "vllm")


def prompt(blocks: list[int], tail: int = 5) -> list[int]:
    return [t for b in blocks for t in range(b * T, b * T + T)] + list(range(3, 3 + tail))


def engine(kind: str, host: int, device: int, **kw: object) -> Engine:
    extra = kvtier_extra_config(num_host_chunks=host) if kind == "kvtier" else cpu_extra_config(host, T)
    e = Engine(extra, device_blocks=device, block_tokens=T, **kw)  # type: ignore[arg-type]
    assert e.manager.__class__.__name__ == ("KvtierOffloadingManager" if kind == "kvtier" else "CPUOffloadingManager")
    if kind == "kvtier":
        e.on_step.append(check_engine)  # kvtier's invariants after every step
    return e


def finish(e: Engine, rid: str, p: list[int], max_steps: int = 200) -> tuple[int, int]:
    """Add a request and step until it finished (other jobs may stay in flight)."""
    r = e.add(rid, p)
    for _ in range(max_steps):
        if r.phase == "finished":
            return r.local, r.external
        e.step()
    raise AssertionError(f"request {rid} not finished after {max_steps} steps ({r.phase})")


SEQUENCE = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 10, 11, 12, 13, 14], [1, 2, 3, 4, 5], [9, 10, 20],
            [30, 31, 32, 33, 34, 35], [1, 2, 40], [9, 10, 11, 12, 50]]


@pytest.mark.parametrize("chunk, delay", [(None, 0), (2 * T, 2), (T, 5)])
def test_hit_tokens_match_vllms_own_manager_on_the_same_sequence(chunk: int | None, delay: int) -> None:
    got = {}
    for kind in MANAGERS:
        e = engine(kind, host=64, device=12, chunk_tokens=chunk, worker=SimWorker(delay=lambda job: delay))
        for i, blocks in enumerate(SEQUENCE):
            e.add(str(i), prompt(blocks))
            for _ in range(3):
                e.step()  # requests overlap: a later one arrives while earlier stores are in flight
        e.drain()
        got[kind] = [e.reqs[str(i)].admissions for i in range(len(SEQUENCE))]
        if kind == "kvtier":
            check_drained(e.manager)
    assert got["kvtier"] == got["vllm"]
    assert sum(ext for adm in got["kvtier"] for _, ext in adm) >= 2 * T  # the host tier served hits


def test_a_refused_store_keeps_the_hit_of_a_repeated_prompt() -> None:
    # 4 host chunks: A stored, B's store in flight for long, C's store refused; then A again
    slow = SimWorker(delay=lambda job: 40 if job.is_store and job.req_id == "b" else 0)
    for kind in MANAGERS:
        e = engine(kind, host=4, device=8, worker=slow if kind == "kvtier" else SimWorker(delay=slow.delay))
        finish(e, "a", prompt([1, 2]))
        finish(e, "b", prompt([3, 4]))
        finish(e, "c", prompt([5, 6, 7]))
        assert e.probe.refused >= 1
        finish(e, "flush", prompt([20, 21, 22, 23, 24, 25]))  # pushes a out of the GPU
        assert finish(e, "a2", prompt([1, 2])) == (0, 2 * T), kind
        e.drain()


def test_a_prompts_tail_is_stored_while_its_head_is_still_being_written() -> None:
    # chunked prefill, stores acked 5 steps late: the tail's parent is still in flight when the
    # tail is offered, at every step up to the request's finish (vLLM does not retry after it)
    for kind in MANAGERS:
        e = engine(kind, host=64, device=10, chunk_tokens=2 * T, worker=SimWorker(delay=lambda job: 5))
        finish(e, "p", prompt([1, 2, 3, 4, 5, 6]))
        e.drain()
        finish(e, "flush", prompt([20, 21, 22, 23, 24, 25, 26, 27]))
        e.drain()
        local, ext = finish(e, "again", prompt([1, 2, 3, 4, 5, 6]))
        assert local + ext == 6 * T and ext >= 5 * T, kind  # every chunk hit, the tail's too
        e.drain()


def _faulty_run(kind: str) -> tuple[Engine, list[list[tuple[int, int]]]]:
    def fail(job: SimJob) -> bool:  # the first store of q1 and the first load of q4 fail
        what = (job.req_id, job.is_store)
        if what in {("q1", True), ("q4", False)} and what not in failed:
            failed.add(what)
            return True
        return False
    failed: set[tuple[str, bool]] = set()
    w = SimWorker(delay=lambda job: 2 if job.is_store else 1, fail=fail)
    e = engine(kind, host=32, device=12, chunk_tokens=2 * T, worker=w)
    finish(e, "q0", prompt([1, 2, 3, 4]))
    finish(e, "q1", prompt([5, 6, 7]))  # its first store fails: nothing of it is stored
    e.drain()
    finish(e, "flush", prompt([40, 41, 42, 43, 44, 45, 46, 47, 48]))
    e.drain()
    r = e.add("q2", prompt([1, 2, 3, 4, 8]))  # aborted while its load is in flight
    while r.phase != "loading":
        e.step()
    e.abort("q2")
    r = e.add("q3", prompt([60, 61, 62, 63, 64]))  # aborted while its store is in flight
    while not e.worker.jobs:
        e.step()
    e.abort("q3")
    finish(e, "q4", prompt([1, 2, 3, 4, 9]))  # its load fails: the request recomputes
    e.add("q5", prompt([70, 71, 72, 73]))
    e.add("q6", prompt([1, 2, 3, 74]))
    e.step()
    e.preempt("q5")
    e.drain()
    finish(e, "q7", prompt([5, 6, 7]))  # q1's chunks were dropped: nothing on the host
    e.drain()
    return e, [e.reqs[k].admissions for k in sorted(e.reqs)]


def test_failed_loads_and_stores_aborts_and_preemption_keep_kvtier_consistent() -> None:
    e, got = _faulty_run("kvtier")
    assert e.worker.failed == 2
    check_drained(e.manager)
    assert e.reqs["q4"].admissions[0][1] > 0  # it had a host hit, whose load failed
    assert e.reqs["q5"].admissions and len(e.reqs["q5"].admissions) == 2  # preempted, admitted again
    _, control = _faulty_run("vllm")
    assert got == control


def test_vllm_prometheus_recorder_observes_the_connectors_stats_every_step() -> None:
    extra = kvtier_extra_config(num_host_chunks=8)
    e = Engine(extra, device_blocks=8, block_tokens=T, chunk_tokens=T, worker=SimWorker(delay=lambda job: 1))
    recorder, registry = prometheus_recorder(e.vllm_config)
    payloads = []

    def observe(eng: Engine) -> None:
        stats = eng.connector.get_stats()
        if stats is not None:
            payloads.append(stats)
            recorder.observe(stats.data, 0)  # vllm serve's stats logger; raises on an undeclared metric

    e.on_step.append(observe)
    for i, blocks in enumerate([[1, 2, 3], [4, 5, 6], [1, 2, 3], [7, 8, 9, 10, 11, 12], [1, 2, 3]]):
        finish(e, str(i), prompt(blocks))
    e.drain()
    labels = {"model_name": "model", "engine": "0"}
    assert len(payloads) == e.step_no
    assert registry.get_sample_value("vllm:kv_offload_cpu_cache_usage_perc", labels) == 0.0
    assert registry.get_sample_value("vllm:kv_offload_cpu_allocation_size_count", labels) >= 4
    assert registry.get_sample_value("vllm:kv_offload_config_info",
                                     {**labels, "kvtier_host_chunks": "8", "kvtier_eviction": "lru"}) == 1.0


def test_hybrid_full_attention_and_sliding_window_groups_match_vllms_own_manager() -> None:
    # vLLM #43884 / #50454 (assertions on hybrid models): both groups' keys, the sliding
    # window's chunks stored and looked up before the hit boundary
    got = {}
    for kind in MANAGERS:
        groups = (None, 2 * T)
        extra = kvtier_extra_config(num_host_chunks=64) if kind == "kvtier" else cpu_extra_config(64, T, groups)
        e = Engine(extra, device_blocks=16, block_tokens=T, groups=groups)
        if kind == "kvtier":
            e.on_step.append(check_engine)
        got[kind] = [e.run(str(i), prompt(b)) for i, b in enumerate([[1, 2, 3, 4, 5], list(range(30, 37)),
                                                                      [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]])]
        if kind == "kvtier":
            check_drained(e.manager)
    assert got["kvtier"] == got["vllm"]
    assert got["kvtier"][2][1] >= 4 * T


def test_a_request_aborted_while_queued_leaves_no_state_vllm_49118() -> None:
    e = engine("kvtier", host=16, device=8)
    e.add("q", prompt([1, 2, 3]))
    e.abort("q")  # never scheduled: on_new_request, then request_finished
    e.drain()
    assert e.manager.tracked_requests() == 0
    assert e.run("after", prompt([1, 2, 3])) == (0, 0)
    check_drained(e.manager)


def test_a_preempted_request_is_delayed_until_its_stores_land_vllm_46014() -> None:
    e = engine("kvtier", host=32, device=8, chunk_tokens=2 * T, worker=SimWorker(delay=lambda job: 4))
    r = e.add("p", prompt([1, 2, 3, 4]))
    e.step()  # chunks 0-1 computed, their store in flight
    assert e.worker.jobs and r.phase == "running"
    e.preempt("p")
    e.step()
    assert r.phase == "waiting" and r.req.num_computed_tokens == 0 and len(r.admissions) == 1
    e.drain()
    assert len(r.admissions) == 2 and r.phase == "finished"
    assert r.admissions[1][0] + r.admissions[1][1] >= 2 * T  # re-admitted with its stored chunks
    check_drained(e.manager)
