"""Completion routing (kvtier.fsm.completions): a failed loadback keeps only the device prefix
its lock holds, and a loadback acknowledgement publishes no second checkpoint."""

from __future__ import annotations

import pytest
from facade_helpers import ack, seeded

from kvtier.tiered import TieredCache


# ----------------------------------------------------------------------------- completions
@pytest.mark.parametrize(("warm", "canon_after"), [(("a", "ab"), [3, 2]), (("a",), [3])])
def test_a_failed_loadback_keeps_only_the_device_prefix_its_lock_holds(warm: tuple[str, ...],
                                                                        canon_after: list[int]) -> None:
    """``abcd`` lives on the host; earlier requests loaded ``a`` (and ``b``) back as nodes of
    their own. ``z``'s loadback of the rest fails while its first pass is out: it is
    fenced, and its table keeps the canonical pages of every device node before the
    failed ones (their sum, not the last node's), no layer reads as ready, and its own
    page stays until the pass returns."""
    c = seeded(device=12)
    for rid in warm:
        adm = c.admit(rid, list(rid), prompt_tokens=2 * len(rid) + 1, chunk_tokens=2 * len(rid) + 1)
        assert adm is not None and adm.loadback_op is not None
        c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
        ack(c, adm.loadback_op)
        c.step_done(rid, adm.chunk_tokens)
        c.finish(rid)
    z = c.admit("z", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert z is not None and z.loadback_op is not None
    c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    r = c.table.get("z")
    assert len(r.canon["kv"]) == 4
    ack(c, z.loadback_op, ok=False)
    assert (c.state("z"), r.canon, r.own) == ("fenced", {"kv": canon_after}, {"kv": [4]})
    assert [c.layer_ready("z", i) for i in range(2)] == [False, False]
    c.step_done("z", 0)
    assert c.state("z") == "waiting" and c.request("z").own_pages == {}
    c.check_invariants()


def test_a_loadback_ack_publishes_no_second_checkpoint() -> None:
    """src(): ``ab`` with its checkpoint lives on the host only; ``b``'s loadback brings both
    back. Its acknowledgement publishes nothing new: no checkpoint pages are allocated for
    the hit terminal (which has one), so none wait in b's deferred frees."""
    from core_helpers import src
    from facade_helpers import prefill

    c = TieredCache(src(), 16, 16, policy="write_back", finish_writeback=True)
    prefill(c, "seed", "abcd", 9, checkpoint=True)
    c.finish("seed")
    (cmd,) = c.poll().commands
    ack(c, cmd.op_id)
    assert c.core.evict_device({"fh": 100, "swa": 100}) == {"fh": 2, "swa": 4}
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None and b.checkpoint_pages == {"swa": [7, 6, 5, 4]}
    c.poll()  # its loadback command is handed out (complete() refuses one poll() has not)
    free = {g: a.free for g, a in c.core.device.items()}
    ack(c, b.loadback_op)
    v = c.request("b")
    assert (v.state, v.own_pages, v.deferred_pages, v.owed_forward) == (
        "running", {"fh": [2], "swa": [3, 2, 1, 0]}, {}, 1)
    assert {g: a.free for g, a in c.core.device.items()} == free
