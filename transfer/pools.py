"""Host and device page pools: one uint8 region per (group, component, layer).

A *region* is a 2-D ``torch.uint8`` tensor of shape ``[pages, page_bytes]``: page ``p``
of component ``c`` of group ``g`` in layer ``l`` is ``region(g, c, l)[p]``. The transfer
engine copies whole pages between a host region and the device region with the same
key. Layout (both pools when they allocate their own memory): one buffer, groups in
spec order, then layers ascending, then components in spec order ("layer-first": the
pages of one layer of one component are contiguous), each region starting at a
multiple of :data:`REGION_ALIGN` bytes. A host pool may instead be *page-major*
(``HostPool(layout="page")``): per group one block of pages, each page holding every
layer (ascending) and component (spec order) of it contiguously, pages
:meth:`_Pool.page_stride` bytes apart (the sum of the group's page bytes, rounded up
to 16); a region is then a strided view ``[pages, page_bytes]`` (row stride = the page
stride). A run of host pages is then one contiguous byte range, which is what the
staging path copies with the copy engines (:mod:`kvtier.transfer.backends.staging`).

Every region also has a byte offset from its pool's *base address* (the lowest
region address rounded down to 16 bytes): with unified virtual addressing one
array view from that base reaches every region of the pool, which is how the Numba
backend covers all groups, components and layers of a chunk in one launch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence

import torch

from kvtier.fsm import CacheGroupSpec, ConfigError

from .errors import HostMemoryError
from .page_layout import REGION_ALIGN, _layout, _page_layout

__all__ = [
    "put_layers",
    "take_layers",
    "REGION_ALIGN",
    "RegionKey",
    "HostPool",
    "DevicePool",
    "pages_for_budget",
    "available_host_bytes",
    "HOST_LAYOUTS",
]

#: Host pool layouts: ``"layer"`` (layer-first, the default) and ``"page"`` (page-major).
HOST_LAYOUTS = ("layer", "page")

#: ``(group name, component name, model layer)``.
RegionKey = tuple[str, str, int]

_GiB = float(1 << 30)


def put_layers(view: torch.Tensor, index: torch.Tensor, data: torch.Tensor) -> None:
    """``view[:, index] = data`` for a ``[layers, pages, page_bytes]`` uint8 layer view
    (:meth:`_Pool.layer_view`) and uint8 ``data`` ``[layers, len(index), page_bytes]``:
    one indexed store, in 8-byte words when both allow it (about 3x faster than bytes)."""
    try:
        view, data = view.view(torch.int64), data.contiguous().view(torch.int64)
    except RuntimeError:  # page bytes or offsets not multiples of 8: store bytes
        pass
    view[:, index] = data


def take_layers(view: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A copy of ``view[:, index]``: uint8 ``[layers, len(index), page_bytes]`` from a
    ``[layers, pages, page_bytes]`` uint8 layer view (:meth:`_Pool.layer_view`), gathered
    in 8-byte words when the view allows it. Advanced indexing, not ``index_select``: on
    a view whose layers are not adjacent (components interleave) ``index_select`` first
    copies the whole view, hundreds of times slower."""
    try:
        return view.view(torch.int64)[:, index].view(torch.uint8)
    except RuntimeError:  # page bytes or offsets not multiples of 8: gather bytes
        return view[:, index]


def _check_specs(specs: Sequence[CacheGroupSpec]) -> dict[str, CacheGroupSpec]:
    if isinstance(specs, CacheGroupSpec):
        specs = [specs]
    out: dict[str, CacheGroupSpec] = {}
    for s in specs:
        if not isinstance(s, CacheGroupSpec):
            raise ConfigError(f"specs must be CacheGroupSpec objects, got {s!r}")
        if s.name in out:
            raise ConfigError(f"cache group names must be unique, got {s.name!r} twice")
        out[s.name] = s
    if not out:
        raise ConfigError("specs must hold at least one CacheGroupSpec, got none")
    return out


