"""Rank-parallel mode (issue 21): separate rank processes over gloo, each with its own core
and pools, agreeing every step. Metadata and real bytes (fingerprints per rank) at 2 and 4
ranks; identical decisions on every rank (and equal to the single-process model); a failure
injected on one rank fails the operation on every rank; nothing left after draining; a rank
that decides differently stops the run at the first step where the digests differ."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.fsm.presets import preset
from kvtier.parallel import RankError, RankJob, launch, reference_run, run_jobs
from kvtier.replay.model_replay import conversation_slice
from kvtier.scheduler import SchedRequest
from kvtier.replay.trace import load_trace

LAYOUT = preset("llama-3-8b", num_layers=4, page_tokens=128)


def trace_job(tokens: int, **kw: object) -> RankJob:
    """Whole conversations of the embedded trace (prompts cut to 8,192 tokens, outputs to 8:
    few decode steps, CI time), on a device of twice the longest request (evictions) with
    a host tier under write-through (loadbacks)."""
    sl = conversation_slice(load_trace(), tokens, 8192)
    t0 = min(r.arrival_s for r in sl)
    a = LAYOUT.alignment
    reqs = []
    for r in sl:
        n = min(r.input_length, 8192)
        units = tuple((h, j) for h in r.hash_ids for j in range(512 // a))[: n // a]
        reqs.append(SchedRequest(f"r{r.index}", r.arrival_s - t0, n, min(8, r.output_length), units))
    base = RankJob(tuple(reqs), LAYOUT, device_units=132, host_units=3000, policy="write_through")
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def check_agreement(results: list[object], job: RankJob, world: int) -> list[dict[str, object]]:
    """Every rank decided alike; metadata runs (completions at the next collect) decide as
    the single-process model does; nothing left on any rank after draining."""
    assert all(isinstance(r, dict) for r in results), results
    rs: list[dict[str, object]] = results  # type: ignore[assignment]
    assert [r["rank"] for r in rs] == list(range(world))
    assert len({r["digest"] for r in rs}) == 1 and len({r["decisions"] for r in rs}) == 1
    assert rs[0]["decisions"] > 300  # type: ignore[operator]  # (the batched step folds one entry per item)
    assert all(r["failed_op_ids"] == rs[0]["failed_op_ids"] for r in rs)
    if job.backend == "none":
        ref = reference_run(job, world)
        assert rs[0]["digest"] == ref["digest"] and rs[0]["decisions"] == ref["decisions"]
        assert rs[0]["failed_op_ids"] == ref["failed_op_ids"]
    counts = [{k: v for k, v in r["run"].items() if not k.endswith("_s")} for r in rs]  # type: ignore[attr-defined]
    assert all(c == counts[0] for c in counts) and counts[0]["steps"] > 40
    assert rs[0]["run"]["finished"] + rs[0]["run"]["aborts"] == len(job.requests)  # type: ignore[index]
    for r in rs:  # drained: nothing held beyond the tree's own pages
        d = r["drain"]
        assert d["requests"] == d["ops_in_flight"] == d["caller_pages"] == d["receipts"] == 0  # type: ignore[index]
        assert d["device_leaked_pages"] == d["host_leaked_pages"] == 0  # type: ignore[index]
        assert d["device_used"] == d["tree_device_pages"] > 0  # type: ignore[index]
    return rs


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list[RankJob], list[list[object]]]:
    meta = trace_job(200_000)
    jobs = [
        meta,
        trace_job(100_000, backend="cpu", byte_scale=256),
        trace_job(200_000, fail={3: 1, 8: 0, 20: 1, 41: 0}),
        trace_job(100_000, backend="cpu", byte_scale=256, fail={2: 0, 9: 1, 15: 1}),
        dataclasses.replace(meta, device_units_of={1: 131}),
    ]
    per_rank = launch(run_jobs, 2, jobs)
    return jobs, [[per_rank[r][j] for r in range(2)] for j in range(len(jobs))]


def test_two_ranks_metadata_identical_decisions(two_ranks: tuple[list[RankJob], list[list[object]]]) -> None:
    jobs, res = two_ranks
    rs = check_agreement(res[0], jobs[0], 2)
    assert rs[0]["core"]["device_evictions"] + rs[0]["core"]["demotions"] > 0  # type: ignore[index]
    assert rs[0]["core"]["loadbacks"] > 0 and rs[0]["failed_ops"] == 0  # type: ignore[index]
    sync = rs[0]["sync"]
    assert sync["exchanges"] > rs[0]["run"]["steps"] and sync["completion_gathers"] > 0  # type: ignore[index]


def test_two_ranks_real_bytes_fingerprints_per_rank(two_ranks: tuple[list[RankJob], list[list[object]]]) -> None:
    jobs, res = two_ranks
    rs = check_agreement(res[1], jobs[1], 2)
    for r in rs:
        assert r["fingerprints"]["checked"] > 0 and r["fingerprints"]["written"] > 0  # type: ignore[index]
    # each rank's pages hold half the bytes of the full model's
    assert rs[0]["shard_bytes_per_unit"] * 2 == LAYOUT.unit_bytes()


@pytest.mark.parametrize("j", [2, 3])
def test_failure_on_one_rank_fails_the_operation_on_all(two_ranks: tuple[list[RankJob], list[list[object]]],
                                                        j: int) -> None:
    jobs, res = two_ranks
    rs = check_agreement(res[j], jobs[j], 2)
    want = set(jobs[j].fail)
    injected = {r["rank"]: set(r["injected"]) for r in rs}  # type: ignore[arg-type]
    # each op was failed by exactly the rank the plan names, and by no other
    assert injected == {rank: {op for op, fr in jobs[j].fail.items() if fr == rank} for rank in (0, 1)}
    for r in rs:  # ... and every rank's core failed it
        assert want <= set(r["failed_op_ids"])  # type: ignore[arg-type]
    assert rs[0]["failed_ops"] >= len(want)


def test_a_rank_that_decides_differently_stops_the_run_at_the_first_differing_step(
        two_ranks: tuple[list[RankJob], list[list[object]]]) -> None:
    jobs, res = two_ranks
    errs = res[4]
    assert all(isinstance(e, RankError) and e.kind == "RankDivergence" for e in errs), errs
    e0, e1 = errs
    assert isinstance(e0, RankError) and isinstance(e1, RankError)
    assert e0.attrs["exchange"] == e1.attrs["exchange"] and e0.attrs["digests"] == e1.attrs["digests"]
    assert "scheduler step" in e0.message
    # the exchange named is the first whose digests differ: rank 1, with one device unit
    # less, decides alike until its pool runs short first (the single-process models of
    # both capacities give the digests each exchange compares)
    h0 = reference_run(jobs[4], 2)["history"]
    h1 = reference_run(dataclasses.replace(jobs[4], device_units=131), 2)["history"]
    first = next(i for i, (a, b) in enumerate(zip(h0, h1)) if a != b)
    assert e0.attrs["exchange"] == first + 1 > 1
    assert e0.attrs["digests"] == (h0[first], h1[first])


def test_four_ranks_metadata_bytes_and_failures() -> None:
    jobs = [trace_job(100_000, fail={4: 3, 11: 2}), trace_job(50_000, backend="cpu", byte_scale=256, fail={5: 1})]
    per_rank = launch(run_jobs, 4, jobs)
    for j, job in enumerate(jobs):
        rs = check_agreement([per_rank[r][j] for r in range(4)], job, 4)
        assert set(job.fail) <= set(rs[0]["failed_op_ids"])  # type: ignore[arg-type]
    for r in range(4):
        assert per_rank[r][1]["fingerprints"]["checked"] > 0
        assert per_rank[r][1]["shard_bytes_per_unit"] * 4 == LAYOUT.unit_bytes()
