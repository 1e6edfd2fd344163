"""Matrix-factorization mechanisms (DP-FTRL): Toeplitz strategies, their error, sensitivity and events.

Independent noise (DP-SGD) adds a fresh Gaussian to the clipped gradient sum
of every step. A matrix-factorization mechanism correlates it so that later
steps partly cancel earlier noise in the model, which sums the updates. This
module holds the mathematics of the two strategy families tf_megadp offers,
in float64 NumPy/SciPy (no TensorFlow); `tf_megadp.accounting.noise`
holds the noise mechanisms that use it (one module each).

Conventions (issue 39; every function here follows them):

* A run has n logical steps. The workload A is the n x n lower-triangular
  all-ones matrix: the model after step t holds the prefix sum of the
  noisy updates 0..t.
* A strategy C is an n x n lower-triangular Toeplitz matrix given by its
  first column c (c_0 > 0): C[t, u] = c[t - u] for t >= u. The noise of
  step t is sigma * C_clip * (C^{-1} z)_t with z_t ~ N(0, I) fresh per step,
  so the released updates are C^{-1}(C x + sigma C_clip z): the Gaussian
  mechanism on C x, whose sensitivity is that of C's columns.
* A banded strategy has b bands: c_0..c_{b-1}, zero afterwards. The library
  scales it to unit L2 norm (`unit_norm`: c / ||c||, no per-column
  normalization), so one participation moves C x by at most C_clip.
  C^{-1} z is computed in streaming form, x_t = (z_t - sum_{j=1..b-1} c_j
  x_{t-j}) / c_0 (`banded_inverse_stream`), with b - 1 buffers.
* A BLT (buffered linear Toeplitz, Dvijotham et al. 2024; McMahan et al.
  2024) with d buffers has buffer decays theta_i and output scales omega_i:
  c_0 = 1 and c_t = sum_i omega_i theta_i^(t-1) for t >= 1
  (`blt_coefficients`). Its inverse is streamed with d buffers whatever n is
  (`blt_inverse_stream`); with unit norm the noise is ||c|| times that.
* Error: the mean squared prefix-sum error per unit noise, E(C) =
  ||A C^{-1}||_F^2 / n, the mean over t of the variance of the noise in the
  t-th prefix sum (`prefix_sum_mse`). Independent noise (C = I) has
  E = (n + 1) / 2. Mechanisms compare at equal sensitivity: by
  sens(C)^2 * E(C), which does not change when C is scaled.
* Participation: an example joins at most k steps, any two at least s
  steps apart ((k, s)-participation, "min-sep"; a fixed-order epoch pass of
  s steps per epoch is the case of exactly s). `minsep_sensitivity` is
  sqrt(max over such patterns of ||sum of C's participating columns||^2);
  exact for non-negative non-increasing coefficients, otherwise an upper
  bound, flagged as one.

Events (dp_accounting, add/remove-one): `cyclic_poisson_event` (banded C
with cyclic Poisson sampling, amplified: Choquette-Choo et al. 2023,
Theorem 4) and `fixed_order_event` (a fixed-order epoch pass, no
amplification: the whole run is one Gaussian mechanism of noise multiplier
sigma / sens). Combinations without a proof are refused with an error that
names the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import dp_accounting
import numpy as np
from scipy import fft, optimize, signal

from tf_megadp._validate import check_num_examples, check_positive_int
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import sampling_rate_of

__all__ = [
    "Sensitivity",
    "banded_inverse_stream",
    "blt_coefficients",
    "blt_inverse_coefficients",
    "blt_inverse_stream",
    "blt_multiply_stream",
    "check_blt_parameters",
    "cyclic_poisson_event",
    "fixed_order_event",
    "inverse_coefficients",
    "minsep_sensitivity",
    "optimal_band_coefficients",
    "optimal_blt_parameters",
    "prefix_sum_mse",
    "sqrt_coefficients",
    "unit_norm",
]


# ---------------------------------------------------------------------------
# Banded Toeplitz strategies.


def _coefficients(coefficients: Sequence[float]) -> np.ndarray:
    """`coefficients` as a float64 vector with c_0 > 0; a PrivacyConfigurationError otherwise."""
    c = np.array(coefficients, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise PrivacyConfigurationError(
            f"Strategy coefficients must be a non-empty vector c_0..c_(b-1), got shape {c.shape}."
        )
    if not np.all(np.isfinite(c)):
        raise PrivacyConfigurationError(f"Strategy coefficients must be finite, got {c}.")
    if not c[0] > 0:
        raise PrivacyConfigurationError(
            f"The first strategy coefficient c_0 must be > 0 (C must be invertible), got {c[0]}."
        )
    return c


def sqrt_coefficients(num_bands: int) -> np.ndarray:
    """The first `num_bands` coefficients of the square root of the prefix-sum matrix.

    Fichtenberger, Henzinger and Upadhyay (2023): c_0 = 1 and
    c_k = prod_{i=1..k} (2i - 1) / (2i), the coefficients of (1 - z)^(-1/2),
    so that C C = A for the full (n-band) strategy. Truncated to b bands, the
    starting point of the BandMF optimization.

    Args:
        num_bands: b >= 1.

    Returns:
        The b coefficients, float64 (not normalized).

    Example:
    ```python
    sqrt_coefficients(3)  # [1.0, 0.5, 0.375]
    ```
    """
    num_bands = check_positive_int("num_bands", num_bands)
    i = np.arange(1, num_bands, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * i - 1) / (2 * i))])


def unit_norm(coefficients: Sequence[float]) -> np.ndarray:
    """c / ||c||: the strategy scaled so that one participation has sensitivity 1.

    Args:
        coefficients: c_0..c_(b-1), c_0 > 0.

    Returns:
        The scaled coefficients, float64.

    Raises:
        PrivacyConfigurationError: c is empty, not finite, or c_0 <= 0.
    """
    c = _coefficients(coefficients)
    return c / np.linalg.norm(c)


def _impulse(numerator: np.ndarray, denominator: np.ndarray, num_steps: int) -> np.ndarray:
    """The first `num_steps` power-series coefficients of numerator(z) / denominator(z)."""
    impulse = np.zeros(num_steps)
    impulse[0] = 1.0
    return signal.lfilter(numerator, denominator, impulse)


def inverse_coefficients(coefficients: Sequence[float], num_steps: int) -> np.ndarray:
    """The first column of C^{-1} (n entries) for the banded strategy `coefficients`.

    C^{-1} is lower-triangular Toeplitz too; its first column is the power
    series of 1 / c(z), computed by the same recurrence as the noise, in
    O(n b).

    Args:
        coefficients: c_0..c_(b-1), c_0 > 0.
        num_steps: n.

    Returns:
        The n coefficients of C^{-1}, float64.
    """
    c = _coefficients(coefficients)
    num_steps = check_positive_int("num_steps", num_steps)
    return _impulse(np.ones(1), c, num_steps)


def banded_inverse_stream(coefficients: Sequence[float], noise: np.ndarray) -> np.ndarray:
    """C^{-1} z, one step at a time, as the optimizer computes it: the reference.

    x_t = (z_t - sum_{j=1..b-1} c_j x_{t-j}) / c_0. Only the last b - 1
    outputs are kept (the buffers); nothing else of the past is needed.

    Args:
        coefficients: c_0..c_(b-1), c_0 > 0 (unit norm for the mechanism).
        noise: z, shape (n, ...): one standard-normal draw per step.

    Returns:
        x = C^{-1} z, shape of `noise`, float64.

    Example:
    ```python
    z = np.random.default_rng().standard_normal((100, 3))
    x = banded_inverse_stream(unit_norm(sqrt_coefficients(4)), z)
    ```
    """
    c = _coefficients(coefficients)
    z = np.asarray(noise, dtype=np.float64)
    buffers: list[np.ndarray] = []  # x_{t-1}, x_{t-2}, ..., at most b - 1 of them.
    x = np.empty_like(z)
    for t in range(z.shape[0]):
        correlated = sum((c[j + 1] * buffer for j, buffer in enumerate(buffers)),
                         np.zeros_like(z[t]))
        x[t] = (z[t] - correlated) / c[0]
        buffers = ([x[t]] + buffers)[: c.size - 1]
    return x


def prefix_sum_mse(noise_coefficients: Sequence[float]) -> float:
    """E(C) = ||A C^{-1}||_F^2 / n: the mean squared prefix-sum error per unit noise.

    A C^{-1} is lower-triangular Toeplitz with first column p = cumsum(r),
    r = C^{-1}'s first column, so ||A C^{-1}||_F^2 = sum_t (n - t) p_t^2:
    O(n), never an n x n matrix. Multiply by sens(C)^2 (and by (sigma C_clip)^2)
    to compare mechanisms; C = I gives (n + 1) / 2.

    Args:
        noise_coefficients: r, the n entries of C^{-1}'s first column
            (`inverse_coefficients`, `blt_inverse_coefficients`).

    Returns:
        E(C), a float.
    """
    r = np.asarray(noise_coefficients, dtype=np.float64)
    n = r.size
    p = np.cumsum(r)
    return float(np.dot(n - np.arange(n), p * p) / n)


# ---------------------------------------------------------------------------
# Sensitivity under (k, s)-participation.


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """The L2 sensitivity of C x for one example, in units of C_clip.

    Args:
        value: sqrt(max over participation patterns of ||sum of C's
            participating columns||^2), or an upper bound on it.
        exact: True when `value` is that maximum (and the vector-valued
            sensitivity); False when it is an upper bound (coefficients of
            mixed sign or not non-increasing).
    """

    value: float
    exact: bool


def _strided_window_sum(x: np.ndarray, stride: int, count: int) -> np.ndarray:
    """y_t = sum_{j=0..count-1} x_{t - j*stride}, terms with t - j*stride >= 0 only."""
    n = x.size
    rows = -(-n // stride)
    padded = np.zeros(rows * stride)
    padded[:n] = x
    cumulative = np.cumsum(padded.reshape(rows, stride), axis=0).reshape(-1)[:n]
    window = cumulative.copy()
    if count * stride < n:
        window[count * stride:] -= cumulative[: n - count * stride]
    return window


def _participations(num_steps: int, min_separation: int, max_participations: int) -> int:
    """The most participations s apart that fit in n steps, capped at k."""
    return min(max_participations, -(-num_steps // min_separation))


def minsep_sensitivity(
    coefficients: Sequence[float],
    num_steps: int,
    *,
    min_separation: int,
    max_participations: int,
) -> Sensitivity:
    """Sensitivity of the n x n Toeplitz C for examples that join <= k steps, >= s apart.

    For non-negative non-increasing coefficients, C^T C is non-negative and
    its entries fall with the distance of two columns and with their
    position, so the worst pattern is the earliest one at exactly the
    minimum separation, {0, s, 2s, ...} (k' = min(k, ceil(n / s)) of them),
    and sens^2 = ||sum of those columns||^2, computed in O(n). This is also
    the vector-valued sensitivity (all the example's gradients equal). It is
    exact for any signs when the columns cannot overlap (s >= the number of
    bands) or k' = 1. Otherwise the coefficients are replaced by their
    smallest non-increasing majorant e_t = max_{u >= t} |c_u|: every
    |(C^T C)_ij| <= (E^T E)_ij, so the minsep value of e bounds
    max_P sum_{i, j in P} |(C^T C)_ij|, which bounds the sensitivity; it is
    returned flagged as a bound.

    Args:
        coefficients: c (b entries for a banded strategy, or n); entries
            past n are ignored, missing ones are 0.
        num_steps: n.
        min_separation: s >= 1, the fewest steps between two participations
            (a fixed-order epoch pass: its steps per epoch).
        max_participations: k >= 1 (a fixed-order pass: its epochs).

    Returns:
        A `Sensitivity`.

    Example:
    ```python
    # 4 epochs of 250 steps, 16 bands <= 250: 4 disjoint unit columns.
    minsep_sensitivity(unit_norm(sqrt_coefficients(16)), 1000,
                       min_separation=250, max_participations=4)  # value 2.0, exact
    ```
    """
    n = check_positive_int("num_steps", num_steps)
    s = check_positive_int("min_separation", min_separation)
    k = check_positive_int("max_participations", max_participations)
    given = _coefficients(coefficients)[:n]
    c = np.zeros(n)
    c[: given.size] = given
    participations = _participations(n, s, k)
    support = int(np.flatnonzero(c)[-1]) + 1
    monotone = bool(np.all(c >= 0) and np.all(np.diff(c) <= 0))
    exact = participations == 1 or s >= support or monotone
    if not exact:
        c = np.maximum.accumulate(np.abs(c)[::-1])[::-1]
    worst = _strided_window_sum(c, s, participations)
    return Sensitivity(float(np.sqrt(worst @ worst)), exact)


# ---------------------------------------------------------------------------
# The objective: log(sens^2 * E) of the unnormalized C, which does not change
# with the scale of C, and its gradient in C's first column c.
#
# With r = C^{-1}'s first column, dr = -r * dc * r (Toeplitz products are
# convolutions), so dE/dc_u = -sum_t g_{t+u} (r * r)_t with g = dE/dr:
# O(n log n) with FFTs, never an n x n matrix.


def _log_error_gradient(noise: np.ndarray, lags: int) -> tuple[float, np.ndarray]:
    """log E(C) (times n) and its gradient in c_0..c_(lags-1), from r = C^{-1}'s first column."""
    n = noise.size
    prefix = np.cumsum(noise)
    weights = (n - np.arange(n)).astype(np.float64)
    error = float(np.dot(weights, prefix * prefix))
    # dE/dr_u = sum_{t >= u} 2 (n - t) p_t.
    grad_noise = np.cumsum((2.0 * weights * prefix)[::-1])[::-1]
    # sum_t g_{t+u} (r * r)_t for every u at once: a circular correlation
    # of length >= 3n - 2, where r * r (2n - 1 terms) does not wrap onto g.
    size = fft.next_fast_len(3 * n, real=True)
    spectrum = fft.rfft(noise, size)
    lagged = fft.irfft(fft.rfft(grad_noise, size) * np.conj(spectrum * spectrum), size)[:lags]
    return math.log(error), -lagged / error


def _log_sensitivity_gradient(strategy: np.ndarray, min_separation: int,
                              participations: int) -> tuple[float, np.ndarray]:
    """log sens^2 by the minsep formula (exact on the sets the optimizers search), and its gradient in c."""
    worst = _strided_window_sum(strategy, min_separation, participations)
    sens_sq = float(worst @ worst)
    # d sens^2 / dc_u = 2 sum_{j < k'} worst[u + j s].
    gradient = 2.0 * _strided_window_sum(worst[::-1], min_separation, participations)[::-1]
    return math.log(sens_sq), gradient / sens_sq


def _minimize(objective, start: np.ndarray, max_iterations: int) -> np.ndarray:
    """L-BFGS on `objective(x) -> (value, gradient)` from `start`; never worse than `start`."""
    result = optimize.minimize(
        objective, start, jac=True, method="L-BFGS-B",
        # The objective is a log: a relative change of 1e-10 is far below
        # anything the RMSE shows.
        options={"maxiter": max_iterations, "ftol": 1e-10, "gtol": 1e-7},
    )
    # A line search that ends in a worse point (or a non-finite one) must
    # not hand the run a worse strategy than the one it started from.
    return result.x if result.fun <= objective(start)[0] else start


def _check_bands(num_steps: int, num_bands: int) -> tuple[int, int]:
    num_steps = check_positive_int("num_steps", num_steps)
    num_bands = check_positive_int("num_bands", num_bands)
    if num_bands > num_steps:
        raise PrivacyConfigurationError(
            f"num_bands = {num_bands} exceeds the run's {num_steps} steps: bands past the "
            f"last step never act. Use num_bands <= {num_steps}."
        )
    return num_steps, num_bands


@functools.lru_cache(maxsize=64)
def _optimal_band(num_steps: int, num_bands: int) -> np.ndarray:
    # c_0 = 1 is fixed (the objective does not change with the scale of c)
    # and the others are optimized as c_j = x_j / 100: L-BFGS's first step
    # has length 1 in x, which in c would jump to a C whose inverse explodes.
    scale = 0.01

    def objective(x):
        c = np.concatenate([[1.0], scale * x])
        with np.errstate(over="ignore", invalid="ignore"):
            noise = _impulse(np.ones(1), c, num_steps)
            if not np.all(np.isfinite(noise)):
                return math.inf, np.zeros_like(x)
            log_error, d_error = _log_error_gradient(noise, num_bands)
        # One participation: sens^2 = ||c||^2.
        sens_sq = float(c @ c)
        return math.log(sens_sq) + log_error, scale * (2.0 * c / sens_sq + d_error)[1:]

    start = sqrt_coefficients(num_bands)[1:] / scale
    x = _minimize(objective, start, max_iterations=1000) if num_bands > 1 else start
    best = unit_norm(np.concatenate([[1.0], scale * x]))
    best.flags.writeable = False
    return best


def optimal_band_coefficients(num_steps: int, num_bands: int) -> np.ndarray:
    """The b-banded Toeplitz strategy of least mean squared prefix-sum error over n steps.

    Minimizes ||c||^2 * ||A C^{-1}||_F^2 / n over the b coefficients (L-BFGS
    from `sqrt_coefficients(b)`, float64): the error E(C) of the unit-norm
    strategy, whose sensitivity is 1 for one participation and sqrt(k) for
    k participations at least b steps apart (cyclic Poisson with
    cycle_length >= b, or fixed-order epochs of >= b steps), the cases the
    accounting covers, so the same coefficients are optimal for all of them.
    One evaluation is O(n b + n log n) (a filter and FFTs, never an n x n
    matrix); the result is cached by (n, b).

    Args:
        num_steps: n, the run's logical steps.
        num_bands: b, 1 <= b <= n.

    Returns:
        The unit-norm coefficients c_0..c_(b-1), a read-only float64 array
        (c_0 > 0; for the prefix-sum workload they come out positive and
        decreasing).

    Raises:
        PrivacyConfigurationError: b > n.

    Example:
    ```python
    c = optimal_band_coefficients(1000, 16)
    prefix_sum_mse(inverse_coefficients(c, 1000))  # 39.4, against 500.5 for independent noise
    ```
    """
    return _optimal_band(*_check_bands(num_steps, num_bands))


# ---------------------------------------------------------------------------
# Buffered linear Toeplitz (BLT) strategies.
#
# Everything is computed from the buffers' state-space form, never from the
# polynomials of C(z) = P(z) / Q(z): with decays clustered near 1 the roots
# of P are ill-conditioned, and a filter by 1 / P can explode where the
# buffers do not.


def check_blt_parameters(
    buffer_decays: Sequence[float], output_scales: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """(theta, omega) as float64 vectors of one length d >= 1, with every decay in (0, 1).

    Raises:
        PrivacyConfigurationError: otherwise (the message says which).
    """
    theta = np.array(buffer_decays, dtype=np.float64).reshape(-1)
    omega = np.array(output_scales, dtype=np.float64).reshape(-1)
    if theta.size == 0 or theta.shape != omega.shape:
        raise PrivacyConfigurationError(
            "A BLT needs one output scale per buffer decay (d >= 1 of each), got "
            f"{theta.size} decays and {omega.size} scales."
        )
    if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))):
        raise PrivacyConfigurationError("BLT parameters must be finite.")
    if not np.all((theta > 0) & (theta < 1)):
        raise PrivacyConfigurationError(
            f"BLT buffer decays must lie in (0, 1), got {theta}: a decay >= 1 lets the "
            "buffers grow without bound."
        )
    return theta, omega


