"""The models kvtier is driven with end to end: their KV caches live in kvtier's pools.

- :mod:`.llama`: the paged Llama-architecture decoder (:class:`PagedLlama`, its shapes
  :data:`CONFIGS`, cache groups :func:`model_layout`, K/V tensors :class:`PagedKV`);
- :mod:`.executor`: :class:`ModelExecutor`, the reference scheduler's executor running its
  forward passes, with correctness checks; :mod:`.clock`: :class:`WallClock`;
- :mod:`.tiny`: a tiny transformer generating through a :class:`~kvtier.tiered.TieredCache`
  (the end-to-end proof that kvtier moves the right bytes).

This package exports the names of :mod:`.llama`, :mod:`.executor` and :mod:`.clock`.
"""

from __future__ import annotations

from .clock import WallClock
from .executor import Checks, ModelExecutor
from .llama import (
    COMPONENTS,
    CONFIGS,
    FULL_GROUP,
    SWA_GROUP,
    ModelConfig,
    PagedKV,
    PagedLlama,
    config,
    model_layout,
    prompt_tokens_for,
)

__all__ = ["ModelConfig", "CONFIGS", "config", "model_layout", "PagedLlama", "PagedKV", "ModelExecutor", "Checks",
           "WallClock", "FULL_GROUP", "SWA_GROUP", "COMPONENTS", "prompt_tokens_for"]
