"""A tiny decoder-only transformer whose paged KV cache lives in kvtier's pools.

The end-to-end proof that kvtier moves the right bytes: a real (if tiny) model computes
its attention from K and V read back through :class:`~kvtier.tiered.TieredCache`'s page
tables, out of a :class:`~kvtier.transfer.DevicePool` that the
:class:`~kvtier.transfer.TransferEngine` fills from a :class:`~kvtier.transfer.HostPool`.
If a page were wrong, stale or read before its copy landed, the logits would change.

The model (:class:`TinyModel`, float32 on CPU, random weights from a fixed seed):
token embedding, ``n_layers`` pre-norm blocks (RMSNorm, multi-head attention with
rotary position embedding, a GELU MLP), a final RMSNorm and an output projection.
Layers in ``full_layers`` attend to every earlier token; their K and V are *history*
(cache group ``tiny.full_kv``: pages of ``page_tokens`` tokens, reusable at any unit
boundary). Layers in ``window_layers`` attend to themselves and the ``window`` tokens
before them (sliding window): their K and V for the last ``window`` tokens are
*continuation state* (cache group ``tiny.swa_kv``, family ``state``), valid only at
the exact position they were taken at.

Per request, :class:`TinyRunner` keeps (all in device-pool pages):

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

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.fsm import CacheGroupSpec, CapacityError, ComponentSpec, ConfigError, Direction, Family, KvtierError
from kvtier.fsm.layout import CacheLayout
from kvtier.transfer import Backend, DevicePool, FakeAsyncBackend, HostPool, NotReadyError, TransferEngine

from .tiered import Admission, TieredCache

__all__ = ["TinyConfig", "TinyModel", "TinyRunner", "GenResult", "FULL_GROUP", "SWA_GROUP", "tiny_layout"]

#: Cache group of the full-attention layers' K/V (history).
FULL_GROUP = "tiny.full_kv"
#: Cache group of the sliding-window layers' K/V over the last ``window`` tokens (state).
SWA_GROUP = "tiny.swa_kv"
#: The two components of both groups: keys (after rotary embedding) and values.
COMPONENTS = ("k", "v")

LayerHook = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Shape of the tiny model and of its cache groups.

    Attributes:
        vocab: vocabulary size (token ids ``0 .. vocab-1``).
        d_model: hidden size (also the K/V row width: all heads together).
        n_heads: attention heads (``d_model`` divisible by it; head dim even for rotary).
        d_ff: MLP hidden size.
        full_layers: layers with full causal attention (history group).
        window_layers: layers with sliding-window attention (state group).
        page_tokens: tokens per page of the history group (the cache unit, alignment).
        window: sliding window in tokens: a query at ``t`` sees ``t - window .. t``.
        state_page_tokens: tokens per page of the state group (``window`` a multiple of
            it, and it divides ``page_tokens``).
        seed: seed of the weights.
    """

    vocab: int = 64
    d_model: int = 32
    n_heads: int = 2
    d_ff: int = 64
    full_layers: tuple[int, ...] = (0, 1)
    window_layers: tuple[int, ...] = (2, 3)
    page_tokens: int = 4
    window: int = 8
    state_page_tokens: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        layers = sorted(self.full_layers + self.window_layers)
        if not self.full_layers or not self.window_layers or layers != list(range(len(layers))):
            raise ConfigError(f"TinyConfig: full_layers {self.full_layers} and window_layers "
                              f"{self.window_layers} must be non-empty and partition 0..n-1")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"TinyConfig: d_model {self.d_model} must split into {self.n_heads} heads "
                              f"of even size")
        if self.window % self.state_page_tokens or self.page_tokens % self.state_page_tokens:
            raise ConfigError(f"TinyConfig: window {self.window} and page_tokens {self.page_tokens} must be "
                              f"multiples of state_page_tokens {self.state_page_tokens}")

    @property
    def n_layers(self) -> int:
        return len(self.full_layers) + len(self.window_layers)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def tiny_layout(cfg: TinyConfig) -> CacheLayout:
    """The model's two cache groups: ``tiny.full_kv`` (history, pages of
    ``page_tokens``) and ``tiny.swa_kv`` (state, ``window / state_page_tokens`` pages),
    each with components ``k`` and ``v`` of ``tokens_per_page * d_model * 4`` bytes."""

    def comps(tokens: int) -> tuple[ComponentSpec, ...]:
        return tuple(ComponentSpec(c, tokens * cfg.d_model * 4) for c in COMPONENTS)

    full = CacheGroupSpec(FULL_GROUP, Family.HISTORY, cfg.page_tokens, 1, cfg.full_layers, comps(cfg.page_tokens))
    swa = CacheGroupSpec(SWA_GROUP, Family.STATE, cfg.state_page_tokens, 1, cfg.window_layers,
                         comps(cfg.state_page_tokens), window=cfg.window)
    return CacheLayout("tiny", (full, swa), cfg.n_layers, source="kvtier.tinymodel (random weights)")


