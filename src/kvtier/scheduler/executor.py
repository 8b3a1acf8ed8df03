"""What the reference scheduler drives besides the cache: the :class:`Executor` (transfers
and forward passes), the :class:`Clock` (measured time), and the metadata-only
:class:`InstantExecutor`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.fsm import Completion, Direction, TransferCommand

from ..tiered import Admission, TieredCache

__all__ = ["Executor", "Clock", "InstantExecutor"]


class Executor(Protocol):
    """What runs transfers and forward passes for the scheduler.

    ``submit`` takes the cache's commands; ``collect`` returns every completion that is
    ready (per layer and final, any order); ``forward`` runs one step's forward pass for
    ``(request_id, first_token, n_tokens, page_table)`` items after ``wait`` says which
    loadback layers are ready. The default :class:`InstantExecutor` moves no bytes.
    """

    def submit(self, commands: Sequence[TransferCommand]) -> None: ...

    def collect(self) -> list[Completion]: ...

    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None: ...

    def transfer_seconds(self) -> float: ...

    def admitted(self, cache: TieredCache, adm: Admission) -> None: ...

    def checkpointed(self, cache: TieredCache, request_id: str, pages: dict[str, list[int]],
                     tokens: int) -> None: ...


class Clock(Protocol):
    """Measured time for :class:`ReferenceScheduler` (seconds; e.g.
    :class:`kvtier.model.WallClock`)."""

    def now(self) -> float: ...

    def skip_to(self, t: float) -> None:
        """Nothing runs and nothing is in flight until ``t``: jump there."""
        ...


class InstantExecutor:
    """Metadata only: every transfer completes at the next collect (all layers, every
    rank), forward passes do nothing."""

    def __init__(self, world_size: int = 1, layer_chunk: int = 4) -> None:
        self.world_size = world_size
        self.layer_chunk = layer_chunk
        self._pending: list[TransferCommand] = []

    def submit(self, commands: Sequence[TransferCommand]) -> None:
        self._pending.extend(commands)

    def collect(self) -> list[Completion]:
        out = []
        for cmd in self._pending:
            for rank in range(self.world_size):
                if cmd.direction is Direction.LOADBACK and cmd.layers:
                    last = cmd.layers[-1]
                    for i in range(self.layer_chunk - 1, len(cmd.layers), self.layer_chunk):
                        out.append(Completion(cmd.op_id, rank, True, cmd.layers[i]))
                    if len(cmd.layers) % self.layer_chunk:
                        out.append(Completion(cmd.op_id, rank, True, last))
                out.append(Completion(cmd.op_id, rank, True, None))
        self._pending.clear()
        return out

    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None:
        return None

    def transfer_seconds(self) -> float:
        return 0.0

    def admitted(self, cache: TieredCache, adm: Admission) -> None:
        return None

    def checkpointed(self, cache: TieredCache, request_id: str, pages: dict[str, list[int]],
                     tokens: int) -> None:
        return None
