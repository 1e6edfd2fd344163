"""Correlated-noise mechanisms: `BandMF` and `BLT`, the descriptions a run's noise and accounting share.

A mechanism here is a frozen value: what the optimizer's noise stage needs
to correlate its noise (the strategy C of n steps, unit norm), what the
accountant needs (the run's `dp_accounting` event), and how much memory the
noise costs (model-sized buffers). The mathematics is in
`tf_megadp.accounting.matrix_factorization`, whose conventions hold here:
the noise of logical step t is sigma * C_clip * (C^{-1} z)_t with z_t fresh
and C scaled to unit L2 norm, and sigma is the noise multiplier on that C.

* `BandMF(num_bands=b)`: a b-banded Toeplitz C (Choquette-Choo et al. 2023),
  b - 1 buffers. Accounted with cyclic Poisson sampling (cycle_length
  L >= b, amplified) or with fixed-order epochs (no amplification).
  `BandMF.for_run` picks b for a privacy target: fewer bands amplify more,
  more bands cancel more noise.
* `BLT(num_buffers=d)`: a buffered linear Toeplitz C (Dvijotham et al. 2024;
  McMahan et al. 2024), d buffers whatever n is, optimized for the run's
  participation. Accounted with fixed-order epochs only.

Independent noise (DP-SGD) is no mechanism object: it is the absence of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Sequence

import dp_accounting
import numpy as np

from tf_megadp._validate import check_num_examples, check_positive_int
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.accounting.mechanisms import INDEPENDENT_NOISE
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["BLT", "BandMF", "INDEPENDENT", "NoiseStrategy", "mechanism_from_dict", "resolve_noise"]


def _fixed_order_participation(steps: int, steps_per_epoch: int) -> tuple[int, int, int]:
    """(n, s, k) of a fixed-order pass: T steps, s per epoch, k = ceil(T / s) epochs."""
    steps = check_positive_int("steps", steps)
    steps_per_epoch = check_positive_int("steps_per_epoch", steps_per_epoch)
    return steps, steps_per_epoch, -(-steps // steps_per_epoch)


@dataclasses.dataclass(frozen=True)
class BandMF:
    """Banded matrix-factorization noise (amplified BandMF, Choquette-Choo et al. 2023).

    The strategy C is lower-triangular Toeplitz with b bands c_0..c_(b-1),
    scaled to unit L2 norm. With `coefficients=None` they are the ones that
    minimize the mean squared prefix-sum error of the run's n steps
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

    # Its noise kind in ledgers and reports (`mechanisms.NOISE_CODES`).
    kind = "bandmf"

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

    def to_dict(self) -> dict[str, Any]:
        """The public description (`mechanism_from_dict` rebuilds it); no secret is in it."""
        return {"kind": self.kind, "num_bands": self.num_bands,
                "coefficients": None if self.coefficients is None else list(self.coefficients)}

    def resolve(self, num_steps: int, *, steps_per_epoch: int | None = None) -> "NoiseStrategy":
        """The exact strategy of a run of `num_steps` steps (the optimized one, or the given).

        Args:
            num_steps: n, the run's logical steps.
            steps_per_epoch: unused (BandMF's optimum does not depend on it).
        """
        return NoiseStrategy(self.kind, tuple(float(c) for c in self.strategy(num_steps)))

    def strategy(self, num_steps: int) -> np.ndarray:
        """The unit-norm coefficients c_0..c_(b-1) of C for a run of `num_steps` steps.

        Raises:
            PrivacyConfigurationError: b > n.
        """
        if self.coefficients is None:
            return mf.optimal_band_coefficients(num_steps, self.num_bands)
        if self.num_bands > check_positive_int("num_steps", num_steps):
            raise PrivacyConfigurationError(
                f"BandMF(num_bands={self.num_bands}) exceeds the run's {num_steps} steps. "
                f"Use at most {num_steps} bands."
            )
        return np.array(self.coefficients)

    def sensitivity(self, steps: int, *, steps_per_epoch: int) -> mf.Sensitivity:
        """The sensitivity of C x for a fixed-order epoch pass of `steps` steps, s per epoch.

        Exact (sqrt of the epochs that fit, when s >= b) for the optimized
        coefficients; for given ones that are not non-negative and
        non-increasing and s < b, an upper bound flagged as one.
        """
        n, s, k = _fixed_order_participation(steps, steps_per_epoch)
        return mf.minsep_sensitivity(self.strategy(n), n, min_separation=s, max_participations=k)

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

    def fixed_order_event(
        self, noise_multiplier: float, *, steps: int, steps_per_epoch: int
    ) -> dp_accounting.DpEvent:
        """The run's event for a fixed-order epoch pass: Gaussian(sigma / sens), no amplification."""
        return mf.fixed_order_event(
            noise_multiplier, self.sensitivity(steps, steps_per_epoch=steps_per_epoch))

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
        """The number of bands of least prefix-sum error at (target_epsilon, delta), cyclic Poisson.

        As jax_privacy's `optimize_coefs_for_amplifications`: for each
        candidate b, with cycle_length = b, calibrate sigma_b so that the
        cyclic Poisson event meets the target (fewer bands: more groups'
        worth of amplification, q = B b / N over ceil(T / b) rounds), and
        take the b that minimizes sigma_b * sqrt(E(C_b)), the RMSE of the
        noisy prefix sums in units of C_clip (more bands: more cancellation).
        The search calibrates with RDP, as jax_privacy does (20x cheaper
        than PLD, and it only ranks candidates): the run's sigma and epsilon
        are then calibrated and accounted as every run's are.

        Args:
            num_examples: N.
            batch_size: the expected batch B.
            steps: T.
            target_epsilon: the budget.
            delta: delta.
            max_bands: the largest b considered (the noise keeps b - 1
                model copies in memory).
            candidate_bands: the b to compare; by default the powers of two
                up to min(max_bands, N // B, T).

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
        num_examples = check_num_examples(num_examples)
        batch_size = check_positive_int("batch_size", batch_size)
        steps = check_positive_int("steps", steps)
        limit = min(num_examples // batch_size, steps)
        if candidate_bands is None:
            top = min(check_positive_int("max_bands", max_bands), limit)
            candidate_bands = [2 ** i for i in range(int(math.log2(max(top, 1))) + 1)]
        candidates = sorted({check_positive_int("candidate_bands", b) for b in candidate_bands})
        if not candidates or candidates[-1] > limit:
            raise PrivacyConfigurationError(
                f"candidate_bands {candidates} must be non-empty and at most "
                f"min(N // B, T) = {limit}: with cycle_length = b, q = B b / N must stay <= 1 "
                "and bands past the last step never act."
            )

        # Here, not at the top: calibration's run description takes a mechanism.
        from tf_megadp.accounting.calibration import calibrate_noise_multiplier

        def rmse(bands: int) -> float:
            # The cyclic Poisson event of b bands and cycle b is DP-SGD's
            # Poisson event at q = B b / N over ceil(T / b) steps
            # (tests/test_matrix_factorization.py checks that they are equal),
            # so the library's calibration finds sigma_b.
            sigma = calibrate_noise_multiplier(
                target_epsilon, delta, num_examples=num_examples, batch_size=batch_size * bands,
                steps=-(-steps // bands), accountant="rdp")
            strategy = mf.optimal_band_coefficients(steps, bands)
            return sigma * math.sqrt(mf.prefix_sum_mse(mf.inverse_coefficients(strategy, steps)))

        return cls(num_bands=min(candidates, key=rmse))


@dataclasses.dataclass(frozen=True)
class BLT:
    """Buffered linear Toeplitz noise (Dvijotham et al. 2024; McMahan et al. 2024).

    The strategy C has c_0 = 1 and c_t = sum_i omega_i theta_i^(t-1), scaled
    to unit L2 norm over the run's n steps; C^{-1} z is streamed with d
    model-sized buffers whatever n is. With no parameters they are optimized
    for the run's participation (`matrix_factorization.optimal_blt_parameters`):
    theta in (0, 1), omega > 0 with sum(omega) < 1, where the sensitivity is
    exact. A BLT is not banded, so it has no amplification by sampling:
    it is accounted with fixed-order epochs only.

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

    # Its noise kind in ledgers and reports (`mechanisms.NOISE_CODES`).
    kind = "blt"

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

    def to_dict(self) -> dict[str, Any]:
        """The public description (`mechanism_from_dict` rebuilds it); no secret is in it."""
        return {"kind": self.kind, "num_buffers": self.num_buffers,
                "buffer_decays": None if self.buffer_decays is None else list(self.buffer_decays),
                "output_scales": None if self.output_scales is None else list(self.output_scales)}

    def resolve(self, num_steps: int, *, steps_per_epoch: int | None = None) -> "NoiseStrategy":
        """The exact strategy of a fixed-order run of `num_steps` steps, s per epoch.

        The parameters (given, or optimized for the run's participation) and
        the factor 1 / ||c|| (over the n steps) that scales c (c_0 = 1) to
        unit norm.
        """
        theta, omega = self.parameters(num_steps, steps_per_epoch=steps_per_epoch)
        norm = float(np.linalg.norm(mf.blt_coefficients(theta, omega, num_steps)))
        return NoiseStrategy(self.kind, (), tuple(float(v) for v in theta),
                             tuple(float(v) for v in omega), 1.0 / norm)

    def parameters(self, steps: int, *, steps_per_epoch: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(buffer_decays, output_scales) for a fixed-order run of `steps` steps, s per epoch.

        Args:
            steps: n.
            steps_per_epoch: s; None (or n) for a single pass.
        """
        if self.buffer_decays is not None:
            return np.array(self.buffer_decays), np.array(self.output_scales)
        n, s, k = _fixed_order_participation(steps, steps_per_epoch or steps)
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

    def sensitivity(self, steps: int, *, steps_per_epoch: int) -> mf.Sensitivity:
        """The sensitivity of C x for a fixed-order epoch pass (exact for optimized parameters)."""
        n, s, k = _fixed_order_participation(steps, steps_per_epoch)
        return mf.minsep_sensitivity(self.strategy(n, steps_per_epoch=s), n, min_separation=s,
                                     max_participations=k)

    def cyclic_poisson_event(self, noise_multiplier: float, **run: object) -> dp_accounting.DpEvent:
        """Refused: a BLT's columns all overlap, so no sampling amplifies it.

        Raises:
            PrivacyConfigurationError: always, naming the two accounted
                alternatives.
        """
        raise PrivacyConfigurationError(
            f"BLT(num_buffers={self.num_buffers}) has no privacy proof under Poisson or "
            "cyclic Poisson sampling: its strategy is not banded, so every participation's "
            "noise is correlated with every other's and amplification by sampling does not "
            "apply. Train it with fixed-order epochs (accounted without amplification), or "
            "use BandMF(num_bands=b) with cyclic Poisson sampling (cycle_length >= b)."
        )

    def fixed_order_event(
        self, noise_multiplier: float, *, steps: int, steps_per_epoch: int
    ) -> dp_accounting.DpEvent:
        """The run's event for a fixed-order epoch pass: Gaussian(sigma / sens), no amplification."""
        return mf.fixed_order_event(
            noise_multiplier, self.sensitivity(steps, steps_per_epoch=steps_per_epoch))


_MECHANISMS = {BandMF.kind: BandMF, BLT.kind: BLT}


def mechanism_from_dict(config: dict[str, Any] | None) -> "BandMF | BLT | None":
    """The mechanism of a `to_dict` (None: independent noise).

    Raises:
        ValueError: an unknown kind.
    """
    if config is None:
        return None
    config = dict(config)
    kind = config.pop("kind", None)
    if kind not in _MECHANISMS:
        raise ValueError(f"noise must describe one of {sorted(_MECHANISMS)}, got kind {kind!r}.")
    return _MECHANISMS[kind](**{name: tuple(value) if isinstance(value, list) else value
                                for name, value in config.items()})


@dataclasses.dataclass(frozen=True)
class NoiseStrategy:
    """A mechanism resolved for one run: the exact unit-norm strategy the noise streams.

    What the optimizer's buffers compute (`tf_megadp.optimizer.noise_buffers`)
    and what the ledger recorder needs of the noise: its kind, a hash of its
    numbers, its bands and, for a fixed-order run, its sensitivity. All of it
    is public (the strategy is no secret; the buffers' values are).

    Args:
        kind: "independent", "bandmf" or "blt" (`mechanisms.NOISE_CODES`).
        coefficients: BandMF: the unit-norm c_0..c_(b-1); independent
            noise: (1.0,) (C = I); BLT: ().
        buffer_decays: BLT's theta (empty otherwise).
        output_scales: BLT's omega (empty otherwise).
        unit_scale: BLT: 1 / ||c|| over the run's n steps, the factor that
            makes its strategy (c_0 = 1) unit norm; 1 otherwise.

    Example:
    ```python
    strategy = BandMF(num_bands=4).resolve(1000)
    strategy.noise_buffers, strategy.column(6)   # 3, c_0..c_3 then 0, 0
    ```
    """

    kind: str
    coefficients: tuple[float, ...] = (1.0,)
    buffer_decays: tuple[float, ...] = ()
    output_scales: tuple[float, ...] = ()
    unit_scale: float = 1.0

    @property
    def bands(self) -> int:
        """b of a BandMF, d of a BLT (its buffers), 0 for independent noise (a ledger column)."""
        if self.kind == "blt":
            return len(self.buffer_decays)
        return 0 if self.kind == INDEPENDENT_NOISE else len(self.coefficients)

    @property
    def noise_buffers(self) -> int:
        """Model-sized buffers the noise keeps in memory: b - 1, d, or 0."""
        if self.kind == "blt":
            return len(self.buffer_decays)
        return len(self.coefficients) - 1

    @property
    def strategy_hash(self) -> int:
        """48 bits of SHA-256 of the kind and every number (exact in a float64 ledger cell); 0 for independent noise."""
        if self.kind == INDEPENDENT_NOISE:
            return 0
        numbers = np.array(self.coefficients + self.buffer_decays + self.output_scales
                           + (self.unit_scale,), np.float64)
        digest = hashlib.sha256(self.kind.encode() + numbers.tobytes()).digest()
        return int.from_bytes(digest[:6], "big")

    def column(self, num_steps: int) -> np.ndarray:
        """The first column of the unit-norm C over `num_steps` steps."""
        num_steps = check_positive_int("num_steps", num_steps)
        if self.kind == "blt":
            return self.unit_scale * mf.blt_coefficients(self.buffer_decays, self.output_scales,
                                                         num_steps)
        column = np.zeros(num_steps)
        given = np.array(self.coefficients[:num_steps])
        column[: given.size] = given
        return column

    def sensitivity(self, num_steps: int, *, steps_per_epoch: int) -> mf.Sensitivity:
        """sens of C x for a fixed-order pass of `num_steps` steps, s per epoch (exact or flagged)."""
        n, s, k = _fixed_order_participation(num_steps, steps_per_epoch)
        return mf.minsep_sensitivity(self.column(n), n, min_separation=s, max_participations=k)

    def buffer_bytes(self, parameters: int, bytes_per_value: int = 4) -> int:
        """Memory of the noise buffers of one replica: buffers x parameters x bytes (float32: 4).

        Every replica streams its own share of the noise through its own
        buffers (`tf_megadp.optimizer.noise_buffers`).
        """
        return self.noise_buffers * check_positive_int("parameters", parameters) * int(
            bytes_per_value)

    def describe(self) -> dict[str, Any]:
        """The strategy as the privacy report states it."""
        return {"kind": self.kind, "bands": self.bands, "noise_buffers": self.noise_buffers,
                "strategy_hash": self.strategy_hash, "coefficients": list(self.coefficients),
                "buffer_decays": list(self.buffer_decays),
                "output_scales": list(self.output_scales), "unit_scale": self.unit_scale}


# C = I: DP-SGD's independent noise, as a strategy.
INDEPENDENT = NoiseStrategy(INDEPENDENT_NOISE)


def resolve_noise(mechanism: "BandMF | BLT | None", num_steps: int, *,
                  steps_per_epoch: int | None = None) -> NoiseStrategy:
    """The strategy of `mechanism` for a run of `num_steps` steps (`INDEPENDENT` for None).

    Args:
        mechanism: a `BandMF`, a `BLT` or None.
        num_steps: n, the run's logical steps.
        steps_per_epoch: s of a fixed-order run (a BLT is optimized for it).
    """
    if mechanism is None:
        return INDEPENDENT
    if not isinstance(mechanism, (BandMF, BLT)):
        raise TypeError(f"noise must be None, a BandMF or a BLT, got {mechanism!r}.")
    return mechanism.resolve(num_steps, steps_per_epoch=steps_per_epoch)