@dataclass(frozen=True, slots=True)
class _Block:
    wq: torch.Tensor  # [d_model, d_model]
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w1: torch.Tensor  # [d_model, d_ff]
    w2: torch.Tensor  # [d_ff, d_model]


class TinyModel:
    """The weights and the arithmetic (no cache of its own: see :class:`TinyRunner`).

    Args:
        cfg: the shape; weights are drawn from ``torch.Generator().manual_seed(cfg.seed)``,
            normal with std ``1/sqrt(fan_in)`` (embedding: std 1), float32.
    """

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        self.cfg = cfg = cfg or TinyConfig()
        self.layout = tiny_layout(cfg)
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(rows: int, cols: int, std: float) -> torch.Tensor:
            return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std

        d, f = cfg.d_model, cfg.d_ff
        self.embed = w(cfg.vocab, d, 1.0)  # [vocab, d_model]
        self.blocks = [_Block(wq=w(d, d, d ** -0.5), wk=w(d, d, d ** -0.5), wv=w(d, d, d ** -0.5),
                              wo=w(d, d, d ** -0.5), w1=w(d, f, d ** -0.5), w2=w(f, d, f ** -0.5))
                       for _ in range(cfg.n_layers)]
        self.head = w(d, cfg.vocab, d ** -0.5)  # [d_model, vocab]
        half = cfg.head_dim // 2
        self._inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))  # [head_dim/2]
        self._window = set(cfg.window_layers)

    @staticmethod
    def rms(x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without gain over the last dim (eps 1e-6)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` float32 ``[n, d_model]`` at positions ``pos`` int64 ``[n]``."""
        h, hd = self.cfg.n_heads, self.cfg.head_dim
        ang = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]  # [n, hd/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        xs = x.view(-1, h, hd)
        a, b = xs[..., : hd // 2], xs[..., hd // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(-1, h * hd)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                  kpos: torch.Tensor) -> torch.Tensor:
        """Causal (or sliding-window, for window layers) attention.

        Args:
            q: float32 ``[n, d_model]``; k, v: float32 ``[m, d_model]`` (every key the
                queries may see, any order); qpos int64 ``[n]``, kpos int64 ``[m]``.

        Returns:
            float32 ``[n, d_model]``, the heads concatenated.
        """
        h, hd = self.cfg.n_heads, self.cfg.head_dim
        qh = q.view(-1, h, hd).transpose(0, 1)  # [h, n, hd]
        kh = k.view(-1, h, hd).transpose(0, 1)  # [h, m, hd]
        vh = v.view(-1, h, hd).transpose(0, 1)
        scores = torch.matmul(qh, kh.transpose(1, 2)) / math.sqrt(hd)  # [h, n, m]
        allowed = kpos[None, :] <= qpos[:, None]
        if layer in self._window:
            allowed &= kpos[None, :] >= qpos[:, None] - self.cfg.window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), vh)  # [h, n, hd]
        return out.transpose(0, 1).reshape(-1, h * hd)

    def forward(self, tokens: torch.Tensor, start: int, kv: _KV) -> torch.Tensor:
        """Run ``tokens`` (int64 ``[n]``, positions ``start .. start+n-1``) on top of the
        cached K/V ``kv`` gives for positions before ``start``; stage the new K/V in ``kv``.

        Returns:
            logits, float32 ``[n, vocab]``.
        """
        pos = torch.arange(start, start + tokens.numel(), dtype=torch.int64)
        x = self.embed[tokens]  # [n, d_model]
        for layer, blk in enumerate(self.blocks):
            hn = self.rms(x)
            q = self.rope(hn @ blk.wq, pos)
            k = self.rope(hn @ blk.wk, pos)
            v = hn @ blk.wv
            k_past, v_past, p_past = kv.past(layer, start)  # waits for the layer's loadback first
            kv.stage(layer, start, k, v)
            a = self.attention(layer, q, torch.cat([k_past, k]), torch.cat([v_past, v]), pos,
                               torch.cat([p_past, pos]))
            x = x + a @ blk.wo
            x = x + torch.nn.functional.gelu(self.rms(x) @ blk.w1) @ blk.w2
        return self.rms(x) @ self.head


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
