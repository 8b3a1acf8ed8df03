"""A paged Llama-architecture decoder whose KV cache lives in kvtier's pools (issue 17).

The model (:class:`PagedLlama`): token embedding, ``n_layers`` pre-norm blocks (RMSNorm,
grouped-query attention with rotary position embedding, a SwiGLU MLP), a final RMSNorm
and an output projection. Weights are random, drawn from a fixed seed (nothing is
downloaded): bf16 on a GPU, float32 on the CPU. Shapes (:data:`CONFIGS`): Llama 3.2 1B
and Llama 3 8B (their published hidden size, layers, heads, KV heads, MLP size and
vocabulary), a 1B-class variant whose even layers use sliding-window attention (as
Gemma 3 and gpt-oss alternate local and global layers), and tiny CPU shapes of both kinds.

Cache groups (:func:`model_layout`):

- ``model.full_kv`` (history): K and V of the full-attention layers, pages of
  ``page_tokens`` tokens; token ``t`` of a layer lives in row ``t % page_tokens`` of page
  ``table[t // page_tokens]`` of the request's page table.
- ``model.swa_kv`` (state, only with ``window > 0``): K and V of the sliding-window
  layers over their last ``window + page_tokens`` tokens: a ring of slots, token ``t`` in
  slot ``t % ring`` (slot ``s`` = row ``s % state_page_tokens`` of working page
  ``s // state_page_tokens``). A query at ``t`` sees ``t - window .. t``; the ring keeps
  ``page_tokens`` more than that, so at any position it still holds the state at the last
  unit boundary (a checkpoint taken on :meth:`TieredCache.retract`, where the request may
  stand past a boundary, is then exact). A checkpoint is a verbatim copy of the ring.

The K/V tensors are the engine's own tensors, one ``[pages, tokens_per_page, kv_heads,
head_dim]`` tensor per (group, component, layer), registered in a
:class:`~kvtier.transfer.DevicePool` (:class:`PagedKV`); the transfer engine's kernels
copy their pages to and from the host pool. The forward pass waits per layer on
loadbacks (:meth:`TransferEngine.wait_layer`, stream-ordered on a GPU), reads K/V from
the pages and writes new K/V into the request's own pages.

Attention reads pages by gathering the rows of the keys a query may see into one
contiguous tensor and calling ``scaled_dot_product_attention`` (causal aligned to the
lower right for a chunk on top of cached tokens; an explicit mask for sliding windows;
decode steps batched with a padding mask). Why not FlexAttention's paged mode: it must
be compiled to be fast (``torch.compile``; uncompiled it runs its reference path), which
costs start-up time per shape on a short device lease and gives no CPU path for CI; the
gather's share of a forward pass is measured by ``bench/e2e_ttft.py`` (``attention``
section of its JSON) and bounds what FlexAttention could save.

Units: tokens, pages; K/V values are ``dtype`` (2 bytes in bf16, 4 in float32).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, ConfigError, Direction, Family, KvtierError, \
    TransferCommand
from kvtier.fsm.layout import CacheLayout
from kvtier.transfer import DevicePool, HostPool, TransferEngine

from .tiered import Admission, TieredCache

__all__ = ["ModelConfig", "CONFIGS", "config", "model_layout", "PagedLlama", "PagedKV", "ModelExecutor",
           "WallClock", "FULL_GROUP", "SWA_GROUP", "COMPONENTS", "prompt_tokens_for"]

#: History group: K/V of the full-attention layers.
FULL_GROUP = "model.full_kv"
#: State group: K/V of the sliding-window layers over their ring of recent tokens.
SWA_GROUP = "model.swa_kv"
#: Components of both groups.
COMPONENTS = ("k", "v")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder and of its cache groups.

    Attributes:
        name: configuration name.
        vocab: vocabulary size.
        hidden: hidden size.
        n_layers: decoder layers.
        n_heads: query heads; n_kv_heads: K/V heads (divides ``n_heads``).
        head_dim: dimension per head (even, for rotary embedding).
        ffn: SwiGLU hidden size.
        page_tokens: tokens per history page (the cache unit).
        window: sliding window in tokens (0: every layer attends to all earlier tokens).
            With a window, even layers are sliding-window layers, odd layers full.
        state_page_tokens: tokens per page of the state group (divides ``page_tokens``
            and ``window``).
        rope_theta: rotary base.
        seed: seed of the weights.
        source: where the shape comes from.
    """

    name: str
    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    page_tokens: int = 64
    window: int = 0
    state_page_tokens: int = 64
    rope_theta: float = 500000.0
    seed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("vocab", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "page_tokens",
                  "state_page_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model config {self.name!r}: {f} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ConfigError(f"model config {self.name!r}: n_heads {self.n_heads} must be a multiple of "
                              f"n_kv_heads {self.n_kv_heads} and head_dim {self.head_dim} even")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ConfigError(f"model config {self.name!r}: window must be an int >= 0, got {self.window!r}")
        if self.window:
            if self.n_layers < 2:
                raise ConfigError(f"model config {self.name!r}: a sliding window needs at least 2 layers")
            if self.window % self.state_page_tokens or self.page_tokens % self.state_page_tokens:
                raise ConfigError(f"model config {self.name!r}: window {self.window} and page_tokens "
                                  f"{self.page_tokens} must be multiples of state_page_tokens "
                                  f"{self.state_page_tokens}")

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Sliding-window layers (even layers when ``window > 0``)."""
        return tuple(range(0, self.n_layers, 2)) if self.window else ()

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Full-attention layers."""
        w = set(self.window_layers)
        return tuple(i for i in range(self.n_layers) if i not in w)

    @property
    def ring(self) -> int:
        """Slots of a sliding-window layer's working state: ``window + page_tokens``."""
        return self.window + self.page_tokens if self.window else 0

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


