"""Matching a key against the tree: a pure function of the walked path and its result.

:func:`find_match` reads node states and checkpoints along a path the tree already
walked (the walk may split a node; that is the core's business). It changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..layout import CacheLayout
from ..lifecycle.names import DEVICE_READABLE, NODE_STATE
from .node import Node, PageMap

__all__ = ["MatchMode", "MatchResult", "find_match", "match_mode", "has_checkpoint"]


class MatchMode(str, enum.Enum):
    """How a match may end."""

    PREFIX_REUSE = "prefix_reuse"  #: new requests: the deepest usable prefix
    STATE_RECOVERY = "state_recovery"  #: resuming a retracted request: exactly its own terminal


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What :meth:`kvtier.fsm.node.core.CacheCore.match` found for a key.

    Attributes:
        key_units: units in the key.
        device_node: deepest node whose device pages the hit reads directly (the root if
            none); with a loadback, the node the loaded chain hangs from.
        device_units: units read directly from the device.
        terminal: the node where the whole usable hit ends (the root if none).
        host_nodes: nodes beyond the device hit to load back, parent first (``host``
            state) — empty without a host tier.
        joined_nodes: nodes beyond the device hit already loading in another operation,
            which this hit joins (it may end inside them).
        host_units: usable hit units in total (device + host); ``>= device_units``.
        history_units: the history-only bound: units matched with history pages,
            ignoring continuation state (equal to ``host_units`` without state groups).
        recompute_tokens: with ``history_replay``, tokens before the hit end the engine
            must recompute to rebuild the continuation state (0 otherwise).
        alignment: tokens per unit.
    """

    key_units: int
    device_node: Node
    device_units: int
    terminal: Node
    host_nodes: tuple[Node, ...]
    joined_nodes: tuple[Node, ...]
    host_units: int
    history_units: int
    recompute_tokens: int
    alignment: int

    @property
    def device_tokens(self) -> int:
        return self.device_units * self.alignment

    @property
    def hit_tokens(self) -> int:
        """Tokens the request need not compute (device + host hit, minus any replay span)."""
        return self.host_units * self.alignment - self.recompute_tokens

    @property
    def needs_loadback(self) -> bool:
        return self.host_units > self.device_units


def match_mode(mode: MatchMode | str, history_replay: bool) -> MatchMode:
    """Validate a match's mode and options.

    Raises:
        UsageError: unknown mode, or ``history_replay`` with ``state_recovery``.
    """
    try:
        m = MatchMode(mode)
    except ValueError:
        raise UsageError(f"match mode must be one of {[x.value for x in MatchMode]}, got {mode!r}") from None
    if history_replay and m is MatchMode.STATE_RECOVERY:
        raise UsageError("history_replay applies to prefix_reuse matches only")
    return m


def has_checkpoint(ckpt: PageMap, state_groups: int) -> bool:
    """Whether a node's checkpoint map covers every one of the ``state_groups`` groups."""
    return len(ckpt) == state_groups


def find_match(path: Sequence[Node], root: Node, key_units: int, mode: MatchMode, *,
               history_replay: bool, has_host: bool, layout: CacheLayout, n_state: int | None = None,
               align: int | None = None) -> MatchResult:
    """The usable device hit and, beyond it, the host hit along ``path``.

    The device hit runs through nodes whose device pages every request may read; the
    host hit continues through nodes with visible host copies and stops at the first
    gap (invariant ``host_evict_leaves``); it may join nodes already loading but never goes past them. With
    state groups a hit ends only at a node holding the exact continuation state for its
    own length in the matching tier (invariant ``exact_continuation_state``); in ``state_recovery`` mode only at
    the key's own end. ``history_replay`` returns the deeper history-only hit with
    ``recompute_tokens`` (see :meth:`CacheLayout.replay_span_tokens`). ``n_state`` and
    ``align``: the layout's state groups and alignment, when the caller has them at hand.
    """
    if n_state is None:
        n_state = len(layout.state_groups)
    if align is None:
        align = layout.alignment
    d = 0
    while d < len(path) and path[d].state in DEVICE_READABLE:
        d += 1
    h = d
    if has_host:
        while h < len(path) and path[h].state in (NODE_STATE.host, NODE_STATE.loading):
            if path[h].state == NODE_STATE.loading:  # (a loading node's lb_op is its operation)
                h += 1
                while h < len(path) and path[h].state == NODE_STATE.loading and path[h].lb_op == path[h - 1].lb_op:
                    h += 1
                break
            h += 1
    history_units = path[h - 1].depth if h else 0
    recompute = 0
    if not n_state:
        dev_end, host_end = d, h  # history-only layouts may resume from any prefix
    else:
        dev_end = host_end = 0
        for i in range(h):
            nd = path[i]
            if i < d and has_checkpoint(nd.dev_ckpt, n_state):
                dev_end = host_end = i + 1
            elif i >= d and has_checkpoint(nd.host_ckpt, n_state):
                # (a loading node keeps its pinned host checkpoint until the loadback settles)
                host_end = i + 1
        if mode is MatchMode.STATE_RECOVERY:
            full = h > 0 and path[h - 1].depth == key_units
            if not (full and max(dev_end, host_end) == h):
                dev_end = host_end = 0
        state_tokens = path[max(dev_end, host_end) - 1].depth * align if max(dev_end, host_end) else 0
        span = layout.replay_span_tokens() if history_replay else 0  # (O(layers): only when asked)
        if history_replay and history_units * align - span > state_tokens:
            recompute = span
            dev_end, host_end = d, h
    if host_end > dev_end:  # load back path[d:host_end], read path[:d] from the device
        dev_end = d
    else:
        host_end = dev_end
    device_node = path[dev_end - 1] if dev_end else root
    beyond = path[dev_end:host_end]
    return MatchResult(  # (positional: a dataclass init with keywords costs twice as much)
        key_units, device_node, device_node.depth,  # key_units, device_node, device_units
        path[host_end - 1] if host_end else root,  # terminal
        tuple([n for n in beyond if n.state == NODE_STATE.host]) if beyond else (),  # host_nodes
        tuple([n for n in beyond if n.state == NODE_STATE.loading]) if beyond else (),  # joined_nodes
        path[host_end - 1].depth if host_end else 0,  # host_units
        history_units, recompute, align,  # history_units, recompute_tokens, alignment
    )
