"""kvtier.testing's machine for the SGLang adapter on SGLang's real pools: late and failed
writebacks and loadbacks, admissions that load back, evict and run out of room, finishes and
aborts, write_through and write_back, pages of one and two tokens. Every invariant (the core's,
KV pool conservation, locked prefixes unchanged) is checked after every step, and nothing may
be left after draining."""

import pytest
from sglang_guard import require_sglang

require_sglang()

from hypothesis import settings  # noqa: E402

from kvtier.adapters.sglang_machine import SglangAdapterMachine  # noqa: E402

pytestmark = pytest.mark.sglang


def _case(**attrs):
    case = SglangAdapterMachine.configured(fault_rate=0.2, **attrs).TestCase
    case.settings = settings(case.settings, max_examples=25, stateful_step_count=60, deadline=None)
    return case


TestWriteThrough = _case()
TestWriteBack = _case(write_policy="write_back")
TestWriteBackPaged = _case(write_policy="write_back", page_size=2)
TestWriteThroughSmallHost = _case(host_pages=6)


def _run(machine, examples=40):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=60,
                                                         deadline=None, database=None,
                                                         report_multiple_bugs=False))


def test_an_evict_that_rounds_the_token_demand_down_fails_the_machines_evict_model(monkeypatch):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kvtier.adapters.sglang import KvtierRadixCache
    from kvtier.fsm.errors import InvariantViolation

    orig = KvtierRadixCache.evict

    def rounded_down(self, params):
        return orig(self, EvictParams(num_tokens=params.num_tokens // self.page_size * self.page_size))

    monkeypatch.setattr(KvtierRadixCache, "evict", rounded_down)
    with pytest.raises(InvariantViolation, match="evict_frees_the_demand"):
        _run(SglangAdapterMachine.configured(fault_rate=0.2, page_size=2, write_policy="write_through"))


def test_a_dec_lock_ref_that_keeps_the_core_lock_fails_the_machines_lock_accounting(monkeypatch):
    from kvtier.adapters.sglang import KvtierRadixCache
    from kvtier.fsm.errors import InvariantViolation

    def keeps_lock(self, node, params=None):
        held = self._locks.get(node.node_id)
        if held:
            held.pop()  # forgets the receipt, never unlocks the core
            if not held:
                del self._locks[node.node_id]

    monkeypatch.setattr(KvtierRadixCache, "dec_lock_ref", keeps_lock)
    with pytest.raises(InvariantViolation, match="adapter_records|drained"):
        _run(SglangAdapterMachine.configured(fault_rate=0.2))
