"""Shared pytest setup: load kvtier's Hypothesis profile (HYPOTHESIS_PROFILE, else
kvtier-ci under CI, else kvtier-dev), and run every lifecycle in the checked mode (each
event fired through both the compiled table and the ``transitions`` machine, compared)."""

from kvtier.fsm.machines import set_checked
from kvtier.testing import load_profile

load_profile()
set_checked(True)