def _check_pages(specs: Mapping[str, CacheGroupSpec], pages: Mapping[str, int] | int,
                 what: str) -> dict[str, int]:
    if isinstance(pages, int) and not isinstance(pages, bool):
        pages = {name: pages for name in specs}
    if not isinstance(pages, Mapping):
        raise ConfigError(f"{what} pages must be an int or a mapping group name -> int, got {pages!r}")
    unknown = sorted(set(pages) - set(specs))
    if unknown:
        raise ConfigError(f"{what} pages name unknown cache groups {unknown}; known: {sorted(specs)}")
    out: dict[str, int] = {}
    for name in specs:
        if name not in pages:
            raise ConfigError(f"{what} pages: missing a page count for cache group {name!r}")
        n = pages[name]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigError(f"{what} pages of cache group {name!r} must be a positive int, got {n!r}")
        out[name] = n
    return out


def available_host_bytes() -> int:
    """Host memory available to a new allocation, in bytes (``MemAvailable`` of
    ``/proc/meminfo``, else free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def pages_for_budget(specs: Sequence[CacheGroupSpec], budget_bytes: int,
                     weights: Mapping[str, float] | None = None) -> dict[str, int]:
    """Split a byte budget into page counts per group.

    Each group gets the share ``weights[g] / sum(weights)`` of the budget (equal shares
    when ``weights`` is None; TokenSpeed weighs by device bytes per group: ``spec/README.md``,
    Sources: TokenSpeed's host transfer path) and as many whole pages
    (``CacheGroupSpec.page_bytes``, all layers and components) as fit.

    Raises:
        ConfigError: budget not a positive int, weights missing/negative, or a group
            whose share holds no page (the message names the group and both sizes).
    """
    by_name = _check_specs(specs)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ConfigError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    w = {name: 1.0 for name in by_name} if weights is None else dict(weights)
    for name in by_name:
        if name not in w or not (float(w[name]) >= 0.0):
            raise ConfigError(f"weights must give every group a weight >= 0; group {name!r} has "
                              f"{w.get(name)!r}")
    total = sum(float(w[n]) for n in by_name)
    if total <= 0:
        raise ConfigError(f"weights must not all be 0, got {w}")
    out: dict[str, int] = {}
    for name, spec in by_name.items():
        share = int(budget_bytes * float(w[name]) / total)
        n = share // spec.page_bytes
        if n <= 0:
            raise ConfigError(f"budget of {budget_bytes} bytes gives cache group {name!r} {share} bytes, "
                              f"less than one page ({spec.page_bytes} bytes over all layers and components)")
        out[name] = n
    return out


class _Pool:
    """Regions keyed by (group, component, layer); shared by both pools."""

    specs: dict[str, CacheGroupSpec]
    _pages: dict[str, int]
    _regions: dict[RegionKey, torch.Tensor]
    _offsets: dict[RegionKey, int]
    _base_ptr: int
    _span_bytes: int
    buffer: torch.Tensor | None

    def _init_regions(self, regions: dict[RegionKey, torch.Tensor]) -> None:
        self._regions = regions
        ptrs = {k: int(t.data_ptr()) for k, t in regions.items()}
        lo = min(ptrs.values()) // 16 * 16
        hi = max(ptrs[k] + (t.shape[0] - 1) * t.stride(0) + t.shape[1] for k, t in regions.items())
        self._base_ptr = lo
        self._span_bytes = -(-(hi - lo) // 16) * 16
        self._offsets = {k: p - lo for k, p in ptrs.items()}

    @property
    def device(self) -> torch.device:
        """Where the pool's memory lives."""
        return next(iter(self._regions.values())).device

    @property
    def nbytes(self) -> int:
        """Bytes of page storage (sum of all regions)."""
        return sum(t.numel() for t in self._regions.values())

    @property
    def base_ptr(self) -> int:
        """Lowest region address rounded down to 16 bytes (unified address space)."""
        return self._base_ptr

    @property
    def span_bytes(self) -> int:
        """Bytes from :attr:`base_ptr` to the end of the highest region, rounded up to 16."""
        return self._span_bytes

    def pages(self, group: str) -> int:
        """Page count of a group in this pool.

        Raises:
            ConfigError: unknown group.
        """
        try:
            return self._pages[group]
        except KeyError:
            raise ConfigError(f"unknown cache group {group!r}; known: {sorted(self._pages)}") from None

    def keys(self) -> Iterator[RegionKey]:
        """All region keys, in layout order."""
        return iter(self._regions)

    def region(self, group: str, component: str, layer: int) -> torch.Tensor:
        """The uint8 region ``[pages(group), page_bytes]`` of one component in one layer.

        Raises:
            ConfigError: the key does not name a region of this pool.
        """
        try:
            return self._regions[(group, component, layer)]
        except KeyError:
            raise ConfigError(self._missing((group, component, layer))) from None

    def region_offset(self, group: str, component: str, layer: int) -> int:
        """Byte offset of a region from :attr:`base_ptr`."""
        try:
            return self._offsets[(group, component, layer)]
        except KeyError:
            raise ConfigError(self._missing((group, component, layer))) from None

    def page_stride(self, group: str, component: str, layer: int) -> int:
        """Bytes from one page of a region to the next: its page bytes in a layer-first
        layout, the group's page stride in a page-major one."""
        return int(self.region(group, component, layer).stride(0))

    @property
    def page_major(self) -> bool:
        """True for a page-major host pool (see the module docstring)."""
        return bool(getattr(self, "_groups", None))

    def group_block(self, group: str) -> tuple[int, int]:
        """Page-major pools: (byte offset of the group's page 0 from :attr:`base_ptr`,
        page stride in bytes). Raises ConfigError for a layer-first pool or an unknown group."""
        groups: dict[str, tuple[int, int]] = getattr(self, "_groups", None) or {}
        if group not in groups:
            raise ConfigError(f"group_block({group!r}) needs a page-major host pool (HostPool(layout='page')) "
                              f"holding that group; page-major groups: {sorted(groups)}")
        return groups[group]  # the buffer starts at base_ptr (its first region is at offset 0)

    def layer_view(self, group: str, component: str) -> torch.Tensor | None:
        """One uint8 view ``[layers, pages(group), page_bytes]`` over the regions of
        ``component`` in every layer of ``group`` (positions as in the spec's ``layers``),
        when they lie in one storage at equal spacing (always for a pool's own buffer);
        else ``None`` (registered tensors: use :meth:`region` per layer). Cached.

        Raises:
            ConfigError: unknown group or component.
        """
        cache: dict[tuple[str, str], torch.Tensor | None] = self.__dict__.setdefault("_layer_views", {})
        key = (group, component)
        if key in cache:
            return cache[key]
        spec = self.specs.get(group)
        if spec is None or component not in [c.name for c in spec.components]:
            raise ConfigError(self._missing((group, component, -1)))
        regions = [self.region(group, component, layer) for layer in spec.layers]
        first = regions[0]
        ptrs = [int(t.data_ptr()) for t in regions]
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else first.numel()
        view = None
        same = all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in regions)
        if same and step > 0 and all(b - a == step for a, b in zip(ptrs, ptrs[1:])) and first.is_contiguous():
            rows, width = first.shape
            view = torch.as_strided(first, (len(regions), rows, width), (step, width, 1), first.storage_offset())
        cache[key] = view
        return view

    def single_buffer(self) -> torch.Tensor | None:
        """The pool's own uint8 buffer (starting at :attr:`base_ptr`) when it allocated
        one, else None (registered tensors)."""
        return self.buffer

    def _missing(self, key: RegionKey) -> str:
        g, c, l = key
        spec = self.specs.get(g)
        if spec is None:
            return f"unknown cache group {g!r}; known: {sorted(self.specs)}"
        comps = [x.name for x in spec.components]
        if c not in comps:
            return f"cache group {g!r} has no component {c!r}; it has {comps}"
        return f"cache group {g!r} does not use layer {l!r}; its layers are {list(spec.layers)}"


