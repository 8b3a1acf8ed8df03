"""The byte-content model shared by the core and facade machines (invariant 12).

Every page written for a prefix holds a value naming exactly what it stands for (the
prefix's units up to the page's unit, the group and the page's position), so a page
copied from the wrong source, reused while a copy is in flight, or left behind by a
failed transfer holds a value that differs from what a reader expects.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node import DEVICE_READABLE, HOST_VISIBLE, Node

from . import _views as views

__all__ = ["content", "node_prefix", "check_tree_bytes"]


def content(prefix: tuple[Hashable, ...], group: str, index: int, ppu: Mapping[str, int]) -> tuple[Any, ...]:
    """What page ``index`` of ``group`` must hold for the prefix ``prefix`` (units)."""
    if group in ppu:
        unit = index // ppu[group]
        return (prefix[: unit + 1], group, index)
    return (prefix, group, "state", index)


def node_prefix(node: Node) -> tuple[Hashable, ...]:
    """The units from the root down to the end of ``node`` (its full key)."""
    out: list[Hashable] = []
    for n in reversed(node.path()):
        out.extend(n.key)
    return tuple(out)


def check_tree_bytes(cache: CacheCore, dev: Mapping[tuple[str, int], Any],
                     host: Mapping[tuple[str, int], Any]) -> None:
    """Invariant 12 on the tree: every page a node exposes holds its prefix's content."""
    ppu = views.pages_per_unit(cache)
    for n in views.nodes(cache).values():
        key = node_prefix(n)
        lo = len(key) - len(n.key)
        checks = []
        if n.state in DEVICE_READABLE:
            checks.append(("device", dev, n.dev, n.dev_ckpt))
        if n.state in HOST_VISIBLE:
            checks.append(("host", host, n.host, n.host_ckpt))
        for tier, store, hist, state in checks:
            for g, pages in hist.items():
                first = lo * ppu[g]
                for j, p in enumerate(pages):
                    if store.get((g, p)) != content(key, g, first + j, ppu):
                        raise InvariantViolation("loaded_equals_written", f"node {n.node_id} ({n.state})",
                                                 f"{tier} page {p} of {g!r} holds {store.get((g, p))!r}")
            for g, pages in state.items():
                for j, p in enumerate(pages):
                    if store.get((g, p)) != content(key, g, j, ppu):
                        raise InvariantViolation("loaded_equals_written", f"node {n.node_id} ({n.state})",
                                                 f"{tier} checkpoint page {p} of {g!r} holds {store.get((g, p))!r}")

