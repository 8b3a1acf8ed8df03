"""Rank-failure fuzz (issue 21): Hypothesis on rank 0 of 2 gloo rank processes; every
example (a small workload with shared prefixes, random capacities and write policy, and
operations failed by one rank at a time) runs on both ranks, whose decisions must equal
each other's and the single-process model's, fail every injected operation on both, and
leave nothing after draining (kvtier.parallel.fuzz)."""

from __future__ import annotations

from kvtier.parallel import launch
from kvtier.parallel.fuzz import FuzzArgs, fuzz_rank


def test_rank_failure_fuzz_two_ranks() -> None:
    res = launch(fuzz_rank, 2, FuzzArgs(max_examples=30, seed=21))
    assert res[0]["failure"] is None, res[0]["failure"]
    assert res[0]["examples"] == res[1]["examples"] >= 30
    assert res[0]["injected"] > 10  # failures were injected, one rank at a time
