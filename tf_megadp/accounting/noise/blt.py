"""BLT: buffered linear Toeplitz noise (Dvijotham et al. 2024; McMahan et al. 2024).

The strategy C has c_0 = 1 and c_t = sum_i omega_i theta_i^(t-1), scaled to
unit L2 norm over the run's n steps; C^{-1} z is streamed with d
model-sized buffers whatever n is: x_t = z_t - sum_i omega_i s_i, then
s_i <- theta_i s_i + x_t. A BLT is not banded, so no sampling amplifies it:
it is accounted with fixed-order epochs only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import dp_accounting
import numpy as np

from tf_megadp._validate import check_positive_int
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.accounting.events import CYCLIC_POISSON, FIXED_ORDER, POISSON
from tf_megadp.accounting.noise.base import (
    NoiseMechanism,
    NoiseStrategy,
    StreamOps,
    fixed_order_participation,
    register_noise,
)
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["BLT", "BLTStrategy"]


@register_noise
@dataclasses.dataclass(frozen=True)
class BLT(NoiseMechanism):
    """Buffered linear Toeplitz noise (Dvijotham et al. 2024; McMahan et al. 2024).

    With no parameters they are optimized for the run's participation
    (`matrix_factorization.optimal_blt_parameters`): theta in (0, 1),
    omega > 0 with sum(omega) < 1, where the sensitivity is exact.

    Args:
        num_buffers: d >= 1.
        buffer_decays: theta, d values in (0, 1), or None to optimize.
        output_scales: omega, d values, or None to optimize (given with
            `buffer_decays`).

    Raises:
        PrivacyConfigurationError: only one of the parameter tuples, a
            length other than d, or a decay outside (0, 1).

    Example:
    ```python
    mechanism = BLT(num_buffers=4)
    event = mechanism.fixed_order_event(4.0, steps=1000, steps_per_epoch=250)
    ```
    """

    num_buffers: int
    buffer_decays: tuple[float, ...] | None = None
    output_scales: tuple[float, ...] | None = None

    kind = "blt"
    option = "buffers"
    summary = "buffered linear Toeplitz: d buffers whatever the run's length; fixed-order epochs"

    def __post_init__(self):
        buffers = check_positive_int("num_buffers", self.num_buffers)
        object.__setattr__(self, "num_buffers", buffers)
        if (self.buffer_decays is None) != (self.output_scales is None):
            raise PrivacyConfigurationError(
                "Pass both buffer_decays and output_scales, or neither (to optimize them for "
                "the run)."
            )
        if self.buffer_decays is not None:
            theta, omega = mf.check_blt_parameters(self.buffer_decays, self.output_scales)
            if theta.size != buffers:
                raise PrivacyConfigurationError(
                    f"BLT(num_buffers={buffers}) needs {buffers} buffer decays and output "
                    f"scales, got {theta.size}."
                )
            object.__setattr__(self, "buffer_decays", tuple(float(v) for v in theta))
            object.__setattr__(self, "output_scales", tuple(float(v) for v in omega))

    @property
    def noise_buffers(self) -> int:
        """Model-sized buffers the noise keeps in memory: d."""
        return self.num_buffers

    def identity(self) -> dict[str, Any]:
        return {"num_buffers": self.num_buffers}

    @classmethod
    def from_option(cls, value: float | None) -> "BLT":
        if value is None or float(value) != int(value):
            raise PrivacyConfigurationError(
                f"--noise blt needs its number of buffers, a positive integer, got {value!r}.")
        return cls(num_buffers=int(value))

    def resolve(self, num_steps: int, *, steps_per_epoch: int | None = None) -> "BLTStrategy":
        """The exact strategy of a fixed-order run of `num_steps` steps, s per epoch.

        The parameters (given, or optimized for the run's participation) and
        the factor 1 / ||c|| (over the n steps) that scales c (c_0 = 1) to
        unit norm.
        """
        theta, omega = self.parameters(num_steps, steps_per_epoch=steps_per_epoch)
        norm = float(np.linalg.norm(mf.blt_coefficients(theta, omega, num_steps)))
        return BLTStrategy(tuple(float(v) for v in theta), tuple(float(v) for v in omega),
                           1.0 / norm)

    def parameters(self, steps: int, *, steps_per_epoch: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(buffer_decays, output_scales) for a fixed-order run of `steps` steps, s per epoch.

        Args:
            steps: n.
            steps_per_epoch: s; None (or n) for a single pass.
        """
        if self.buffer_decays is not None:
            return np.array(self.buffer_decays), np.array(self.output_scales)
        n, s, k = fixed_order_participation(steps, steps_per_epoch or steps)
        return mf.optimal_blt_parameters(n, self.num_buffers, min_separation=s,
                                         max_participations=k)

    def strategy(self, steps: int, *, steps_per_epoch: int | None = None) -> np.ndarray:
        """The unit-norm first column of C for the run (n entries).

        With c the unnormalized column (c_0 = 1), this is c / ||c||, so the
        noise of the unit-norm C is ||c|| = 1 / strategy[0] times
        `matrix_factorization.blt_inverse_stream`'s output.
        """
        theta, omega = self.parameters(steps, steps_per_epoch=steps_per_epoch)
        return mf.unit_norm(mf.blt_coefficients(theta, omega, steps))

    def check_sampling(self, sampling: str, cycle_length: int = 1) -> None:
        """Fixed-order epochs only: a BLT's columns all overlap, so no sampling amplifies it."""
        if sampling != FIXED_ORDER:
            named = ("Poisson or cyclic Poisson" if sampling in (POISSON, CYCLIC_POISSON)
                     else repr(sampling))
            raise PrivacyConfigurationError(
                f"BLT(num_buffers={self.num_buffers}) has no privacy proof under {named} "
                "sampling: its strategy is not banded, so every participation's noise is "
                "correlated with every other's and amplification by sampling does not apply. "
                "Train it with fixed-order epochs (tf_megadp.FixedOrderSampler, accounted "
                "without amplification), or use BandMF(num_bands=b) with cyclic Poisson "
                "sampling (cycle_length >= b).")

    def accounted_sampling(self) -> dict[str, Any]:
        return {"sampling": FIXED_ORDER}

    def label(self) -> str:
        return f"BLT correlated noise ({self.num_buffers} buffers)"

    def cyclic_poisson_event(self, noise_multiplier: float, **run: object) -> dp_accounting.DpEvent:
        """Refused: a BLT's columns all overlap, so no sampling amplifies it.

        Raises:
            PrivacyConfigurationError: always, naming the two accounted
                alternatives.
        """
        self.check_sampling("cyclic_poisson", int(run.get("cycle_length", 1)))
        raise AssertionError("unreachable: a BLT refuses cyclic Poisson sampling")


@dataclasses.dataclass(frozen=True)
class BLTStrategy(NoiseStrategy):
    """A BLT resolved for a run: theta, omega and 1 / ||c|| over its n steps.

    Args:
        buffer_decays: theta.
        output_scales: omega.
        unit_scale: 1 / ||c||, the factor that makes the strategy (c_0 = 1)
            unit norm over the run's steps.
    """

    buffer_decays: tuple[float, ...]
    output_scales: tuple[float, ...]
    unit_scale: float

    kind = BLT.kind

    @property
    def noise_buffers(self) -> int:
        return len(self.buffer_decays)

    def mechanism(self) -> NoiseMechanism:
        return BLT(num_buffers=len(self.buffer_decays))

    def numbers(self) -> tuple[float, ...]:
        return self.buffer_decays + self.output_scales + (self.unit_scale,)

    def column(self, num_steps: int) -> np.ndarray:
        return self.unit_scale * mf.blt_coefficients(
            self.buffer_decays, self.output_scales, check_positive_int("num_steps", num_steps))

    def stream(self, ops: StreamOps):
        """x_t = z_t - sum_i omega_i s_i, then s_i <- theta_i s_i + x_t; the noise is ||c|| x_t."""
        output = ops.draw - ops.weighted_sum(self.output_scales, ops.buffers)
        for decay, buffer in zip(self.buffer_decays, ops.buffers):
            # One buffer at a time: one or two model-sized temporaries, not d.
            ops.write(buffer, ops.read(buffer) * decay + output)
        return output * (1.0 / self.unit_scale)
