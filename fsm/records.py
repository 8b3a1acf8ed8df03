"""Frozen records that cross the boundary between the core (``kvtier.fsm``) and the
transfer engine (``kvtier.transfer``) or the engine embedding kvtier.

Units: pages are counted in whole pages of one cache group; page ids are ``int``
indices into that group's pool (device or host); tokens are token positions; bytes
are bytes. Layers are model layer indices (0-based, the model's own numbering).
"""

from __future__ import annotations

from enum import Enum

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from .checks import finite, plain_bool, plain_int
from .errors import ConfigError, KvtierError

__all__ = ["StoreOp", "StoreCommand", "StoreResult", 
    "Family",
    "Direction",
    "ComponentSpec",
    "CacheGroupSpec",
    "GroupTransfer",
    "TransferCommand",
    "Completion",
]


class Family(str, enum.Enum):
    """What a cache group's pages hold.

    ``HISTORY``: replayable prefix KV; any page-aligned prefix of it can be reused.
    ``STATE``: continuation-only state (sliding-window KV, compressor residue), valid
    only at the exact token position it was taken at (invariant ``exact_continuation_state``).
    """

    HISTORY = "history"
    STATE = "state"


class Direction(str, enum.Enum):
    """Which way a transfer moves bytes."""

    WRITEBACK = "writeback"  #: device to host (D2H)
    LOADBACK = "loadback"  #: host to device (H2D)


