"""The reference scheduler's step-time model (modeled time, never measured time).

Cache decisions never depend on it: it only turns each step's work into a modeled
duration, from which time to first token is reported (labelled *modeled*).

Default constants and their sources:

- ``prefill_s_per_token = 1.316e-5`` s: one SGLang user measured a time to first token of
  1,725 ms when recomputing 16 concurrent 8K-token prompts (131,072 tokens) on a GQA model
  (SGLang issue #26305; ``spec/README.md``, Sources: Prefill cost):
  1.725 s / 131,072 tokens.
- ``step_overhead_s = 0.02`` s per forward step (a decode step of a batch): an assumption
  of this project, not a measurement; override it for your model and GPU.
- ``decode_s_per_token = 2e-5`` s per decoded token in the batch: an assumption, likewise.
- ``link_bytes_per_s = 48e9``: the H200's measured scattered-page kernel rate for loadback
  over PCIe Gen5 x16 (45-50 GB/s; ``spec/README.md``, Sources: H200 host link and copy
  costs); a loadback overlaps the step's compute layer by layer, so a step takes the
  longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.fsm import ConfigError

__all__ = ["CostModel"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear step-time model (seconds).

    Attributes:
        prefill_s_per_token: seconds per prefill token computed.
        decode_s_per_token: seconds per decode token in the batch.
        step_overhead_s: fixed seconds per forward step.
        link_bytes_per_s: host link rate used for modeled transfer time (bytes/s).

    Raises:
        ConfigError: a negative constant or a non-positive link rate.
    """

    prefill_s_per_token: float = 1.725 / 131072
    decode_s_per_token: float = 2e-5
    step_overhead_s: float = 0.02
    link_bytes_per_s: float = 48e9

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "step_overhead_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost model: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.link_bytes_per_s <= 0:
            raise ConfigError(f"cost model: link_bytes_per_s must be > 0, got {self.link_bytes_per_s!r}")

    def compute_s(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Modeled compute time of one step."""
        if prefill_tokens == 0 and decode_tokens == 0:
            return 0.0
        return (self.step_overhead_s + prefill_tokens * self.prefill_s_per_token
                + decode_tokens * self.decode_s_per_token)

    def transfer_s(self, nbytes: int) -> float:
        """Modeled time to move ``nbytes`` over the host link."""
        return nbytes / self.link_bytes_per_s

    def step_s(self, prefill_tokens: int, decode_tokens: int, loadback_bytes: int) -> float:
        """Modeled step time: compute, or the loadback it overlaps if that is longer."""
        return max(self.compute_s(prefill_tokens, decode_tokens), self.transfer_s(loadback_bytes))

    def describe(self) -> str:
        """The constants, for reports."""
        return (f"prefill {self.prefill_s_per_token * 1e6:.2f} us/token, decode {self.decode_s_per_token * 1e6:.1f} "
                f"us/token, {self.step_overhead_s * 1e3:.1f} ms/step, link {self.link_bytes_per_s / 1e9:.0f} GB/s")
