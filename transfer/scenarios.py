"""Random transfer scenarios and a torch reference, for testing backends.

Used by kvtier's own tests on CPU, under the CUDA simulator and on a GPU, and usable by
engines that want to test their own tensors: :func:`random_specs`,
:func:`random_pools`, :func:`random_commands` (loadbacks and writebacks without
conflicts or cross-stream hazards, with overlapping fragments and contiguous runs),
:func:`reference` (expected pool contents), :func:`check_pools`, :func:`check_protocol`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.fsm import CacheGroupSpec, Completion, ComponentSpec, Direction, Family, GroupTransfer, TransferCommand

from .plan import layers_for
from .pools import DevicePool, HostPool

__all__ = ["PAGE_SIZES", "random_specs", "random_pools", "random_commands", "reference", "check_pools",
           "check_protocol"]

L, W = Direction.LOADBACK, Direction.WRITEBACK
#: Page sizes drawn by :func:`random_specs` (bytes; odd ones included).
PAGE_SIZES = [1, 3, 16, 20, 37, 48, 64, 100, 128]

Expected = tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor]]


# ----------------------------------------------------------------------------------------
def random_specs(rng: np.random.Generator, max_groups: int = 3) -> list[CacheGroupSpec]:
    specs = []
    for g in range(int(rng.integers(1, max_groups + 1))):
        layers = tuple(sorted(int(x) for x in rng.choice(6, size=int(rng.integers(1, 6)), replace=False)))
        comps = tuple(ComponentSpec(f"c{i}", int(rng.choice(PAGE_SIZES))) for i in range(int(rng.integers(1, 3))))
        specs.append(CacheGroupSpec(f"g{g}", Family.HISTORY, 4, 1, layers, comps))
    return specs


def random_pools(rng: np.random.Generator, specs: list[CacheGroupSpec], registered: bool,
                 device: str = "cpu", host_layout: str = "layer") -> tuple[HostPool, DevicePool]:
    host = HostPool(specs, {s.name: int(rng.integers(10, 20)) for s in specs}, layout=host_layout)
    dev_pages = {s.name: int(rng.integers(8, 14)) for s in specs}
    if registered:
        tensors: dict[tuple[str, str, int], torch.Tensor] = {}
        for s in specs:
            for layer in s.layers:
                for c in s.components:
                    n = dev_pages[s.name]
                    if c.page_bytes % 4 == 0:
                        t = torch.empty(n, c.page_bytes // 4, dtype=torch.float32, device=device)
                    elif c.page_bytes % 2 == 0:
                        t = torch.empty(n, c.page_bytes // 2, dtype=torch.bfloat16, device=device)
                    else:
                        t = torch.empty(n, c.page_bytes, dtype=torch.float8_e4m3fn, device=device)
                    tensors[(s.name, c.name, layer)] = t
        dev = DevicePool.register(specs, tensors)
    else:
        dev = DevicePool.allocate(specs, dev_pages, device)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    for pool in (host, dev):
        for k in pool.keys():
            r = pool.region(*k)
            r.copy_(torch.randint(0, 256, tuple(r.shape), generator=g, dtype=torch.uint8))
    return host, dev


def random_commands(rng: np.random.Generator, specs: list[CacheGroupSpec], host: HostPool, dev: DevicePool,
                    first_op: int = 1) -> list[TransferCommand]:
    """Loadbacks and writebacks without conflicts or cross-direction hazards, with
    overlapping fragments (pairs repeated across commands) and contiguous runs."""
    cmds: list[TransferCommand] = []
    op = first_op
    free_dev = {s.name: list(rng.permutation(dev.pages(s.name))) for s in specs}
    free_host = {s.name: list(rng.permutation(host.pages(s.name))) for s in specs}
    lb_dev = {s.name: free_dev[s.name][: len(free_dev[s.name]) // 2] for s in specs}
    wb_dev = {s.name: free_dev[s.name][len(free_dev[s.name]) // 2:] for s in specs}
    lb_host = {s.name: free_host[s.name][: len(free_host[s.name]) // 2] for s in specs}
    wb_host = {s.name: free_host[s.name][len(free_host[s.name]) // 2:] for s in specs}
    for direction, n_cmds in ((L, int(rng.integers(1, 4))), (W, int(rng.integers(0, 3)))):
        src_pool_pages, dst_choices = ((lb_host, lb_dev) if direction is L else (wb_dev, wb_host))
        used: dict[str, dict[int, int]] = {s.name: {} for s in specs}  # dst -> src, per group
        for _ in range(n_cmds):
            transfers = []
            for s in specs:
                if rng.random() < 0.25:
                    continue
                pairs: list[tuple[int, int]] = []
                if used[s.name] and rng.random() < 0.5:  # overlapping fragment: repeat earlier pairs
                    old = list(used[s.name].items())
                    for i in rng.choice(len(old), size=min(len(old), 2), replace=False):
                        pairs.append((old[int(i)][1], old[int(i)][0]))
                avail = [d for d in dst_choices[s.name] if d not in used[s.name]]
                k = int(rng.integers(0, min(4, len(avail)) + 1))
                if k and rng.random() < 0.4:  # a contiguous run where the pool allows it
                    d0 = int(rng.integers(0, max(1, dev.pages(s.name) - k)))
                    run = [d0 + i for i in range(k)]
                    if all(d in avail for d in run):
                        s0 = int(rng.integers(0, host.pages(s.name) - k + 1)) if direction is L else d0
                        srcs = [s0 + i for i in range(k)]
                        if all(x in src_pool_pages[s.name] for x in srcs):
                            pairs += list(zip(srcs, run))
                            k = 0
                for d in avail[:k]:
                    pairs.append((int(rng.choice(src_pool_pages[s.name])), int(d)))
                for sp, dp in pairs:
                    used[s.name][dp] = sp
                if pairs:
                    transfers.append(GroupTransfer(s.name, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)))
            layers: tuple[int, ...] = ()
            if rng.random() < 0.3:
                layers = tuple(sorted(int(x) for x in rng.choice(6, size=3, replace=False)))
                transfers = [t for t in transfers
                             if layers_for(TransferCommand(0, direction, (), layers), next(
                                 s for s in specs if s.name == t.group))]
            cmds.append(TransferCommand(op, direction, tuple(transfers), layers))
            op += 1
    return cmds


def reference(specs: list[CacheGroupSpec], host: HostPool, dev: DevicePool,
              cmds: list[TransferCommand]) -> Expected:
    """Expected pool contents after ``cmds``: plain torch indexing on CPU copies."""
    h = {k: host.region(*k).cpu().clone() for k in host.keys()}
    d = {k: dev.region(*k).cpu().clone() for k in dev.keys()}
    by_name = {s.name: s for s in specs}
    for c in cmds:
        src, dst = (h, d) if c.direction is L else (d, h)
        for t in c.transfers:
            spec = by_name[t.group]
            for layer in layers_for(c, spec):
                for comp in spec.components:
                    k = (t.group, comp.name, layer)
                    dst[k][list(t.dst_pages)] = src[k][list(t.src_pages)]
    return h, d


def check_pools(host: HostPool, dev: DevicePool, want: Expected) -> None:
    for k in host.keys():
        assert torch.equal(host.region(*k).cpu(), want[0][k]), f"host region {k} differs"
    for k in dev.keys():
        assert torch.equal(dev.region(*k).cpu(), want[1][k]), f"device region {k} differs"


def check_protocol(cmds: list[TransferCommand], comps: list[Completion], rank: int = 0) -> None:
    """Per op: layer completions ascending (loadbacks only), then exactly one ack, all ok."""
    for c in cmds:
        mine = [x for x in comps if x.op_id == c.op_id]
        assert all(x.rank == rank and x.ok for x in mine), mine
        acks = [i for i, x in enumerate(mine) if x.layer is None]
        assert acks == [len(mine) - 1], f"op {c.op_id}: {mine}"
        layers = [x.layer for x in mine[:-1]]
        if c.direction is W:
            assert layers == []
        else:
            assert layers == sorted(set(layers))  # type: ignore[type-var]
