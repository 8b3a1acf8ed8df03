"""Model-based stateful test of the facade, :class:`kvtier.tiered.TieredCache`, through the
public kit.

The machine lives in :mod:`kvtier.testing.machines` (``FacadeMachine``), so engines run
exactly the rules and checks kvtier runs itself: it plays a scheduler and a transfer engine
around one TieredCache (with or without a host tier, on the kit's layouts with and without
continuation state and on the presets', world size 1 and 2): admissions with shared
prefixes (fresh, cached, joining a loadback), chunked prefill and decode reservations,
forward results (some discarded, some of loading requests whose layers are ready), whole
batched steps, finishes, retractions and resumes, client aborts at every point, completions
delivered in any order across ops and ranks with per-layer progress, failures and
deadlines, victim aborts, capacity pressure, and refused calls that must name the request
and change nothing.

After every step the core's and the facade's invariants hold, and the kit's models agree:
the bytes every page of the tree and of a running request's page table holds (invariant
12), ``layer_ready`` per rank, each admission's answer, the forward passes out, what every
poll hands out and reports (each request's end exactly once), and after a drain nothing is
held, in flight or tracked.

``TestFacadeShortRun`` runs the same machine for few examples (the mutation run's subset,
bench/mutation/tests.txt).
"""

from __future__ import annotations

from hypothesis import settings

from kvtier.testing.machines import FacadeMachine


class FacadeStateful(FacadeMachine):
    pass


TestFacadeStateful = FacadeStateful.TestCase
TestFacadeStateful.settings = settings(TestFacadeStateful.settings,
                                       stateful_step_count=max(100, TestFacadeStateful.settings.stateful_step_count),
                                       max_examples=max(150, TestFacadeStateful.settings.max_examples))


class FacadeShortRun(FacadeMachine):
    """The facade machine, few examples: fast enough for every mutant of the request lifecycle."""


TestFacadeShortRun = FacadeShortRun.TestCase
TestFacadeShortRun.settings = settings(TestFacadeShortRun.settings, max_examples=25, stateful_step_count=40)
