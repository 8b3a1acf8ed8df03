"""Forward results (kvtier.fsm.forward): ``step_done``'s refusals naming what is owed and
reserved, decode steps inside and across units, and the checkpoints a pass publishes,
keeps or skips."""

from __future__ import annotations

import pytest
from core_helpers import h1, src
from facade_helpers import seeded

from kvtier.fsm import UsageError
from kvtier.tiered import TieredCache


# ------------------------------------------------------------------ request lifecycle
def _pools(c: TieredCache) -> dict[str, int]:
    return {g: a.free for g, a in c.core.device.items()}


def test_a_chunk_checkpoint_is_skipped_not_evicted_for_when_the_device_is_full() -> None:
    """B's pass asks for a checkpoint with every ``swa`` page taken (A's published
    checkpoint and B's own state pages): publishing skips the checkpoint rather than
    evict A's unlocked node for it."""
    c = TieredCache(src(), {"fh": 32, "swa": 8}, None)
    a = c.admit("A", list("abcd"), prompt_tokens=17, chunk_tokens=17)
    assert a is not None
    assert c.step_done("A", 17, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.finish("A")
    b = c.admit("B", list("wxyz"), prompt_tokens=17, chunk_tokens=17)
    assert b is not None and b.page_table == {"fh": [4, 5, 6, 7, 8], "swa": [3, 2, 1, 0]}
    assert _pools(c) == {"fh": 23, "swa": 0}
    assert c.step_done("B", 17, checkpoint=True) == {}
    nodes = {n.key: (n.dev, n.dev_ckpt) for n in c.core.nodes()}
    assert nodes == {tuple("abcd"): ({"fh": [0, 1, 2, 3]}, {"swa": [4, 5, 6, 7]}),
                     tuple("wxyz"): ({"fh": [4, 5, 6, 7]}, {})}
    assert _pools(c) == {"fh": 23, "swa": 0}
    c.check_invariants()


def borrowing() -> TieredCache:
    """src(): ``a`` published 2 units with the checkpoint at 8 tokens; ``b`` hit them and
    owes its first pass, which copies that checkpoint (borrowed)."""
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert c.step_done("a", 9, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.finish("a")
    adm = c.admit("b", list("abcd"), prompt_tokens=12, chunk_tokens=4)
    assert adm is not None and adm.checkpoint_pages == {"swa": [4, 5, 6, 7]}
    r = c.table.get("b")
    assert (r.canon, r.own, r.ckpt_pages) == ({"fh": [0, 1]}, {"fh": [2], "swa": [3, 2, 1, 0]}, {"swa": [4, 5, 6, 7]})
    c.check_invariants()
    return c


# ----------------------------------------------------------------------------- forward
def test_step_done_refusals_name_what_is_owed_and_reserved() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=4)
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 5)
    assert str(exc.value) == "request 'a': 5 tokens computed but only 4 reserved (state 'running')"
    c.step_done("a", 3)
    c.reserve("a", 2)
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 4)
    assert str(exc.value) == "request 'a': 4 tokens computed but only 2 reserved (state 'running')"
    c.step_done("a", 2)
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 1)
    assert str(exc.value) == "request 'a' (state 'running') owes no forward result"
    assert (c.request("a").tokens, c.request("a").reserved_tokens) == (5, 5)


def test_a_short_pass_after_a_checkpoint_hit_still_lets_go_of_the_checkpoint() -> None:
    c = borrowing()
    r = c.table.get("b")
    c.step_done("b", 1)  # no unit completes: the checkpoint copy is done all the same
    assert (r.ckpt_borrow, r.ckpt_pages, r.tokens) == (None, {}, 9)
    c.check_invariants()


def test_a_decode_step_that_completes_a_unit_publishes_it() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("ab"), prompt_tokens=5, chunk_tokens=5)
    c.step_done("a", 5)
    r = c.table.get("a")
    assert (r.published, r.tokens) == (2, 5)
    c.reserve("a", 1)
    c.step_done("a", 1, new_units=["c"])
    assert (r.published, r.tokens, r.units) == (3, 6, ["a", "b", "c"])
    assert sorted(n.key for n in c.core.nodes()) == [("a", "b"), ("c",)]


def test_a_decode_step_inside_a_unit_counts_its_tokens_and_drops_the_retract_checkpoint() -> None:
    """After the prompt (9 tokens, 4 units published) a one-token step completes no unit
    (the step_done fast path): tokens grow by one, and the continuation-state checkpoint
    asked for by the previous result no longer matches, so none is published at retract."""
    from core_helpers import src

    c = TieredCache(src(), 32, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert c.step_done("a", 9, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    r = c.table.get("a")
    assert (r.tokens, r.published, r.retract_ckpt) == (9, 2, True)
    c.reserve("a", 1)
    assert c.step_done("a", 1) == {}
    assert (r.tokens, r.published, r.retract_ckpt, r.results) == (10, 2, False, 2)
    c.reserve("a", 1)
    assert c.step_done("a", 1) == {}
    assert c.request("a").tokens == 11


def test_a_result_while_loading_returns_no_checkpoint() -> None:
    c = seeded()
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and c.state("b") == "loading"
    assert c.step_done("b", 1) == {}
    assert (c.state("b"), c.request("b").tokens) == ("loading", 9)


def test_the_checkpoint_at_the_prompts_last_full_unit_is_kept() -> None:
    """src() (4-token units): a 9-token prompt's chunk of 8 tokens ends at its last full
    unit; the checkpoint there is kept for later turns (even after ``a`` is aborted), not
    given way to a deeper one."""
    from core_helpers import src

    c = TieredCache(src(), 32, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=8)
    assert c.step_done("a", 8, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.abort("a")
    assert c.state("a") == "aborted"
    b = c.admit("b", list("abcdefgh"), prompt_tokens=25, chunk_tokens=8)
    assert b is not None and (b.start_token, b.checkpoint_pages) == (8, {"swa": [4, 5, 6, 7]})
    deeper = c.step_done("b", 8, checkpoint=True)
    assert sorted(deeper["swa"]) == [8, 9, 10, 11]
    assert {n.key: n.dev_ckpt for n in c.core.nodes()} == {("a", "b"): {"swa": [4, 5, 6, 7]}, ("c", "d"): deeper}
