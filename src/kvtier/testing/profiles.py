"""kvtier's Hypothesis profiles, defined once for pytest, ``kvtier fuzz`` and engines.

Profiles (names prefixed ``kvtier-`` so they never overwrite an engine's own profiles,
which are global to the process):

- ``kvtier-dev``: local development; random seeds, the example database on, no deadline.
- ``kvtier-ci``: deterministic (``derandomize=True``), no database, bounded size; the
  default whenever the ``CI`` environment variable is set.
- ``kvtier-fuzz``: long campaigns; random seeds, many examples, long step sequences;
  ``KVTIER_FUZZ_EXAMPLES`` (default 5000) and ``KVTIER_FUZZ_DB`` (default
  ``.hypothesis-fuzz``) tune it.

``HYPOTHESIS_PROFILE`` selects one (Hypothesis itself does not read that variable).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

__all__ = ["PROFILES", "register_profiles", "load_profile", "default_profile_name"]

PROFILES = ("kvtier-dev", "kvtier-ci", "kvtier-fuzz")


def register_profiles() -> None:
    """Register the three profiles (idempotent). Each names its parent explicitly: a
    profile registered without one inherits whatever profile is active at the time
    (``spec/README.md``, Sources: Hypothesis profiles)."""
    default = settings.get_profile("default")
    settings.register_profile(
        "kvtier-dev", parent=default, deadline=None, max_examples=100, stateful_step_count=50,
    )
    settings.register_profile(
        "kvtier-ci", parent=default, derandomize=True, database=None, deadline=None,
        print_blob=True, max_examples=40, stateful_step_count=40,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile(
        "kvtier-fuzz", parent=default, derandomize=False, deadline=None, print_blob=True,
        max_examples=int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "5000")),
        stateful_step_count=200,
        database=DirectoryBasedExampleDatabase(os.environ.get("KVTIER_FUZZ_DB", ".hypothesis-fuzz")),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )


def default_profile_name() -> str:
    """``HYPOTHESIS_PROFILE`` if set, else ``kvtier-ci`` under CI, else ``kvtier-dev``."""
    name = os.environ.get("HYPOTHESIS_PROFILE")
    if name:
        return name
    return "kvtier-ci" if os.environ.get("CI") else "kvtier-dev"


def load_profile(name: str | None = None) -> str:
    """Register the profiles and load ``name`` (default :func:`default_profile_name`).

    Returns:
        The loaded profile's name.

    Raises:
        hypothesis.errors.InvalidArgument: unknown profile name.
    """
    register_profiles()
    chosen = name or default_profile_name()
    settings.load_profile(chosen)
    return chosen
