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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Family, KvtierError
from kvtier.fsm.layout import CacheLayout
from kvtier.transfer import DevicePool

__all__ = ["ModelConfig", "CONFIGS", "config", "model_layout", "PagedLlama", "PagedKV", "FULL_GROUP",
           "SWA_GROUP", "COMPONENTS", "prompt_tokens_for"]

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
