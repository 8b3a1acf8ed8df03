"""The transfer engine's contract as the engine machine checks it
(kvtier.testing.engine_contract): a wait_layer that waits on the wrong chunk and a cancel
that leaves a queued command's page marks are caught by a short campaign of the machine."""

from __future__ import annotations

import bisect
import io

import pytest

from kvtier.testing.fuzz import campaign
from kvtier.transfer.layers import OpLayers
from kvtier.transfer.plan.planner import Planner


def test_wait_layer_on_the_chunk_before_the_layer_s_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def chunk_for(self: OpLayers, layer: int) -> int | None:  # bisects on the chunks' last layers
        i = bisect.bisect_right([c[2] for c in self.chunks], layer)
        return None if i == 0 else self.chunks[i - 1][0]

    monkeypatch.setattr(OpLayers, "chunk_for", chunk_for)
    res = campaign(steps=1500, seed_value=1, mix={"engine": 1.0}, progress=False, shrink=False, stream=io.StringIO())
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "model_layer_ready"


def test_a_cancel_that_keeps_the_queued_command_s_page_marks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    orig = Planner.unqueue

    def unqueue(self: Planner, direction: object, remaining: object = None) -> None:
        if remaining is None:  # a flush forgets its queue; a cancel (which names the rest) forgets nothing
            orig(self, direction)  # type: ignore[arg-type]

    monkeypatch.setattr(Planner, "unqueue", unqueue)
    res = campaign(steps=3000, seed_value=1, mix={"engine": 1.0}, progress=False, shrink=False, stream=io.StringIO())
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "model_transfer_cancel"
