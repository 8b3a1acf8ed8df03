"""Byte layouts of a pool's own buffer: layer-first (both pools) and page-major (host
pools with ``layout="page"``); see :mod:`kvtier.transfer.pools`."""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.fsm import CacheGroupSpec

__all__ = ["REGION_ALIGN", "_layout", "_page_layout"]

#: Alignment (bytes) of the start of every region in a pool's own buffer.
REGION_ALIGN = 256

#: ``(group name, component name, model layer)``.
RegionKey = tuple[str, str, int]


def _layout(specs: Mapping[str, CacheGroupSpec], pages: Mapping[str, int]) -> tuple[dict[RegionKey, int], int]:
    """Byte offset of every region in one buffer, and the buffer's size (a multiple of 16)."""
    offsets: dict[RegionKey, int] = {}
    off = 0
    for name, spec in specs.items():
        for layer in spec.layers:
            for comp in spec.components:
                off = -(-off // REGION_ALIGN) * REGION_ALIGN
                offsets[(name, comp.name, layer)] = off
                off += pages[name] * comp.page_bytes
    return offsets, -(-off // 16) * 16


def _page_layout(specs: Mapping[str, CacheGroupSpec], pages: Mapping[str, int]
                 ) -> tuple[dict[RegionKey, int], dict[str, tuple[int, int]], int]:
    """Page-major layout: (byte offset of every region's page 0, per group (block offset,
    page stride), buffer size, a multiple of 16)."""
    offsets: dict[RegionKey, int] = {}
    groups: dict[str, tuple[int, int]] = {}
    off = 0
    for name, spec in specs.items():
        off = -(-off // REGION_ALIGN) * REGION_ALIGN
        inner = 0
        for layer in spec.layers:
            for comp in spec.components:
                offsets[(name, comp.name, layer)] = off + inner
                inner += comp.page_bytes
        stride = -(-inner // 16) * 16
        groups[name] = (off, stride)
        off += pages[name] * stride
    return offsets, groups, -(-off // 16) * 16
