"""kvtier.testing's machine for the vLLM adapter inside vLLM's real offloading connector:
late and failed stores and loads, aborts of queued, loading and running requests,
preemption and re-admission, full-attention-only and hybrid (full + sliding-window)
models. Every invariant is checked after every step, and nothing may be left after
draining (``check_drained``)."""

import pytest
from vllm_guard import require_vllm

require_vllm()

from hypothesis import settings  # noqa: E402

from kvtier.adapters.vllm_machine import VllmAdapterMachine  # noqa: E402

pytestmark = pytest.mark.vllm

FullAttention = VllmAdapterMachine.configured(fault_rate=0.2)
Hybrid = VllmAdapterMachine.configured(fault_rate=0.2, groups=(None, 32))

TestFullAttention = FullAttention.TestCase
TestFullAttention.settings = settings(TestFullAttention.settings, max_examples=25, stateful_step_count=60,
                                      deadline=None)
TestHybrid = Hybrid.TestCase
TestHybrid.settings = settings(TestHybrid.settings, max_examples=25, stateful_step_count=60, deadline=None)
