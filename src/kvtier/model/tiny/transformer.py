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

The runner that generates with it is :mod:`.runner`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Family
from kvtier.fsm.layout import CacheLayout

__all__ = ["TinyConfig", "TinyModel", "KVView", "FULL_GROUP", "SWA_GROUP", "COMPONENTS", "LayerHook", "tiny_layout"]

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
    return CacheLayout("tiny", (full, swa), cfg.n_layers, source="kvtier.model.tiny (random weights)")


class KVView(Protocol):
    """What :meth:`TinyModel.forward` reads and writes one request's paged K/V through
    (:class:`~kvtier.model.tiny.runner.TinyRunner` gives one per forward pass)."""

    def past(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V float32 ``[m, d_model]`` and positions int64 ``[m]`` a query at ``start`` may see."""
        ...

    def stage(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the pass's new K/V ``[n, d_model]`` of ``layer`` from position ``start``."""
        ...


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

    def forward(self, tokens: torch.Tensor, start: int, kv: KVView) -> torch.Tensor:
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
