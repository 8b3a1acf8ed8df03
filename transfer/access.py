"""Page access for tests and tools: reading and writing pool pages through the engine,
checked by the backend (the fake-async backend refuses pages a pending copy still uses).
:class:`PageAccess` is a mixin of :class:`~kvtier.transfer.engine.TransferEngine`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtier.fsm import ConfigError

from .backends import Backend
from .pools import DevicePool, HostPool, _Pool, put_layers, take_layers

__all__ = ["PageAccess"]


class PageAccess:
    """``read_pages``, ``read_layers``, ``write_pages`` and ``write_layers`` over the
    engine's ``host`` and ``device`` pools, checked by its ``backend``."""

    host: HostPool
    device: DevicePool
    backend: Backend

    # -- page access for tests and tools ----------------------------------------------------------
    def _pool(self, side: str) -> _Pool:
        if side == "host":
            return self.host
        if side == "device":
            return self.device
        raise ConfigError(f"side must be 'host' or 'device', got {side!r}")

    def read_pages(self, side: str, group: str, component: str, layer: int,
                   pages: Sequence[int]) -> torch.Tensor:
        """A copy of pages of one region: uint8 ``[len(pages), page_bytes]`` on the
        pool's device. The fake-async backend raises :class:`PoisonedReadError` if a
        pending copy still writes any of them."""
        check = getattr(self.backend, "check_read", None)
        if check is not None:
            check(side, group, layer, pages)
        region = self._pool(side).region(group, component, layer)
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=region.device)
        return region.index_select(0, idx)

    def read_layers(self, side: str, group: str, component: str, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """A copy of ``pages`` of ``component`` in every layer of ``group``: uint8
        ``[layers, len(pages), page_bytes]`` (layers in the spec's order), in one
        indexed gather when the pool has a layer view; checked like :meth:`read_pages`."""
        spec = self._pool(side).specs[group]
        check = getattr(self.backend, "check_read", None)
        if check is not None:
            for layer in spec.layers:
                check(side, group, layer, pages)
        view = self._pool(side).layer_view(group, component)
        if view is None:
            ids = pages.tolist() if isinstance(pages, torch.Tensor) else pages
            return torch.stack([self.read_pages(side, group, component, layer, ids) for layer in spec.layers])
        return take_layers(view, self._index(pages, view.device))

    def write_layers(self, side: str, group: str, component: str, pages: Sequence[int] | torch.Tensor,
                     data: torch.Tensor) -> None:
        """Overwrite ``pages`` of ``component`` in every layer of ``group`` with ``data``
        (uint8 ``[layers, len(pages), page_bytes]``), in one ``index_copy_`` when the pool
        has a layer view; checked like :meth:`write_pages`."""
        spec = self._pool(side).specs[group]
        check = getattr(self.backend, "check_write", None)
        if check is not None:
            for layer in spec.layers:
                check(side, group, layer, pages)
        view = self._pool(side).layer_view(group, component)
        if view is None:
            ids = pages.tolist() if isinstance(pages, torch.Tensor) else pages
            for i, layer in enumerate(spec.layers):
                self.write_pages(side, group, component, layer, ids, data[i])
            return
        put_layers(view, self._index(pages, view.device), data.to(view.device, torch.uint8))

    @staticmethod
    def _index(pages: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
        if isinstance(pages, torch.Tensor):
            return pages.to(device, torch.int64)
        return torch.as_tensor(np.asarray(pages, dtype=np.int64), device=device)

    def write_pages(self, side: str, group: str, component: str, layer: int,
                    pages: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite pages of one region with ``data`` (uint8 ``[len(pages), page_bytes]``).
        The fake-async backend raises :class:`HazardError` if a pending copy still reads
        or writes any of them."""
        check = getattr(self.backend, "check_write", None)
        if check is not None:
            check(side, group, layer, pages)
        region = self._pool(side).region(group, component, layer)
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=region.device)
        region.index_copy_(0, idx, data.to(region.device, torch.uint8))