class HostPool(_Pool):
    """Host (L2) page storage for every group, component and layer.

    Memory is one ``torch.uint8`` buffer allocated with ``torch.empty(...,
    pin_memory=True)`` when CUDA is available (pinned, mapped into the device's unified
    address space, so kernels read and write it directly), pageable otherwise.

    Args:
        specs: the cache groups.
        pages: host pages per group (a mapping, or one int for every group); see
            :func:`pages_for_budget` to size from bytes.
        pin: pin the memory; None (default) pins exactly when ``torch.cuda.is_available()``.
        reserve_bytes: host memory to leave free (bytes, default 2 GiB).
        available_bytes: override of :func:`available_host_bytes` (tests).
        layout: ``"layer"`` (layer-first, default) or ``"page"`` (page-major: every
            layer and component of a host page contiguous; see the module docstring).

    Raises:
        ConfigError: bad specs, page counts or layout; ``pin=True`` without CUDA.
        HostMemoryError: the pool needs more than the available memory minus the reserve.
    """

    def __init__(self, specs: Sequence[CacheGroupSpec], pages: Mapping[str, int] | int, *,
                 pin: bool | None = None, reserve_bytes: int = 2 << 30,
                 available_bytes: int | None = None, layout: str = "layer") -> None:
        self.specs = _check_specs(specs)
        if layout not in HOST_LAYOUTS:
            raise ConfigError(f"host pool layout must be one of {HOST_LAYOUTS}, got {layout!r}")
        self.layout = layout
        self._pages = _check_pages(self.specs, pages, "host pool")
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ConfigError("HostPool(pin=True) needs CUDA (torch.cuda.is_available() is False); "
                              "use pin=None or pin=False")
        if layout == "page":
            offsets, self._groups, total = _page_layout(self.specs, self._pages)
        else:
            offsets, total = _layout(self.specs, self._pages)
            self._groups = {}
        avail = available_host_bytes() if available_bytes is None else available_bytes
        if total > avail - reserve_bytes:
            raise HostMemoryError(
                total, avail - reserve_bytes,
                f"host pool needs {total} bytes ({total / _GiB:.2f} GiB) for pages "
                f"{self._pages}, but only {avail} bytes ({avail / _GiB:.2f} GiB) are available and "
                f"{reserve_bytes} bytes ({reserve_bytes / _GiB:.2f} GiB) stay reserved")
        self.pinned = bool(pin)
        self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.pinned)
        regions: dict[RegionKey, torch.Tensor] = {}
        for key, off in offsets.items():
            g, c, _ = key
            pb = next(x.page_bytes for x in self.specs[g].components if x.name == c)
            n = self._pages[g]
            if layout == "page":
                regions[key] = torch.as_strided(self.buffer, (n, pb), (self._groups[g][1], 1), off)
            else:
                regions[key] = self.buffer[off:off + n * pb].view(n, pb)
        self._init_regions(regions)

    @classmethod
    def for_budget(cls, specs: Sequence[CacheGroupSpec], budget_bytes: int, *,
                   weights: Mapping[str, float] | None = None, pin: bool | None = None,
                   reserve_bytes: int = 2 << 30, available_bytes: int | None = None,
                   layout: str = "layer") -> HostPool:
        """A host pool sized from a byte budget (see :func:`pages_for_budget`)."""
        return cls(specs, pages_for_budget(specs, budget_bytes, weights), pin=pin,
                   reserve_bytes=reserve_bytes, available_bytes=available_bytes, layout=layout)

    def __repr__(self) -> str:
        return (f"HostPool(groups={list(self.specs)}, pages={self._pages}, bytes={self.nbytes}, "
                f"pinned={self.pinned}, layout={self.layout!r})")


