"""The reference scheduler's accounting of a run (kvtier.scheduler.reference): which tokens of a
forward pass are prefill and which are decode, how many steps a run takes, and the modeled
seconds (the cost model's compute time of each step, no loadback on a device-only cache).

A request of ``p`` prompt tokens and ``o`` output tokens computes its ``p`` prompt tokens as
prefill (that pass also yields the first output token), then ``o - 1`` decode tokens, one per
step."""

from __future__ import annotations

import pytest

from kvtier import TieredCache
from kvtier.fsm.presets import preset
from kvtier.replay.costmodel import CostModel
from kvtier.scheduler import ReferenceScheduler, SchedRequest


@pytest.mark.parametrize("n_requests", [1, 2])
def test_the_prompt_is_prefill_and_each_later_output_token_is_one_decode_token(n_requests: int) -> None:
    cache = TieredCache(preset("llama-3-8b"), device_pages=64, host_pages=None)
    cost = CostModel()
    sched = ReferenceScheduler(cache, token_budget=64, cost=cost)
    reqs = [SchedRequest(f"r{i}", 0.0, 40, 5, tuple(("r", i, u) for u in range(2))) for i in range(n_requests)]
    st = sched.run(reqs)
    assert st.finished == n_requests and st.aborts == 0 and st.hit_tokens == 0
    assert (st.prefill_tokens, st.decode_tokens) == (40 * n_requests, 4 * n_requests)
    # one prefill step for the batch (40 tokens each fit the 64-token budget only one at a time
    # when there are two), then four decode steps with every request in the batch
    prefill_steps = n_requests
    assert st.steps == prefill_steps + 4
    expected = sum(cost.compute_s(40, 0) for _ in range(prefill_steps)) + 4 * cost.compute_s(0, n_requests)
    assert st.modeled_s == pytest.approx(expected, rel=1e-12)
    cache.check_invariants()
    assert cache.quiescent()


def test_loadback_and_writeback_bytes_are_the_pages_moved_times_the_page_size() -> None:
    """Two requests whose prefixes were pushed to the host load back in the same step: the run's
    loadback bytes are its loadback pages times the one group's page bytes (2 MiB: 32 layers of
    64 KiB), not a running total of the step's loadbacks; the same holds for writebacks."""
    layout = preset("llama-3-8b")
    (group,) = layout.groups
    cache = TieredCache(layout, device_pages=24, host_pages=256, policy="write_through")
    fill = [SchedRequest(f"w{i}", 0.0, 130, 1, tuple((f"p{i}", j) for j in range(8))) for i in range(3)]
    push = [SchedRequest(f"x{i}", 1.0, 130, 1, tuple((f"q{i}", j) for j in range(8))) for i in range(3)]
    back = [SchedRequest(f"r{i}", 2.0, 130, 1, tuple((f"p{i}", j) for j in range(8))) for i in range(2)]
    st = ReferenceScheduler(cache, token_budget=512).run(fill + push + back)
    assert st.finished == 8 and st.host_hit_tokens == 256
    assert st.loadback_pages == 16 and group.page_bytes == 2 * 1024 * 1024
    assert st.loadback_bytes == st.loadback_pages * group.page_bytes
    assert st.writeback_pages > 0
    assert st.writeback_bytes == st.writeback_pages * group.page_bytes
    cache.check_invariants()
