"""Testing kit for engines embedding kvtier: Hypothesis profiles and state machines.

Needs the ``testing`` extra: ``pip install 'kvtier[testing]'``.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvtier.testing needs Hypothesis; install the testing extra: pip install 'kvtier[testing]'"
    ) from exc

from .profiles import PROFILES, default_profile_name, load_profile, register_profiles

__all__ = ["PROFILES", "default_profile_name", "load_profile", "register_profiles"]
