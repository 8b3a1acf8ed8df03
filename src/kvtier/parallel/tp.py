"""Tensor parallelism for the paged Llama (:mod:`kvtier.model`): attention heads and the
MLP sharded across ranks, each rank's K/V in its own kvtier pools.

:class:`ShardedLlama` holds rank ``r``'s slice of the full model's weights (every rank
draws the full weights from the same seed, then keeps its slice): the query heads and the
K/V heads of its group of K/V heads (Megatron-style column split of the QKV projection),
the matching rows of the output projection, a column slice of the MLP's gate and up
projections and the matching rows of its down projection. The two row-parallel products
of a layer are summed over the ranks (``torch.distributed.all_reduce``). Embedding, norms
and the output head are replicated. Its ``cfg`` and ``layout`` are the shard's: a page
holds ``1 / world_size`` of the full model's bytes.

With NCCL every rank needs a GPU of its own (NCCL refuses two ranks on one device); when
ranks share a GPU, gloo carries the sums through host memory (``stage_through_host``).

:func:`run_tp_rank` serves requests on one rank with the model's executor, a
:class:`~kvtier.parallel.cache.RankCache` and the per-step agreement, and returns its
measured times and checks.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvtier.fsm import ConfigError, units_to_pages

from ..model import ModelConfig, ModelExecutor, PagedLlama, WallClock, model_layout
from ..replay.model_replay import summarize
from ..scheduler import ReferenceScheduler, SchedRequest, percentile
from .cache import RankCache
from .rank import AgreedClock, RankExecutor, check_drained
from .replay import fresh
from .sync import StepSync

__all__ = ["ShardedLlama", "shard_config", "TPJob", "run_tp_rank", "sharded_logits"]


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one rank computes: ``n_heads``, ``n_kv_heads`` and ``ffn`` divided by
    ``world_size``.

    Raises:
        ConfigError: one of them is not a multiple of ``world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    for f in ("n_heads", "n_kv_heads", "ffn"):
        if getattr(cfg, f) % world_size:
            raise ConfigError(f"model {cfg.name!r}: {f} {getattr(cfg, f)} is not a multiple of world_size "
                              f"{world_size}")
    return replace(cfg, n_heads=cfg.n_heads // world_size, n_kv_heads=cfg.n_kv_heads // world_size,
                   ffn=cfg.ffn // world_size)


class ShardedLlama(PagedLlama):
    """Rank ``rank``'s shard of :class:`~kvtier.model.PagedLlama` (see the module docstring).

    Args:
        cfg: the full model's shape.
        rank, world_size: this rank and the tensor-parallel size (``torch.distributed``
            initialised with ``world_size`` ranks when ``world_size`` > 1).
        device, dtype: as :class:`~kvtier.model.PagedLlama`.
        group: the tensor-parallel process group (``None``: the default).
        stage_through_host: sum through CPU tensors (gloo with CUDA tensors).

    Attributes:
        full_cfg: the full model's shape; ``cfg`` is the shard's.
        reduce_s: seconds spent in the all-reduces (synchronous).
        reduces: all-reduce calls.

    Raises:
        ConfigError: heads or MLP size not divisible by ``world_size``.
    """

    def __init__(self, cfg: ModelConfig, rank: int, world_size: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, *, group: Any = None, stage_through_host: bool = False) -> None:
        shard = shard_config(cfg, world_size)
        super().__init__(cfg, device, dtype)
        self.full_cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.stage = stage_through_host
        self.reduces = 0
        hd = cfg.head_dim
        q0, q1 = rank * shard.n_heads * hd, (rank + 1) * shard.n_heads * hd
        k0 = cfg.n_heads * hd + rank * shard.n_kv_heads * hd
        v0 = (cfg.n_heads + cfg.n_kv_heads) * hd + rank * shard.n_kv_heads * hd
        kw = shard.n_kv_heads * hd
        f0, f1 = rank * shard.ffn, (rank + 1) * shard.ffn
        layers = []
        for L in self.layers:
            wqkv = torch.cat([L.wqkv[:, q0:q1], L.wqkv[:, k0:k0 + kw], L.wqkv[:, v0:v0 + kw]], dim=1).contiguous()
            w13 = torch.cat([L.w13[:, f0:f1], L.w13[:, cfg.ffn + f0:cfg.ffn + f1]], dim=1).contiguous()
            layers.append(replace(L, wqkv=wqkv, wo=L.wo[q0:q1].contiguous(), w13=w13, w2=L.w2[f0:f1].contiguous()))
        self.layers = layers
        self.cfg = shard
        self.layout = model_layout(shard, torch.empty(0, dtype=self.dtype).element_size())
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        self.reduces += 1
        if self.stage and t.device.type == "cuda":
            h = t.cpu()
            dist.all_reduce(h, group=self.group)
            return h.to(t.device)
        dist.all_reduce(t, group=self.group)
        return t

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after attention (this rank's heads ``[n, n_heads/W, hd]``; the output
        projection's partial products summed over ranks), then the SwiGLU MLP (its
        partial down projections summed likewise)."""
        L = self.layers[layer]
        x = x + self._sum(attn.reshape(x.shape[0], -1) @ L.wo)
        gu = _rms(x, L.mlp_norm) @ L.w13
        g, u = gu[:, : self.cfg.ffn], gu[:, self.cfg.ffn:]
        return x + self._sum((F.silu(g) * u) @ L.w2)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


