"""The reference of vLLM's offloading-manager contract (kvtier.testing.offload_contract)
checks a manager's answers without vLLM: a block is HIT only once its store completed and
no eviction took it; eviction spares blocks being stored or loaded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.fsm.errors import InvariantViolation
from kvtier.testing.offload_contract import GONE_CAP, OffloadContract


class _Manager:
    """A toy manager: HIT once stored (or, with ``eager``, as soon as a store starts)."""

    def __init__(self, eager: bool = False, evict: tuple[bytes, ...] = ()) -> None:
        self.eager, self.evict = eager, list(evict)
        self.stored: set[bytes] = set()
        self.writing: set[bytes] = set()

    def lookup(self, key: bytes, ctx: Any) -> Any:
        hit = key in self.stored or (self.eager and key in self.writing)
        return SimpleNamespace(name="HIT" if hit else "HIT_PENDING" if key in self.writing else "MISS")

    def prepare_load(self, keys: list[bytes], ctx: Any) -> None:
        return None

    def complete_load(self, keys: list[bytes], ctx: Any) -> None:
        return None

    def prepare_store(self, keys: list[bytes], ctx: Any) -> Any:
        new = [k for k in keys if k not in self.stored]
        self.writing |= set(new)
        gone, self.evict = self.evict, []
        self.stored -= set(gone)
        return SimpleNamespace(keys_to_store=new, evicted_keys=gone)

    def complete_store(self, keys: list[bytes], ctx: Any, success: bool = True) -> None:
        self.writing -= set(keys)
        if success:
            self.stored |= set(keys)


def test_a_block_whose_store_is_in_flight_is_pending_then_hit_after_complete_store() -> None:
    m = _Manager()
    c = OffloadContract(m)
    m.prepare_store([b"a", b"b"], None)
    c.probe(None)
    assert m.lookup(b"a", None).name == "HIT_PENDING" and c.storing[b"a"] == 1
    m.complete_store([b"a"], None, False)
    m.complete_store([b"b"], None)
    c.probe(None)
    assert c.stored == {b"b"} and set(c.gone) == {b"a"} and c.lookups == 2 + 1 + 2
    c.check_drained()


def test_a_hit_for_a_block_still_being_stored_is_caught() -> None:
    m = _Manager(eager=True)
    c = OffloadContract(m)
    m.prepare_store([b"a"], None)
    with pytest.raises(InvariantViolation, match="HIT, but its store is in flight"):
        c.probe(None)


def test_evicting_a_block_pinned_by_prepare_load_is_caught() -> None:
    m = _Manager(evict=(b"a",))
    c = OffloadContract(m)
    c.stored.add(b"a")
    m.stored.add(b"a")
    m.prepare_load([b"a"], None)
    with pytest.raises(InvariantViolation, match="pinned by prepare_load"):
        m.prepare_store([b"b"], None)


def test_a_load_never_completed_is_left_at_the_drain() -> None:
    m = _Manager()
    c = OffloadContract(m)
    c.stored.add(b"a")
    m.prepare_load([b"a"], None)
    with pytest.raises(InvariantViolation, match="loads never completed"):
        c.check_drained()
    m.complete_load([b"a"], None)
    c.check_drained()


class _Strict(_Manager):
    """A manager that groups its stores: ``complete_store`` must name each store whole
    (else it raises, settling nothing, or with ``settle_first`` after settling the whole ones);
    ``refuse`` makes ``prepare_store`` answer None (with ``drop``, forgetting a stored block)."""

    def __init__(self, settle_first: bool = False, refuse: bool = False, drop: bool = False) -> None:
        super().__init__()
        self.settle_first, self.refuse, self.drop = settle_first, refuse, drop
        self.stores: list[set[bytes]] = []

    def prepare_store(self, keys: list[bytes], ctx: Any) -> Any:
        if self.refuse:
            if self.drop and self.stored:
                self.stored.discard(sorted(self.stored)[0])
            return None
        out = super().prepare_store(keys, ctx)
        self.stores.append(set(out.keys_to_store))
        return out

    def complete_store(self, keys: list[bytes], ctx: Any, success: bool = True) -> None:
        want = set(keys)
        whole = [s for s in self.stores if s <= want]
        part = [s for s in self.stores if s & want and not s <= want]
        if part and not self.settle_first:
            raise ValueError("complete_store: a store covered in part")
        for st in whole:
            self.stores.remove(st)
            super().complete_store(sorted(st), ctx, success)
        if part:
            raise ValueError("complete_store: a store covered in part")


def test_a_completion_covering_one_store_whole_and_another_in_part_is_refused_and_settles_neither() -> None:
    m = _Strict()
    c = OffloadContract(m, probe_ctx="probe")
    m.prepare_store([b"a"], "r1")
    m.prepare_store([b"b", b"c"], "r2")
    assert c.complete_mixed(0) is True  # refused, nothing changed
    assert m.lookup(b"a", None).name == "HIT_PENDING" and c.storing[b"a"] == 1
    m.complete_store([b"a"], "r1")
    m.complete_store([b"b", b"c"], "r2")
    assert c.stored == {b"a", b"b", b"c"} and c.complete_mixed(0) is False  # no store left in flight
    c.check_drained()


def test_a_refused_completion_that_settles_the_whole_store_first_is_caught() -> None:
    m = _Strict(settle_first=True)
    c = OffloadContract(m, probe_ctx="probe")
    m.prepare_store([b"a"], "r1")
    m.prepare_store([b"b", b"c"], "r2")
    with pytest.raises(InvariantViolation, match="complete_store that raised ValueError: changed what the "
                                                 "manager answers.*HIT_PENDING -> HIT"):
        c.complete_mixed(0)


def test_a_completion_covering_a_store_in_part_that_is_accepted_is_caught() -> None:
    m = _Manager()  # settles any keys it is given
    c = OffloadContract(m, probe_ctx="probe")
    m.prepare_store([b"a"], "r1")
    m.prepare_store([b"b", b"c"], "r2")
    with pytest.raises(InvariantViolation, match="accepted keys covering a store of 1 blocks whole and one "
                                                 "of 2 blocks in part"):
        c.complete_mixed(0)


def test_a_refused_prepare_store_that_drops_a_stored_block_is_caught() -> None:
    ok = _Strict()
    c = OffloadContract(ok, probe_ctx="probe")
    ok.prepare_store([b"a"], "r")
    ok.complete_store([b"a"], "r")
    ok.refuse = True
    assert ok.prepare_store([b"b"], "r") is None  # refused, nothing changed: passes
    bad = _Strict()
    c = OffloadContract(bad, probe_ctx="probe")
    bad.prepare_store([b"a"], "r")
    bad.complete_store([b"a"], "r")
    bad.refuse = bad.drop = True
    with pytest.raises(InvariantViolation, match=r"a refused prepare_store \(it returned None\): changed what "
                                                 r"the manager answers.*HIT -> MISS"):
        bad.prepare_store([b"b"], "r")
    assert c.stored == {b"a"}


def test_a_stored_block_that_a_lookup_misses_without_an_eviction_is_caught() -> None:
    m = _Manager()
    c = OffloadContract(m)
    m.prepare_store([b"a"], None)
    m.complete_store([b"a"], None)
    c.probe(None)  # HIT: passes
    m.stored.clear()  # lost without prepare_store reporting it evicted
    with pytest.raises(InvariantViolation, match="answered MISS, but its store completed and no eviction"):
        c.probe(None)


def test_an_evicted_block_may_miss_and_the_evicted_keys_remembered_are_capped() -> None:
    m = _Manager()
    c = OffloadContract(m)
    keys = [bytes([i]) for i in range(GONE_CAP + 10)]
    for k in keys:
        m.prepare_store([k], None)
        m.complete_store([k], None, False)  # a failed store: gone
    assert len(c.gone) == GONE_CAP and list(c.gone)[0] == keys[10] and keys[-1] in c.gone
    c.probe(None)
