"""DP-lambda-CGD: each step's noise correlated with the previous step's only, at no memory cost.

Kalinin, McKenna, Pagh and Lampert (arXiv 2601.22334): the noise of step t
is proportional to z_t - lambda z_(t-1). The previous draw z_(t-1) is drawn
again from the secret stream (the same key, step and generation), so the
noise keeps no buffer: the memory of DP-SGD.

As a matrix factorization (the conventions of
`tf_megadp.accounting.matrix_factorization`), C^{-1} = (I - lambda S) /
sqrt(1 - lambda^2), S the shift, so C is the lower-triangular Toeplitz
matrix of column c_k = sqrt(1 - lambda^2) lambda^k: unit norm over an
unbounded run (over n steps its norm is sqrt(1 - lambda^(2n)) <= 1, and
the accounting uses the exact sensitivity of the n steps). The noise is
sigma C_clip (z_t - lambda z_(t-1)) / sqrt(1 - lambda^2); the paper's
noise scale is sigma / sqrt(1 - lambda^2).

Accounting: C is not banded (every column reaches every later step), so
no amplification by sampling applies. tf_megadp accounts it with
fixed-order epochs, as every matrix factorization (the whole run is one
Gaussian mechanism on C x, of sensitivity the minsep sensitivity of C's
column, exact here since the column is non-negative and non-increasing).
That is the accounting proven here; the paper's own accounting of sampled
lambda-CGD is not reproduced (docs/privacy.md, "Correlated noise").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tf_megadp._validate import check_positive_int
from tf_megadp.accounting.events import FIXED_ORDER
from tf_megadp.accounting.noise.base import (
    NoiseMechanism,
    NoiseStrategy,
    StreamOps,
    register_noise,
)
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["LambdaCGD", "LambdaCGDStrategy"]


@register_noise
@dataclasses.dataclass(frozen=True)
class LambdaCGD(NoiseMechanism):
    """DP-lambda-CGD noise: sigma C_clip (z_t - lam z_(t-1)) / sqrt(1 - lam^2), no buffer.

    Args:
        lam: lambda in [0, 1); 0 is independent noise. The lag-1
            correlation of the noise is -lam / (1 + lam^2).

    Raises:
        PrivacyConfigurationError: lam outside [0, 1) or not a number.

    Example:
    ```python
    mechanism = LambdaCGD(0.5)
    mechanism.resolve(1000).noise_buffers              # 0: DP-SGD's memory
    event = mechanism.fixed_order_event(4.0, steps=1000, steps_per_epoch=1000)
    ```
    """

    lam: float

    kind = "lambda_cgd"
    option = "lambda"
    summary = ("DP-lambda-CGD: noise z_t - lambda z_(t-1), the previous draw regenerated, "
               "no buffer; fixed-order epochs")

    def __post_init__(self):
        if isinstance(self.lam, bool) or not isinstance(self.lam, (int, float, np.number)):
            raise PrivacyConfigurationError(f"LambdaCGD(lam) needs a number, got {self.lam!r}.")
        lam = float(self.lam)
        if not (math.isfinite(lam) and 0.0 <= lam < 1.0):
            raise PrivacyConfigurationError(
                f"LambdaCGD(lam={self.lam!r}): lam must lie in [0, 1). At 1 the strategy "
                "C = (I - S)^-1 has no bounded sensitivity; 0 is independent noise.")
        object.__setattr__(self, "lam", lam)

    def identity(self) -> dict[str, Any]:
        return {"lam": self.lam}

    @classmethod
    def from_option(cls, value: float | None) -> "LambdaCGD":
        if value is None:
            raise PrivacyConfigurationError(
                "--noise lambda_cgd needs its lambda, a number in [0, 1).")
        return cls(lam=float(value))

    @property
    def noise_buffers(self) -> int:
        """None: the previous draw is drawn again from the secret stream."""
        return 0

    @property
    def needs_run_length(self) -> bool:
        return False

    def resolve(self, num_steps: int, *, steps_per_epoch: int | None = None
                ) -> "LambdaCGDStrategy":
        """The same strategy for every run: C's column sqrt(1 - lam^2) lam^k."""
        return LambdaCGDStrategy(self.lam)

    def check_sampling(self, sampling: str, cycle_length: int = 1) -> None:
        """Fixed-order epochs only: C is not banded, so no sampling amplifies it."""
        if sampling != FIXED_ORDER:
            raise PrivacyConfigurationError(
                f"LambdaCGD(lam={self.lam:g}) is accounted by tf_megadp only with fixed-order "
                f"epochs, not with {sampling!r} sampling: its strategy C (column lambda^k) is "
                "not banded, so an example's participations are correlated with every later "
                "step's noise and amplification by sampling does not apply step by step. "
                "Train it with tf_megadp.FixedOrderSampler, or use BandMF(num_bands=b) with "
                "cyclic Poisson sampling (cycle_length >= b).")

    def accounted_sampling(self) -> dict[str, Any]:
        return {"sampling": FIXED_ORDER}

    def label(self) -> str:
        return f"DP-lambda-CGD correlated noise (lambda {self.lam:g}, no buffer)"


@dataclasses.dataclass(frozen=True)
class LambdaCGDStrategy(NoiseStrategy):
    """DP-lambda-CGD's strategy: C^{-1} = (I - lam S) / sqrt(1 - lam^2)."""

    lam: float

    kind = LambdaCGD.kind

    @property
    def noise_buffers(self) -> int:
        """None: the previous draw is drawn again from the secret stream."""
        return 0

    def mechanism(self) -> NoiseMechanism:
        return LambdaCGD(self.lam)

    def numbers(self) -> tuple[float, ...]:
        return (self.lam,)

    def column(self, num_steps: int) -> np.ndarray:
        powers = self.lam ** np.arange(check_positive_int("num_steps", num_steps))
        return math.sqrt(1.0 - self.lam ** 2) * powers

    def stream(self, ops: StreamOps):
        """(z_t - lam z_(t-1)) / sqrt(1 - lam^2), z_(t-1) regenerated (zero at a segment's start)."""
        scale = 1.0 / math.sqrt(1.0 - self.lam ** 2)
        if self.lam == 0.0:
            return ops.draw
        return (ops.draw - ops.previous_draw(1) * self.lam) * scale
