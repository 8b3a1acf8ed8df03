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

from .tiered import Admission, TieredCache

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
            self._write(cache, request_id, g, ps, [(unit, j) for j in range(len(ps))], state=True)

    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None:
        for rid, start, n in batch:
            adm = self._pending_checks.pop(rid, None)
            if adm is not None and cache.allows(rid, "reserve"):  # running or loading (spec [request.calls])
                self._check_hit(cache, adm)
            # only pages this pass completes: only full units are ever published and reused
            table = None
            for g in self.layout.history_groups:
                tpp = g.tokens_per_page
                first, last = start // tpp, (start + n) // tpp - 1
                if last < first:
                    continue
                table = table or cache.page_table(rid)
                pages = table[g.name][first:last + 1]
                ppu = self._align // tpp
                self._write(cache, rid, g.name, pages, [(i // ppu, i % ppu) for i in range(first, last + 1)])

    # -- fingerprints ----------------------------------------------------------------
    def _prefix_hash(self, cache: TieredCache, rid: str, unit: int) -> int:
        chain = self._prefix.setdefault(rid, [])
        if len(chain) <= unit:
            keys: Sequence[Hashable] = cache.unit_keys(rid)
            h = chain[-1] if chain else self.salt
            for u in range(len(chain), unit + 1):
                key = keys[u] if u < len(keys) else (rid, "u", u)
                h = hash((h, key)) & _MASK
                chain.append(h)
        return chain[unit]

    def _bases(self, cache: TieredCache, rid: str, group: str, where: Sequence[tuple[int, int]],
               state: bool) -> torch.Tensor:
        gi = self._groups[group][0]
        vals = [hash((self._prefix_hash(cache, rid, u), gi, j, state)) & _MASK for u, j in where]
        return torch.tensor(vals, dtype=torch.int64)

    @staticmethod
    def _values(bases: torch.Tensor, comp: int, layer: int) -> torch.Tensor:
        # int64 arithmetic wraps; the mask keeps the fingerprint non-negative
        return (bases * 6364136223846793005 + (comp * 1000003 + layer * 10007 + 1)) & _MASK

    def _write(self, cache: TieredCache, rid: str, group: str, pages: Sequence[int],
               where: Sequence[tuple[int, int]], state: bool = False) -> None:
        if not pages:
            return
        _, spec = self._groups[group]
        bases = self._bases(cache, rid, group, where, state)
        for ci, comp in enumerate(spec.components):
            words = comp.page_bytes // 8
            for layer in spec.layers:
                vals = self._values(bases, ci, layer)
                data = vals[:, None].expand(len(pages), words).contiguous().view(torch.uint8)
                self.engine.write_pages("device", group, comp.name, layer, pages, data)
        self.pages_written += len(pages)

    def _check(self, cache: TieredCache, rid: str, group: str, pages: Sequence[int],
               where: Sequence[tuple[int, int]], state: bool = False) -> None:
        if not pages:
            return
        _, spec = self._groups[group]
        bases = self._bases(cache, rid, group, where, state)
        for ci, comp in enumerate(spec.components):
            for layer in spec.layers:
                got = self.engine.read_pages("device", group, comp.name, layer, pages).view(torch.int64)
                want = self._values(bases, ci, layer).to(got.device)
                bad = (got != want[:, None]).any(dim=1)
                if bool(bad.any()):
                    i = int(bad.nonzero()[0, 0])
                    raise FingerprintMismatch(rid, group, comp.name, layer, int(pages[i]),
                                              f"does not hold unit {where[i][0]} page {where[i][1]} of its prefix")
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
                self._check(cache, adm.request_id, g.name, table[g.name][:n], [(i // ppu, i % ppu) for i in range(n)])
            elif adm.checkpoint_pages.get(g.name) and units:
                ps = adm.checkpoint_pages[g.name]
                self._check(cache, adm.request_id, g.name, ps, [(units - 1, j) for j in range(len(ps))], state=True)