def _decay_powers(theta: np.ndarray, count: int) -> np.ndarray:
    """[theta_i^t for t < count], shape (count, d): repeated products, so monotone in t."""
    powers = np.ones((count, theta.size))
    if count > 1:
        powers[1:] = np.cumprod(np.broadcast_to(theta, (count - 1, theta.size)), axis=0)
    return powers


def blt_coefficients(
    buffer_decays: Sequence[float], output_scales: Sequence[float], num_steps: int
) -> np.ndarray:
    """The first column of the BLT strategy C: c_0 = 1, c_t = sum_i omega_i theta_i^(t-1).

    Computed as sums of repeated products, so for omega >= 0 the result is
    exactly non-negative and non-increasing from c_1 on (floating-point
    products and sums are monotone), as the sensitivity's exactness needs.

    Args:
        buffer_decays: theta, d values in (0, 1).
        output_scales: omega, d values.
        num_steps: n.

    Returns:
        The n coefficients, float64 (not normalized: c_0 = 1).
    """
    theta, omega = check_blt_parameters(buffer_decays, output_scales)
    num_steps = check_positive_int("num_steps", num_steps)
    return np.concatenate([[1.0], _decay_powers(theta, num_steps - 1) @ omega])


def _blt_inverse(theta: np.ndarray, omega: np.ndarray, num_steps: int) -> np.ndarray:
    """C^{-1}'s first column from the buffers: r_0 = 1, r_t = -omega^T M^(t-1) 1, M = diag(theta) - 1 omega^T.

    After the impulse every buffer holds 1 and then evolves by M (the
    recurrence of `blt_inverse_stream` with zero input), computed in blocks
    of 256 steps: one d x d power per block instead of a Python step per t.
    """
    d = theta.size
    transition = np.diag(theta) - np.outer(np.ones(d), omega)
    block = max(1, min(num_steps - 1, 256))
    states = np.empty((block, d))
    state = np.ones(d)
    for t in range(block):
        states[t] = state
        state = transition @ state
    blocks = [states]
    jump = np.linalg.matrix_power(transition, block).T
    while len(blocks) * block < num_steps - 1:
        blocks.append(blocks[-1] @ jump)
    trajectory = np.concatenate(blocks)[: num_steps - 1]
    return np.concatenate([[1.0], -(trajectory @ omega)])