def _llama_1b(name: str, window: int = 0, source: str = "Llama 3.2 1B config (random weights)") -> ModelConfig:
    return ModelConfig(name, vocab=128256, hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192,
                       window=window, source=source)


#: Named shapes. The 1B and 8B shapes are Llama 3.2 1B's and Llama 3 8B's published
#: configurations (hidden size, layers, heads, KV heads, head dim, MLP size, vocabulary,
#: rope theta); ``llama-1b-swa`` makes every even layer of the 1B shape a 512-token
#: sliding-window layer (Gemma 3 1B's window); ``tiny`` and ``tiny-swa`` are CPU shapes.
CONFIGS: dict[str, ModelConfig] = {
    "llama-1b": _llama_1b("llama-1b"),
    "llama-1b-swa": _llama_1b("llama-1b-swa", window=512, source="Llama 3.2 1B config, even layers 512-token "
                                                                 "sliding window (random weights)"),
    "llama-8b": ModelConfig("llama-8b", vocab=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                            ffn=14336, source="Llama 3 8B config (random weights)"),
    "tiny": ModelConfig("tiny", vocab=512, hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128,
                        page_tokens=16, state_page_tokens=8, source="tiny CPU shape"),
    "tiny-swa": ModelConfig("tiny-swa", vocab=512, hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                            ffn=128, page_tokens=16, window=32, state_page_tokens=8, source="tiny CPU shape"),
}


