"""``kvtier replay --plot``: hit rate and tier occupancy over (modeled) time. Needs matplotlib."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib  # type: ignore[import-not-found,unused-ignore]

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]  # noqa: E402

from .replay import ConfigResult, run_title  # noqa: E402

__all__ = ["plot_timeline"]


def plot_timeline(results: Sequence[ConfigResult], path: str, summary: Mapping[str, Any] | None = None) -> None:
    """Write a PNG with two panels: cumulative hit rate, and device/host pool occupancy,
    titled with the run's trace, preset, capacities and policy (``summary``: the
    replay's setup summary, :func:`kvtier.replay.run_replay`)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    if summary is not None:
        fig.suptitle(run_title(summary), fontsize=9)
    for r in results:
        if not r.timeline:
            continue
        t = [s[0] for s in r.timeline]
        top.plot(t, [s[1] * 100 for s in r.timeline], label=r.name)
        bottom.plot(t, [s[2] * 100 for s in r.timeline], label=f"{r.name} device")
        if r.host_tokens:
            bottom.plot(t, [s[3] * 100 for s in r.timeline], "--", label=f"{r.name} host")
    top.set_ylabel("prefix-hit rate so far (%)")
    top.legend()
    bottom.set_ylabel("pool pages used (%)")
    bottom.set_xlabel("modeled time (s)")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
