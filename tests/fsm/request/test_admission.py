"""Admission and reservation (kvtier.fsm.admission): unit keys counted, an admitted request
refused by name, a resume that hits its own terminal, reservations only for the groups
that need pages and from the tokens computed, and a history-replay chunk that reserves no
history page."""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import h1, snapshot, src

from kvtier.fsm import UsageError
from kvtier.tiered import TieredCache


# ------------------------------------------------------------------ request lifecycle
def _pools(c: TieredCache) -> dict[str, int]:
    return {g: a.free for g, a in c.core.device.items()}


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
    assert _pools(c) == {"fh": 24, "swa": 28}
    b = c.admit("B", list("abcdefgz"), prompt_tokens=33, chunk_tokens=4)
    assert b is not None
    assert (b.start_token, b.chunk_tokens, b.recompute_tokens, b.history_hit_tokens) == (12, 4, 16, 28)
    assert b.page_table == {"fh": [0, 1, 2, 3, 4, 5, 6], "swa": [3, 2, 1, 0]}
    assert c.request("B").own_pages == {"swa": [3, 2, 1, 0]}
    assert _pools(c) == {"fh": 24, "swa": 24}
    c.check_invariants()


def _two_decoding() -> TieredCache:
    """Requests a and b decoding: prompts of 8 tokens computed and published, 1 more token reserved."""
    c = TieredCache(h1(), 32, None)
    for rid, key in (("a", "abcd"), ("b", "efgh")):
        assert c.admit(rid, list(key), prompt_tokens=8, chunk_tokens=8) is not None
        assert c.step_done(rid, 8) == {}
        assert c.reserve(rid, 1) is not None
    return c


def _seen(c: TieredCache) -> tuple[Any, ...]:
    """What a call may change: the counters, every request's record and the tree."""
    recs = [(r.request_id, r.state, r.tokens, r.reserved, r.passes, r.results, list(r.units),
             {g: list(p) for g, p in r.own.items()}) for r in c.table]
    return c.stats(), recs, snapshot(c.core)


def test_admit_of_an_admitted_request_says_it_is_already_admitted() -> None:
    """Was "request 'a': admit in state 'running' (accepted in ...)", which did not say
    that the id is in use. The record (its units, prompt, pages) stays as it was."""
    c = _two_decoding()
    assert c.step_done("b", 1) == {}
    assert c.retract("b") is not None
    assert c.states(["a", "b"]) == ["running", "retracted"]
    before = _seen(c)
    for rid, st in (("a", "running"), ("b", "retracted")):
        with pytest.raises(UsageError) as exc:
            c.admit(rid, list("xyzw"), prompt_tokens=8, chunk_tokens=8)
        assert type(exc.value) is UsageError
        assert str(exc.value) == (f"request {rid!r} is already admitted: admit in state {st!r} "
                                  f"(accepted in aborted, finished, waiting)")
        assert _seen(c) == before
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
