"""The reference machine: the product and the independent reference model
(:mod:`kvtier.testing.reference`) side by side, where transfers are instant and succeed.

Each example draws a configuration (device and host capacities in units, or no host tier;
the write policy, the eviction policy, the exclusive host tier) and a workload: every step
adds prompts over a small alphabet, so that prompts share, extend and fork prefixes, each
ending inside a unit or at a unit's end. At the end of the example
:func:`~kvtier.testing.reference_driver.compare_requests` drives a
:class:`~kvtier.tiered.TieredCache` and the model on the whole workload, one request at a
time (admit, drain, step_done, finish, drain), and fails as ``model_reference`` on the first
difference: the hit tokens by tier of an admission, the victims of a call (demote, evict,
drop, by unit path and size, in order), or the residency of the tree. The comparison names
the request and the calls so far.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from .base import KitMachine, kit_layout, recorded
from .models import ModelViolation
from .reference_driver import Divergence, ReferenceConfig, Request, compare_requests

__all__ = ["ReferenceMachine"]

_PROMPT = st.tuples(st.lists(st.sampled_from("abc"), min_size=1, max_size=6), st.integers(0, 3))


class ReferenceMachine(KitMachine):
    """The product against the reference model on a drawn configuration and workload."""

    def __init__(self) -> None:
        super().__init__()
        self.config: ReferenceConfig | None = None
        self.requests: list[Request] = []
        self.compared = 0  # requests the last comparison covered

    @initialize(device=st.integers(2, 8), host=st.one_of(st.none(), st.integers(2, 10)),
                policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
                eviction=st.sampled_from(["lru", "lru_turns", "lru2"]), exclusive=st.booleans())
    @recorded
    def setup(self, device: int, host: int | None, policy: str, eviction: str, exclusive: bool) -> None:
        if host is None:  # without a host tier the write policy and the exclusive tier do not apply
            policy, exclusive = "write_through", False
        self.kit_set_args(device=device, host=host, policy=policy, eviction=eviction, exclusive=exclusive)
        self.config = ReferenceConfig(device, host, policy, eviction, exclusive)

    @rule(prompts=st.lists(_PROMPT, min_size=1, max_size=4))
    @recorded
    def arrive(self, prompts: list[Any]) -> None:
        """Requests arrive: each ``(units, tail)`` is a prompt of those units, ending
        ``tail`` tokens into its last unit (0: at the unit's end)."""
        align = kit_layout().alignment
        for units, tail in prompts:
            n = len(self.requests)
            tokens = len(units) * align - (align - tail if tail else 0)
            self.requests.append(Request(f"q{n}", tuple(units), tokens))

    def kit_drain(self) -> None:
        """Compare the product with the model on the example's whole workload."""
        if self.config is None or not self.requests:
            return
        try:
            compare_requests(self.requests, kit_layout(), self.config, residency_every=1)
        except Divergence as exc:
            raise ModelViolation("model_reference", f"request #{exc.index} ({exc.request_id!r})",
                                 str(exc)) from None
        self.compared = len(self.requests)
