"""The transfer engine's ``stats()`` against counts kept from the commands it flushed
(``model_engine_stats``).

:class:`EngineStatsModel` is told, on one rank, the commands each flush takes out of the
queue (:meth:`flushed`), and computes what the engine's cumulative statistics
(:meth:`~kvtier.transfer.engine.TransferEngine.stats`, ``cumulative`` per direction) must
add for that flush, from the plan's documented merging (``transfer/plan/__init__.py``): all
commands of one direction in one flush are merged per cache group, a page pair that repeats
counted once; a loadback is cut into chunks of ``chunk_layers`` model layers over the
layers its groups span (sorted), a writeback is one chunk; a page moves every component on
every layer of its group (:attr:`~kvtier.fsm.records.CacheGroup.page_bytes`'s doc), so a
flush fully issued copies its pages times each group's page bytes. Per direction:

- ``flushes``, ``ops``, ``pages``: exact, after every flush;
- ``chunks``, ``bytes``: exact when no issue failure was injected into the flush; else at
  most what the flush would have issued (a failing chunk stops the rest).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtier.fsm import Direction
from kvtier.fsm.layout import CacheLayout

from .models import ModelViolation

__all__ = ["EngineStatsModel", "page_bytes_by_group"]

_EXACT = ("flushes", "ops", "pages")
_AT_MOST = ("chunks", "bytes")


def page_bytes_by_group(layout: CacheLayout) -> dict[str, int]:
    """Bytes one page of each cache group moves, from the layout's own parts: every component on
    every layer of the group (``CacheGroup.page_bytes``'s doc), not the product's sum."""
    return {g.name: sum(c.page_bytes for c in g.components) * len(g.layers) for g in layout.groups}


class EngineStatsModel:
    """The expected cumulative counters of one rank's engine (module doc)."""

    def __init__(self, layout: CacheLayout, chunk_layers: int, rank: int) -> None:
        self.groups = {g.name: g for g in layout.groups}
        self.page_bytes = page_bytes_by_group(layout)
        self.chunk_layers, self.rank = chunk_layers, rank
        self.exact: dict[str, Counter[str]] = {d.value: Counter() for d in Direction}
        self.most: dict[str, Counter[str]] = {d.value: Counter() for d in Direction}

    def flushed(self, commands: list[Any], faulty: bool) -> None:
        """A flush took ``commands`` (:class:`~kvtier.fsm.records.TransferCommand`) out of
        the queue; ``faulty``: an issue failure was armed for it."""
        for d in Direction:
            cmds = [c for c in commands if c.direction is d]
            if not cmds:
                continue
            pairs: dict[str, set[tuple[int, int]]] = {}
            for c in cmds:
                for t in c.transfers:
                    pairs.setdefault(t.group, set()).update(zip(t.src_pages, t.dst_pages))
            pages = sum(len(p) for p in pairs.values())
            nbytes = sum(len(p) * self.page_bytes[g] for g, p in pairs.items())
            layers = sorted({layer for g, p in pairs.items() if p for layer in self.groups[g].layers})
            step = self.chunk_layers if d is Direction.LOADBACK else max(1, len(layers))
            chunks = -(-len(layers) // step)
            ex, most = self.exact[d.value], self.most[d.value]
            ex["flushes"] += 1
            ex["ops"] += len(cmds)
            ex["pages"] += pages
            most["chunks"] += chunks
            most["bytes"] += nbytes
            if not faulty:
                ex["chunks"] += chunks
                ex["bytes"] += nbytes

    def bytes_range(self, direction: str) -> tuple[int, int]:
        """The bytes the engine copied in ``direction`` so far: (least, most); equal when no
        flush had an issue failure armed."""
        return self.exact[direction]["bytes"], self.most[direction]["bytes"]

    def check(self, stats: dict[str, Any]) -> None:
        """``stats``: the engine's ``stats()``; raises ``model_engine_stats`` on a mismatch."""
        for d in Direction:
            got = stats["cumulative"][d.value]
            ex, most = self.exact[d.value], self.most[d.value]
            exact_all = ex["chunks"] == most["chunks"] and ex["bytes"] == most["bytes"]
            for k in (*_EXACT, *(_AT_MOST if exact_all else ())):
                if got[k] != ex[k]:
                    self._fail(f"{d.value} {k} is {got[k]}, the commands flushed add up to {ex[k]}")
            if not exact_all:
                for k in _AT_MOST:
                    if not ex[k] <= got[k] <= most[k]:
                        self._fail(f"{d.value} {k} is {got[k]}: the flushes without an issue failure add up "
                                   f"to {ex[k]}, all of them fully issued to {most[k]}")

    def _fail(self, what: str) -> None:
        raise ModelViolation("model_engine_stats", f"the transfer engine of rank {self.rank}", what)
