"""The node core's constructor defaults and read-only views (kvtier.fsm.node.core.CacheCore): an
inclusive host tier unless asked, the alignment in tokens, the receipts counted."""

from __future__ import annotations

from core_helpers import h1, h2, put

from kvtier.fsm import CacheCore


def test_the_host_tier_is_inclusive_unless_asked() -> None:
    assert CacheCore(h1(), 4, 8).exclusive is False
    assert CacheCore(h1(), 4, 8, exclusive=True).exclusive is True
    assert CacheCore(h1(), 4, None, exclusive=True).exclusive is False  # no host tier: nothing to be exclusive of


def test_alignment_is_the_layouts_in_tokens() -> None:
    assert CacheCore(h1(), 4).alignment == 2
    assert CacheCore(h2(), 4).alignment == 4


def test_receipts_count_locks_and_node_receipts() -> None:
    """``len(core.receipts)`` (the rank digest's count) is locks plus pins and borrows."""
    c = CacheCore(h1(), 8)
    res = put(c, list("abc"))
    node = res.node if hasattr(res, "node") else c.match(list("abc")).device_node
    assert len(c.receipts) == 0
    c.receipts.lock(node, "r", 1)
    c.receipts.take("pin", [node], "r")
    assert (len(c.receipts.locks()), len(c.receipts.node_receipts())) == (1, 1)
    assert len(c.receipts) == 2
