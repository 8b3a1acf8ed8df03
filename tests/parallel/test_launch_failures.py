"""A failing rank: ``launch`` reports the root cause, the first failure in time on any rank,
not a peer's lost connection.

Families: which rank fails x how (its completion carries another rank's number, so it
raises ConfigError and leaves; or it raises a RuntimeError) x world size. Each asserts the
exact class and message of the reported cause and that the peers' later failures follow it.
"""

from __future__ import annotations

import pytest
from parallel_helpers import faulty_rank

from kvtier.parallel import RankFailed, launch

CASES = [
    (2, 1, "wrong-rank", 7, "ConfigError", "rank 1: the local executor reported rank 7"),
    (3, 2, "wrong-rank", 1, "ConfigError", "rank 2: the local executor reported rank 1"),
    (2, 0, "raises", 0, "RuntimeError", "rank 0 broke"),
]


@pytest.mark.parametrize(("world", "faulty", "how", "reported", "kind", "fragment"), CASES,
                         ids=[f"{c[2]}-rank{c[1]}-of-{c[0]}" for c in CASES])
def test_launch_reports_the_failing_rank_first(world: int, faulty: int, how: str, reported: int, kind: str,
                                               fragment: str) -> None:
    with pytest.raises(RankFailed) as info:
        launch(faulty_rank, world, (faulty, how, reported), timeout_s=30)
    err = info.value
    assert (err.first.rank, err.first.kind) == (faulty, kind), str(err)
    assert fragment in err.first.message and str(err).startswith(f"rank {faulty} failed first: {kind}: ")
    assert "faulty_rank" in err.traceback
    assert all(e.rank != faulty for e in err.others)  # the peers fail after it, if at all
