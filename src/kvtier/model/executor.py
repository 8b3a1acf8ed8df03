"""The reference scheduler's executor with real forward passes of the paged Llama
(:class:`ModelExecutor`; the model and its K/V pages: :mod:`kvtier.model.llama`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.fsm import Completion, Direction, KvtierError, TransferCommand
from kvtier.transfer import HostPool, TransferEngine

from ..tiered import Admission, TieredCache
from .clock import WallClock
from .llama import COMPONENTS, FULL_GROUP, SWA_GROUP, PagedKV, PagedLlama

__all__ = ["ModelExecutor", "Checks"]


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
