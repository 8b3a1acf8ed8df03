"""The facade's own calls (:class:`kvtier.tiered.TieredCache`): ``poll`` hands out loadbacks
first and at most ``max_writebacks_in_flight`` writebacks, and a completion of a command
``poll`` has not handed out yet is refused. The request lifecycle's scenarios (aborts,
victim aborts, loadback failures and deadlines, joins, admissions, forward results, bad
calls) are in the tests of kvtier.fsm.request (tests/fsm/request/).

Layouts (tests/core_helpers.py): ``h1`` has one history group ``kv`` with 2 tokens per
page (alignment 2: one page per unit, 2 layers); ``src`` has ``fh`` history (4 tokens per
page, alignment 4) and ``swa`` continuation state (window 8: 4 pages per checkpoint).
"""

from __future__ import annotations

import pytest
from core_helpers import h1
from facade_helpers import ack, prefill, seeded

from kvtier.fsm import Completion, Direction
from kvtier.fsm.errors import UsageError
from kvtier.tiered import TieredCache


# ---------------------------------------------------------------------------- poll
def wb_in_flight(c: TieredCache) -> list[int]:
    return sorted(op for op, o in c.core.operations().items() if o.direction is Direction.WRITEBACK)


@pytest.mark.parametrize("limit", [1, 2])
def test_poll_bounds_writebacks_and_returns_loadbacks_first(limit: int) -> None:
    """poll() issues tree writebacks only while fewer than ``max_writebacks_in_flight``
    writeback operations are in flight (however many nodes each carries), never holds a
    loadback back, and lists loadbacks first."""
    c = TieredCache(h1(), 16, 32, policy="write_through", finish_writeback=False, max_writebacks_in_flight=limit)
    prefill(c, "s", "pq", 4)
    c.finish("s")
    (seed_wb,) = c.poll().commands
    ack(c, seed_wb.op_id)
    c.core.evict_device({"kv": 2})  # "pq" on the host only
    keys = ["aa", "bb", "cc", "dd", "ee", "ff"]
    for k in keys[:2]:
        prefill(c, k, k, 4)  # new device nodes queued for write-through
    adm = c.admit("l", list("pq"), prompt_tokens=5, chunk_tokens=1)
    assert adm is not None and adm.loadback_op is not None
    out = c.poll()
    assert out.commands[0].op_id == adm.loadback_op
    assert all(cmd.direction is Direction.WRITEBACK for cmd in out.commands[1:])
    assert 1 <= len(wb_in_flight(c)) <= limit
    for k in keys[2:]:
        prefill(c, k, k, 4)  # more nodes queued while writebacks are in flight
        before = wb_in_flight(c)
        issued = c.poll().commands
        assert len(before) + len(issued) <= limit
        assert not issued or len(before) < limit  # nothing new once the bound is reached
    while wb_in_flight(c):
        ack(c, wb_in_flight(c)[0])
        c.poll()
        assert len(wb_in_flight(c)) <= limit
    assert c.core.queued_writebacks() == []
    backed = sorted("".join(n.key) for n in c.core.nodes() if n.state == "backed")  # type: ignore[arg-type]
    assert backed == keys


def test_a_completion_before_poll_hands_out_its_command_is_refused() -> None:
    """poll() is the one place commands come from: a completion for a loadback whose
    command is still waiting to be handed out is refused and nothing changes (it used to
    run the request on pages no byte was loaded into, and poll() then handed out a
    command for a settled operation)."""
    c = seeded()
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None and c.state("b") == "loading"
    with pytest.raises(UsageError, match=f"op {b.loadback_op}: its command has not been handed out by poll"):
        c.complete(Completion(b.loadback_op))
    assert c.state("b") == "loading" and not c.layer_ready("b", 0)
    assert [cmd.op_id for cmd in c.poll().commands] == [b.loadback_op]
    ack(c, b.loadback_op)
    assert c.state("b") == "running" and c.layer_ready("b", 0)


@pytest.mark.parametrize("finish_writeback", [None, True, False])
def test_write_through_finish_writes_back_as_its_own_operation_by_default(finish_writeback: bool | None) -> None:
    """Under write_through ``finish_writeback`` defaults to True: ``finish`` writes the request's
    pages back as its own operation, and the request stays ``finishing`` until that writeback's
    ack; with False it ends at once, its pages written back by the policy alone."""
    from kvtier.fsm.presets import preset

    cache = TieredCache(preset("llama-3-8b"), device_pages=16, host_pages=64, policy="write_through",
                        finish_writeback=finish_writeback)
    assert cache.finish_writeback is (finish_writeback is not False)
    cache.admit("a", [("u", i) for i in range(4)], prompt_tokens=70, chunk_tokens=80)
    cache.step_done("a", 70)
    cache.finish("a")
    cmds = cache.poll().commands
    assert [c.direction for c in cmds] == [Direction.WRITEBACK]
    if cache.finish_writeback:
        assert cache.state("a") == "finishing"
        cache.complete(Completion(cmds[0].op_id))
        assert cache.state("a") == "finished"
    else:
        assert cache.state("a") == "finished"
        cache.complete(Completion(cmds[0].op_id))
    assert not cache.poll().commands
    cache.check_invariants()
    assert cache.quiescent()
