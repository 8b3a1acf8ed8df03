"""Admission and reservation (kvtier.fsm.request.admission): all or nothing (with a loadback too),
evicting unlocked tree pages, never reusing the whole prompt, a second request joining a
loadback in flight, unit keys counted, an admitted request refused by name, a resume that
hits its own terminal (and one without the exact terminal state recomputing from
scratch), reservations only for the groups that need pages and from the tokens computed,
and a history-replay chunk that reserves no history page.

Layouts (tests/core_helpers.py): ``h1`` has one history group ``kv`` with 2 tokens per
page (alignment 2: one page per unit, 2 layers); ``src`` has ``fh`` history (4 tokens per
page, alignment 4) and ``swa`` continuation state (window 8: 4 pages per checkpoint)."""

from __future__ import annotations

import pytest
from core_helpers import h1, snapshot, src
from facade_helpers import ack, free, held, layer, only_node, prefill, seeded, seen, two_decoding

from kvtier.fsm import UsageError
from kvtier.tiered import TieredCache


def test_history_replay_chunk_inside_the_span_reserves_no_history_page() -> None:
    """src(): align 4, span 16. B's history hit is 7 units (28 tokens), it starts at 12
    (28 - 16) and its chunk of 4 tokens ends at 16, well inside the 7 pages it reads:
    its need for ``fh`` is 4 - 7 < 0 pages, so it takes none (only its 4 ``swa`` state
    pages)."""
    c = TieredCache(src(), 32, None, history_replay=True)
    a = c.admit("A", list("abcdefgh"), prompt_tokens=33, chunk_tokens=33)
    assert a is not None
    c.step_done("A", a.chunk_tokens, checkpoint=True)
    c.finish("A")
    assert free(c) == {"fh": 24, "swa": 28}
    b = c.admit("B", list("abcdefgz"), prompt_tokens=33, chunk_tokens=4)
    assert b is not None
    assert (b.start_token, b.chunk_tokens, b.recompute_tokens, b.history_hit_tokens) == (12, 4, 16, 28)
    assert b.page_table == {"fh": [0, 1, 2, 3, 4, 5, 6], "swa": [3, 2, 1, 0]}
    assert c.request("B").own_pages == {"swa": [3, 2, 1, 0]}
    assert free(c) == {"fh": 24, "swa": 24}
    c.check_invariants()


def test_admit_of_an_admitted_request_says_it_is_already_admitted() -> None:
    """Was "request 'a': admit in state 'running' (accepted in ...)", which did not say
    that the id is in use. The record (its units, prompt, pages) stays as it was."""
    c = two_decoding()
    assert c.step_done("b", 1) == {}
    assert c.retract("b") is not None
    assert c.states(["a", "b"]) == ["running", "retracted"]
    before = seen(c)
    for rid, st in (("a", "running"), ("b", "retracted")):
        with pytest.raises(UsageError) as exc:
            c.admit(rid, list("xyzw"), prompt_tokens=8, chunk_tokens=8)
        assert type(exc.value) is UsageError
        assert str(exc.value) == (f"request {rid!r} is already admitted: admit in state {st!r} "
                                  f"(accepted in aborted, finished, waiting)")
        assert seen(c) == before
    c.check_invariants()
    # once it has ended, the id may be admitted again
    assert c.step_done("a", 1) == {}
    c.finish("a")
    assert c.admit("a", list("xyzw"), prompt_tokens=8, chunk_tokens=8) is not None
    assert c.states(["a"]) == ["running"] and list(c.table.get("a").units) == list("xyzw")


def test_reserve_adds_pages_only_to_the_groups_that_need_them() -> None:
    """h2: ``a`` 2 tokens per page, ``b`` 4; 5 tokens reserved hold 3 ``a`` and 2 ``b``
    pages (room 6 tokens); 7 tokens need one more ``a`` page and no ``b`` page."""
    from core_helpers import h2

    c = TieredCache(h2(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=5, chunk_tokens=5)
    c.step_done("a", 5)
    assert c.table.get("a").room == 6
    assert c.reserve("a", 2) == {"a": [3]}
    assert c.page_table("a") == {"a": [0, 1, 2, 3], "b": [0, 1]}
    assert c.table.get("a").room == 8
    assert c.reserve("a", 2) == {"a": [4], "b": [2]}


# ----------------------------------------------------------------------------- admission
def test_too_few_unit_keys_are_refused_with_the_counts() -> None:
    c = TieredCache(h1(), 12, None)
    with pytest.raises(UsageError) as exc:
        c.admit("a", list("ab"), prompt_tokens=9, chunk_tokens=9)
    assert str(exc.value) == "request 'a': 9 prompt tokens need 4 unit keys, got 2"
    assert c.requests() == []


def test_resume_after_a_retract_mid_prefill_hits_its_own_terminal() -> None:
    """4 of 9 prompt tokens computed, then retracted: resuming matches exactly the 2 units
    it published (not the prompt's 4 unit keys) and continues from token 4."""
    from kvtier.fsm.request import Admission

    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=4)
    c.step_done("a", 4)
    assert c.retract("a") == {}
    assert c.resume("a", 5) == Admission("a", 4, 5, 4, 4, {"kv": [0, 1, 2, 3, 4]}, None, (), 0, 4, {})
    assert c.request("a").own_pages == {"kv": [2, 3, 4]}


def test_a_pass_that_computed_less_than_reserved_is_continued_from_its_tokens() -> None:
    """No pass out: the next reservation starts at the tokens computed (10), not at the
    end of the last reservation (13), so 2 more tokens need nothing new."""
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcdef"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    assert c.reserve("a", 4) == {"kv": [5, 6]}
    c.step_done("a", 1)
    assert (c.request("a").tokens, c.request("a").reserved_tokens) == (10, 13)
    assert c.reserve("a", 2) == {}
    assert c.request("a").reserved_tokens == 13


