"""The plumbing under :class:`~kvtier.adapters.sglang.KvtierRadixCache` that needs no SGLang
import: the core's layout, the table from the core's device pages to SGLang's KV pool
indices, and the transfer executors (metadata only, or copying the bytes of an SGLang
``MHATokenToKVPool`` on the CPU).

One unit of the core's radix tree is one SGLang page (``page_size`` tokens); one device page
of the core is one page of SGLang's token-to-KV pool. SGLang's allocator owns the index
space: the core's device page ids are its own numbering, and :class:`DevicePageTable` says
which KV pool indices each tree-owned device page holds. The host tier is kvtier's
own pool (host page ``h`` = rows ``h * page_size .. h * page_size + page_size - 1`` of the
executor's host buffers); SGLang's ``HostKVCache`` is not used.
"""

from __future__ import annotations

from collections.abc import Sequence
import numbers
from typing import Any, Protocol

import numpy as np

from kvtier.fsm import CacheGroupSpec, ComponentSpec, Completion, ConfigError, Direction, Family, TransferCommand, UsageError
from kvtier.fsm.checks import plain_int
from kvtier.fsm.layout import CacheLayout

__all__ = ["GROUP", "DevicePageTable", "Executor", "InstantCompletions", "KVPoolCopier", "check_token_count", "kv_indices",
           "positive_int", "sglang_layout"]

#: the core's one cache group: one page = one SGLang KV page (``page_size`` tokens)
GROUP = "kv"


def positive_int(name: str, v: Any) -> int:
    """``v`` as an int when it is an integer >= 1 (a Python or NumPy integer; not a bool,
    a float or a numeric string).

    Raises:
        ConfigError: naming ``name`` and the value.
    """
    got = plain_int(v)
    if got is None or got < 1:
        raise ConfigError(f"{name} must be a positive int, got {v!r}")
    return got


def sglang_layout(page_size: int, num_layers: int = 1, page_bytes: int = 1) -> CacheLayout:
    """The core's layout: one history group whose page (and unit) is one SGLang page.

    Args:
        page_size: SGLang's ``page_size`` (tokens per page), >= 1.
        num_layers: model layers (loadback layer progress counts them), >= 1.
        page_bytes: bytes of one page of one layer (nominal: the core moves no bytes).

    Raises:
        ConfigError: a value that is not a positive int.
    """
    for name, v in (("page_size", page_size), ("num_layers", num_layers), ("page_bytes", page_bytes)):
        positive_int(name, v)
    g = CacheGroupSpec(GROUP, Family.HISTORY, page_size, 1, tuple(range(num_layers)), (ComponentSpec("kv", page_bytes),))
    return CacheLayout("sglang-kv-pages", (g,), num_layers, source="SGLang token-to-KV pool (kvtier.adapters.sglang)")


class DevicePageTable:
    """The core's device page -> the SGLang KV pool token indices it holds (``page_size``
    of them, int64), ``-1`` when the core's page holds none (free, or a caller's page not
    yet published). With SGLang's paged allocators a page's indices are one SGLang page;
    the table does not rely on it.

    Args:
        capacity: the core's device pages.
        page_size: tokens per page.
    """

    def __init__(self, capacity: int, page_size: int) -> None:
        self.page_size = page_size
        self.table = np.full((capacity, page_size), -1, dtype=np.int64)

    def bind(self, pages: Sequence[int], token_indices: np.ndarray) -> None:
        """Record that the core's ``pages`` hold ``token_indices`` (``page_size`` per page, in order)."""
        self.table[np.asarray(pages, dtype=np.int64)] = token_indices.reshape(-1, self.page_size)

    def unbind(self, pages: Sequence[int]) -> np.ndarray:
        """Forget ``pages`` (the core freed them); returns the token indices they held
        (pages that held none are left out)."""
        idx = np.asarray(pages, dtype=np.int64)
        got = self.table[idx].reshape(-1)
        self.table[idx] = -1
        return got[got >= 0]

    def token_indices(self, pages: Sequence[int]) -> np.ndarray:
        """Token indices of the core's ``pages``, page by page; ``-1`` where one holds none."""
        return self.table[np.asarray(pages, dtype=np.int64)].reshape(-1)


class Executor(Protocol):
    """What the adapter hands transfer commands to: ``submit`` takes the commands with the
    SGLang token indices of their device side (a writeback reads them, a loadback writes
    them), ``collect`` returns the completions that arrived since."""

    def submit(self, command: TransferCommand, device_indices: np.ndarray) -> None: ...

    def collect(self) -> list[Completion]: ...


