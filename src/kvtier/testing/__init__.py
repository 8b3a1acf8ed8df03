"""Testing kit for engines embedding kvtier: Hypothesis profiles and state machines.

Needs the ``testing`` extra: ``pip install 'kvtier[testing]'``. Modules:

- :mod:`kvtier.testing.profiles`: the ``kvtier-dev``, ``kvtier-ci`` and ``kvtier-fuzz`` profiles;
- :mod:`kvtier.testing.machines`: the public state machines (core, facade with pluggable
  scheduler adapter and transfer backend, raw node and request lifecycles), re-exported
  from the modules they live in: ``base`` (the machines' base), ``content`` (the
  byte-content model), ``core_machine`` (with ``core_steps``), ``facade_machine`` (with
  ``facade_steps``, ``facade_rules``, ``facade_engine``, ``facade_checks``, ``plugs`` and
  ``canonical``), ``l3_machine`` (with ``l3_steps`` and ``l3_cases``), ``misuse_machine``
  (with ``misuse_cases``, ``corruptions`` and ``corruption_cases``), ``raw_machines``;
  ``_views`` holds the kit's reads of core and facade internals;
- :mod:`kvtier.testing.steps`: the kvtier event-sequence JSON format;
- :mod:`kvtier.testing.registry`: the names sequence files give the machines;
- :mod:`kvtier.testing.sequence`: exact replay and minimization (and the names above);
- :mod:`kvtier.testing.coverage`: lifecycle coverage computed from the spec;
- :mod:`kvtier.testing.fuzz`: the ``kvtier fuzz`` campaign driver;
- :mod:`kvtier.testing.verify`: ``kvtier verify``, exhaustive bounded exploration.
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