def _positive_int(owner: str, name: str, value: object) -> int:
    v = plain_int(value)
    if v is None or v <= 0:
        raise ConfigError(f"{owner}: {name} must be a positive int, got {value!r}")
    return v


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """One tensor per layer of a cache group.

    Components of a group share the group's page ids but differ in bytes per page
    (DeepSeek V4's ratio-4 compressed group carries the compressed KV and the indexer
    keys under the same page ids; ``spec/README.md``, Sources: DeepSeek V4 cache groups).

    Attributes:
        name: component name, unique within the group (e.g. ``"kv"``, ``"indexer_k"``).
        page_bytes: bytes of one page of this component in one layer.
    """

    name: str
    page_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"component name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "page_bytes", _positive_int(f"component {self.name!r}", "page_bytes",
                                                             self.page_bytes))


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """A cache group: pages of one geometry, shared by a set of layers.

    Attributes:
        name: unique group name (e.g. ``"v4.c4a.compressed_kv"``).
        family: :class:`Family` (``history`` or ``state``).
        rows: entries per page.
        stride: tokens covered by one entry; tokens per page = ``rows * stride``.
        layers: model layer indices that use this group (sorted, unique, non-empty).
        components: one or more :class:`ComponentSpec` (tensors per layer sharing page ids).
        window: for ``state`` groups, the window in tokens the continuation state must
            cover (e.g. the sliding window); ``None`` for ``history`` groups.

    Raises:
        ConfigError: on any invalid field, naming the group, the field and the value.
    """

    name: str
    family: Family
    rows: int
    stride: int
    layers: tuple[int, ...]
    components: tuple[ComponentSpec, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"cache group name must be a non-empty str, got {self.name!r}")
        owner = f"cache group {self.name!r}"
        try:
            object.__setattr__(self, "family", Family(self.family))
        except ValueError:
            raise ConfigError(f"{owner}: family must be 'history' or 'state', got {self.family!r}") from None
        object.__setattr__(self, "rows", _positive_int(owner, "rows", self.rows))
        object.__setattr__(self, "stride", _positive_int(owner, "stride", self.stride))
        try:
            layers = tuple(self.layers)
        except TypeError:
            raise ConfigError(f"{owner}: layers must be a sequence of ints >= 0, got {self.layers!r}") from None
        plain = [plain_int(x) for x in layers]
        if not layers or any(x is None or x < 0 for x in plain):
            raise ConfigError(f"{owner}: layers must be a non-empty sequence of ints >= 0, got {self.layers!r}")
        layers = tuple(x for x in plain if x is not None)
        if list(layers) != sorted(set(layers)):
            raise ConfigError(f"{owner}: layers must be sorted and unique, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        components = tuple(self.components)
        if not components or not all(isinstance(c, ComponentSpec) for c in components):
            raise ConfigError(f"{owner}: components must be a non-empty sequence of ComponentSpec, "
                              f"got {self.components!r}")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ConfigError(f"{owner}: component names must be unique, got {names}")
        object.__setattr__(self, "components", components)
        if self.family is Family.STATE:
            object.__setattr__(self, "window", _positive_int(owner, "window (tokens, required for state groups)",
                                                             self.window))
        elif self.window is not None:
            raise ConfigError(f"{owner}: window is only for state groups, got {self.window!r}")

    @property
    def tokens_per_page(self) -> int:
        """Tokens covered by one page: ``rows * stride``."""
        return self.rows * self.stride

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page in one layer, summed over components."""
        return sum(c.page_bytes for c in self.components)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer and component of the group."""
        return self.layer_page_bytes * len(self.layers)

    @property
    def state_pages(self) -> int:
        """For a state group, pages that hold the continuation state at a position:
        ``ceil(window / tokens_per_page)``; 0 for history groups."""
        if self.window is None:
            return 0
        return math.ceil(self.window / self.tokens_per_page)


def _index(owner: str, name: str, value: object) -> int:
    v = plain_int(value)
    if v is None or v < 0:
        raise ConfigError(f"{owner}: {name} must be an int >= 0, got {value!r}")
    return v


def _indices(owner: str, name: str, value: Iterable[object], what: str) -> tuple[int, ...]:
    ids: list[int] = []
    for p in value:
        v = p if type(p) is int else plain_int(p)
        if v is None or v < 0:
            raise ConfigError(f"{owner}: {name} must hold {what}, got {p!r}")
        ids.append(v)
    return tuple(ids)


def _page_ids(owner: str, name: str, value: Iterable[object]) -> tuple[int, ...]:
    return _indices(owner, name, value, "page ids (ints >= 0)")


@dataclass(frozen=True, slots=True)
class GroupTransfer:
    """The pages of one cache group that one operation moves.

    Attributes:
        group: cache group name.
        src_pages: source page ids (device pages for a writeback, host pages for a loadback).
        dst_pages: destination page ids, same length; ``src_pages[i]`` goes to ``dst_pages[i]``.
    """

    group: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]

    def __post_init__(self) -> None:
        owner = f"transfer of group {self.group!r}"
        src = _page_ids(owner, "src_pages", self.src_pages)
        dst = _page_ids(owner, "dst_pages", self.dst_pages)
        if len(src) != len(dst):
            raise ConfigError(f"{owner}: {len(src)} source pages but {len(dst)} destination pages")
        object.__setattr__(self, "src_pages", src)
        object.__setattr__(self, "dst_pages", dst)

    @property
    def pages(self) -> int:
        """Number of pages moved."""
        return len(self.src_pages)

    @classmethod
    def trusted(cls, group: str, src_pages: tuple[int, ...], dst_pages: tuple[int, ...]) -> GroupTransfer:
        """The record without re-validation, for the core, whose page ids come from its own
        allocators (equal-length tuples of ints >= 0). Anything else builds it normally."""
        t = object.__new__(cls)
        object.__setattr__(t, "group", group)
        object.__setattr__(t, "src_pages", src_pages)
        object.__setattr__(t, "dst_pages", dst_pages)
        return t


