"""Rank-failure fuzz of the rank-parallel mode (Hypothesis, bounded).

:func:`fuzz_rank` runs in every rank process (through
:func:`~kvtier.parallel.launch.launch`). Rank 0 runs a Hypothesis test; each example (a
:class:`~kvtier.parallel.replay.RankJob`: a small workload with shared prefixes, random
capacities and write policy, and injected failures, each operation failed by at most one
rank) is broadcast to every rank, run there by :func:`~kvtier.parallel.replay.run_rank`,
and the ranks' results are gathered on rank 0, which checks:

- no rank raised (no divergence, no invariant violation, no leak after draining);
- every rank's decision digest is the same, and equal to the single-process model of the
  run (:func:`~kvtier.parallel.replay.reference_run`: one core, every rank's completions);
- every rank's core failed the same operations, those of the model, and among them every
  operation any rank failed (a failure on one rank fails the operation on all).

Shrinking runs on every rank too (each shrunk example is broadcast like the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from kvtier.fsm import KvtierError
from kvtier.fsm.presets import preset

from ..scheduler import SchedRequest
from .launch import RankError
from .replay import RankJob, reference_run, run_rank
from .sync import StepSync

__all__ = ["FuzzArgs", "fuzz_rank", "check_case", "POLICIES"]

POLICIES = ("write_through", "write_through_selective", "write_back")
_ALIGN = 16


@dataclass(frozen=True)
class FuzzArgs:
    """Bounds of one fuzz campaign.

    Attributes:
        max_examples: Hypothesis examples (each runs on every rank).
        seed: Hypothesis seed (the same examples every time).
    """

    max_examples: int = 25
    seed: int = 0


def _jobs(world_size: int) -> Any:
    from hypothesis import strategies as st

    layout = preset("llama-3-8b", num_layers=2, page_tokens=_ALIGN)

    @st.composite
    def job(draw: Any) -> RankJob:
        prefixes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
        n = draw(st.integers(2, 8))
        reqs = []
        longest = 0
        for i in range(n):
            p = draw(st.integers(0, len(prefixes) - 1))
            k = draw(st.integers(0, prefixes[p]))
            own = draw(st.integers(0, 3))
            tail = draw(st.integers(0, _ALIGN - 1))
            units = tuple([(p, j) for j in range(k)] + [(f"q{i}", j) for j in range(own)])
            prompt = max(1, len(units) * _ALIGN + tail)
            out = draw(st.integers(1, 6))
            arrival = draw(st.integers(0, 4)) * 0.01
            reqs.append(SchedRequest(f"r{i}", arrival, prompt, out, units))
            longest = max(longest, (prompt + out) // _ALIGN + 2)
        device = longest + draw(st.integers(0, 12))
        host = draw(st.one_of(st.none(), st.integers(2, 30)))
        fail = draw(st.dictionaries(st.integers(1, 25), st.integers(0, world_size - 1), max_size=3))
        return RankJob(tuple(reqs), layout, device, host, policy=draw(st.sampled_from(POLICIES)),
                       token_budget=draw(st.sampled_from((32, 64, 256))), fail=fail, check_every=1)

    return job()


def _one(sync: StepSync, job: RankJob) -> dict[str, Any] | RankError:
    try:
        return run_rank(sync, job)
    except KvtierError as e:
        return RankError(sync.rank, type(e).__name__, str(e), {})


def check_case(job: RankJob, results: list[dict[str, Any] | RankError], world_size: int) -> None:
    """The fuzz's properties (module docstring); raises AssertionError naming the first
    that fails."""
    errors = [r for r in results if isinstance(r, RankError)]
    assert not errors, f"ranks raised: {errors}"
    ok = [r for r in results if isinstance(r, dict)]
    ref = reference_run(job, world_size)
    digests = {r["digest"] for r in ok}
    assert digests == {ref["digest"]}, f"digests {sorted(digests)} vs the single-process model {ref['digest']}"
    for r in ok:
        assert r["failed_op_ids"] == ref["failed_op_ids"], \
            f"rank {r['rank']} failed ops {r['failed_op_ids']}, model {ref['failed_op_ids']}"
    injected = set().union(*(set(r["injected"]) for r in ok))
    missing = injected - set(ref["failed_op_ids"])
    assert not missing, f"ops failed on one rank but not failed on all: {sorted(missing)}"
    for r in ok:
        assert not any(v for k, v in r["drain"].items() if k.endswith("leaked_pages")), r["drain"]


def fuzz_rank(sync: StepSync, args: FuzzArgs) -> dict[str, Any]:
    """The campaign on this rank (see the module docstring).

    Returns:
        On rank 0: ``{"examples": examples run, "injected": failures injected,
        "failure": None or the falsifying example and error}``; on the others:
        ``{"examples": examples run}``.
    """
    world = sync.world_size
    count = {"examples": 0, "injected": 0}

    def run(job: RankJob) -> list[Any]:
        mine = _one(sync, job)
        results: list[Any] = [None] * world
        dist.all_gather_object(results, mine)
        count["examples"] += 1
        return results

    if sync.rank != 0:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return count
            run(box[0])

    from hypothesis import HealthCheck, given, seed, settings

    @seed(args.seed)
    @settings(max_examples=args.max_examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(_jobs(world))
    def prop(job: RankJob) -> None:
        dist.broadcast_object_list([job], src=0)
        results = run(job)
        count["injected"] += len(job.fail)
        check_case(job, results, world)

    failure = None
    try:
        prop()
    except AssertionError as e:
        failure = f"{type(e).__name__}: {e}"
    finally:
        dist.broadcast_object_list([None], src=0)
    return {**count, "failure": failure}
