"""The third tier (spec ``[l3]``): prefix chunks in a shared store as one instance sees them
(:class:`L3Tier`, :mod:`~kvtier.fsm.l3.tier`), its options and object records
(:mod:`~kvtier.fsm.l3.options`) and the ``l3_*`` invariants (:mod:`~kvtier.fsm.l3.checks`).

Everything :mod:`~kvtier.fsm.l3.tier` exports is importable from here, as it was from
``kvtier.fsm.l3`` before the core was grouped by the spec's chapters.
"""

from .tier import (WRITE_POLICIES, L3Object, L3Options, L3Outstanding, L3Stats, L3Tier, StoreCommand, StoreOp,
                   StoreResult, chain_keys, namespace)

__all__ = ["StoreOp", "StoreCommand", "StoreResult", "L3Options", "L3Stats", "L3Object", "L3Outstanding", "L3Tier",
           "WRITE_POLICIES", "namespace", "chain_keys"]
