"""A cache layout: the cache groups of one model and what follows from them.

Units: tokens, pages, bytes. The *alignment* is the least common multiple of the
history groups' tokens per page: the radix tree caches prefixes in whole units of
``alignment`` tokens (256 for DeepSeek V4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError
from .checks import plain_int
from .records import CacheGroupSpec, Family

__all__ = ["CacheLayout", "ChunkRows"]


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """What a prefill chunk on top of a cached prefix completes in one history group.

    Attributes:
        group: cache group name.
        first_row: index of the first row that becomes complete (rows before it were cached).
        rows: number of rows that become complete in this chunk (the only rows the engine
            must insert).
        residue_tokens: trailing tokens of the chunk that do not fill a whole row (they stay
            as compressor residue for the next chunk).
    """

    group: str
    first_row: int
    rows: int
    residue_tokens: int


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The cache groups of one model.

    Attributes:
        name: preset or model name.
        groups: the cache groups (names unique; at least one history group).
        num_layers: model layers (every group's layers lie in ``range(num_layers)``).
        source: where the geometry comes from (shown in reports).

    Raises:
        ConfigError: an empty name or one not a str, groups not CacheGroupSpec records,
            duplicate group names, no history group, a layer out of range, or a state
            group whose tokens per page does not divide the alignment.
    """

    name: str
    groups: tuple[CacheGroupSpec, ...]
    num_layers: int
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"layout name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.groups, (tuple, list)) or not all(isinstance(g, CacheGroupSpec) for g in self.groups):
            raise ConfigError(f"layout {self.name!r}: groups must be a tuple of CacheGroupSpec, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(self.groups))
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"layout {self.name!r}: duplicate cache group names {names}")
        if not any(g.family is Family.HISTORY for g in self.groups):
            raise ConfigError(f"layout {self.name!r}: needs at least one history group")
        layers = plain_int(self.num_layers)
        if layers is None or layers <= 0:
            raise ConfigError(f"layout {self.name!r}: num_layers must be a positive int, got {self.num_layers!r}")
        object.__setattr__(self, "num_layers", layers)
        for g in self.groups:
            if g.layers[-1] >= self.num_layers:
                raise ConfigError(f"layout {self.name!r}: group {g.name!r} uses layer {g.layers[-1]} "
                                  f"but the model has {self.num_layers} layers")
        for g in self.state_groups:
            if self.alignment % g.tokens_per_page:
                raise ConfigError(f"layout {self.name!r}: state group {g.name!r} has {g.tokens_per_page} "
                                  f"tokens per page, which does not divide the alignment {self.alignment}")

    @property
    def history_groups(self) -> tuple[CacheGroupSpec, ...]:
        return tuple(g for g in self.groups if g.family is Family.HISTORY)

    @property
    def state_groups(self) -> tuple[CacheGroupSpec, ...]:
        return tuple(g for g in self.groups if g.family is Family.STATE)

    @property
    def alignment(self) -> int:
        """Tokens per cache unit: lcm of the history groups' tokens per page."""
        return math.lcm(*(g.tokens_per_page for g in self.history_groups))

    def group(self, name: str) -> CacheGroupSpec:
        """The group called ``name``.

        Raises:
            ConfigError: no such group (the message lists the groups).
        """
        for g in self.groups:
            if g.name == name:
                return g
        raise ConfigError(f"layout {self.name!r} has no cache group {name!r}; groups: "
                          f"{[g.name for g in self.groups]}")

    def pages_per_unit(self, group: CacheGroupSpec) -> int:
        """History pages per cache unit of ``alignment`` tokens (0 for state groups)."""
        return self.alignment // group.tokens_per_page if group.family is Family.HISTORY else 0

    def unit_bytes(self) -> int:
        """Bytes of one cache unit over every history group, layer and component."""
        return sum(self.pages_per_unit(g) * g.page_bytes for g in self.history_groups)

    def checkpoint_bytes(self) -> int:
        """Bytes of one continuation-state checkpoint over every state group."""
        return sum(g.state_pages * g.page_bytes for g in self.state_groups)

    def replay_span_tokens(self) -> int:
        """Tokens to recompute to rebuild every state group's continuation state from
        history alone (the ``history_replay`` match option).

        Stacked sliding-window layers widen the receptive field: the state at position
        ``D`` in layer ``l`` depends on tokens ``[D - w_0 - ... - w_l, D)``, where ``w_i`` is
        the largest window of a state group used by layer ``i``. So the span is the sum,
        over layers, of that largest window (0 for layers with no state group).
        """
        per_layer = [0] * self.num_layers
        for g in self.state_groups:
            assert g.window is not None
            for layer in g.layers:
                per_layer[layer] = max(per_layer[layer], g.window)
        return sum(per_layer)

    def chunk_rows(self, cached_tokens: int, chunk_tokens: int) -> tuple[ChunkRows, ...]:
        """For a prefill chunk of ``chunk_tokens`` on top of ``cached_tokens`` cached tokens,
        which rows of each history group become complete (the engine inserts exactly those)
        and how many trailing tokens stay as compressor residue.

        Raises:
            ConfigError: negative token counts.
        """
        if cached_tokens < 0 or chunk_tokens < 0:
            raise ConfigError(f"chunk_rows: token counts must be >= 0, got cached={cached_tokens}, "
                              f"chunk={chunk_tokens}")
        end = cached_tokens + chunk_tokens
        out = []
        for g in self.history_groups:
            first = cached_tokens // g.stride
            last = end // g.stride
            out.append(ChunkRows(g.name, first, last - first, end % g.stride))
        return tuple(out)