class InstantCompletions:
    """Metadata only: every command completes successfully at the next ``collect``
    (acknowledgement on every rank, no layer events)."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self._done: list[int] = []

    def submit(self, command: TransferCommand, device_indices: np.ndarray) -> None:
        self._done.append(command.op_id)

    def collect(self) -> list[Completion]:
        out = [Completion(op, rank) for op in self._done for rank in range(self.world_size)]
        self._done.clear()
        return out


class KVPoolCopier(InstantCompletions):
    """Copies the bytes of an SGLang ``MHATokenToKVPool`` (its per-layer ``k_buffer`` and
    ``v_buffer``, shape ``[pool tokens, heads, head_dim]``) to and from host buffers of
    ``host_pages * page_size`` rows, synchronously on ``submit`` (CPU tensors, or any device
    ``torch`` copies to). Completes like :class:`InstantCompletions`.

    Args:
        kv_pool: the pool (``k_buffer`` and ``v_buffer`` lists of tensors).
        host_pages: host capacity in pages (the core's host pool).
        page_size: tokens per page.
    """

    def __init__(self, kv_pool: Any, host_pages: int, page_size: int) -> None:
        import torch

        super().__init__(1)
        self._torch = torch
        self.pool = kv_pool
        self.page_size = page_size
        rows = host_pages * page_size
        self.host_k = [torch.empty((rows, *b.shape[1:]), dtype=b.dtype) for b in kv_pool.k_buffer]
        self.host_v = [torch.empty((rows, *b.shape[1:]), dtype=b.dtype) for b in kv_pool.v_buffer]
        self._offsets = np.arange(page_size, dtype=np.int64)

    def _host_rows(self, pages: Sequence[int]) -> Any:
        p = np.asarray(pages, dtype=np.int64)
        return self._torch.from_numpy((p[:, None] * self.page_size + self._offsets).reshape(-1))

    def submit(self, command: TransferCommand, device_indices: np.ndarray) -> None:
        torch = self._torch
        dev = torch.from_numpy(np.ascontiguousarray(device_indices))
        (t,) = command.transfers
        pairs = zip(self.pool.k_buffer + self.pool.v_buffer, self.host_k + self.host_v)
        if command.direction is Direction.WRITEBACK:
            host = self._host_rows(t.dst_pages)
            for d, h in pairs:
                h[host] = d[dev.to(d.device)].to(h.device)
        else:
            host = self._host_rows(t.src_pages)
            for d, h in pairs:
                d[dev.to(d.device)] = h[host].to(d.device)
        super().submit(command, device_indices)


def kv_indices(value: Any, n_tok: int) -> np.ndarray:
    """The first ``n_tok`` of ``value`` (an insert's KV pool indices: a 1-D integer tensor on any
    device, or a sequence of ints) as an int64 array.

    Raises:
        UsageError: ``value`` is not 1-D integers (a float, bool or 2-D tensor), is shorter than
            ``n_tok``, or holds a negative index. Nothing is changed.
    """
    dtype: Any = getattr(value, "dtype", None)
    if hasattr(value, "detach") and (dtype.is_floating_point or dtype.is_complex):
        raise UsageError(f"insert: value must hold integer KV indices, got a tensor of {dtype}")
    try:
        arr = value.detach().to("cpu").numpy() if hasattr(value, "detach") else np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"insert: value must be 1-D integer KV indices, got {str(value)[:60]!r} ({exc})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise UsageError(f"insert: value must be 1-D integer KV indices, got shape {arr.shape} of {arr.dtype}")
    if len(arr) < n_tok:
        raise UsageError(f"insert: value has {len(arr)} KV indices for a key of {n_tok} tokens")
    out = arr[:n_tok].astype(np.int64)
    if out.size and int(out.min()) < 0:
        raise UsageError(f"insert: KV indices must be >= 0, got {int(out.min())}")
    return out


def check_token_count(num_tokens: Any) -> int:
    """``evict``'s ``num_tokens`` as an int (numpy ints accepted).

    Raises:
        UsageError: not an integer (a bool, a float, NaN, a string).
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
        raise UsageError(f"evict: num_tokens must be an int (device tokens to free), got {num_tokens!r}")
    return int(num_tokens)
