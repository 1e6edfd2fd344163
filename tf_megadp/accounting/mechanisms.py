"""The mechanisms of one step: what a logical step releases about its sampled batch.

A DP-SGD step releases the clipped gradient sum with Gaussian noise of
multiplier sigma (sensitivity C). With adaptive clipping
(`tf_megadp.AdaptiveClipping`, Andrew et al. 2021) it also releases a noisy
count of the examples whose gradient was not clipped, centred so that adding
or removing one example moves it by exactly `COUNT_SENSITIVITY` = 1/2: a
Gaussian of multiplier 2 s for count noise s. The two Gaussians see the same
sampled batch, so their privacy losses add in quadrature, and the pair is
exactly one Gaussian of multiplier (sigma_grad^-2 + (2 s)^-2)^-1/2. Adaptive
clipping keeps the run's sigma by raising the gradient's own multiplier to
sigma_grad = (sigma^-2 - (2 s)^-2)^-1/2 (`gradient_noise_multiplier`).

The gradient's noise is independent from step to step (DP-SGD) or
correlated across steps by a matrix-factorization strategy: the noise
mechanisms are a registry of their own (`tf_megadp.accounting.noise`).

These are accounting concepts (numbers, `dp_accounting` events), used by the
sampling kinds' events (`tf_megadp.accounting.events`), the accountants
(`tf_megadp.accounting.engines`), the optimizer's settings and the CLI; the
graph side of adaptive clipping (`tf_megadp.adaptive_clipping`) computes the
same pair on tensors.
"""

from __future__ import annotations

import dp_accounting
import numpy as np

from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "COUNT_SENSITIVITY",
    "as_single_gaussian",
    "equivalent_noise_multiplier",
    "gradient_noise_multiplier",
    "step_mechanism",
]

# Adding or removing one example moves the centred count by 1/2.
COUNT_SENSITIVITY = 0.5

def gradient_noise_multiplier(noise_multiplier: float, count_stddev: float) -> tuple[float, float]:
    """(sigma_grad, count noise multiplier) whose pair is one Gaussian of `noise_multiplier`.

    Args:
        noise_multiplier: sigma, the run's noise multiplier (0: no privacy).
        count_stddev: s, the noise standard deviation on the count.

    Returns:
        (sigma_grad, 2 s), with sigma_grad = (sigma^-2 - (2 s)^-2)^-1/2
        (and (0, 0) for a non-private run).

    Raises:
        PrivacyConfigurationError: 2 s <= sigma, where no gradient noise
            could keep the pair within sigma; or a count without noise in a
            private run.

    Example:
    ```python
    gradient_noise_multiplier(1.0, 5.0)   # (1.005, 10.0): 1.005^-2 + 10^-2 = 1
    ```
    """
    sigma = float(noise_multiplier)
    count_multiplier = float(count_stddev) / COUNT_SENSITIVITY
    if sigma == 0.0:
        if count_multiplier:
            raise PrivacyConfigurationError(
                "noise_multiplier=0 trains without privacy, but adaptive clipping was "
                f"given count_stddev={count_stddev}: set count_stddev=0 as well, so "
                "that the non-private baseline follows the exact quantile.")
        return 0.0, 0.0
    if count_multiplier <= sigma:
        raise PrivacyConfigurationError(
            f"Adaptive clipping with count noise s = {count_stddev:g} cannot stay within "
            f"noise multiplier sigma = {sigma:g}: the count alone, a Gaussian of "
            f"multiplier 2 s = {count_multiplier:g}, spends more than sigma allows "
            f"(2 s must exceed sigma). Raise count_stddev above {sigma / 2:g} (e.g. "
            "AdaptiveClipping(count_stddev=None), the expected batch size / 20, with a "
            "batch of more than 10 sigma examples), or lower noise_multiplier.")
    return (sigma ** -2 - count_multiplier ** -2) ** -0.5, count_multiplier


def equivalent_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """The single Gaussian multiplier equivalent to the gradient's and the count's.

    Args:
        noise_multiplier: the gradient's multiplier.
        count_noise_multiplier: the count's multiplier (0: the step releases
            no count).

    Returns:
        (noise_multiplier^-2 + count_noise_multiplier^-2)^-1/2, or
        `noise_multiplier` without a count.
    """
    if not count_noise_multiplier:
        return float(noise_multiplier)
    return float((noise_multiplier ** -2 + count_noise_multiplier ** -2) ** -0.5)


def step_mechanism(noise_multiplier: float, count_noise_multiplier: float) -> dp_accounting.DpEvent:
    """The DpEvent of one step's releases on the sampled batch (before sampling).

    Args:
        noise_multiplier: the gradient's multiplier.
        count_noise_multiplier: the count's multiplier (0: no count).

    Returns:
        A `GaussianDpEvent` for the gradient alone; with a count, the
        `ComposedDpEvent` of the gradient's and the count's Gaussians.
    """
    gradient = dp_accounting.GaussianDpEvent(noise_multiplier)
    if not count_noise_multiplier:
        return gradient
    return dp_accounting.ComposedDpEvent(
        [gradient, dp_accounting.GaussianDpEvent(count_noise_multiplier)])


def as_single_gaussian(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """A sampled step of several Gaussians, as the one Gaussian it equals.

    Gaussian mechanisms on the same sampled batch, each of sensitivity 1 in
    units of its noise, have the privacy loss of one Gaussian whose
    multiplier is (sum_k sigma_k^-2)^-1/2 (as dp_accounting's RDP
    accountant reduces them); tf_megadp's PLD accountants account that
    Gaussian.

    Args:
        event: any DpEvent.

    Returns:
        The equivalent `PoissonSampledDpEvent` of one Gaussian for a
        Poisson-sampled composition of positive Gaussians; `event`
        unchanged otherwise.
    """
    if (isinstance(event, dp_accounting.PoissonSampledDpEvent)
            and isinstance(event.event, dp_accounting.ComposedDpEvent)
            and event.event.events
            and all(isinstance(e, dp_accounting.GaussianDpEvent) for e in event.event.events)):
        multipliers = [e.noise_multiplier for e in event.event.events]
        if all(m > 0 for m in multipliers):
            sigma = float(np.sum(np.asarray(multipliers, np.float64) ** -2.0) ** -0.5)
            return dp_accounting.PoissonSampledDpEvent(
                event.sampling_probability, dp_accounting.GaussianDpEvent(sigma))
    return event
