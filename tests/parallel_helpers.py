"""Rank functions of the rank-parallel tests (tests/parallel/), importable in the spawned
rank processes (a test module is not: pytest imports it under its own name)."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.fsm import Completion
from kvtier.parallel import RankExecutor, StepSync


class _Reports:
    """A local executor whose ``collect`` reports the given completions once."""

    def __init__(self, completions: list[Completion]) -> None:
        self.completions = completions

    def collect(self) -> list[Completion]:
        out, self.completions = self.completions, []
        return out


def faulty_rank(sync: StepSync, arg: tuple[int, str, int]) -> int:
    """Rank ``faulty`` fails one way (``"wrong-rank"``: its completion carries rank
    ``reported``; ``"raises"``: a RuntimeError) before the step's exchange; the other
    ranks go into the exchange and lose their peer."""
    faulty, how, reported = arg
    digest = SimpleNamespace(value=lambda: 0)
    mine: list[Completion] = []
    if sync.rank == faulty:
        if how == "raises":
            raise RuntimeError(f"rank {faulty} broke")
        mine = [Completion(0, reported)]
    ex = RankExecutor(_Reports(mine), sync, SimpleNamespace(digest=digest))  # type: ignore[arg-type]
    for _ in range(3):
        ex.collect()
    return sync.rank