@dataclass(frozen=True, slots=True)
class TransferCommand:
    """One writeback or loadback the core asks the transfer engine to run.

    Attributes:
        op_id: unique operation id (per core instance, increasing).
        direction: :class:`Direction` (writeback = D2H, loadback = H2D).
        transfers: per cache group, the page pairs to copy.
        layers: model layers to move, ascending; every layer of every group involved
            unless the command says otherwise.
        request_id: the request that owns the operation (its loadback, or the writeback
            of its own pages on finish or retract), or ``None`` when tree nodes own it
            (write-through of pages already published).
        node_ids: the radix nodes whose pages move.
        deadline_step: scheduler step after which the core fails the operation
            (invariant ``operation_ends_once``), or ``None`` for no deadline.
    """

    op_id: int
    direction: Direction
    transfers: tuple[GroupTransfer, ...]
    layers: tuple[int, ...]
    request_id: str | None = None
    node_ids: tuple[int, ...] = ()
    deadline_step: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "op_id", _index("transfer command", "op_id", self.op_id))
        owner = f"op {self.op_id}"
        try:
            object.__setattr__(self, "direction", Direction(self.direction))
        except ValueError:
            raise ConfigError(f"{owner}: direction must be 'writeback' or 'loadback', "
                              f"got {self.direction!r}") from None
        transfers = tuple(self.transfers)
        if not all(isinstance(t, GroupTransfer) for t in transfers):
            raise ConfigError(f"{owner}: transfers must be GroupTransfer records, got {self.transfers!r}")
        object.__setattr__(self, "transfers", transfers)
        layers = _indices(owner, "layers", self.layers, "layer indices (ints >= 0)")
        if list(layers) != sorted(set(layers)):
            raise ConfigError(f"{owner}: layers must be sorted and unique, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        if self.request_id is not None and not isinstance(self.request_id, str):
            raise ConfigError(f"{owner}: request_id must be a str or None, got {self.request_id!r}")
        object.__setattr__(self, "node_ids", _indices(owner, "node_ids", self.node_ids, "node ids (ints >= 0)"))
        if self.deadline_step is not None:
            object.__setattr__(self, "deadline_step", _index(owner, "deadline_step", self.deadline_step))

    @property
    def pages(self) -> int:
        """Pages moved, summed over groups."""
        return sum(t.pages for t in self.transfers)

    @classmethod
    def trusted(cls, op_id: int, direction: Direction, transfers: tuple[GroupTransfer, ...],
                layers: tuple[int, ...], request_id: str | None, node_ids: tuple[int, ...],
                deadline_step: int | None) -> TransferCommand:
        """The record without re-validation (one attribute store per field), for the core,
        which builds every field from its own counters, allocators and layout. Engines and
        tests build commands normally (validated)."""
        c = object.__new__(cls)
        for name, value in (("op_id", op_id), ("direction", direction), ("transfers", transfers),
                            ("layers", layers), ("request_id", request_id), ("node_ids", node_ids),
                            ("deadline_step", deadline_step)):
            object.__setattr__(c, name, value)
        return c


@dataclass(frozen=True, slots=True)
class Completion:
    """What happened to an operation on one rank.

    A completion with ``layer=None`` is the operation's acknowledgement on that rank:
    sent exactly once per rank, after the last layer's event. A completion with a layer
    (loadbacks only) says that layers up to and including ``layer`` are complete on that
    rank; it never acknowledges.

    Attributes:
        op_id: the operation's id (:attr:`TransferCommand.op_id`).
        rank: tensor-parallel rank that reports it (0-based).
        ok: ``True`` for success, ``False`` for failure.
        layer: for a layer completion, the highest complete model layer; ``None`` for the ack.

    Raises:
        ConfigError: ``op_id``, ``rank`` or ``layer`` not an int >= 0 (bools refused), or
            ``ok`` not a bool.
    """

    op_id: int
    rank: int = 0
    ok: bool = True
    layer: int | None = None

    def __post_init__(self) -> None:
        owner = f"completion for op {self.op_id!r}"
        object.__setattr__(self, "op_id", _index(owner, "op_id", self.op_id))
        object.__setattr__(self, "rank", _index(owner, "rank", self.rank))
        if type(self.ok) is not bool:
            ok = plain_bool(self.ok)  # numpy.bool_ too
            if ok is None:
                raise ConfigError(f"{owner}: ok must be True or False, got {self.ok!r}")
            object.__setattr__(self, "ok", ok)
        if self.layer is not None:
            object.__setattr__(self, "layer", _index(owner, "layer", self.layer))

    @property
    def is_ack(self) -> bool:
        """True for the acknowledgement (the completion without a layer)."""
        return self.layer is None


# -- L3 store operations (kvtier.fsm.l3 <-> kvtier.transfer.store) --------------------------
class StoreOp(Enum):
    """The kind of a store operation."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class StoreCommand:
    """One batch operation for the store backend.

    Attributes:
        op_id: the operation's id (its result must carry it).
        kind: exists, put, get or remove.
        keys: object keys (hex strings), in prefix order for exists and get.
        pages: per key, host pages (history group -> page ids) that a put reads or a get
            fills; empty for exists and remove.
        deadline: the caller's clock value (seconds) after which the operation has failed.
    """

    op_id: int
    kind: StoreOp
    keys: tuple[str, ...]
    pages: tuple[dict[str, list[int]], ...]
    deadline: float


@dataclass(frozen=True, slots=True)
class StoreResult:
    """The outcome of one :class:`StoreCommand`.

    Attributes:
        op_id: the command's op id (checked by :meth:`kvtier.fsm.l3.L3Tier.complete`).
        ok: per key, success (put stored, get delivered a checked object, remove done);
            ignored for exists.
        present: exists only: how many keys, from the first on, the store holds.
        corrupt: get only: keys whose object failed its check (wrong key, size or digest).
        nbytes: bytes moved between host and store.
        seconds: seconds the backend spent on the operation.
        error: the backend's error text, if the operation failed as a whole.

    Raises:
        ConfigError: ``ok`` not a sequence of bools, ``present`` or ``nbytes`` not an int
            >= 0, ``corrupt`` not a sequence of strings, ``seconds`` not a finite number
            >= 0 or ``error`` not a string or ``None`` (numpy bools and ints are taken).
    """

    op_id: int
    ok: tuple[bool, ...] = ()
    present: int = 0
    corrupt: tuple[str, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    def __post_init__(self) -> None:
        for name, value in zip(("ok", "present", "corrupt", "nbytes", "seconds"),
                               store_result_fields(self, f"store result for op {self.op_id!r}", ConfigError)):
            object.__setattr__(self, name, value)


def store_result_fields(res: StoreResult, owner: str, error: type[KvtierError]
                        ) -> tuple[tuple[bool, ...], int, tuple[str, ...], int, float]:
    """``res``'s ok, present, corrupt, nbytes and seconds, checked and in plain types;
    ``error`` names the first bad field, its value and what was expected."""
    ok = tuple(plain_bool(x) for x in res.ok) if isinstance(res.ok, (tuple, list)) else None
    if ok is None or None in ok:
        raise error(f"{owner}: ok must be a tuple of bools, got {res.ok!r}")
    corrupt = tuple(res.corrupt) if isinstance(res.corrupt, (tuple, list)) else None
    if corrupt is None or not all(isinstance(k, str) for k in corrupt):
        raise error(f"{owner}: corrupt must be a tuple of key strings, got {res.corrupt!r}")
    present, nbytes = plain_int(res.present), plain_int(res.nbytes)
    for name, v, given in (("present", present, res.present), ("nbytes", nbytes, res.nbytes)):
        if v is None or v < 0:
            raise error(f"{owner}: {name} must be an int >= 0, got {given!r}")
    seconds = res.seconds
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not finite(seconds)
            or seconds < 0):
        raise error(f"{owner}: seconds must be a finite number >= 0, got {seconds!r}")
    if res.error is not None and not isinstance(res.error, str):
        raise error(f"{owner}: error must be a str or None, got {res.error!r}")
    return ok, present, corrupt, nbytes, float(seconds)  # type: ignore[return-value]