class DevicePool(_Pool):
    """Device (L1) page storage: the engine's own KV tensors, or a buffer of its own.

    Build with :meth:`allocate` (one buffer, same layout as :class:`HostPool`; for tests
    and the replay) or :meth:`register` (the inference engine's tensors, any dtype:
    they are seen as raw bytes, since kernels copy bits).
    """

    def __init__(self, specs: Mapping[str, CacheGroupSpec], pages: dict[str, int],
                 regions: dict[RegionKey, torch.Tensor], buffer: torch.Tensor | None) -> None:
        self.specs = dict(specs)
        self._pages = pages
        self.buffer = buffer
        self._init_regions(regions)

    @classmethod
    def allocate(cls, specs: Sequence[CacheGroupSpec], pages: Mapping[str, int] | int,
                 device: str | torch.device = "cuda", *, reserve_bytes: int = 2 << 30) -> DevicePool:
        """Allocate one uint8 buffer on ``device`` holding every region.

        Args:
            reserve_bytes: on ``device="cpu"``, host memory to leave free (bytes, default 2 GiB).

        Raises:
            ConfigError: bad specs or page counts, a CUDA device without CUDA, or a buffer
                the device cannot hold.
            HostMemoryError: on ``device="cpu"``, more than the available host memory.
        """
        by_name = _check_specs(specs)
        n_pages = _check_pages(by_name, pages, "device pool")
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"DevicePool.allocate(device={str(dev)!r}) needs CUDA; "
                              f"torch.cuda.is_available() is False (use device='cpu')")
        offsets, total = _layout(by_name, n_pages)
        if dev.type == "cpu":  # a CPU stand-in for device memory lives in host memory
            avail = available_host_bytes() - reserve_bytes
            if total > avail:
                raise HostMemoryError(
                    total, avail, f"device pool (on the CPU) needs {total} bytes ({total / _GiB:.2f} GiB) for "
                    f"pages {n_pages}, but only {avail} bytes ({avail / _GiB:.2f} GiB) of host memory are "
                    f"available after a reserve of {reserve_bytes} bytes")
        try:
            buf = torch.empty(total, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as exc:
            raise ConfigError(f"device pool needs {total} bytes ({total / _GiB:.2f} GiB) for pages {n_pages} "
                              f"on {dev}: {exc}") from exc
        regions: dict[RegionKey, torch.Tensor] = {}
        for key, off in offsets.items():
            g, c, _ = key
            pb = next(x.page_bytes for x in by_name[g].components if x.name == c)
            regions[key] = buf[off:off + n_pages[g] * pb].view(n_pages[g], pb)
        return cls(by_name, n_pages, regions, buf)

    @classmethod
    def register(cls, specs: Sequence[CacheGroupSpec],
                 tensors: Mapping[RegionKey, torch.Tensor]) -> DevicePool:
        """Register existing per-(group, component, layer) tensors.

        Each tensor: contiguous, any dtype, leading dimension = the group's page count
        (the same for every layer and component of a group), and ``tensor[0].nbytes`` =
        the component's ``page_bytes``. All on one device. Kept by reference (not
        copied): the pool sees them as ``uint8 [pages, page_bytes]`` views.

        Raises:
            ConfigError: a missing or extra key, a non-contiguous tensor, a wrong page
                size or page count, tensors on several devices; the message names the key.
        """
        by_name = _check_specs(specs)
        expected: dict[RegionKey, int] = {}
        for name, spec in by_name.items():
            for layer in spec.layers:
                for comp in spec.components:
                    expected[(name, comp.name, layer)] = comp.page_bytes
        extra = [k for k in tensors if k not in expected]
        if extra:
            raise ConfigError(f"device tensors given for keys no cache group has: {extra[:4]} "
                              f"(keys are (group, component, layer))")
        missing = [k for k in expected if k not in tensors]
        if missing:
            raise ConfigError(f"device tensors missing for {len(missing)} keys, e.g. {missing[:4]}")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ConfigError(f"device tensors must all be on one device, got {sorted(map(str, devices))}")
        pages: dict[str, int] = {}
        regions: dict[RegionKey, torch.Tensor] = {}
        for key, pb in expected.items():
            t = tensors[key]
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"device tensor {key} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 1 or t.shape[0] == 0:
                raise ConfigError(f"device tensor {key} must have a leading page dimension > 0, "
                                  f"got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ConfigError(f"device tensor {key} must be contiguous, got shape {tuple(t.shape)} "
                                  f"strides {t.stride()}")
            n = int(t.shape[0])
            got = t[0].numel() * t.element_size()
            if got != pb:
                raise ConfigError(f"device tensor {key}: one page is {got} bytes (shape {tuple(t.shape)}, "
                                  f"{t.dtype}), expected page_bytes={pb}")
            g = key[0]
            if pages.setdefault(g, n) != n:
                raise ConfigError(f"device tensor {key} has {n} pages, but other tensors of cache group "
                                  f"{g!r} have {pages[g]}")
            regions[key] = t.detach().reshape(-1).view(torch.uint8).view(n, pb)
        return cls(by_name, pages, regions, None)

    def __repr__(self) -> str:
        kind = "allocated" if self.buffer is not None else "registered"
        return (f"DevicePool({kind}, groups={list(self.specs)}, pages={self._pages}, "
                f"bytes={self.nbytes}, device={self.device})")

