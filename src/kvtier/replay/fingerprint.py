"""Real bytes for the replay: a transfer backend moving pages, and fingerprints that prove
every page read back holds what was written for its prefix (invariant 12).

Every page the simulated forward pass produces is filled with an 8-byte fingerprint
derived from its prefix (a hash chain over the unit keys up to the page's unit), its
cache group, component, layer and index within the unit; a continuation-state checkpoint
page from the prefix at its unit boundary. When a request is admitted with a prefix hit,
every page of the hit (device pages, loaded pages, the checkpoint) is read back and
compared with the fingerprint recomputed from the request's own keys: a wrong page
mapping, a lost or stale copy is caught page by page, not averaged away.

Geometry is scaled down by ``byte_scale`` so real copies fit in this machine's memory:
each component keeps at least 64 bytes per page (rounded to 8).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from kvtier.fsm import Completion, ComponentSpec, KvtierError, TransferCommand
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import Family

from ..tiered import Admission, TieredCache

__all__ = ["FingerprintMismatch", "scaled_layout", "BytesExecutor"]

_MASK = (1 << 63) - 1


class FingerprintMismatch(KvtierError):
    """A page read back does not hold the bytes written for its prefix.

    Attributes:
        request_id, group, component, layer, page: where.
    """

    def __init__(self, request_id: str, group: str, component: str, layer: int, page: int, detail: str) -> None:
        self.request_id = request_id
        self.group = group
        self.component = component
        self.layer = layer
        self.page = page
        super().__init__(f"request {request_id!r}: device page {page} of {group!r}/{component} layer {layer} "
                         f"{detail} (loaded_equals_written)")


def scaled_layout(layout: CacheLayout, byte_scale: int) -> CacheLayout:
    """``layout`` with every component's page bytes divided by ``byte_scale`` (at least 64,
    rounded up to a multiple of 8)."""
    if isinstance(byte_scale, bool) or not isinstance(byte_scale, int) or byte_scale < 1:
        raise KvtierError(f"byte_scale must be an int >= 1, got {byte_scale!r}")

    def scale(c: ComponentSpec) -> ComponentSpec:
        b = max(64, -(-c.page_bytes // byte_scale))
        return ComponentSpec(c.name, -(-b // 8) * 8)

    groups = tuple(replace(g, components=tuple(scale(c) for c in g.components)) for g in layout.groups)
    return replace(layout, groups=groups)


class BytesExecutor:
    """Runs the replay's transfers through a :class:`kvtier.transfer.TransferEngine` and
    writes / checks fingerprints in the forward pass.

    Args:
        layout: the (already scaled) layout whose pages the pools hold.
        device_pages, host_pages: pages per group of the two pools (as the cache has them).
        backend: ``cpu``, ``torch`` or ``numba`` (``torch``/``numba`` need a GPU).
        salt: mixed into every fingerprint.
    """

    def __init__(self, layout: CacheLayout, device_pages: dict[str, int], host_pages: dict[str, int] | None,
                 backend: str = "cpu", salt: int = 0) -> None:
        from kvtier.transfer import DevicePool, HostPool, TransferEngine

        self.layout = layout
        specs = list(layout.groups)
        dev = "cuda" if backend in ("torch", "numba", "hybrid") else "cpu"
        self.device = DevicePool.allocate(specs, device_pages, dev)
        self.host = HostPool(specs, host_pages or {g.name: 1 for g in specs})
        self.engine = TransferEngine(specs, self.host, self.device, backend)
        self.salt = salt
        self.pages_checked = 0
        self.pages_written = 0
        self._seconds = 0.0
        self._groups = {g.name: (i, g) for i, g in enumerate(layout.groups)}
        self._prefix: dict[str, list[int]] = {}
        self._align = layout.alignment
        #: (name, tokens per page, pages per unit) of each history group, in layout order
        self._history = [(g.name, g.tokens_per_page, self._align // g.tokens_per_page)
                         for g in layout.history_groups]
        self._pending_checks: dict[str, Admission] = {}

    # -- the scheduler's hooks -------------------------------------------------------
    def submit(self, commands: Sequence[TransferCommand]) -> None:
        if not commands:
            return
        t0 = time.perf_counter()
        for cmd in commands:
            self.engine.submit(cmd)
        self.engine.flush()
        self._seconds += time.perf_counter() - t0

    def collect(self) -> list[Completion]:
        t0 = time.perf_counter()
        out = self.engine.poll_completions()
        self._seconds += time.perf_counter() - t0
        return out

    def transfer_seconds(self) -> float:
        """Seconds the backend spent moving bytes: its own timing of the copies (CUDA events
        on a GPU) when it reports one, else the wall time of submit, flush and poll."""
        cum = self.engine.stats().get("cumulative", {})
        timed = sum(float(d.get("seconds") or 0.0) for d in cum.values() if isinstance(d, dict))
        return timed if timed > 0 else self._seconds

    def admitted(self, cache: TieredCache, adm: Admission) -> None:
        """Remember to check the hit's pages at the request's first forward pass (after
        its loadback has completed)."""
        self._prefix.pop(adm.request_id, None)
        if adm.hit_tokens:
            self._pending_checks[adm.request_id] = adm

    def checkpointed(self, cache: TieredCache, request_id: str, pages: dict[str, list[int]], tokens: int) -> None:
        """The tree adopted checkpoint pages at ``tokens``: fill them with the state's fingerprint."""
        unit = tokens // self._align - 1
        for g, ps in pages.items():
            n = len(ps)
            self._write(cache, request_id, g, ps, torch.full((n,), unit, dtype=torch.int64),
                        torch.arange(n, dtype=torch.int64), state=True)

    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None:
        pending = self._pending_checks
        for rid, start, n in batch:
            adm = pending.pop(rid, None) if pending else None
            if adm is not None and cache.allows(rid, "reserve"):  # running or loading (spec [request.calls])
                self._check_hit(cache, adm)
            # only pages this pass completes: only full units are ever published and reused
            table = None
            end = start + n
            for name, tpp, ppu in self._history:
                first, last = start // tpp, end // tpp - 1
                if last < first:
                    continue
                table = table or cache.page_table(rid)
                pages = table[name][first:last + 1]
                idx = torch.arange(first, last + 1, dtype=torch.int64)
                self._write(cache, rid, name, pages, idx // ppu, idx % ppu)

    # -- fingerprints ----------------------------------------------------------------
    def _prefix_hashes(self, cache: TieredCache, rid: str, upto: int) -> torch.Tensor:
        """The prefix hash chain of ``rid`` for units ``0 .. upto - 1`` (int64; one Python
        step per unit, computed once per request and unit)."""
        chain = self._prefix.setdefault(rid, [])
        if len(chain) < upto:
            keys: Sequence[Hashable] = cache.unit_keys(rid)
            h = chain[-1] if chain else self.salt
            for u in range(len(chain), upto):
                key = keys[u] if u < len(keys) else (rid, "u", u)
                h = hash((h, key)) & _MASK
                chain.append(h)
        return torch.tensor(chain[:upto], dtype=torch.int64)

    def _bases(self, cache: TieredCache, rid: str, group: str, units: torch.Tensor, index: torch.Tensor,
               state: bool) -> torch.Tensor:
        """One fingerprint base per page (unit ``units[i]``, page ``index[i]`` in it), in
        array operations (int64 arithmetic wraps; the mask keeps it non-negative)."""
        gi = self._groups[group][0]
        prefix = self._prefix_hashes(cache, rid, int(units.max()) + 1)[units]
        mixed = prefix ^ ((index * 1000033 + gi * 97 + int(state) * 7 + 11) * 2862933555777941757)
        return (mixed * 6364136223846793005 + 1442695040888963407) & _MASK

    def _values(self, bases: torch.Tensor, spec_layers: torch.Tensor, comp: int) -> torch.Tensor:
        """``[layers, pages]``: the fingerprint of every page in every layer of a component."""
        return (bases[None, :] * 6364136223846793005 + (comp * 1000003 + spec_layers[:, None] * 10007 + 1)) & _MASK

    def _layers(self, group: str) -> torch.Tensor:
        return torch.tensor(self._groups[group][1].layers, dtype=torch.int64)

    def _write(self, cache: TieredCache, rid: str, group: str, pages: Sequence[int], units: torch.Tensor,
               index: torch.Tensor, state: bool = False) -> None:
        """Fill ``pages`` with their fingerprints: one array operation per component for
        every layer and page of the chunk."""
        if not pages:
            return
        _, spec = self._groups[group]
        bases = self._bases(cache, rid, group, units, index, state)
        layers = self._layers(group)
        for ci, comp in enumerate(spec.components):
            words = comp.page_bytes // 8
            vals = self._values(bases, layers, ci)
            data = vals[:, :, None].expand(len(layers), len(pages), words).contiguous().view(torch.uint8)
            self.engine.write_layers("device", group, comp.name, pages, data)
        self.pages_written += len(pages)

    def _check(self, cache: TieredCache, rid: str, group: str, pages: Sequence[int], units: torch.Tensor,
               index: torch.Tensor, state: bool = False) -> None:
        """Compare every word of every page in every layer with its fingerprint (one read
        and one comparison per component); the first wrong page raises."""
        if not pages:
            return
        _, spec = self._groups[group]
        bases = self._bases(cache, rid, group, units, index, state)
        layers = self._layers(group)
        for ci, comp in enumerate(spec.components):
            got = self.engine.read_layers("device", group, comp.name, pages).view(torch.int64)
            want = self._values(bases, layers, ci).to(got.device)
            bad = (got != want[:, :, None]).any(dim=2)  # [layers, pages]
            if bool(bad.any()):
                li, i = (int(x) for x in bad.nonzero()[0])
                raise FingerprintMismatch(rid, group, comp.name, int(spec.layers[li]), int(pages[i]),
                                          f"does not hold unit {int(units[i])} page {int(index[i])} of its prefix")
        self.pages_checked += len(pages)

    def _check_hit(self, cache: TieredCache, adm: Admission) -> None:
        # the forward pass reads a loaded layer only after its chunk landed: the checks
        # below read every layer, so wait for the last one of every loadback it waits on
        for op in adm.wait_ops:
            self.engine.wait_layer(op, self.layout.num_layers - 1)
        table = adm.page_table
        units = adm.hit_tokens // self._align
        for g in self.layout.groups:
            if g.family is Family.HISTORY:
                ppu = self._align // g.tokens_per_page
                n = units * ppu
                idx = torch.arange(n, dtype=torch.int64)
                self._check(cache, adm.request_id, g.name, table[g.name][:n], idx // ppu, idx % ppu)
            elif adm.checkpoint_pages.get(g.name) and units:
                ps = adm.checkpoint_pages[g.name]
                n = len(ps)
                self._check(cache, adm.request_id, g.name, ps, torch.full((n,), units - 1, dtype=torch.int64),
                            torch.arange(n, dtype=torch.int64), state=True)
