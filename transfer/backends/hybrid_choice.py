"""The hybrid backend's choice between the SM kernel and the copy engines (pure logic).

Per flush, per direction and per tensor ref (one (group, component, layer) region
pair), the hybrid backend (:mod:`.hybrid`) moves the ref's contiguous runs
either with the Numba copy kernel (on at most ``blocks`` SMs) or as batched
copy-engine copies (``cuMemcpyBatchAsync``, :mod:`.copy_engine`). What decides is
the ref's *copy size*, the mean bytes per contiguous run (``pages / spans * page
bytes``), against a crossover taken from a :class:`Calibration`:

- the other direction idle: the copy engines from ``crossover(direction, busy=False)``
  up: the smallest measured copy size at which batched copies alone are at least as
  fast as the kernel alone (and stay so for every larger size);
- both directions busy (the other direction has work in the same flush or still in
  flight): from ``crossover(direction, busy=True)`` up: the smallest copy size at which
  batched copies in both directions at once give each direction at least what it gets
  when the two directions take turns on the SM kernel (kernel traffic to host memory in
  one direction slows the other, ``bench/RESULTS.md``; copy engines in both directions
  reach the both-ways ceiling).

Below the crossover the kernel moves the ref, and a writeback's kernel part waits for
the loadback in flight: the loadback (latency-critical, time to first token) keeps
the link, the writeback yields.

With a page-major host pool the same crossover decides the *staging path*
(:mod:`.staging`) per chunk and group: a group whose host pages of the chunk form
extents of mean size (bytes of the chunk's layers per extent) at or above
``crossover(direction, busy)`` and at least ``staging_min_bytes`` in all is staged (one
copy-engine copy per extent, gathered or scattered on the device); below it, the SM
kernel reads or writes the scattered host pages directly. The kernels of either path
run on at most ``blocks`` (default 8) SMs per direction.

A :class:`Calibration` is measured on the device when the backend binds
(:meth:`HybridBackend.calibrate <kvtier.transfer.backends.hybrid.HybridBackend.calibrate>`),
or taken from the committed table for the GPU (:data:`COMMITTED`), or given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.fsm import ConfigError, Direction

__all__ = ["Calibration", "SM", "CE", "STAGING", "engine_for", "copy_bytes", "COMMITTED", "committed_calibration",
           "DEFAULT_CALIBRATION"]

#: Engine names as reported in the statistics.
SM = "sm"
CE = "copy_engine"
STAGING = "staging"

_DIRS = (Direction.LOADBACK, Direction.WRITEBACK)


def _rates(name: str, value: Mapping[Any, Sequence[float]], n: int) -> dict[Direction, tuple[float, ...]]:
    out: dict[Direction, tuple[float, ...]] = {}
    for d in _DIRS:
        row = value.get(d, value.get(d.value))
        if row is None:
            raise ConfigError(f"calibration: {name} has no row for {d.value}")
        rates = tuple(float(x) for x in row)
        if len(rates) != n or not all(x >= 0 and math.isfinite(x) for x in rates):
            raise ConfigError(f"calibration: {name}[{d.value}] must be {n} finite GB/s values >= 0, got {row!r}")
        out[d] = rates
    return out


@dataclass(frozen=True)
class Calibration:
    """Measured GB/s of both engines per copy size: what the crossover comes from.

    Attributes:
        sizes: copy sizes measured, bytes, ascending (scattered copies of that size).
        sm_gbps: per direction, the SM kernel alone, GB/s per size.
        ce_gbps: per direction, batched copy-engine copies alone, GB/s per size.
        ce_pair_gbps: per direction, batched copies while the other direction runs
            batched copies of the same size at the same time, GB/s per size.
        source: where the numbers come from (``"measured ..."``, ``"committed ..."``,
            ``"default ..."``).
        extra: anything else worth reporting (device, settings).

    Raises:
        ConfigError: sizes not positive and ascending, or a rate row of the wrong length.
    """

    sizes: tuple[int, ...]
    sm_gbps: Mapping[Direction, tuple[float, ...]]
    ce_gbps: Mapping[Direction, tuple[float, ...]]
    ce_pair_gbps: Mapping[Direction, tuple[float, ...]]
    source: str = "given"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.sizes)
        if not sizes or any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ConfigError(f"calibration: sizes must be positive and ascending, got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        for name in ("sm_gbps", "ce_gbps", "ce_pair_gbps"):
            object.__setattr__(self, name, _rates(name, getattr(self, name), len(sizes)))

    def crossover(self, direction: Direction, busy: bool) -> int | None:
        """Smallest copy size (bytes) from which the copy engines move ``direction``'s
        refs, or None (never): see the module docstring."""
        d = Direction(direction)
        other = Direction.WRITEBACK if d is Direction.LOADBACK else Direction.LOADBACK
        wins: list[bool] = []
        for i in range(len(self.sizes)):
            sm = self.sm_gbps[d][i]
            if busy:
                so = self.sm_gbps[other][i]
                # the two directions take turns on the kernel: each gets 1 / (1/sm + 1/so) of the time
                sm = 0.0 if sm <= 0 or so <= 0 else 1.0 / (1.0 / sm + 1.0 / so)
                ce = self.ce_pair_gbps[d][i]
            else:
                ce = self.ce_gbps[d][i]
            wins.append(ce > 0 and ce >= sm)
        for i in range(len(wins)):
            if all(wins[i:]):
                return self.sizes[i]
        return None

    def crossovers(self) -> dict[str, int | None]:
        """Every crossover, keyed ``"loadback"``, ``"writeback"``, ``"loadback_busy"``, ``"writeback_busy"``."""
        out: dict[str, int | None] = {}
        for d in _DIRS:
            out[d.value] = self.crossover(d, False)
            out[d.value + "_busy"] = self.crossover(d, True)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON), with the crossovers."""
        return {"source": self.source, "sizes": list(self.sizes),
                "sm_gbps": {d.value: list(self.sm_gbps[d]) for d in _DIRS},
                "ce_gbps": {d.value: list(self.ce_gbps[d]) for d in _DIRS},
                "ce_pair_gbps": {d.value: list(self.ce_pair_gbps[d]) for d in _DIRS},
                "crossovers": self.crossovers(), "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str | None = None) -> Calibration:
        """Inverse of :meth:`as_dict` (the crossovers are recomputed, not read).

        Raises:
            ConfigError: a missing or malformed field."""
        try:
            return cls(tuple(d["sizes"]), d["sm_gbps"], d["ce_gbps"], d["ce_pair_gbps"],
                       source if source is not None else str(d.get("source", "given")), dict(d.get("extra", {})))
        except (KeyError, TypeError) as e:
            raise ConfigError(f"calibration: malformed calibration data ({e!r})") from None


def engine_for(copy_size: float, direction: Direction, busy: bool, calibration: Calibration | None) -> str:
    """:data:`CE` or :data:`SM` for refs of ``copy_size`` bytes per contiguous run
    (no calibration, or no crossover: :data:`SM`)."""
    if calibration is None:
        return SM
    x = calibration.crossover(direction, busy)
    return CE if x is not None and copy_size >= x else SM


def copy_bytes(pages: int, spans: int, page_bytes: int) -> float:
    """Mean bytes per contiguous run of a ref: ``pages / spans * page_bytes`` (0 without runs)."""
    return pages / spans * page_bytes if spans else 0.0


_KIB = 1024

#: Before any measurement: figures from ``bench/RESULTS.md`` (H200, commit b7cf736: the
#: kernel alone 50-51 GB/s each way at every page size; batched copies alone 5.0 / 13.6
#: GB/s H2D / D2H at 4 KiB and 55 GB/s at 64 KiB; both ways batched at 64 KiB 52 + 50.6
#: GB/s), sizes between them interpolated as a fixed per-copy cost (0.8 us H2D, 0.3 us
#: D2H) overlapping the transfer. A GPU run replaces it with a measurement.
DEFAULT_CALIBRATION = Calibration(
    sizes=(4 * _KIB, 16 * _KIB, 32 * _KIB, 64 * _KIB, 128 * _KIB),
    sm_gbps={Direction.LOADBACK: (50.0, 50.0, 50.0, 50.0, 50.0), Direction.WRITEBACK: (51.0, 51.0, 51.0, 51.0, 51.0)},
    ce_gbps={Direction.LOADBACK: (5.0, 20.0, 40.0, 55.0, 55.0), Direction.WRITEBACK: (13.6, 50.0, 55.0, 55.0, 55.0)},
    ce_pair_gbps={Direction.LOADBACK: (4.9, 19.0, 38.0, 52.0, 52.0),
                  Direction.WRITEBACK: (3.2, 19.0, 38.0, 50.6, 50.6)},
    source="default: bench/RESULTS.md figures (H200, b7cf736), interpolated",
)

#: Calibrations measured on devices, keyed by ``torch.cuda.get_device_name()``
#: (filled from ``bench/results/`` JSON; see ``bench/RESULTS.md``).
COMMITTED: dict[str, dict[str, Any]] = {
    "NVIDIA H200": {
        "source": ("bench/results/staging-serving-h200-20261202-0e41ace.json (measured at start-up, H200, "
                   "commit 0e41ace)"),
        "sizes": [4096, 8192, 16384, 32768, 65536, 131072, 1048576, 4194304],
        "sm_gbps": {"loadback": [40.13, 41.5, 40.66, 43.38, 40.51, 42.4, 45.62, 45.62],
                     "writeback": [44.55, 43.15, 42.26, 44.37, 43.43, 40.44, 47.54, 47.04]},
        "ce_gbps": {"loadback": [2.22, 3.13, 4.25, 21.78, 30.89, 39.87, 52.79, 53.91],
                     "writeback": [4.57, 8.17, 14.33, 22.95, 31.8, 45.45, 53.17, 53.89]},
        "ce_pair_gbps": {"loadback": [2.02, 2.83, 3.82, 21.19, 30.53, 42.89, 50.02, 51.04],
                         "writeback": [1.4, 2.14, 3.03, 13.32, 21.35, 35.98, 46.8, 48.42]}},
}


def committed_calibration(device_name: str) -> Calibration | None:
    """The committed calibration for a device name, if there is one."""
    d = COMMITTED.get(device_name)
    if d is None:
        return None
    return Calibration.from_dict(d, source=f"committed ({d.get('source', '?')})")
