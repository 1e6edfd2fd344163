"""Independent noise (DP-SGD): a fresh Gaussian every step, C = I, no buffer.

The noise every run has unless it asks for another mechanism: it goes with
every sampling (each step is accounted on its own, amplified by Poisson
sampling), and its strategy streams the step's draw as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tf_megadp._validate import check_positive_int
from tf_megadp.accounting.noise.base import (
    NoiseMechanism,
    NoiseStrategy,
    StreamOps,
    register_noise,
)

__all__ = ["Independent", "IndependentStrategy"]


@register_noise
@dataclasses.dataclass(frozen=True)
class Independent(NoiseMechanism):
    """DP-SGD's noise: N(0, sigma^2 C_clip^2) drawn afresh for every step.

    Example:
    ```python
    Independent().resolve(1000).noise_buffers   # 0
    ```
    """

    kind = "independent"
    default = True
    summary = "independent Gaussian noise every step (DP-SGD)"
    has_strategy = False

    @property
    def noise_buffers(self) -> int:
        return 0

    @property
    def needs_run_length(self) -> bool:
        return False

    def resolve(self, num_steps: int, *, steps_per_epoch: int | None = None) -> NoiseStrategy:
        """C = I whatever the run."""
        return IndependentStrategy()

    def check_sampling(self, sampling: str, cycle_length: int = 1) -> None:
        """Every sampling: each step is a Gaussian mechanism of its own."""

    def accounted_sampling(self) -> dict[str, Any]:
        return {}

    def label(self) -> str:
        return "independent Gaussian noise (DP-SGD)"


@dataclasses.dataclass(frozen=True)
class IndependentStrategy(NoiseStrategy):
    """C = I: the step's draw is its noise."""

    kind = Independent.kind

    @property
    def noise_buffers(self) -> int:
        return 0

    def mechanism(self) -> NoiseMechanism:
        return Independent()

    def numbers(self) -> tuple[float, ...]:
        return ()

    def column(self, num_steps: int) -> np.ndarray:
        column = np.zeros(check_positive_int("num_steps", num_steps))
        column[0] = 1.0
        return column

    def stream(self, ops: StreamOps):
        return ops.draw
