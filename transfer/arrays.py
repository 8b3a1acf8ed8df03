"""Page ids as integer arrays: the transfer engine's array records.

The core's :class:`~kvtier.fsm.TransferCommand` carries page ids as tuples of Python
ints; turning 32,768 of them into an array costs about a millisecond per list on a
server's host. An engine that already holds its page ids as arrays (an inference
engine's block tables are NumPy or torch integer arrays) submits
:class:`ArrayCommand` records instead; :meth:`TransferEngine.submit` takes both, and
from there on a flush does no per-page Python work (planning and table building are
NumPy, see :mod:`.plan`).

    cmd = ArrayCommand(7, Direction.LOADBACK,
                       (PageArrays("kv", np.array([4, 5, 9]), np.array([0, 1, 2])),))
    engine.submit(cmd)

:func:`as_array_command` converts a core command (the engine does the same at its
boundary, caching the arrays by the identity of the command's transfer records).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.fsm import ConfigError, Direction, GroupTransfer, TransferCommand

__all__ = ["PageArrays", "ArrayCommand", "page_array", "as_array_command"]

I64 = npt.NDArray[np.int64]

#: Page ids must be below this (plans pack a (source, destination) pair into one int64).
MAX_PAGE_ID = (1 << 31) - 1


def page_array(owner: str, name: str, value: Any) -> I64:
    """``value`` (an integer NumPy array, a torch CPU tensor, or a sequence of ints) as a
    new read-only C-contiguous int64 ``[n]`` array.

    Raises:
        ConfigError: not one-dimensional, not integers (bools and floats are refused),
            or an id outside ``0..2**31-1``.
    """
    if hasattr(value, "numpy") and hasattr(value, "device"):  # a torch tensor: no torch import here
        if getattr(value.device, "type", "cpu") != "cpu":
            raise ConfigError(f"{owner}: {name} must be on the CPU, got a tensor on {value.device}")
        value = value.numpy()
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(list(value) if not isinstance(value, (list, tuple)) else value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{owner}: {name} must be an integer array or a sequence of ints, "
                              f"got {type(value).__name__}: {e}") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ConfigError(f"{owner}: {name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{owner}: {name} must hold integer page ids, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.int64, copy=True, order="C")  # own copy: later changes do not leak in
    if out.shape[0]:
        lo, hi = int(out.min()), int(out.max())
        if lo < 0 or hi > MAX_PAGE_ID or (arr.dtype.kind == "u" and int(arr.max()) > MAX_PAGE_ID):
            bad = lo if lo < 0 else int(arr.max())
            raise ConfigError(f"{owner}: {name} holds page id {bad}; page ids are ints in 0..{MAX_PAGE_ID}")
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False, slots=True)
class PageArrays:
    """The pages of one cache group that one operation moves, as arrays.

    The counterpart of :class:`~kvtier.fsm.GroupTransfer` with int64 arrays: the
    constructor copies and validates (vectorised) the ids it is given, so the arrays
    are the record's own and read-only.

    Attributes:
        group: cache group name.
        src_pages: int64 ``[n]`` source page ids (device pages for a writeback, host
            pages for a loadback).
        dst_pages: int64 ``[n]`` destination page ids; ``src_pages[i]`` goes to ``dst_pages[i]``.

    Raises:
        ConfigError: see :func:`page_array`; lengths that differ; a group that is not a str.
    """

    group: str
    src_pages: I64
    dst_pages: I64

    def __post_init__(self) -> None:
        if not isinstance(self.group, str):
            raise ConfigError(f"PageArrays: group must be a str, got {self.group!r}")
        owner = f"transfer of group {self.group!r}"
        src = page_array(owner, "src_pages", self.src_pages)
        dst = page_array(owner, "dst_pages", self.dst_pages)
        if src.shape[0] != dst.shape[0]:
            raise ConfigError(f"{owner}: {src.shape[0]} source pages but {dst.shape[0]} destination pages")
        object.__setattr__(self, "src_pages", src)
        object.__setattr__(self, "dst_pages", dst)

    @property
    def pages(self) -> int:
        """Number of pages moved."""
        return int(self.src_pages.shape[0])


@dataclass(frozen=True, eq=False, slots=True)
class ArrayCommand:
    """One writeback or loadback with its page ids as arrays (see :class:`PageArrays`).

    The counterpart of :class:`~kvtier.fsm.TransferCommand` for
    :meth:`TransferEngine.submit`; completions are the same
    :class:`~kvtier.fsm.Completion` records.

    Attributes:
        op_id: operation id (an int >= 0, unique among the engine's queued and in-flight ops).
        direction: :class:`~kvtier.fsm.Direction` (or its value, ``"loadback"`` / ``"writeback"``).
        transfers: per cache group, the page pairs (:class:`PageArrays`, or
            :class:`~kvtier.fsm.GroupTransfer`, which is converted).
        layers: model layers to move, ascending and unique; empty = every layer of
            every group involved.

    Raises:
        ConfigError: a bad op id, direction, transfer or layer list.
    """

    op_id: int
    direction: Direction
    transfers: tuple[PageArrays, ...]
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        op = self.op_id
        if isinstance(op, bool) or not isinstance(op, (int, np.integer)) or op < 0:
            raise ConfigError(f"ArrayCommand: op_id must be an int >= 0, got {op!r}")
        object.__setattr__(self, "op_id", int(op))
        try:
            object.__setattr__(self, "direction", Direction(self.direction))
        except ValueError:
            raise ConfigError(f"op {op}: direction must be 'writeback' or 'loadback', "
                              f"got {self.direction!r}") from None
        ts: list[PageArrays] = []
        for t in self.transfers:
            if isinstance(t, GroupTransfer):
                t = PageArrays(t.group, np.fromiter(t.src_pages, np.int64, len(t.src_pages)),
                               np.fromiter(t.dst_pages, np.int64, len(t.dst_pages)))
            if not isinstance(t, PageArrays):
                raise ConfigError(f"op {op}: transfers must be PageArrays (or GroupTransfer) records, "
                                  f"got {type(t).__name__}")
            ts.append(t)
        object.__setattr__(self, "transfers", tuple(ts))
        layers = _layers(op, self.layers)
        object.__setattr__(self, "layers", layers)


def _layers(op: object, value: Iterable[object]) -> tuple[int, ...]:
    out: list[int] = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ConfigError(f"op {op}: layers must be layer indices (ints >= 0), got {x!r}")
        out.append(int(x))
    if out != sorted(set(out)):
        raise ConfigError(f"op {op}: layers must be sorted and unique, got {tuple(out)!r}")
    return tuple(out)


def as_array_command(command: TransferCommand | ArrayCommand) -> ArrayCommand:
    """An :class:`ArrayCommand` with the same op id, direction, pages and layers."""
    if isinstance(command, ArrayCommand):
        return command
    if not isinstance(command, TransferCommand):
        raise ConfigError(f"expected a TransferCommand or ArrayCommand, got {type(command).__name__}")
    return ArrayCommand(command.op_id, command.direction, tuple(command.transfers),  # type: ignore[arg-type]
                        command.layers)


def page_count(transfers: Sequence[Any]) -> int:
    """Pages over a command's transfers (GroupTransfer or PageArrays)."""
    return sum(len(t.src_pages) for t in transfers)
