"""Exact values of the node core (fsm/core.py and its parts) that the mutation run
(bench/mutation, issue 12) found unchecked: defaults of the constructor and read-only views."""

from __future__ import annotations

from core_helpers import h1, h2

from kvtier.fsm import CacheCore


def test_the_host_tier_is_inclusive_unless_asked() -> None:
    assert CacheCore(h1(), 4, 8).exclusive is False
    assert CacheCore(h1(), 4, 8, exclusive=True).exclusive is True
    assert CacheCore(h1(), 4, None, exclusive=True).exclusive is False  # no host tier: nothing to be exclusive of


def test_alignment_is_the_layouts_in_tokens() -> None:
    assert CacheCore(h1(), 4).alignment == 2
    assert CacheCore(h2(), 4).alignment == 4
