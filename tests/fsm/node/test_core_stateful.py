"""Model-based stateful test of the tiered cache (issue 3), through the public kit.

The machine lives in :mod:`kvtier.testing.machines` (``CoreMachine``), so engines run
exactly the rules and invariants kvtier runs itself: random inserts, matches with lock
and unlock, request and tree writebacks, loadbacks with per-layer progress, completions
delivered in any order (successes and failures, across ranks), splits through diverging
inserts, device and host eviction under pressure and deadlines. After every step
``check_invariants()`` holds, and a simulated byte store checks invariant 12.
"""

from __future__ import annotations

from hypothesis import settings

from kvtier.testing.machines import CoreMachine, RequestLifecycleMachine


class CoreStateful(CoreMachine):
    pass


TestCoreStateful = CoreStateful.TestCase
TestCoreStateful.settings = settings(TestCoreStateful.settings,
                                     stateful_step_count=max(100, TestCoreStateful.settings.stateful_step_count))


class RequestLifecycleStateful(RequestLifecycleMachine):
    pass


TestRequestLifecycle = RequestLifecycleStateful.TestCase
