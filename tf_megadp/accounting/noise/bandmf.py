"""BandMF: banded matrix-factorization noise (amplified BandMF, Choquette-Choo et al. 2023).

The strategy C is lower-triangular Toeplitz with b bands c_0..c_(b-1),
scaled to unit L2 norm; its inverse is streamed with b - 1 model-sized
buffers: x_t = (z_t - sum_{j=1..b-1} c_j x_{t-j}) / c_0. It is accounted
with cyclic Poisson sampling of cycle_length L >= b (amplified: an
example's steps are L apart, so their columns never overlap) or with
fixed-order epochs (no amplification, the minsep sensitivity). One band is
DP-SGD itself, which every sampling accounts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import dp_accounting
import numpy as np

from tf_megadp._validate import check_num_examples, check_positive_int
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.accounting.engines import quiet_unconverged_orders
from tf_megadp.accounting.events import CYCLIC_POISSON, FIXED_ORDER, POISSON
from tf_megadp.accounting.noise.base import (
    NoiseMechanism,
    NoiseStrategy,
    StreamOps,
    register_noise,
)
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["BandMF", "BandMFStrategy"]


@register_noise
@dataclasses.dataclass(frozen=True)
class BandMF(NoiseMechanism):
    """Banded matrix-factorization noise (amplified BandMF, Choquette-Choo et al. 2023).

    With `coefficients=None` the b coefficients are the ones that minimize
    the mean squared prefix-sum error of the run's n steps
    (`matrix_factorization.optimal_band_coefficients`, cached by (n, b)).
    The noise needs b - 1 model-sized buffers, in memory only.

    Args:
        num_bands: b >= 1; b = 1 is independent noise.
        coefficients: b coefficients with c_0 > 0, or None to optimize them
            for the run. Stored scaled to unit norm.

    Raises:
        PrivacyConfigurationError: coefficients that are not b finite
            numbers with c_0 > 0.

    Example:
    ```python
    mechanism = BandMF(num_bands=16)
    c = mechanism.strategy(1000)                     # 16 unit-norm coefficients
    event = mechanism.cyclic_poisson_event(
        1.0, num_examples=60_000, batch_size=250, steps=1000, cycle_length=16)
    ```
    """

    num_bands: int
    coefficients: tuple[float, ...] | None = None

    kind = "bandmf"
    option = "bands"
    plan_examples = (4, 16, 64)
    summary = ("banded matrix factorization: b - 1 buffers; cyclic Poisson sampling with "
               "cycle_length >= b, or fixed-order epochs")

    def __post_init__(self):
        bands = check_positive_int("num_bands", self.num_bands)
        object.__setattr__(self, "num_bands", bands)
        if self.coefficients is not None:
            c = mf.unit_norm(self.coefficients)
            if c.size != bands:
                raise PrivacyConfigurationError(
                    f"BandMF(num_bands={bands}) needs {bands} coefficients, got {c.size}. Pass "
                    "one coefficient per band, or coefficients=None to optimize them."
                )
            object.__setattr__(self, "coefficients", tuple(float(v) for v in c))

    @property
    def noise_buffers(self) -> int:
        """Model-sized buffers the noise keeps in memory: b - 1."""
        return self.num_bands - 1

    def identity(self) -> dict[str, Any]:
        return {"num_bands": self.num_bands}

    @classmethod
    def from_option(cls, value: float | None) -> "BandMF":
        if value is None or float(value) != int(value):
            raise PrivacyConfigurationError(
                f"--noise bandmf needs its number of bands, a positive integer, got {value!r}.")
        return cls(num_bands=int(value))

    @property
    def needs_run_length(self) -> bool:
        return self.coefficients is None

    def resolve(self, num_steps: int | None, *, steps_per_epoch: int | None = None
                ) -> "BandMFStrategy":
        """The exact strategy of a run of `num_steps` steps (the optimized one, or the given).

        Args:
            num_steps: n, the run's logical steps.
            steps_per_epoch: unused (BandMF's optimum does not depend on it).
        """
        return BandMFStrategy(tuple(float(c) for c in self.strategy(num_steps)))

    def strategy(self, num_steps: int | None) -> np.ndarray:
        """The unit-norm coefficients c_0..c_(b-1) of C for a run of `num_steps` steps.

        Args:
            num_steps: n; None for a run of unknown length (given
                coefficients only).

        Raises:
            PrivacyConfigurationError: b > n.
        """
        if self.coefficients is None:
            return mf.optimal_band_coefficients(num_steps, self.num_bands)
        if num_steps is not None and self.num_bands > check_positive_int("num_steps", num_steps):
            raise PrivacyConfigurationError(
                f"BandMF(num_bands={self.num_bands}) exceeds the run's {num_steps} steps. "
                f"Use at most {num_steps} bands."
            )
        return np.array(self.coefficients)

    def check_sampling(self, sampling: str, cycle_length: int = 1) -> None:
        """Cyclic Poisson with L >= b (Theorem 4 of Choquette-Choo et al. 2023) or fixed order.

        One band is independent noise: every sampling.
        """
        bands = self.num_bands
        if sampling == FIXED_ORDER or bands == 1:
            return
        if sampling in (POISSON, CYCLIC_POISSON) and cycle_length <= 1:
            raise PrivacyConfigurationError(
                f"Poisson sampling without cycles under BandMF(num_bands={bands}) has no "
                "privacy proof: an example can join two steps fewer than b apart, whose noise "
                "the bands correlate, and amplification by sampling no longer applies step by "
                f"step. Sample with cycle_length >= {bands} (e.g. PoissonSampler.from_arrays("
                f"..., cycle_length={bands}), which amplifies most), train with fixed-order "
                "epochs (tf_megadp.FixedOrderSampler), or use noise=None (independent noise).")
        if sampling in (POISSON, CYCLIC_POISSON) and cycle_length < bands:
            raise PrivacyConfigurationError(
                f"cycle_length = {cycle_length} is smaller than num_bands = {bands}: an "
                "example's participations would share bands, which the cyclic Poisson "
                f"accounting does not cover. Raise cycle_length to at least {bands}, or lower "
                f"num_bands to at most {cycle_length}.")
        if sampling not in (POISSON, CYCLIC_POISSON):
            raise PrivacyConfigurationError(
                f"bandmf noise has no privacy proof with {sampling!r} batches: BandMF is "
                "accounted only with cyclic Poisson sampling (cycle_length >= num_bands) or "
                "fixed-order epochs (tf_megadp.FixedOrderSampler). Feed one of those "
                "samplers' datasets, or use noise=None.")

    def accounted_sampling(self) -> dict[str, Any]:
        """Cyclic Poisson with L = b, the cycle that amplifies most (Poisson for b = 1)."""
        return {"cycle_length": self.num_bands} if self.num_bands > 1 else {}

    def label(self) -> str:
        if self.num_bands == 1:
            return "BandMF with 1 band: independent Gaussian noise (DP-SGD)"
        return f"BandMF correlated noise ({self.num_bands} bands)"

    def cyclic_poisson_event(
        self,
        noise_multiplier: float,
        *,
        num_examples: int,
        batch_size: int | Sequence[int],
        steps: int,
        cycle_length: int,
    ) -> dp_accounting.DpEvent:
        """The run's event under cyclic Poisson sampling (`matrix_factorization.cyclic_poisson_event`).

        Raises:
            PrivacyConfigurationError: cycle_length < num_bands (1 is
                Poisson sampling without cycles), a round with two batch
                sizes, or q = B L / N > 1.
        """
        return mf.cyclic_poisson_event(
            noise_multiplier, num_examples=num_examples, batch_size=batch_size, steps=steps,
            cycle_length=cycle_length, num_bands=self.num_bands)

    @classmethod
    def for_run(
        cls,
        *,
        num_examples: int,
        batch_size: int,
        steps: int,
        target_epsilon: float,
        delta: float,
        max_bands: int = 64,
        candidate_bands: Sequence[int] | None = None,
    ) -> "BandMF":
        """The number of bands of least expected error at (target_epsilon, delta), cyclic Poisson.

        As jax_privacy's `optimize_coefs_for_amplifications`: for each
        candidate b, with cycle_length = b, calibrate sigma_b so that the
        cyclic Poisson event meets the target (fewer bands: more groups'
        worth of amplification, q = B b / N over ceil(T / b) rounds), and
        take the b that minimizes sigma_b * sqrt(E(C_b)), the RMSE of the
        noisy prefix sums in units of C_clip (more bands: more
        cancellation). b = 1 is DP-SGD itself (Poisson sampling, C = I,
        E = (T + 1) / 2), always a candidate: the choice is never worse
        than DP-SGD by this error. The search calibrates with RDP, as
        jax_privacy does (20x cheaper than PLD, and it only ranks
        candidates): the run's sigma and epsilon are then calibrated and
        accounted as every run's are.

        Args:
            num_examples: N.
            batch_size: the expected batch B.
            steps: T.
            target_epsilon: the budget.
            delta: delta.
            max_bands: the largest b considered (the noise keeps b - 1
                model copies in memory).
            candidate_bands: the b to compare (1 is added); by default the
                powers of two up to min(max_bands, N // B, T).

        Returns:
            `BandMF(num_bands=b)`; train it with cycle_length=b.

        Raises:
            PrivacyConfigurationError: a candidate above N // B (q would
                exceed 1) or above T.

        Example:
        ```python
        mechanism = BandMF.for_run(num_examples=60_000, batch_size=500, steps=2_000,
                                   target_epsilon=8.0, delta=1e-6)
        ```
        """
        errors = cls.expected_errors(num_examples=num_examples, batch_size=batch_size,
                                     steps=steps, target_epsilon=target_epsilon, delta=delta,
                                     max_bands=max_bands, candidate_bands=candidate_bands)
        return cls(num_bands=min(errors, key=errors.get))

    @classmethod
    def expected_errors(
        cls,
        *,
        num_examples: int,
        batch_size: int,
        steps: int,
        target_epsilon: float,
        delta: float,
        max_bands: int = 64,
        candidate_bands: Sequence[int] | None = None,
        phase_starts: Sequence[int] = (),
    ) -> dict[int, float]:
        """sigma_b * sqrt(E(C_b)) for each candidate b at (target_epsilon, delta) (see `for_run`).

        Args:
            phase_starts: the steps where a growing batch's later phases
                start: a cyclic round of b steps must not straddle two of
                them (`cyclic_poisson_segment_event` refuses it), so only the
                b that divide every one of them are candidates (b = 1 always).

        Returns:
            {b: the RMSE of the run's noisy prefix sums in units of C_clip},
            b = 1 (DP-SGD) always among them.
        """
        num_examples = check_num_examples(num_examples)
        batch_size = check_positive_int("batch_size", batch_size)
        steps = check_positive_int("steps", steps)
        limit = min(num_examples // batch_size, steps)
        if candidate_bands is None:
            top = min(check_positive_int("max_bands", max_bands), limit)
            candidate_bands = [2 ** i for i in range(int(math.log2(max(top, 1))) + 1)]
        candidates = sorted(b for b in {check_positive_int("candidate_bands", b)
                                         for b in candidate_bands} | {1}
                            if all(start % b == 0 for start in phase_starts))
        if candidates[-1] > limit:
            raise PrivacyConfigurationError(
                f"candidate_bands {candidates} must be at most min(N // B, T) = {limit}: with "
                "cycle_length = b, q = B b / N must stay <= 1 and bands past the last step "
                "never act."
            )
        return {bands: _calibrated_rdp_sigma(
                    target_epsilon, delta, sampling_rate=batch_size * bands / num_examples,
                    rounds=-(-steps // bands))
                * math.sqrt(mf.prefix_sum_mse(mf.inverse_coefficients(
                    mf.optimal_band_coefficients(steps, bands), steps)))
                for bands in candidates}


def _calibrated_rdp_sigma(target_epsilon: float, delta: float, *, sampling_rate: float,
                          rounds: int) -> float:
    """sigma whose `rounds` Poisson-sampled Gaussians at q spend target_epsilon (RDP).

    The cyclic Poisson event of b bands and cycle b is DP-SGD's Poisson
    event at q = B b / N over ceil(T / b) rounds
    (tests/test_matrix_factorization.py checks that they are equal), so the
    search needs only dp_accounting's RDP accountant (the library's "rdp"
    engine), not the library's calibration, which would make this module
    import the run description, which imports it.
    """
    def event(sigma):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(sampling_rate,
                                                dp_accounting.GaussianDpEvent(sigma)), rounds)

    with quiet_unconverged_orders():
        return float(dp_accounting.calibrate_dp_mechanism(
            dp_accounting.rdp.RdpAccountant, event, target_epsilon, delta))


@dataclasses.dataclass(frozen=True)
class BandMFStrategy(NoiseStrategy):
    """A BandMF resolved for a run: its unit-norm coefficients c_0..c_(b-1).

    Example:
    ```python
    strategy = BandMF(num_bands=4).resolve(1000)
    strategy.noise_buffers, strategy.column(6)   # 3, c_0..c_3 then 0, 0
    ```
    """

    coefficients: tuple[float, ...]

    kind = BandMF.kind

    @property
    def noise_buffers(self) -> int:
        return len(self.coefficients) - 1

    def mechanism(self) -> NoiseMechanism:
        return BandMF(num_bands=len(self.coefficients))

    def numbers(self) -> tuple[float, ...]:
        return self.coefficients

    def column(self, num_steps: int) -> np.ndarray:
        column = np.zeros(check_positive_int("num_steps", num_steps))
        given = np.array(self.coefficients[:num_steps])
        column[: given.size] = given
        return column

    def stream(self, ops: StreamOps):
        """x_t = (z_t - sum_{j=1..b-1} c_j x_{t-j}) / c_0, the past outputs in a ring of b - 1 buffers.

        Step t writes only its own slot (t mod (b - 1)): no buffer is copied.
        """
        c0 = self.coefficients[0]
        if not ops.buffers:
            return ops.draw * (1.0 / c0)
        weights = ops.ring_weights(self.coefficients[1:])
        output = (ops.draw - ops.weighted_sum(weights, ops.buffers)) * (1.0 / c0)
        ops.ring_write(output)
        return output
