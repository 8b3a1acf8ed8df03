"""The runner of the tiny model: :class:`TinyRunner` generates with
:class:`~.transformer.TinyModel` over a :class:`~kvtier.tiered.TieredCache` and real pools.

Per request it keeps (all in device-pool pages):

- history group: the request's page table (``TieredCache.page_table``): token ``t`` of
  a full-attention layer lives in row ``t % page_tokens`` of page ``table[t // page_tokens]``;
- state group: its working state pages, a ring of ``window`` slots: token ``t``'s K/V
  of a window layer lives in slot ``t % window`` (slot ``s`` is row
  ``s % state_page_tokens`` of working page ``s // state_page_tokens``). A
  continuation-state checkpoint is a verbatim copy of the ring at a unit boundary: on a
  hit the first forward pass copies the checkpoint pages into the ring (layer by layer,
  after that layer's loadback has landed); when ``step_done`` adopts checkpoint pages,
  the runner copies the ring into them.

Every page access goes through :meth:`TransferEngine.read_pages` /
:meth:`TransferEngine.write_pages`, so with the fake-asynchronous backend a read of a
page whose copy is still pending raises :class:`~kvtier.transfer.PoisonedReadError`.
Before reading layer ``l`` of a request that waits on loadbacks, the forward pass calls
:meth:`TransferEngine.wait_layer` for each of them and checks
:meth:`TieredCache.layer_ready`.

Units: tokens and pages as in :mod:`kvtier.tiered`; K and V rows are float32
``[d_model]`` (4 bytes per value), so a page of one component in one layer holds
``page_tokens * d_model * 4`` bytes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.fsm import CapacityError, ConfigError, Direction, KvtierError
from kvtier.transfer import Backend, DevicePool, FakeAsyncBackend, HostPool, NotReadyError, TransferEngine

from ...tiered import Admission, TieredCache
from .transformer import COMPONENTS, FULL_GROUP, SWA_GROUP, LayerHook, TinyModel

__all__ = ["TinyRunner", "GenResult"]


def _to_rows(pages: torch.Tensor, d_model: int) -> torch.Tensor:
    """uint8 ``[p, page_bytes]`` -> float32 ``[p * tokens_per_page, d_model]``."""
    return pages.contiguous().view(torch.float32).reshape(-1, d_model)


def _to_pages(rows: torch.Tensor, n_pages: int) -> torch.Tensor:
    """float32 ``[p * tokens_per_page, d_model]`` -> uint8 ``[p, page_bytes]``."""
    return rows.contiguous().reshape(n_pages, -1).view(torch.uint8)


class _KV:
    """One forward pass's view of one request's paged K/V (see the module docstring)."""

    def __init__(self, runner: TinyRunner, req: _Req, before_layer: LayerHook | None, layer_wait: bool) -> None:
        self.runner = runner
        self.req = req
        self.table = runner.cache.page_table(req.request_id)
        self.before_layer = before_layer
        self.layer_wait = layer_wait
        self.staged: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def past(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V float32 ``[m, d_model]`` and positions int64 ``[m]`` a query at ``start``
        may see before ``start``: all of them (full layers) or the last ``window``."""
        r, cfg = self.runner, self.runner.model.cfg
        if self.before_layer is not None:
            self.before_layer(layer)
        if self.layer_wait:
            r.wait_layer(self.req, layer)
        eng = r.engine
        if layer in r.model._window:
            ring = self.table[SWA_GROUP]
            if self.req.ckpt:  # first pass after a checkpoint hit: copy it into the working state
                for c in COMPONENTS:
                    eng.write_pages("device", SWA_GROUP, c, layer, ring,
                                    eng.read_pages("device", SWA_GROUP, c, layer, self.req.ckpt))
            lo = max(0, start - cfg.window)
            p = torch.arange(lo, start, dtype=torch.int64)
            if not ring or start == 0:
                empty = torch.empty(0, cfg.d_model)
                return empty, empty, p
            k, v = (_to_rows(eng.read_pages("device", SWA_GROUP, c, layer, ring), cfg.d_model)[p % cfg.window]
                    for c in COMPONENTS)
            return k, v, p
        n_pages = -(-start // cfg.page_tokens)
        p = torch.arange(0, start, dtype=torch.int64)
        if n_pages == 0:
            empty = torch.empty(0, cfg.d_model)
            return empty, empty, p
        pages = self.table[FULL_GROUP][:n_pages]
        k, v = (_to_rows(eng.read_pages("device", FULL_GROUP, c, layer, pages), cfg.d_model)[:start]
                for c in COMPONENTS)
        return k, v, p

    def stage(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the pass's new K/V ``[n, d_model]`` until :meth:`commit` (so a pass that
        fails part-way changes no working state and can be run again)."""
        self.staged[layer] = (start, k, v)

    def commit(self) -> None:
        """Write the staged K/V: into the history pages (read-modify-write of the pages
        the new tokens touch) and into the window ring."""
        r, cfg = self.runner, self.runner.model.cfg
        eng = r.engine
        for layer, (start, k, v) in sorted(self.staged.items()):
            end = start + k.shape[0]
            if layer in r.model._window:
                ring = self.table[SWA_GROUP]
                lo = max(start, end - cfg.window)
                slots = torch.arange(lo, end, dtype=torch.int64) % cfg.window
                for c, new in zip(COMPONENTS, (k, v)):
                    rows = _to_rows(eng.read_pages("device", SWA_GROUP, c, layer, ring), cfg.d_model)
                    rows[slots] = new[lo - start:]
                    eng.write_pages("device", SWA_GROUP, c, layer, ring, _to_pages(rows, len(ring)))
                continue
            tpp = cfg.page_tokens
            first, last = start // tpp, (end - 1) // tpp
            pages = self.table[FULL_GROUP][first:last + 1]
            for c, new in zip(COMPONENTS, (k, v)):
                rows = _to_rows(eng.read_pages("device", FULL_GROUP, c, layer, pages), cfg.d_model)
                rows[start - first * tpp:end - first * tpp] = new
                eng.write_pages("device", FULL_GROUP, c, layer, pages, _to_pages(rows, len(pages)))
        self.req.ckpt = []


@dataclass(eq=False)
class _Req:
    request_id: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_tokens: int
    decode_steps: int
    adm: Admission
    computed: int  # tokens whose K/V exist
    ckpt: list[int]  # checkpoint pages still to copy into the working state (first pass)
    reserved: bool = True  # the next pass is reserved (admission reserves the first)
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class GenResult:
    """One request's generation.

    Attributes:
        request_id: the request.
        prompt_tokens: prompt length (tokens).
        hit_tokens: prefix-hit tokens at admission (device + host).
        device_hit_tokens: of which already on the device.
        loadback: whether the admission started a loadback.
        checkpoint_hit: whether the hit included a state-group checkpoint (the working
            state was initialised from it).
        history_hit_pages: history-group pages of the hit the forward pass read.
        generated: greedy tokens, ``1 + decode_steps`` of them.
        logits: float32 ``[1 + decode_steps, vocab]``: the prompt's last position, then
            each decode step.
    """

    request_id: str
    prompt_tokens: int
    hit_tokens: int
    device_hit_tokens: int
    loadback: bool
    checkpoint_hit: bool
    history_hit_pages: int
    generated: tuple[int, ...]
    logits: torch.Tensor


class TinyRunner:
    """Generates with :class:`TinyModel` over a :class:`TieredCache` and real pools,
    one request at a time.

    Prefill runs in at most two passes: up to the prompt's last unit boundary (the
    continuation state there is checkpointed), then the rest; then one pass per decode
    token.

    Args:
        model: the model (its ``layout`` sizes the pools).
        device_pages: device pages per group (``{FULL_GROUP: n, SWA_GROUP: m}``).
        host_pages: host pages per group, or ``None`` for a device-only cache.
        policy: the cache's write policy (``write_through`` keeps host copies of every
            published node).
        backend: transfer backend: ``"cpu"``, ``"fake-async"`` or a :class:`Backend`.
        prefix_reuse: ``False`` salts every unit key with the request id, so nothing is
            ever matched (the no-reuse baseline).
        chunk_layers: model layers per loadback chunk (1: layer by layer).
    """

    def __init__(self, model: TinyModel, device_pages: Mapping[str, int], host_pages: Mapping[str, int] | None,
                 *, policy: str = "write_through", backend: str | Backend = "cpu", prefix_reuse: bool = True,
                 chunk_layers: int = 1) -> None:
        self.model = model
        layout = model.layout
        self.cache = TieredCache(layout, dict(device_pages), None if host_pages is None else dict(host_pages),
                                 policy=policy)
        specs = list(layout.groups)
        self.device = DevicePool.allocate(specs, dict(device_pages), "cpu")
        self.host = HostPool(specs, dict(host_pages) if host_pages else 1, pin=False)
        self.engine = TransferEngine(specs, self.host, self.device, backend, chunk_layers=chunk_layers)
        self.prefix_reuse = prefix_reuse
        #: fake-async backend only: leave loadback copies pending (the caller completes them).
        self.hold_loadbacks = False
        self._reqs: dict[str, _Req] = {}
        self._align = layout.alignment

    @property
    def backend(self) -> Backend:
        return self.engine.backend

    # -- transfers -------------------------------------------------------------------------
    def _auto_complete(self) -> None:
        b = self.engine.backend
        if isinstance(b, FakeAsyncBackend):
            while b.complete_next(Direction.WRITEBACK) is not None:
                pass
            if not self.hold_loadbacks:
                while b.complete_next(Direction.LOADBACK) is not None:
                    pass

    def collect(self) -> int:
        """Feed the engine's completions to the cache; returns how many."""
        done = self.engine.poll_completions()
        for c in done:
            self.cache.complete(c)
        return len(done)

    def pump(self) -> None:
        """Submit the cache's commands and feed completions back until nothing moves
        (with the fake-async backend, writebacks, and loadbacks unless
        :attr:`hold_loadbacks`, are completed at once).

        Raises:
            KvtierError: a request was aborted.
        """
        while True:
            out = self.cache.poll()
            for cmd in out.commands:
                self.engine.submit(cmd)
            self.engine.flush()
            self._auto_complete()
            n = self.collect()
            for e in out.events:
                if e.state == "aborted":
                    raise KvtierError(f"tiny model: request {e.request_id!r} aborted: {e.reason}")
            if not out.commands and not n:
                return

    def wait_layer(self, req: _Req, layer: int) -> None:
        """The layer-wise wait before the forward pass reads ``layer`` of ``req``.

        Raises:
            NotReadyError: a loadback it waits on has not landed that layer (fake-async).
        """
        for op in req.adm.wait_ops:
            self.engine.wait_layer(op, layer)
        self.collect()
        if not self.cache.layer_ready(req.request_id, layer):
            raise NotReadyError(f"request {req.request_id!r}: layer {layer} of its loadback is not complete")

    # -- requests --------------------------------------------------------------------------
    def unit_keys(self, request_id: str, tokens: Sequence[int]) -> list[Hashable]:
        """One key per full unit: the unit's token ids (salted with the request id when
        prefix reuse is off)."""
        a = self._align
        keys: list[Hashable] = [tuple(tokens[i * a:(i + 1) * a]) for i in range(len(tokens) // a)]
        return keys if self.prefix_reuse else [(request_id, k) for k in keys]

    def start(self, request_id: str, prompt: Sequence[int], decode_steps: int) -> Admission:
        """Admit a request (reserving its whole prompt) and submit what that needs.

        Raises:
            CapacityError: the cache refused the admission (device pages short).
        """
        prompt = [int(t) for t in prompt]
        if not prompt or any(not 0 <= t < self.model.cfg.vocab for t in prompt):
            raise ConfigError(f"request {request_id!r}: prompt must be non-empty token ids < {self.model.cfg.vocab}")
        adm = self.cache.admit(request_id, self.unit_keys(request_id, prompt), prompt_tokens=len(prompt),
                               chunk_tokens=len(prompt))
        if adm is None:
            raise self._short(request_id, len(prompt))
        ckpt = list(adm.checkpoint_pages.get(SWA_GROUP, [])) if adm.start_token else []
        self._reqs[request_id] = _Req(request_id, prompt, len(prompt), decode_steps, adm, adm.start_token, ckpt)
        self.pump()
        return adm

    def next_pass(self, request_id: str) -> tuple[int, int]:
        """(first position, tokens) of the request's next forward pass."""
        r = self._reqs[request_id]
        floor = r.prompt_tokens // self._align * self._align
        if r.computed < floor:
            return r.computed, floor - r.computed
        if r.computed < r.prompt_tokens:
            return r.computed, r.prompt_tokens - r.computed
        return r.computed, 1

    def done(self, request_id: str) -> bool:
        """Whether every pass of the request has run."""
        r = self._reqs[request_id]
        return len(r.logits) == 1 + r.decode_steps

    def step(self, request_id: str, *, before_layer: LayerHook | None = None, layer_wait: bool = True) -> None:
        """Run the request's next forward pass and report it to the cache.

        Args:
            before_layer: called with each layer index before the pass reads that layer
                (tests drive transfer completions from here).
            layer_wait: go through the layer-wise wait (``False`` only to show that
                reading without it hits poisoned pages).

        Raises:
            NotReadyError: a layer's loadback has not landed (fake-async backend).
            PoisonedReadError: with ``layer_wait=False``, a page read before its copy.
            Either leaves the request as it was: the pass may be run again.
        """
        r = self._reqs[request_id]
        start, n = self.next_pass(request_id)
        if not r.reserved:
            if self.cache.reserve(request_id, n) is None:
                raise self._short(request_id, n)
            r.reserved = True
        kv = _KV(self, r, before_layer, layer_wait)
        logits = self.model.forward(torch.tensor(r.tokens[start:start + n], dtype=torch.int64), start, kv)
        kv.commit()
        r.reserved = False
        self.collect()
        end = start + n
        adopted = self.cache.step_done(request_id, n, checkpoint=end == r.prompt_tokens // self._align * self._align)
        r.computed = end
        self._fill_checkpoint(r, adopted, kv.table)
        self.pump()
        if end >= r.prompt_tokens:
            r.logits.append(logits[-1].clone())
            r.tokens.append(int(torch.argmax(logits[-1])))

    def _short(self, request_id: str, tokens: int) -> CapacityError:
        g = FULL_GROUP
        free = self.cache.core.device[g].free
        return CapacityError("device", g, -(-tokens // self.model.layout.group(g).tokens_per_page), free)

    def _fill_checkpoint(self, r: _Req, adopted: Mapping[str, list[int]], table: Mapping[str, list[int]]) -> None:
        """Copy the working state (the ring pages in ``table``, holding the state at
        ``r.computed``, a unit boundary whenever the cache adopts a checkpoint) into the
        adopted checkpoint pages."""
        if not adopted:
            return
        if r.computed % self._align:
            raise KvtierError(f"request {r.request_id!r}: checkpoint adopted at {r.computed} tokens, "
                              f"not a unit boundary")
        for g, pages in adopted.items():
            ring = table[g]
            for layer in self.model.layout.group(g).layers:
                for c in COMPONENTS:
                    self.engine.write_pages("device", g, c, layer, pages,
                                            self.engine.read_pages("device", g, c, layer, ring))

    def finish(self, request_id: str) -> GenResult:
        """Finish the request (its full units published, its pages written back) and
        return its result.

        Raises:
            KvtierError: passes are still to run.
        """
        if not self.done(request_id):
            raise KvtierError(f"request {request_id!r}: finish before its last pass")
        r = self._reqs[request_id]
        table = self.cache.page_table(request_id)  # finish may free the working state at once
        self._fill_checkpoint(r, self.cache.finish(request_id) or {}, table)
        del self._reqs[request_id]
        self.pump()
        a = r.adm
        return GenResult(request_id, r.prompt_tokens, a.hit_tokens, a.device_hit_tokens, a.loadback_op is not None,
                         bool(a.hit_tokens and a.checkpoint_pages.get(SWA_GROUP)),
                         a.hit_tokens // self.model.layout.group(FULL_GROUP).tokens_per_page,
                         tuple(r.tokens[r.prompt_tokens:]), torch.stack(r.logits))

    def run_to_end(self, request_id: str) -> GenResult:
        """Run the request's remaining passes, then :meth:`finish` it."""
        while not self.done(request_id):
            self.step(request_id)
        return self.finish(request_id)

    def generate(self, request_id: str, prompt: Sequence[int], decode_steps: int = 3) -> GenResult:
        """Admit, prefill, decode ``decode_steps`` greedy tokens, finish."""
        self.start(request_id, prompt, decode_steps)
        return self.run_to_end(request_id)

    def read_hit(self, request_id: str, layer: int) -> torch.Tensor:
        """Read, without any wait, the cached K of ``layer`` the request's hit covers
        (history pages for a full layer, the checkpoint for a window layer): uint8
        ``[pages, page_bytes]``. For tests: raises
        :class:`~kvtier.transfer.PoisonedReadError` while a copy still writes them."""
        r = self._reqs[request_id]
        if layer in self.model._window:
            return self.engine.read_pages("device", SWA_GROUP, "k", layer, r.adm.checkpoint_pages[SWA_GROUP])
        n = r.adm.hit_tokens // self.model.layout.group(FULL_GROUP).tokens_per_page
        return self.engine.read_pages("device", FULL_GROUP, "k", layer, r.adm.page_table[FULL_GROUP][:n])