def blt_inverse_coefficients(
    buffer_decays: Sequence[float], output_scales: Sequence[float], num_steps: int
) -> np.ndarray:
    """The first column of C^{-1} for the BLT (n entries; r_0 = 1), in O(n d^2).

    C^{-1} of a BLT is itself a BLT (Dvijotham et al. 2024); this computes
    its column from the buffers' recurrence, which is what the noise uses.
    For omega > 0 with sum(omega) < 1 the recurrence is a contraction (the
    eigenvalues of diag(theta) - 1 omega^T interlace the decays and lie in
    (-1, 1)), so the column decays.
    """
    theta, omega = check_blt_parameters(buffer_decays, output_scales)
    return _blt_inverse(theta, omega, check_positive_int("num_steps", num_steps))


def blt_multiply_stream(
    buffer_decays: Sequence[float], output_scales: Sequence[float], values: np.ndarray
) -> np.ndarray:
    """C x for the BLT, one step at a time with d buffers.

    y_t = x_t + sum_i omega_i s_{i,t}, then s_{i,t+1} = theta_i s_{i,t} + x_t,
    s_0 = 0: buffer i holds sum_{u < t} theta_i^(t-1-u) x_u.

    Args:
        buffer_decays: theta, d values in (0, 1).
        output_scales: omega, d values.
        values: x, shape (n, ...).

    Returns:
        C x, float64.
    """
    theta, omega = check_blt_parameters(buffer_decays, output_scales)
    x = np.asarray(values, dtype=np.float64)
    decays = theta.reshape((-1,) + (1,) * (x.ndim - 1))
    buffers = np.zeros((theta.size,) + x.shape[1:])
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        out[t] = x[t] + np.tensordot(omega, buffers, axes=1)
        buffers = decays * buffers + x[t]
    return out


