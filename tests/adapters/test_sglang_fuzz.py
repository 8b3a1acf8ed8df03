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