# ---------------------------------------------------------------------------- joining a loadback
def test_second_request_joins_loadback_in_flight() -> None:
    """A second request matching nodes another request is loading joins that loadback:
    its own pin, no second copy, it waits for the same op (layer progress already made
    counts), and one acknowledgement lets both proceed; the loaded pages become readable
    by other requests only after that acknowledgement."""
    c = seeded(world=2)
    node = only_node(c)
    b = c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=1)
    assert b is not None and b.loadback_op is not None
    op = b.loadback_op
    (b_load,) = c.poll().commands  # poll hands the admission's loadback out
    layer(c, op, 0)  # layer 0 complete on both ranks before the second request arrives
    assert c.core.match(list("abcd")).device_units == 0  # not readable by others yet
    d = c.admit("d", list("abcd") + ["e"], prompt_tokens=11, chunk_tokens=3)
    c.check_invariants()
    assert d is not None and d.loadback_op is None and d.wait_ops == (op,) and c.state("d") == "loading"
    assert (d.start_token, d.chunk_tokens) == (8, 3)
    assert c.poll().commands == ()  # no second loadback
    assert (node.host_pin, node.lock_ref) == (3, 2)  # the op's pin, b's and d's
    assert d.page_table["kv"][:4] == b.page_table["kv"][:4] == list(b_load.transfers[0].dst_pages)
    assert c.layer_ready("d", 0) and not c.layer_ready("d", 1)
    layer(c, op, 1, ranks=[0])
    assert not c.layer_ready("d", 1) and not c.layer_ready("b", 1)
    layer(c, op, 1, ranks=[1])
    assert c.layer_ready("d", 1) and c.layer_ready("b", 1)
    ack(c, op)  # one acknowledgement: both proceed
    assert (c.state("b"), c.state("d")) == ("running", "running")
    assert (node.state, node.host_pin, node.lock_ref) == ("backed", 0, 2)
    assert c.core.match(list("abcd")).device_units == 4
    for rid, tokens in (("b", 1), ("d", 3)):
        c.step_done(rid, tokens)
        c.finish(rid)
    assert (c.state("b"), c.state("d")) == ("finished", "finishing")  # d's unit "e" is written back
    (wb,) = c.poll().commands
    ack(c, wb.op_id)
    assert c.state("d") == "finished"
    assert held(c) == {"kv": 0} and node.lock_ref == 0 and c.poll().commands == ()
    assert c.requests() == []


# ---------------------------------------------------------------------------- admission
def test_admission_is_all_or_nothing() -> None:
    """Short of device pages after eviction, admit returns None and holds nothing."""
    c = TieredCache(h1(), 4, None)
    x = c.admit("x", list("ab"), prompt_tokens=5, chunk_tokens=5)  # 3 own pages, not yet published
    assert x is not None
    before = snapshot(c.core)
    assert c.admit("y", list("cd"), prompt_tokens=5, chunk_tokens=5) is None
    c.check_invariants()
    assert snapshot(c.core) == before
    v = c.request("y")
    assert (v.state, v.owed_forward, v.ops, v.reserved_tokens) == ("waiting", 0, (), 0)
    assert c.page_table("y") == {"kv": []}
    assert [e.request_id for e in c.poll().events] == ["x"]  # y changed no state
    # it fits once x is done (x's published pages are evicted for it)
    c.step_done("x", 5)
    c.finish("x")
    assert c.admit("y", list("cd"), prompt_tokens=5, chunk_tokens=5) is not None


def test_admission_with_loadback_is_all_or_nothing() -> None:
    """A host hit whose loadback plus first chunk does not fit pins nothing and issues
    no operation."""
    c = seeded()
    node = only_node(c)
    x = c.admit("x", list("zzzzzz"), prompt_tokens=13, chunk_tokens=13)  # 7 of 8 device pages
    assert x is not None
    before = snapshot(c.core)
    assert c.admit("y", list("abcd"), prompt_tokens=9, chunk_tokens=1) is None  # 4 + 1 pages
    c.check_invariants()
    assert snapshot(c.core) == before
    assert (node.state, node.host_pin, node.lock_ref) == ("host", 0, 0)
    assert c.poll().commands == () and not c.core.operations()


def test_admission_evicts_unlocked_tree_pages() -> None:
    c = TieredCache(h1(), 4, None)
    prefill(c, "x", "ab", 5)
    c.finish("x")  # its 2 published pages stay in the tree, unlocked
    assert free(c) == {"kv": 2}
    y = c.admit("y", list("cd"), prompt_tokens=5, chunk_tokens=5)
    assert y is not None and c.core.stats.device_evictions == 1


def test_admission_never_reuses_the_whole_prompt() -> None:
    c = TieredCache(h1(), 8, None)
    prefill(c, "x", "abcd", 8)
    adm = c.admit("y", list("abcd"), prompt_tokens=8, chunk_tokens=8)
    assert adm is not None and (adm.start_token, adm.chunk_tokens) == (6, 2)


def test_resume_without_the_exact_terminal_state_recomputes_from_scratch() -> None:
    """State recovery never settles for a shorter prefix: with the terminal gone the
    request recomputes from the start."""
    c = TieredCache(src(), 4, None)
    c.admit("a", list("xy"), prompt_tokens=10, chunk_tokens=10)
    c.step_done("a", 10, checkpoint=True)
    c.retract("a")
    assert c.state("a") == "retracted"  # no host tier: nothing to write back
    c.core.evict_device({"fh": 4})
    res = c.resume("a", chunk_tokens=16)
    assert res is not None and (res.start_token, res.hit_tokens, res.chunk_tokens) == (0, 0, 10)