def blt_inverse_stream(
    buffer_decays: Sequence[float], output_scales: Sequence[float], noise: np.ndarray
) -> np.ndarray:
    """C^{-1} z for the BLT, one step at a time with d buffers: the reference for the optimizer.

    x_t = z_t - sum_i omega_i s_{i,t}, then s_{i,t+1} = theta_i s_{i,t} + x_t:
    the buffers hold the past outputs, decayed, so that C x = z. For the
    unit-norm strategy C / ||c|| the noise is ||c|| times this.

    Args:
        buffer_decays: theta, d values in (0, 1).
        output_scales: omega, d values.
        noise: z, shape (n, ...).

    Returns:
        C^{-1} z, float64.

    Example:
    ```python
    theta, omega = optimal_blt_parameters(1000, 4)
    z = np.random.default_rng().standard_normal((1000, 3))
    x = np.linalg.norm(blt_coefficients(theta, omega, 1000)) * blt_inverse_stream(theta, omega, z)
    ```
    """
    theta, omega = check_blt_parameters(buffer_decays, output_scales)
    z = np.asarray(noise, dtype=np.float64)
    decays = theta.reshape((-1,) + (1,) * (z.ndim - 1))
    buffers = np.zeros((theta.size,) + z.shape[1:])
    out = np.empty_like(z)
    for t in range(z.shape[0]):
        out[t] = z[t] - np.tensordot(omega, buffers, axes=1)
        buffers = decays * buffers + out[t]
    return out


