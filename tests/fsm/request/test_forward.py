"""Forward results (kvtier.fsm.request.forward): ``step_done``'s refusals naming what is owed and
reserved, an overlapped pass keeping the pages ``step_done`` lets go of, decode steps
inside and across units, and the checkpoints a pass publishes, keeps or skips (one handed
out at admission stays until the forward result; none inside a history replay span).

Layouts (tests/core_helpers.py): ``h1`` has one history group ``kv`` with 2 tokens per
page (alignment 2: one page per unit, 2 layers); ``src`` has ``fh`` history (4 tokens per
page, alignment 4) and ``swa`` continuation state (window 8: 4 pages per checkpoint)."""

from __future__ import annotations

import pytest
from core_helpers import h1, src
from facade_helpers import borrowing, free, held, only_node, prefill, seeded

from kvtier.fsm import UsageError
from kvtier.tiered import TieredCache


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
    assert free(c) == {"fh": 23, "swa": 0}
    assert c.step_done("B", 17, checkpoint=True) == {}
    nodes = {n.key: (n.dev, n.dev_ckpt) for n in c.core.nodes()}
    assert nodes == {tuple("abcd"): ({"fh": [0, 1, 2, 3]}, {"swa": [4, 5, 6, 7]}),
                     tuple("wxyz"): ({"fh": [4, 5, 6, 7]}, {})}
    assert free(c) == {"fh": 23, "swa": 0}
    c.check_invariants()


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


def test_overlapped_pass_keeps_the_pages_step_done_lets_go_of() -> None:
    """Overlapped scheduling: pass 2 of ``b`` is reserved before step_done of pass 1. That
    step_done publishes b's units, which ``a`` already published: b's copies leave its
    table, but pass 2 may still read them, so they are freed only at step_done of pass 2."""
    c = TieredCache(h1(), 12, None)
    a = c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert a is not None and b is not None
    assert (a.page_table, b.page_table) == ({"kv": [0, 1, 2, 3, 4]}, {"kv": [5, 6, 7, 8, 9]})
    c.step_done("a", 9)
    assert c.reserve("b", 1) == {} and c.request("b").reserved_tokens == 10  # pass 2 starts at token 9
    assert c.step_done("b", 9) == {}
    v = c.request("b")
    assert c.page_table("b") == {"kv": [0, 1, 2, 3, 9]}  # canonical pages from now on
    assert (v.owed_forward, v.own_pages, v.deferred_pages) == (1, {"kv": [9]}, {"kv": [5, 6, 7, 8]})
    assert free(c) == {"kv": 2} and held(c) == {"kv": 6}
    c.check_invariants()
    x = c.admit("x", list("w"), prompt_tokens=3, chunk_tokens=3)
    assert x is not None and x.page_table == {"kv": [10, 11]}  # never b's copies
    assert c.admit("y", list("v"), prompt_tokens=1, chunk_tokens=1) is None  # nothing else is free
    c.step_done("b", 1)
    v = c.request("b")
    assert (v.tokens, v.owed_forward, v.deferred_pages) == (10, 0, {})
    assert free(c) == {"kv": 4} and held(c) == {"kv": 4}
    y = c.admit("y", list("v"), prompt_tokens=1, chunk_tokens=1)
    assert y is not None and y.page_table["kv"][0] in (5, 6, 7, 8)
    c.check_invariants()


def test_a_checkpoint_handed_out_at_admission_stays_until_the_forward_result() -> None:
    """R is admitted on X's chunk checkpoint (it copies it into its working state during
    its forward pass). Q, admitted before X existed, then publishes a deeper checkpoint
    through X: X's chunk checkpoint must not be dropped (its pages freed and reused)
    while R's forward pass still reads it (invariant 14)."""
    c = TieredCache(src(), 8, None)
    assert c.admit("Q", list("xy"), prompt_tokens=9, chunk_tokens=9) is not None
    assert c.admit("A", list("xy"), prompt_tokens=9, chunk_tokens=4) is not None
    c.step_done("A", 4, checkpoint=True)  # X = [x] with a chunk checkpoint
    c.abort("A")
    x = only_node(c)
    assert x.chunk_checkpoint and len(x.dev_ckpt["swa"]) == 4
    r = c.admit("R", list("xz"), prompt_tokens=9, chunk_tokens=5)
    assert r is not None and r.start_token == 4 and r.checkpoint_pages == x.dev_ckpt
    pages = list(r.checkpoint_pages["swa"])
    c.step_done("Q", 9, checkpoint=True)  # Y = [x, y] under X, with its own checkpoint
    c.check_invariants()
    assert x.dev_ckpt == {"swa": pages}
    assert not set(pages) & c.core.device["swa"].free_pages()
    c.step_done("R", 5)  # R's forward pass has copied it: the chunk checkpoint may go now
    c.check_invariants()
    assert x.borrow_ref == 0
    c.abort("R")
    c.finish("Q")
    c.check_invariants()
    assert c.poll().events and c.requests() == []
    assert all(n.borrow_ref == 0 and n.lock_ref == 0 for n in c.core.nodes())


def test_no_checkpoint_is_published_inside_a_history_replay_span() -> None:
    """With history replay the forward pass recomputes the span before the hit end only
    to rebuild the continuation state: the state at a unit boundary inside the span is not
    exact, so a checkpoint there is not published (invariant 15); at the hit end it is."""
    lay = src()
    assert lay.replay_span_tokens() == 16
    c = TieredCache(lay, 32, None, history_replay=True)
    prefill(c, "A", "abcdefgh", 33, checkpoint=True)  # one node of 8 units, checkpoint at its end
    c.finish("A")
    b = c.admit("B", list("abcdefgz"), prompt_tokens=33, chunk_tokens=4)
    assert b is not None
    assert (b.start_token, b.recompute_tokens, b.history_hit_tokens, b.checkpoint_pages) == (12, 16, 28, {})
    assert c.step_done("B", 4, checkpoint=True) == {}  # tokens 12..16: inside the span
    assert [n.depth for n in c.core.nodes() if n.dev_ckpt] == [8]
    assert c.reserve("B", 12) is not None
    adopted = c.step_done("B", 12, checkpoint=True)  # tokens 16..28: the hit end, exact again
    c.check_invariants()
    assert set(adopted) == {"swa"}
    assert sorted(n.depth for n in c.core.nodes() if n.dev_ckpt) == [7, 8]