def config(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration with field overrides.

    Raises:
        ConfigError: unknown name (the message lists them) or a bad override.
    """
    try:
        base = CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; expected one of {sorted(CONFIGS)}") from None
    try:
        return replace(base, **overrides)
    except TypeError as e:
        raise ConfigError(f"model {name!r}: {e}") from None


def model_layout(cfg: ModelConfig, dtype_bytes: int) -> CacheLayout:
    """The model's cache groups: ``model.full_kv`` (history) and, with a window,
    ``model.swa_kv`` (state, window ``ring`` tokens); components ``k`` and ``v`` of
    ``tokens_per_page * n_kv_heads * head_dim * dtype_bytes`` bytes per page and layer."""

    def comps(tokens: int) -> tuple[ComponentSpec, ...]:
        return tuple(ComponentSpec(c, tokens * cfg.n_kv_heads * cfg.head_dim * dtype_bytes) for c in COMPONENTS)

    groups = [CacheGroupSpec(FULL_GROUP, Family.HISTORY, cfg.page_tokens, 1, cfg.full_layers, comps(cfg.page_tokens))]
    if cfg.window:
        groups.append(CacheGroupSpec(SWA_GROUP, Family.STATE, cfg.state_page_tokens, 1, cfg.window_layers,
                                     comps(cfg.state_page_tokens), window=cfg.ring))
    return CacheLayout(cfg.name, tuple(groups), cfg.n_layers, source=f"kvtier.model: {cfg.source}")


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [hidden, (n_heads + 2 * n_kv_heads) * head_dim]
    wo: torch.Tensor  # [n_heads * head_dim, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w13: torch.Tensor  # [hidden, 2 * ffn] (gate, up)
    w2: torch.Tensor  # [ffn, hidden]


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim (eps 1e-5), computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


class PagedLlama:
    """Weights and arithmetic of the decoder (the K/V cache lives in :class:`PagedKV`).

    Args:
        cfg: the shape.
        device: where the weights live (``"cuda"`` or ``"cpu"``).
        dtype: bf16 on a GPU, float32 on the CPU (default: by device).

    Weights are normal with std ``1/sqrt(fan_in)`` (embedding std 1), drawn from a
    ``torch.Generator`` on ``device`` seeded with ``cfg.seed``; norm gains are 1.
    """

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed)

        def w(rows: int, cols: int, std: float) -> torch.Tensor:
            t = torch.empty(rows, cols, device=self.device, dtype=torch.float32)
            t.normal_(0.0, std, generator=gen)
            return t.to(self.dtype)

        h, hd = cfg.hidden, cfg.head_dim
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
        ones = torch.ones(h, device=self.device, dtype=self.dtype)
        self.embed = w(cfg.vocab, h, 1.0)
        self.layers = [_Layer(ones, w(h, qkv, h ** -0.5), w(cfg.n_heads * hd, h, (cfg.n_heads * hd) ** -0.5), ones,
                              w(h, 2 * cfg.ffn, h ** -0.5), w(cfg.ffn, h, cfg.ffn ** -0.5))
                       for _ in range(cfg.n_layers)]
        self.norm = ones
        self.head = w(h, cfg.vocab, h ** -0.5)
        half = hd // 2
        self._inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float32, device=self.device) / half))
        self.window_layers = frozenset(cfg.window_layers)
        self.layout = model_layout(cfg, torch.empty(0, dtype=self.dtype).element_size())

    # -- pieces --------------------------------------------------------------------------------
    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half form) of ``x`` ``[n, heads, head_dim]`` at
        positions ``pos`` int64 ``[n]`` (angles in float32)."""
        ang = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]  # [n, hd/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        xf = x.float()
        a, b = xf[..., : xf.shape[-1] // 2], xf[..., xf.shape[-1] // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)

    def qkv(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[n, n_heads, hd]``, K and V ``[n, n_kv_heads, hd]`` (Q and K rotated)."""
        cfg, L = self.cfg, self.layers[layer]
        hd = cfg.head_dim
        y = _rms(x, L.attn_norm) @ L.wqkv
        q = y[:, : cfg.n_heads * hd].view(-1, cfg.n_heads, hd)
        k = y[:, cfg.n_heads * hd:(cfg.n_heads + cfg.n_kv_heads) * hd].view(-1, cfg.n_kv_heads, hd)
        v = y[:, (cfg.n_heads + cfg.n_kv_heads) * hd:].view(-1, cfg.n_kv_heads, hd)
        return self.rope(q, pos), self.rope(k, pos), v.contiguous()

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after attention (``attn`` ``[n, n_heads, hd]``), then the SwiGLU MLP."""
        L = self.layers[layer]
        x = x + attn.reshape(x.shape[0], -1) @ L.wo
        gu = _rms(x, L.mlp_norm) @ L.w13
        g, u = gu[:, : self.cfg.ffn], gu[:, self.cfg.ffn:]
        return x + (F.silu(g) * u) @ L.w2

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab]`` of final hidden states ``[n, hidden]``."""
        return (_rms(x, self.norm) @ self.head).float()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, k0: int,
               window: int) -> torch.Tensor:
        """Attention of queries at positions ``q0 ..`` over keys at ``k0 .. q0 + n - 1``.

        Args:
            q: ``[n, n_heads, hd]``; k, v: ``[m, n_kv_heads, hd]`` with ``k0 + m == q0 + n``.
            window: 0 for causal attention, else a query at ``t`` sees ``t - window .. t``.

        Returns:
            ``[n, n_heads, hd]``.
        """
        n, m = q.shape[0], k.shape[0]
        if k0 + m != q0 + n:
            raise KvtierError(f"attend: keys {k0}..{k0 + m} do not end with the queries {q0}..{q0 + n}")
        g = self.cfg.group_size
        # 4-D [1, H, len, hd]: CUDA's flash and memory-efficient kernels take only 4-D
        # inputs (3-D ones fall back to the math kernel, which materializes the scores)
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
        if window:
            qp = torch.arange(q0, q0 + n, device=q.device)[:, None]
            kp = torch.arange(k0, k0 + m, device=q.device)[None, :]
            mask = (kp <= qp) & (kp >= qp - window)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        elif n == m:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        elif n == 1:
            out = F.scaled_dot_product_attention(qh, kh, vh)
        else:
            from torch.nn.attention.bias import causal_lower_right

            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, m))
        return out[0].transpose(0, 1)

    # -- a reference without pages -------------------------------------------------------------
    @torch.no_grad()
    def reference_logits(self, tokens: Sequence[int], block: int = 4096) -> torch.Tensor:
        """Logits float32 ``[vocab]`` at the last of ``tokens``, computed from scratch in one
        pass without any cache (no prefix reuse; query blocks of ``block`` tokens)."""
        t = torch.tensor(list(tokens), dtype=torch.int64, device=self.device)
        n = t.numel()
        pos = torch.arange(n, device=self.device)
        x = self.embed[t]
        for layer in range(self.cfg.n_layers):
            q, k, v = self.qkv(layer, x, pos)
            window = self.cfg.window if layer in self.window_layers else 0
            outs = []
            for q0 in range(0, n, block):
                q1 = min(n, q0 + block)
                k0 = max(0, q0 - window) if window else 0
                outs.append(self.attend(q[q0:q1], k[k0:q1], v[k0:q1], q0, k0, window))
            x = self.finish_layer(layer, x, torch.cat(outs))
        return self.logits(x[-1:])[0]


class PagedKV:
    """The engine's K/V tensors: one ``[pages, tokens_per_page, n_kv_heads, head_dim]``
    tensor per (group, component, layer), registered in a :class:`DevicePool`.

    Args:
        model: the model (layout, dtype, device).
        pages: pages per group.
    """

    def __init__(self, model: PagedLlama, pages: Mapping[str, int]) -> None:
        cfg = model.cfg
        self.tensors: dict[tuple[str, str, int], torch.Tensor] = {}
        for g in model.layout.groups:
            for layer in g.layers:
                for c in COMPONENTS:
                    self.tensors[(g.name, c, layer)] = torch.zeros(
                        pages[g.name], g.tokens_per_page, cfg.n_kv_heads, cfg.head_dim, dtype=model.dtype,
                        device=model.device)
        self.pool = DevicePool.register(list(model.layout.groups), self.tensors)

    def rows(self, group: str, comp: str, layer: int) -> torch.Tensor:
        """The tensor of one (group, component, layer) as rows ``[pages * tpp, kv_heads, hd]``."""
        t = self.tensors[(group, comp, layer)]
        return t.view(-1, t.shape[2], t.shape[3])


class WallClock:
    """Measured seconds for the scheduler (``ReferenceScheduler(clock=...)``): wall time
    since creation, plus idle gaps skipped (:meth:`skip_to`: nothing runs, nothing is in
    flight), minus the time spent in :meth:`excluded` blocks (verification work).

    Args:
        sync: called at the edges of an excluded block so queued device work is
            counted on the right side (``torch.cuda.synchronize`` on a GPU).
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._t0 = time.perf_counter()
        self._offset = 0.0
        self._sync = sync
        self.excluded_s = 0.0
        self.skipped_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0 + self._offset

    def skip_to(self, t: float) -> None:
        d = t - self.now()
        if d > 0:
            self._offset += d
            self.skipped_s += d

    @contextmanager
    def excluded(self) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            d = time.perf_counter() - t0
            self._offset -= d
            self.excluded_s += d


def prompt_tokens_for(block_ids: Sequence[int], length: int, vocab: int, block_tokens: int = 512) -> list[int]:
    """Synthetic token ids of a Mooncake prompt: block id ``h`` stands for 512 tokens drawn
    from a generator seeded with ``h`` (equal block ids give equal tokens, so equal
    prefixes stay equal); the prompt is the first ``length`` of them."""
    out: list[int] = []
    for h in block_ids:
        if len(out) >= length:
            break
        g = torch.Generator().manual_seed(int(h) * 7919 + 1)
        out.extend(torch.randint(0, vocab, (block_tokens,), generator=g).tolist())
    if len(out) < length:
        raise ConfigError(f"prompt of {length} tokens needs {math.ceil(length / block_tokens)} block ids, "
                          f"got {len(block_ids)}")
    return out[:length]


@dataclass(eq=False)
class _Req:
    rid: str
    tokens: list[int]  # prompt, then generated
    prompt: int
    adm: Admission | None = None
    wait_ops: tuple[int, ...] = ()
    ckpt: list[int] = field(default_factory=list)  # checkpoint pages to copy into the ring (first pass)
    loaded: bool = False  # the admission started or joined a loadback
    passes: list[tuple[int, int]] = field(default_factory=list)
    first_token_s: float | None = None
    last_token_s: float | None = None
    generated: int = 0
    first_pass_checked: bool = False


@dataclass
class Checks:
    """What the correctness checks found (see :class:`ModelExecutor`)."""

    loaded_requests: int = 0
    rerun_identical: int = 0
    rerun_different: list[str] = field(default_factory=list)
    pages_checksummed: int = 0
    page_mismatches: list[str] = field(default_factory=list)
    no_reuse_compared: int = 0
    no_reuse_max_abs: float = 0.0
    no_reuse_max_rel: float = 0.0
    no_reuse_top1_agree: int = 0
    no_reuse_details: list[dict[str, Any]] = field(default_factory=list)


class ModelExecutor:
    """The reference scheduler's executor with real forward passes (the
    :class:`~kvtier.scheduler.Executor` protocol).

    It owns the model's K/V tensors (registered as the device pool), a host pool, and a
    :class:`TransferEngine`; ``forward`` runs the batch's passes: each prefill chunk on
    its own, the decode steps together (one token each).

    Correctness checks (``check=True``), timed out of the clock (:meth:`WallClock.excluded`):

    - page round trip: at every writeback's submit, a checksum of each source page (all
      layers and components) is kept for its host page; at every loadback's submit, the
      destination pages inherit their source's checksum; after the first pass of a request
      that waited on a loadback, every loaded page must still hold it;
    - re-run: that first pass (the one that read the loaded prefix, with the layer-wise
      waits) is run again once every copy has landed, reading the same pages and
      writing nothing; its logits at the pass's last position must be bit-identical;
    - no reuse: for the first ``no_reuse_samples`` such requests, the same logits
      computed from scratch (:meth:`PagedLlama.reference_logits`); the differences are
      recorded (their tolerance is the caller's).

    Args:
        model: the model.
        layout: the cache layout (``model.layout``).
        device_pages, host_pages: pages per group (``host_pages`` None: device only).
        prompts: request id -> prompt token ids.
        outputs: request id -> tokens to generate (at least 1).
        backend: transfer backend name.
        clock: the clock the scheduler uses (for per-request times).
        chunk_layers: model layers per loadback chunk.
        check: run the correctness checks above.
        no_reuse_samples: loaded requests compared with a computation from scratch.
        backend_options: options of the named backend.
        keep_logits: keep each request's first-token logits (:attr:`first_logits`).
    """

    def __init__(self, model: PagedLlama, device_pages: Mapping[str, int], host_pages: Mapping[str, int] | None,
                 prompts: Mapping[str, Sequence[int]], outputs: Mapping[str, int], *, backend: str = "cpu",
                 clock: WallClock | None = None, chunk_layers: int = 2, check: bool = True,
                 no_reuse_samples: int = 4, backend_options: Mapping[str, Any] | None = None,
                 keep_logits: bool = False) -> None:
        self.model = model
        self.cfg = model.cfg
        specs = list(model.layout.groups)
        self.kv = PagedKV(model, device_pages)
        self.host = HostPool(specs, dict(host_pages) if host_pages else 1,
                             pin=None if model.device.type == "cuda" else False)
        self.engine = TransferEngine(specs, self.host, self.kv.pool, backend, chunk_layers=chunk_layers,
                                     backend_options=backend_options)
        self.clock = clock or WallClock(self._sync)
        self.check = check
        self.no_reuse_samples = no_reuse_samples
        self.checks = Checks()
        self._reqs = {rid: _Req(rid, [int(t) for t in p], len(p)) for rid, p in prompts.items()}
        self._outputs = {rid: max(1, int(n)) for rid, n in outputs.items()}
        self._align = model.layout.alignment
        self._host_sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._expect: dict[str, list[tuple[str, list[int], torch.Tensor]]] = {}
        self._submit_s = 0.0
        #: per forward call: (prefill tokens, decode tokens, seconds)
        self.steps: list[tuple[int, int, float]] = []
        self.forward_s = 0.0
        self._sampled: list[_Req] = []
        #: request id -> float32 logits [vocab] of its first token (with ``keep_logits``)
        self.first_logits: dict[str, torch.Tensor] = {}
        self.keep_logits = keep_logits

    # -- helpers ---------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def request(self, rid: str) -> _Req:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KvtierError(f"model executor: unknown request {rid!r}") from None

    def per_request(self) -> dict[str, dict[str, Any]]:
        """Request id -> first/last token times (clock seconds), tokens generated, hit."""
        out = {}
        for rid, r in self._reqs.items():
            a = r.adm
            out[rid] = {"prompt_tokens": r.prompt, "first_token_s": r.first_token_s, "last_token_s": r.last_token_s,
                        "generated": r.generated, "hit_tokens": a.hit_tokens if a else 0,
                        "device_hit_tokens": a.device_hit_tokens if a else 0, "loaded": r.loaded,
                        "passes": list(r.passes)}
        return out

    # -- the executor protocol ---------------------------------------------------------------------
    def submit(self, commands: Sequence[TransferCommand]) -> None:
        if not commands:
            return
        if self.check:
            with self.clock.excluded():
                for cmd in commands:
                    self._track(cmd)
        t0 = time.perf_counter()
        for cmd in commands:
            self.engine.submit(cmd)
        self.engine.flush()
        self._submit_s += time.perf_counter() - t0

    def collect(self) -> list[Completion]:
        return list(self.engine.poll_completions())

    def transfer_seconds(self) -> float:
        cum = self.engine.stats().get("cumulative", {})
        return sum(float(d.get("seconds") or 0.0) for d in cum.values() if isinstance(d, dict))

    def admitted(self, cache: TieredCache, adm: Admission) -> None:
        r = self.request(adm.request_id)
        r.adm = adm
        r.wait_ops = tuple(adm.wait_ops)
        r.loaded = bool(adm.wait_ops)
        r.first_pass_checked = False
        r.ckpt = list(adm.checkpoint_pages.get(SWA_GROUP, [])) if adm.start_token else []

    def checkpointed(self, cache: TieredCache, request_id: str, pages: dict[str, list[int]], tokens: int) -> None:
        """Copy the request's ring (its state at ``tokens``; the ring still holds the state
        at the last unit boundary) into the adopted checkpoint pages, layer by layer."""
        r = self.request(request_id)
        # the ring of its admission: retract and finish free it before they return
        ring = list(r.adm.page_table.get(SWA_GROUP, [])) if r.adm is not None else []
        dst = pages.get(SWA_GROUP, [])
        if not dst:
            return
        if len(dst) != len(ring):
            raise KvtierError(f"request {request_id!r}: checkpoint of {len(dst)} pages for a ring of {len(ring)}")
        src_i = torch.tensor(ring, device=self.model.device)
        dst_i = torch.tensor(dst, device=self.model.device)
        for layer in self.cfg.window_layers:
            for c in COMPONENTS:
                t = self.kv.tensors[(SWA_GROUP, c, layer)]
                t.index_copy_(0, dst_i, t.index_select(0, src_i))

    @torch.no_grad()
    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None:
        t0 = time.perf_counter()
        decode: list[tuple[_Req, int]] = []
        prefill = 0
        for rid, start, n in batch:
            r = self.request(rid)
            if start + n > len(r.tokens):
                raise KvtierError(f"request {rid!r}: pass {start}..{start + n} beyond its {len(r.tokens)} known tokens")
            if n == 1 and start + 1 == len(r.tokens) and start >= r.prompt and not r.wait_ops and not r.ckpt:
                decode.append((r, start))
                continue
            prefill += n
            table = cache.page_table(rid)
            first_loaded = r.loaded and not r.first_pass_checked
            ckpt = list(r.ckpt)
            h = self._pass(r, table, start, n, write=True)
            r.passes.append((start, n))
            if first_loaded and self.check:
                self._check_first_pass(r, table, start, n, h, ckpt)
            r.first_pass_checked = True
            r.wait_ops = ()  # later passes are stream-ordered after this one's waits
            if start + n == len(r.tokens):
                self._sample(r, h, keep=start + n == r.prompt)
        if decode:
            self._decode(cache, decode)
        self._sync()
        dt = time.perf_counter() - t0
        now = self.clock.now()
        for r in self._sampled:
            if r.first_token_s is None:
                r.first_token_s = now
            r.last_token_s = now
        self._sampled = []
        self.steps.append((prefill, len(decode), dt))
        self.forward_s += dt

    def _sample(self, r: _Req, h: torch.Tensor, keep: bool = False) -> None:
        logits = self.model.logits(h[-1:])[0]
        if keep and self.keep_logits:
            self.first_logits[r.rid] = logits
        r.tokens.append(int(torch.argmax(logits)))
        r.generated += 1
        self._sampled.append(r)

    # -- the passes --------------------------------------------------------------------------------
    def _wait(self, r: _Req, layer: int) -> None:
        for op in r.wait_ops:
            self.engine.wait_layer(op, layer)

    def _pass(self, r: _Req, table: Mapping[str, list[int]], start: int, n: int, *, write: bool,
              ckpt: Sequence[int] = ()) -> torch.Tensor:
        """One pass over positions ``start .. start + n - 1`` of request ``r``: returns the
        final hidden states ``[n, hidden]``. ``write=False`` (the re-run) writes no page
        and reads the sliding-window state from ``ckpt`` (the checkpoint the first pass
        started from) instead of the ring."""
        m, cfg, dev = self.model, self.cfg, self.model.device
        end = start + n
        pos = torch.arange(start, end, device=dev)
        x = m.embed[torch.tensor(r.tokens[start:end], device=dev)]
        hist = table.get(FULL_GROUP, [])
        tpp = cfg.page_tokens
        idx_all = self._slots(hist, 0, end, tpp)
        idx_new = idx_all[start:]
        ring = table.get(SWA_GROUP, [])
        copy_ckpt = write and bool(r.ckpt)
        for layer in range(cfg.n_layers):
            if write:
                self._wait(r, layer)
            q, k, v = m.qkv(layer, x, pos)
            if layer in m.window_layers:
                kr, vr = self.kv.rows(SWA_GROUP, "k", layer), self.kv.rows(SWA_GROUP, "v", layer)
                if copy_ckpt:  # first pass after a checkpoint hit: the working state starts from it
                    src = torch.tensor(r.ckpt, device=dev)
                    dst = torch.tensor(ring, device=dev)
                    for c in COMPONENTS:
                        t = self.kv.tensors[(SWA_GROUP, c, layer)]
                        t.index_copy_(0, dst, t.index_select(0, src))
                state = ring if write or not ckpt else list(ckpt)
                k0 = max(0, start - cfg.window)
                past = self._ring_slots(state, k0, start)
                kk = torch.cat([kr[past], k])
                vv = torch.cat([vr[past], v])
                a = m.attend(q, kk, vv, start, k0, cfg.window)
                if write:
                    lo = max(start, end - cfg.ring)
                    slots = self._ring_slots(ring, lo, end)
                    kr[slots] = k[lo - start:]
                    vr[slots] = v[lo - start:]
            else:
                kr, vr = self.kv.rows(FULL_GROUP, "k", layer), self.kv.rows(FULL_GROUP, "v", layer)
                if write:
                    kr[idx_new] = k
                    vr[idx_new] = v
                    kk, vv = kr[idx_all], vr[idx_all]
                else:
                    kk = torch.cat([kr[idx_all[:start]], k])
                    vv = torch.cat([vr[idx_all[:start]], v])
                a = m.attend(q, kk, vv, start, 0, 0)
            x = m.finish_layer(layer, x, a)
        if copy_ckpt:
            r.ckpt = []
        return x

    def _slots(self, pages: Sequence[int], lo: int, hi: int, tpp: int) -> torch.Tensor:
        """Row indices (page * tpp + row) of positions ``lo .. hi - 1`` in a page table."""
        if hi > len(pages) * tpp:
            raise KvtierError(f"positions up to {hi} need {math.ceil(hi / tpp)} pages, the table has {len(pages)}")
        p = torch.arange(lo, hi, device=self.model.device)
        table = torch.tensor(list(pages), dtype=torch.int64, device=self.model.device)
        return table[p // tpp] * tpp + p % tpp

    def _ring_slots(self, ring: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """Row indices of positions ``lo .. hi - 1`` in a sliding-window ring."""
        cfg = self.cfg
        p = torch.arange(lo, hi, device=self.model.device) % cfg.ring
        table = torch.tensor(list(ring), dtype=torch.int64, device=self.model.device)
        spt = cfg.state_page_tokens
        return table[p // spt] * spt + p % spt

    def _decode(self, cache: TieredCache, items: list[tuple[_Req, int]]) -> None:
        """One decode token for each item (position ``start``), batched: the linear layers
        on ``[B, hidden]``, attention over each request's keys gathered into a padded
        ``[B, L, kv_heads, hd]`` with a mask (query heads grouped per K/V head)."""
        m, cfg, dev = self.model, self.cfg, self.model.device
        B = len(items)
        starts = [s for _, s in items]
        pos = torch.tensor(starts, device=dev)
        x = m.embed[torch.tensor([r.tokens[s] for r, s in items], device=dev)]
        tables = [cache.page_table(r.rid) for r, _ in items]
        tpp = cfg.page_tokens
        L = max(starts) + 1
        idx = torch.zeros(B, L, dtype=torch.int64, device=dev)
        for b, (t, s) in enumerate(zip(tables, starts)):
            idx[b, : s + 1] = self._slots(t[FULL_GROUP], 0, s + 1, tpp)
        valid = torch.arange(L, device=dev)[None, :] <= pos[:, None]  # [B, L]
        new_rows = idx[torch.arange(B, device=dev), pos]
        if m.window_layers:
            W = cfg.window
            ring_idx = torch.zeros(B, W + 1, dtype=torch.int64, device=dev)
            ring_valid = torch.zeros(B, W + 1, dtype=torch.bool, device=dev)
            ring_new = torch.zeros(B, dtype=torch.int64, device=dev)
            for b, (t, s) in enumerate(zip(tables, starts)):
                lo = max(0, s - W)
                ring_idx[b, W + 1 - (s + 1 - lo):] = self._ring_slots(t[SWA_GROUP], lo, s + 1)
                ring_valid[b, W + 1 - (s + 1 - lo):] = True
                ring_new[b] = self._ring_slots(t[SWA_GROUP], s, s + 1)[0]
        g = cfg.group_size
        for layer in range(cfg.n_layers):
            q, k, v = m.qkv(layer, x, pos)  # q [B, H, hd], k/v [B, KVH, hd]
            if layer in m.window_layers:
                kr, vr = self.kv.rows(SWA_GROUP, "k", layer), self.kv.rows(SWA_GROUP, "v", layer)
                rows, mask, new = ring_idx, ring_valid, ring_new
            else:
                kr, vr = self.kv.rows(FULL_GROUP, "k", layer), self.kv.rows(FULL_GROUP, "v", layer)
                rows, mask, new = idx, valid, new_rows
            kr[new] = k
            vr[new] = v
            kk = kr[rows].permute(0, 2, 1, 3)  # [B, KVH, L, hd]
            vv = vr[rows].permute(0, 2, 1, 3)
            qq = q.view(B, cfg.n_kv_heads, g, cfg.head_dim)  # the group's heads as queries
            a = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[:, None, None, :])
            x = m.finish_layer(layer, x, a.reshape(B, cfg.n_heads, cfg.head_dim))
        logits = m.logits(x)
        nxt = torch.argmax(logits, dim=-1).tolist()
        for (r, s), t in zip(items, nxt):
            r.tokens.append(int(t))
            r.generated += 1
            r.passes.append((s, 1))
            self._sampled.append(r)

    # -- checks --------------------------------------------------------------------------------------
    def _page_sums(self, group: str, pages: Sequence[int]) -> torch.Tensor:
        """int64 ``[len(pages)]``: a position-weighted checksum of each page over every
        layer and component of the group (pages taken 256 at a time)."""
        spec = self.model.layout.group(group)
        dev = self.model.device
        out = []
        for lo in range(0, len(pages), 256):
            idx = torch.tensor([int(p) for p in pages[lo:lo + 256]], dtype=torch.int64, device=dev)
            acc = torch.zeros(idx.numel(), dtype=torch.int64, device=dev)
            for layer in spec.layers:
                for c in COMPONENTS:
                    rows = self.kv.tensors[(group, c, layer)].index_select(0, idx).reshape(idx.numel(), -1)
                    w = (rows.view(torch.int16) if rows.element_size() == 2 else rows.view(torch.int32)).to(torch.int64)
                    weights = torch.arange(1, w.shape[1] + 1, dtype=torch.int64, device=dev) * 2 + 1
                    acc = acc * 1000003 + (w * weights).sum(dim=1)
            out.append(acc)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=dev)

    def _host_table(self, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(checksum per host page, written-back flag per host page) of a group."""
        t = self._host_sums.get(group)
        if t is None:
            n = self.host.pages(group)
            t = (torch.zeros(n, dtype=torch.int64, device=self.model.device),
                 torch.zeros(n, dtype=torch.bool, device=self.model.device))
            self._host_sums[group] = t
        return t

    def _track(self, cmd: TransferCommand) -> None:
        """Writeback: keep the source pages' checksums for their host pages. Loadback:
        the destination pages must come to hold their source's checksum."""
        dev = self.model.device
        for t in cmd.transfers:
            if not t.src_pages:
                continue
            sums, written = self._host_table(t.group)
            if cmd.direction is Direction.WRITEBACK:
                dst = torch.tensor([int(p) for p in t.dst_pages], dtype=torch.int64, device=dev)
                sums[dst] = self._page_sums(t.group, t.src_pages)
                written[dst] = True
            else:
                src = torch.tensor([int(p) for p in t.src_pages], dtype=torch.int64, device=dev)
                if not bool(written[src].all()):
                    self.checks.page_mismatches.append(f"op {cmd.op_id}: a host page of {t.group} was loaded "
                                                       f"before any writeback filled it")
                self._expect.setdefault(str(cmd.op_id), []).append(
                    (t.group, [int(p) for p in t.dst_pages], sums[src].clone()))

    def _check_first_pass(self, r: _Req, table: Mapping[str, list[int]], start: int, n: int, h: torch.Tensor,
                          ckpt: Sequence[int]) -> None:
        with self.clock.excluded():
            self.checks.loaded_requests += 1
            for op in r.wait_ops:  # every copy lands before the checks read (fake-async: completes them)
                self.engine.wait_layer(op, self.cfg.n_layers - 1)
            self._sync()
            for op in r.wait_ops:
                for group, pages, want in self._expect.pop(str(op), []):
                    got = self._page_sums(group, pages)
                    self.checks.pages_checksummed += len(pages)
                    bad = (got != want).nonzero().flatten().tolist()
                    for i in bad[:4]:
                        self.checks.page_mismatches.append(f"request {r.rid!r} (op {op}): {group} device page "
                                                           f"{pages[i]} differs from what was written back")
            first = self.model.logits(h[-1:])[0]
            again = self.model.logits(self._pass(r, table, start, n, write=False, ckpt=ckpt)[-1:])[0]
            if torch.equal(first, again):
                self.checks.rerun_identical += 1
            else:
                self.checks.rerun_different.append(r.rid)
            if self.checks.no_reuse_compared < self.no_reuse_samples:
                ref = self.model.reference_logits(r.tokens[: start + n])
                d = (first - ref).abs()
                rel = float(d.norm() / ref.norm().clamp_min(1e-30))
                top = int(torch.argmax(first)) == int(torch.argmax(ref))
                c = self.checks
                c.no_reuse_compared += 1
                c.no_reuse_max_abs = max(c.no_reuse_max_abs, float(d.max()))
                c.no_reuse_max_rel = max(c.no_reuse_max_rel, rel)
                c.no_reuse_top1_agree += int(top)
                c.no_reuse_details.append({"request": r.rid, "hit_tokens": r.adm.hit_tokens if r.adm else 0,
                                           "position": start + n - 1, "max_abs": float(d.max()), "rel_l2": rel,
                                           "top1_agree": top})