def _blt_from_unconstrained(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """theta = sigmoid(u) in (0, 1); omega = softmax((v, 0))[:d] > 0 with sum(omega) < 1.

    On this set C's coefficients are non-negative and non-increasing
    (c_1 = sum(omega) < c_0 = 1), where the minsep sensitivity is exact, and
    C^{-1}'s recurrence is a contraction.
    """
    d = x.size // 2
    theta = 1.0 / (1.0 + np.exp(-x[:d]))
    logits = np.concatenate([x[d:], np.zeros(1)])
    weights = np.exp(logits - np.max(logits))
    return theta, (weights / np.sum(weights))[:d]


def _blt_start(num_steps: int, num_buffers: int) -> np.ndarray:
    """Decay times spread geometrically up to n, scales summing to c_1 = 1/2.

    A sum of exponentials at geometric time scales tracks the t^(-1/2) tail
    of the sqrt coefficients; scales ~ tau^(-1/2) match its level.
    """
    taus = np.geomspace(2.0, max(float(num_steps), 4.0), num_buffers)
    theta = np.exp(-1.0 / taus)
    omega = taus ** -0.5
    omega *= 0.5 / omega.sum()
    return np.concatenate([np.log(theta / (1.0 - theta)), np.log(omega / (1.0 - omega.sum()))])


@functools.lru_cache(maxsize=64)
def _optimal_blt(num_steps: int, num_buffers: int, min_separation: int,
                 participations: int) -> tuple[np.ndarray, np.ndarray]:
    n, d = num_steps, num_buffers
    steps = np.arange(n, dtype=np.float64)

    def objective(x):
        theta, omega = _blt_from_unconstrained(x)
        powers = _decay_powers(theta, n)  # theta^t, t < n.
        strategy = np.concatenate([[1.0], powers[: n - 1] @ omega])
        log_sens, d_sens = _log_sensitivity_gradient(strategy, min_separation, participations)
        log_error, d_error = _log_error_gradient(_blt_inverse(theta, omega, n), n)
        grad_c = d_sens + d_error
        # c_t = sum_i omega_i theta_i^(t-1) for t >= 1.
        d_omega = grad_c[1:] @ powers[: n - 1]
        d_theta = omega * ((grad_c[2:] * steps[1: n - 1]) @ powers[: n - 2]) if n > 2 else (
            np.zeros(d))
        # Through theta = sigmoid(u) and omega = softmax((v, 0))[:d].
        d_u = d_theta * theta * (1.0 - theta)
        d_v = omega * (d_omega - d_omega @ omega)
        return log_sens + log_error, np.concatenate([d_u, d_v])

    best = _minimize(objective, _blt_start(n, d), max_iterations=2000)
    theta, omega = _blt_from_unconstrained(best)
    order = np.argsort(theta)[::-1]
    theta, omega = theta[order], omega[order]
    theta.flags.writeable = False
    omega.flags.writeable = False
    return theta, omega


def optimal_blt_parameters(
    num_steps: int,
    num_buffers: int,
    *,
    min_separation: int | None = None,
    max_participations: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """The d-buffer BLT of least sens^2 * E for the run's participation pattern.

    Minimizes log(sens(C)^2 * ||A C^{-1}||_F^2 / n) over theta in (0, 1)^d
    and omega > 0 with sum(omega) < 1 (L-BFGS in float64 with the exact
    gradient, O(n d^2 + n log n) per evaluation), where sens is the minsep
    sensitivity of (k, s)-participation: exact on this set, whose
    coefficients are all non-negative and non-increasing. Cached by
    (n, d, s, k).

    Args:
        num_steps: n.
        num_buffers: d >= 1.
        min_separation: s, steps between two participations (a fixed-order
            pass: its steps per epoch); None for one participation.
        max_participations: k (a fixed-order pass: its epochs).

    Returns:
        (buffer_decays, output_scales), read-only float64 arrays of d
        entries, decays in decreasing order.

    Example:
    ```python
    theta, omega = optimal_blt_parameters(1000, 4)
    c = blt_coefficients(theta, omega, 1000)
    ```
    """
    num_steps = check_positive_int("num_steps", num_steps)
    num_buffers = check_positive_int("num_buffers", num_buffers)
    min_separation = num_steps if min_separation is None else check_positive_int(
        "min_separation", min_separation)
    max_participations = check_positive_int("max_participations", max_participations)
    participations = _participations(num_steps, min_separation, max_participations)
    if participations == 1:
        min_separation = num_steps  # One participation: one cache entry for every s.
    return _optimal_blt(num_steps, num_buffers, min_separation, participations)


# ---------------------------------------------------------------------------
# dp_accounting events.


def _check_noise_multiplier(noise_multiplier: float) -> float:
    if isinstance(noise_multiplier, bool) or not isinstance(
            noise_multiplier, (int, float, np.integer, np.floating)):
        raise PrivacyConfigurationError(
            f"noise_multiplier must be a number > 0, got {noise_multiplier!r}.")
    sigma = float(noise_multiplier)
    if not (math.isfinite(sigma) and sigma > 0):
        raise PrivacyConfigurationError(
            f"noise_multiplier must be finite and > 0 for correlated noise, got {sigma}: "
            "without noise the run releases exact gradients and is not private."
        )
    return sigma


def cyclic_poisson_event(
    noise_multiplier: float,
    *,
    num_examples: int,
    batch_size: int | Sequence[int],
    steps: int,
    cycle_length: int,
    num_bands: int,
) -> dp_accounting.DpEvent:
    """The event of a banded strategy with cyclic Poisson sampling (amplified BandMF).

    The examples are split into L = `cycle_length` groups; step t
    Poisson-samples group t mod L at q = B L / N, so an example can join only
    steps L apart. With L >= b the b-banded unit-norm C's columns of two such
    steps do not overlap, and the run is the adaptive composition of
    ceil(T / L) rounds, each a Poisson-sampled Gaussian of noise multiplier
    sigma (Choquette-Choo et al. 2023, Theorem 4; jax_privacy's
    amplified BandMF event with L = b). A round whose steps differ in B is
    refused; rounds that differ from each other are each accounted with their
    own q.

    Args:
        noise_multiplier: sigma, on the unit-norm C.
        num_examples: N.
        batch_size: the expected batch B of every step, or a sequence of T
            values, one per step (a growing schedule).
        steps: T.
        cycle_length: L >= num_bands.
        num_bands: b.

    Returns:
        SelfComposed(PoissonSampled(q, Gaussian(sigma)), ceil(T / L)), or a
        Composed event of such runs of rounds when q changes between rounds.

    Raises:
        PrivacyConfigurationError: L < b (L = 1 is Poisson sampling without
            cycles), a round with two batch sizes, q > 1, or sigma <= 0.

    Example:
    ```python
    cyclic_poisson_event(1.0, num_examples=60_000, batch_size=250, steps=1000,
                         cycle_length=16, num_bands=16)
    # SelfComposed(PoissonSampled(q=1/15, Gaussian(1.0)), 63)
    ```
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    num_examples = check_num_examples(num_examples)
    steps = check_positive_int("steps", steps)
    cycle = check_positive_int("cycle_length", cycle_length)
    bands = check_positive_int("num_bands", num_bands)
    if cycle < bands:
        if cycle == 1:
            raise PrivacyConfigurationError(
                f"Poisson sampling without cycles under BandMF(num_bands={bands}) has no "
                "privacy proof: an example can join two steps fewer than b apart, whose "
                "noise the bands correlate, and amplification by sampling no longer "
                f"applies step by step. Sample with cycle_length >= {bands} (cycle_length="
                f"{bands} amplifies most), or use num_bands=1 (independent noise)."
            )
        raise PrivacyConfigurationError(
            f"cycle_length = {cycle} is smaller than num_bands = {bands}: an example's "
            "participations would share bands, which the cyclic Poisson accounting does not "
            f"cover. Raise cycle_length to at least {bands}, or lower num_bands to at most "
            f"{cycle}."
        )
    sizes = np.broadcast_to(np.asarray(batch_size), (steps,)) if np.ndim(batch_size) == 0 else (
        np.asarray(batch_size))
    if sizes.shape != (steps,):
        raise PrivacyConfigurationError(
            f"batch_size must be one number or one per step ({steps}), got {sizes.shape[0]} "
            "values.")
    for value in np.unique(sizes):
        check_positive_int("batch_size", value.item())
    rounds = -(-steps // cycle)
    rates = []
    for index in range(rounds):
        in_round = sizes[index * cycle:(index + 1) * cycle]
        if np.any(in_round != in_round[0]):
            raise PrivacyConfigurationError(
                f"Round {index} (steps {index * cycle}..{index * cycle + in_round.size - 1}) "
                f"mixes batch sizes {sorted(set(in_round.tolist()))}: a cyclic Poisson round "
                "must sample every group at one q, or the groups' guarantees differ. Start "
                f"each batch-size phase at a multiple of cycle_length = {cycle}, or keep the "
                "batch size constant."
            )
        rate = sampling_rate_of(int(in_round[0]) * cycle, num_examples)
        if rate > 1:
            raise PrivacyConfigurationError(
                f"Cyclic Poisson sampling at batch_size {int(in_round[0])} with cycle_length "
                f"{cycle} needs q = B L / N = {rate:.4g} > 1 ({num_examples} examples in "
                f"{cycle} groups). Lower cycle_length to at most "
                f"{num_examples // int(in_round[0])}, or the batch size."
            )
        rates.append(rate)
    runs: list[dp_accounting.DpEvent] = []
    start = 0
    for index in range(1, rounds + 1):
        if index == rounds or rates[index] != rates[start]:
            runs.append(dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    rates[start], dp_accounting.GaussianDpEvent(sigma)),
                index - start))
            start = index
    return runs[0] if len(runs) == 1 else dp_accounting.ComposedDpEvent(runs)


def fixed_order_event(noise_multiplier: float, sensitivity: Sensitivity) -> dp_accounting.DpEvent:
    """The event of a fixed-order epoch pass: the whole run as one Gaussian mechanism.

    Each example joins the same slot of every epoch ((k, s)-participation,
    no amplification). The released C x + sigma C_clip z is the Gaussian
    mechanism with sensitivity sens * C_clip, i.e. Gaussian(sigma / sens).
    The guarantee is for adding or removing one example that keeps every
    other example in its slot (zero-out adjacency, as in Kairouz et al.
    2021 and Choquette-Choo et al. 2023): the sampler must not shift the
    others when one goes.

    Args:
        noise_multiplier: sigma, on the unit-norm C.
        sensitivity: `minsep_sensitivity` for s = steps per epoch and k =
            epochs (exact or a bound: either way the event is an upper bound).

    Returns:
        GaussianDpEvent(sigma / sens).

    Example:
    ```python
    sens = minsep_sensitivity(unit_norm(sqrt_coefficients(4)), 1000,
                              min_separation=250, max_participations=4)
    fixed_order_event(8.0, sens)  # GaussianDpEvent(4.0)
    ```
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    if not isinstance(sensitivity, Sensitivity):
        raise TypeError(f"sensitivity must be a Sensitivity, got {sensitivity!r}.")
    return dp_accounting.GaussianDpEvent(sigma / sensitivity.value)