@dataclass(frozen=True)
class TPJob:
    """One tensor-parallel serving run (every rank gets the same job).

    Attributes:
        cfg: the full model's shape.
        requests, prompts, outputs: as :func:`kvtier.replay.model_replay.build_requests` returns.
        configs: ``(name, device units, host units or None)`` to serve, in order.
        backend: transfer backend (``numba`` on a GPU, ``cpu`` on the CPU).
        token_budget, chunk_layers, policy: as :class:`kvtier.replay.model_replay.E2ESetup`.
        check: the executor's correctness checks; no_reuse_samples: its comparisons.
        measured: wall clock (rank 0's, :class:`AgreedClock`) instead of modeled time.
        stage_through_host: the model's sums through host memory (gloo, shared GPU).
        gpus: GPUs to spread the ranks over (rank r uses ``r % gpus``; 0: the CPU).
    """

    cfg: ModelConfig
    requests: tuple[SchedRequest, ...]
    prompts: dict[str, list[int]]
    outputs: dict[str, int]
    configs: tuple[tuple[str, int, int | None], ...]
    backend: str = "cpu"
    token_budget: int = 8192
    chunk_layers: int = 2
    policy: str = "write_through"
    check: bool = True
    no_reuse_samples: int = 2
    measured: bool = True
    stage_through_host: bool = False
    gpus: int = 0


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def run_tp_rank(sync: StepSync, job: TPJob) -> dict[str, Any]:
    """Serve ``job``'s configurations on this rank with the sharded model.

    Returns:
        ``{"rank", "world_size", "device", "shard_unit_bytes", "full_unit_bytes",
        "configurations": [...]}``; each configuration: TTFT and end-to-end statistics
        (this rank's clock, seconds), counts, the executor's checks, the final decision
        digest, the drain report, and the agreement's cost: exchanges, clock broadcasts,
        their seconds, and per scheduler step.

    Raises:
        RankDivergence, InvariantViolation: as :func:`~kvtier.parallel.replay.run_rank`.
    """
    rank, world = sync.rank, sync.world_size
    device = torch.device(f"cuda:{rank % job.gpus}") if job.gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = ShardedLlama(job.cfg, rank, world, device, stage_through_host=job.stage_through_host)
    full_layout = model_layout(job.cfg, torch.empty(0, dtype=model.dtype).element_size())
    out: dict[str, Any] = {"rank": rank, "world_size": world, "device": str(device),
                           "shard_unit_bytes": model.layout.unit_bytes(), "full_unit_bytes": full_layout.unit_bytes(),
                           "configurations": []}
    # warm-up (kernels, allocator, the collectives): not on any clock
    model.reference_logits(job.prompts[job.requests[0].request_id][:256])
    for name, dev_units, host_units in job.configs:
        out["configurations"].append(_serve(sync, job, model, name, dev_units, host_units))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _serve(sync: StepSync, job: TPJob, model: ShardedLlama, name: str, dev_units: int,
           host_units: int | None) -> dict[str, Any]:
    layout = model.layout
    dev = units_to_pages(layout, dev_units)
    host = units_to_pages(layout, host_units) if host_units else None
    ex = ModelExecutor(model, dev, host, job.prompts, job.outputs, backend=job.backend, chunk_layers=job.chunk_layers,
                       check=job.check, no_reuse_samples=job.no_reuse_samples)
    ex.clock = WallClock(ex._sync)
    cache = RankCache(layout, dev, host, policy=job.policy, world_size=sync.world_size)
    sched: ReferenceScheduler | None = None
    rex = RankExecutor(ex, sync, cache, step=lambda: sched.stats.steps if sched is not None else 0)
    clock = AgreedClock(ex.clock, sync) if job.measured else None
    sched = ReferenceScheduler(cache, rex, token_budget=job.token_budget, clock=clock)
    s0 = (sync.stats.exchanges, sync.stats.exchange_s, sync.stats.broadcasts, sync.stats.broadcast_s,
          len(sync.stats.samples_us))
    r0 = model.reduces
    st = sched.run(fresh(job.requests))
    ex._sync()
    makespan = ex.clock.now()
    drain = check_drained(cache)
    ss = sync.stats
    exchanges, ex_s = ss.exchanges - s0[0], ss.exchange_s - s0[1]
    bcasts, bc_s = ss.broadcasts - s0[2], ss.broadcast_s - s0[3]
    arrivals = {r.request_id: r.arrival_s for r in job.requests}
    per = ex.per_request()
    for rid, p in per.items():
        p["arrival_s"] = arrivals[rid]
        p["ttft_s"] = p["first_token_s"] - arrivals[rid] if p["first_token_s"] is not None else None
        p["e2e_s"] = p["last_token_s"] - arrivals[rid] if p["last_token_s"] is not None else None
    es = ex.engine.stats()
    res: dict[str, Any] = {
        "name": name, "device_units": dev_units, "host_units": host_units or 0,
        "device_tokens": dev_units * layout.alignment, "host_tokens": (host_units or 0) * layout.alignment,
        "requests": len(job.requests), "finished": st.finished, "aborts": st.aborts, "steps": st.steps,
        "prompt_tokens": st.prompt_tokens, "hit_tokens": st.hit_tokens, "host_hit_tokens": st.host_hit_tokens,
        "prefill_tokens": st.prefill_tokens, "decode_tokens": st.decode_tokens, "makespan_s": makespan,
        "forward_s": ex.forward_s, "kvtier_bookkeeping_s": st.kvtier_s, "loadbacks": cache.core.stats.loadbacks,
        "writebacks": cache.core.stats.writebacks, "evictions": cache.core.stats.device_evictions,
        "transfer": {d: es["cumulative"].get(d) for d in ("loadback", "writeback")},
        "checks": {"loaded_requests": ex.checks.loaded_requests, "rerun_identical": ex.checks.rerun_identical,
                   "pages_checksummed": ex.checks.pages_checksummed,
                   "page_mismatches": len(ex.checks.page_mismatches),
                   "no_reuse_compared": ex.checks.no_reuse_compared,
                   "no_reuse_top1_agree": ex.checks.no_reuse_top1_agree,
                   "no_reuse_max_rel": ex.checks.no_reuse_max_rel},
        "digest": cache.digest.value(), "decisions": cache.digest.updates, "drain": drain,
        "agreement": {"exchanges": exchanges, "exchange_s": ex_s, "clock_broadcasts": bcasts,
                      "clock_broadcast_s": bc_s, "per_step_us": (ex_s + bc_s) / max(1, st.steps) * 1e6,
                      "per_exchange_us": _stats(ss.samples_us[s0[4]:]),
                      "share_of_makespan": (ex_s + bc_s) / makespan if makespan > 0 else 0.0},
        "model_all_reduces": model.reduces - r0,
        "per_request": per,
    }
    res.update(summarize(res))
    del ex, cache, sched, rex
    return res


def sharded_logits(sync: StepSync, arg: tuple[ModelConfig, list[int]]) -> list[float]:
    """Logits (float32 ``[vocab]``, as a list) at the last of ``tokens`` computed from
    scratch by this rank's shard of the model (every rank returns the same values); for
    comparing the sharded model with the whole one."""
    cfg, tokens = arg
    model = ShardedLlama(cfg, sync.rank, sync.world_size, "cpu")
    out: list[float] = model.reference_logits(tokens).tolist()
    return out
