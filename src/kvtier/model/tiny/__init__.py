"""A tiny decoder-only transformer whose paged KV cache lives in kvtier's pools, and the
runner that generates with it through a :class:`~kvtier.tiered.TieredCache`: the
end-to-end proof that kvtier moves the right bytes.

Modules: :mod:`.transformer` (:class:`TinyModel`, :class:`TinyConfig`, its cache groups) and
:mod:`.runner` (:class:`TinyRunner`, :class:`GenResult`).
"""

from __future__ import annotations

from .runner import GenResult, TinyRunner
from .transformer import COMPONENTS, FULL_GROUP, SWA_GROUP, LayerHook, TinyConfig, TinyModel, tiny_layout

__all__ = ["TinyConfig", "TinyModel", "TinyRunner", "GenResult", "FULL_GROUP", "SWA_GROUP", "COMPONENTS", "LayerHook",
           "tiny_layout"]
