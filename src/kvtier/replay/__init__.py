"""Trace replay: the main job, and what it is built from.

Modules: :mod:`.replay` (the single-instance replay: a trace through the reference
scheduler, the tiered cache and a transfer backend, in three configurations), :mod:`.command`
(the ``kvtier replay`` command line), :mod:`.l3replay` with :mod:`.l3instance` (N instances
behind a router over a shared L3 store), :mod:`.model_replay` (the paged model end to end),
:mod:`.router`, :mod:`.fingerprint` (the real-bytes executor that checks every hit page),
:mod:`.costmodel` (modeled step times), :mod:`.trace` with :mod:`.trace_lines` (the Mooncake
trace reader) and :mod:`.plot`.

This package exports the names of :mod:`.replay` (``from kvtier.replay import run_replay``),
imported on first use: ``import kvtier.replay.trace`` imports neither the scheduler nor the
cache.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .replay import (
        ROWS,
        ConfigResult,
        ReplaySetup,
        capacity_bounds,
        format_table,
        make_executor,
        run_config,
        run_replay,
        run_title,
        to_json,
        trace_requests,
        working_set_units,
    )

__all__ = ["ReplaySetup", "ConfigResult", "trace_requests", "run_replay", "run_config", "make_executor",
           "working_set_units", "capacity_bounds", "format_table", "run_title", "to_json", "ROWS"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".replay", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
