"""The reference of vLLM's offloading-manager contract (kvtier.testing.offload_contract)
checks a manager's answers without vLLM: a block is HIT only once its store completed and
no eviction took it; eviction spares blocks being stored or loaded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.fsm.errors import InvariantViolation
from kvtier.testing.offload_contract import OffloadContract


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
    assert c.stored == {b"b"} and c.gone == {b"a"} and c.lookups == 2 + 1 + 2
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
