"""The request lifecycle in fsm/ (request, request_table, admission, forward,
request_ends, completions, fence) checked for the mutation run (bench/mutation, issue 12):
a short, derandomized run of the facade machine of tests/test_facade_stateful.py (every
invariant, the byte model and the teardown checks after every step), and exact-value
tests for what the mutants that survived it showed unchecked."""

from __future__ import annotations

from hypothesis import settings
from test_facade_stateful import FacadeMachine


class ShortFacadeMachine(FacadeMachine):
    """The facade machine, few examples: fast enough for every mutant of the request lifecycle."""


TestShortFacade = ShortFacadeMachine.TestCase
TestShortFacade.settings = settings(TestShortFacade.settings, max_examples=25, stateful_step_count=40)
