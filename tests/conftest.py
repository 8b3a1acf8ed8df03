"""Shared pytest setup: load kvtier's Hypothesis profile (HYPOTHESIS_PROFILE, else
kvtier-ci under CI, else kvtier-dev)."""

from kvtier.testing import load_profile

load_profile()
