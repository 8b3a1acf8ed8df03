"""Read-only walks of the core's tree for the L3 tier (spec ``[l3]``): where the local hit
ends (a prefetch asks the store beyond it) and which host chunks the write policies put,
as ``(node, unit index within node, key)`` items the tier pins and submits
(:meth:`kvtier.fsm.l3.tier.L3Tier.offer`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from ..lifecycle.names import DEVICE_READABLE, HOST_VISIBLE
from ..node.node import Node
from .options import L3Options, chain_keys

if TYPE_CHECKING:
    from ..node.core import CacheCore

__all__ = ["local_end", "offer_items", "victim_items"]

Item = tuple[Node, int, str]


def local_end(core: CacheCore, units: Sequence[Hashable]) -> tuple[Node, int]:
    """The deepest node of ``units``' path whose data is available locally (device
    readable or host visible), and its depth in units (0 at the root)."""
    last: Node = core.root
    for n in core.walk(units):
        if n.depth > len(units) or not (n.state in DEVICE_READABLE or n.state in HOST_VISIBLE):
            break
        last = n
    return last, last.depth if last is not core.root else 0


def _path_end(core: CacheCore, units: Sequence[Hashable]) -> int:
    depth = 0
    for n in core.walk(units):
        if n.depth > len(units) or n.state not in HOST_VISIBLE:
            break
        depth = n.depth
    return depth


def offer_items(core: CacheCore, keys_for: Callable[[Sequence[Hashable]], list[str]], options: L3Options,
                units: Sequence[Hashable], wants: Callable[[str, Node], bool]) -> list[Item]:
    """``host_write`` / ``selective``: the host-visible chunks of ``units`` that ``wants``,
    from the root, at most ``options.max_put_units``."""
    items: list[Item] = []
    keys: list[str] | None = None
    for n in core.walk(units):
        if n.depth > len(units) or n.state not in HOST_VISIBLE:
            break
        lo = n.depth - len(n.key)
        for i in range(len(n.key)):
            if keys is None:
                keys = keys_for(units[:min(len(units), _path_end(core, units))])
            key = keys[lo + i]
            if wants(key, n):
                items.append((n, i, key))
            if len(items) >= options.max_put_units:
                return items
    return items


def victim_items(core: CacheCore, seed: bytes, options: L3Options, wants: Callable[[str, Node], bool]) -> list[Item]:
    """``host_eviction``: the chunks of the next host eviction victims that ``wants``
    (``options.eviction_lookahead`` victims, at most ``options.max_put_units`` items)."""
    victims = sorted((n for n in core.tree if core.evictable_on_host(n)),
                     key=lambda n: (n.last_access, -n.depth, n.node_id))[:options.eviction_lookahead]
    items: list[Item] = []
    for n in victims:
        units: list[Hashable] = []
        for m in reversed(n.path()):
            units.extend(m.key)
        lo = n.depth - len(n.key)
        keys = [d.hex() for d in chain_keys(seed, units)]
        for i in range(len(n.key)):
            if wants(keys[lo + i], n):
                items.append((n, i, keys[lo + i]))
        if len(items) >= options.max_put_units:
            break
    return items[:options.max_put_units]
