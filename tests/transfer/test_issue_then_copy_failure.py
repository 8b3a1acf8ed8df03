"""A loadback whose later chunk fails at issue and whose earlier chunk's copy then fails:
the failed chunk's layers are never reported as loaded (found by ``kvtier fuzz``'s engine
machine, issue 12; its sequence is tests/regressions/found/found-issue-failure-then-copy-failure.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core_helpers import fake_async_engine

from kvtier.fsm import Completion, Direction, GroupTransfer, TransferCommand


def _engine() -> Any:
    return fake_async_engine(chunk_layers=4)


def test_copy_failure_after_an_issue_failure_reports_no_layer() -> None:
    eng = _engine()
    fake = eng.backend
    real = fake.run_chunk
    calls = []

    def second_chunk_fails(*a: Any, **k: Any) -> Any:
        calls.append(1)
        out = real(*a, **k)
        if len(calls) == 2:
            raise RuntimeError("launch failed")  # its copies are queued, then the issue fails
        return out

    fake.run_chunk = second_chunk_fails
    eng.submit(TransferCommand(1, Direction.LOADBACK, (GroupTransfer("kv", (1, 2), (3, 4)),), ()))
    eng.flush()
    first = fake.pending()[0]
    assert first.chunk == 0
    fake.fail_next()  # the first chunk's copy fails when it completes
    fake.complete_all()
    got = eng.poll_completions()
    assert got == [Completion(1, 0, False)], got  # no layer of the failed first chunk reported


def test_the_found_sequence_passes() -> None:
    """The engine machine's minimal sequence (a replay through the facade and the engines)."""
    pytest.importorskip("torch")
    from kvtier.testing.sequence import EventSequence, replay

    seq = EventSequence.load(Path(__file__).parents[1] / "regressions" / "found"
                             / "found-issue-failure-then-copy-failure.json")
    result = replay(seq)
    assert result.matches(seq.expect), result.describe() + "\n" + result.detail
