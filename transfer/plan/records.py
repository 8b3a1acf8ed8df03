"""What a flush's plan is: the merged page pairs per cache group, the layer chunks and
their tensor refs (built by :class:`~kvtier.transfer.plan.planner.Planner`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.fsm import CacheGroupSpec, Direction, TransferCommand

from ..arrays import ArrayCommand

__all__ = ["Command", "GroupPlan", "ChunkRef", "ChunkPlan", "FlushPlan", "layers_for", "I64"]

#: What a flush plans: the core's records or their array form.
Command = TransferCommand | ArrayCommand

I64 = npt.NDArray[np.int64]


def layers_for(command: TransferCommand | ArrayCommand, spec: CacheGroupSpec) -> tuple[int, ...]:
    """Layers of ``spec`` that ``command`` moves: all of the group's layers when
    ``command.layers`` is empty, else those also in ``command.layers``."""
    if not command.layers:
        return spec.layers
    wanted = set(command.layers)
    return tuple(layer for layer in spec.layers if layer in wanted)


@dataclass(eq=False)
class GroupPlan:
    """The merged page pairs of one (group, layers) in one flush.

    Attributes:
        group: cache group name.
        layers: model layers moved for this group (ascending).
        src, dst: int64 ``[pages]`` page ids, unique pairs: in the order given when no
            destination page repeats, else sorted by (src, dst).
        run_src, run_dst, run_len: int64 ``[spans]``: contiguous runs (``run_len``
            pages from ``run_src`` to ``run_dst``).
    """

    group: str
    layers: tuple[int, ...]
    src: I64
    dst: I64
    run_src: I64
    run_dst: I64
    run_len: I64
    _torch: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def pages(self) -> int:
        """Page pairs (after de-duplication)."""
        return int(self.src.shape[0])

    @property
    def spans(self) -> int:
        """Contiguous runs."""
        return int(self.run_len.shape[0])

    def index_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) as CPU int64 tensors (cached)."""
        if not self._torch:  # (array records' ids are read-only: torch wants writable arrays)
            self._torch["src"] = torch.from_numpy(self.src if self.src.flags.writeable else self.src.copy())
            self._torch["dst"] = torch.from_numpy(self.dst if self.dst.flags.writeable else self.dst.copy())
        return self._torch["src"], self._torch["dst"]


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One tensor pair a chunk copies: (group, component, layer) on both sides."""

    group_index: int
    group: str
    component: str
    layer: int
    page_bytes: int


@dataclass(eq=False)
class ChunkPlan:
    """The copies of one layer chunk (one kernel launch for the Numba backend).

    Attributes:
        index: chunk number within the flush (0-based, issue order).
        layers: model layers whose refs this chunk copies (ascending).
        refs: tensor refs, grouped by group plan.
        pages: page pairs summed over the refs' groups (each group counted once).
        spans: contiguous runs summed likewise.
        rows: copy descriptors = sum over refs of its group's spans.
        nbytes: bytes copied.
        cache: scratch space for backends (e.g. a device-side table), kept with the plan.
    """

    index: int
    layers: tuple[int, ...]
    refs: tuple[ChunkRef, ...]
    pages: int
    spans: int
    rows: int
    nbytes: int
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def tensor_refs(self) -> int:
        """Number of (group, component, layer) tensor pairs."""
        return len(self.refs)


@dataclass(eq=False)
class FlushPlan:
    """Everything one direction of one flush copies.

    Attributes:
        direction: writeback (D2H) or loadback (H2D).
        groups: merged pairs per (group, layers).
        chunks: layer chunks in issue order (empty when nothing is copied).
        rejected: index into the flush's command list -> why it was rejected.
        cache: scratch space for backends (e.g. the flush's run table), kept with the plan.
    """

    direction: Direction
    groups: tuple[GroupPlan, ...]
    chunks: tuple[ChunkPlan, ...]
    rejected: dict[int, str]
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def pages(self) -> int:
        return sum(g.pages for g in self.groups)

    @property
    def spans(self) -> int:
        return sum(g.spans for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)
