"""A run's epsilon (`compute_epsilon`) and its inverse (`calibrate_noise_multiplier`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dp_accounting import mechanism_calibration

from tf_megadp.accounting.accountant import PrivacyAccountant
from tf_megadp.accounting.engines import (
    DEFAULT_ACCOUNTANT,
    TruncationAwareAccountant,
    pld_grid_points,
    quiet_unconverged_orders,
)
from tf_megadp.accounting.run_description import RunDescription
from tf_megadp.errors import PrivacyConfigurationError

__all__ = ["compute_epsilon", "calibrate_noise_multiplier"]


def compute_epsilon(*, delta: float, accountant: str = DEFAULT_ACCOUNTANT, **run: Any) -> float:
    """Epsilon of a DP-SGD run at `delta`.

    Describe the run either by a `BatchSizeSchedule` (plus `noise_multiplier`
    for phases that do not set their own; Poisson steps are truncated at each
    phase's capacity) or by constant `num_examples`, `batch_size`, `steps` (or
    `epochs`) and `noise_multiplier` (optionally truncated at
    `max_batch_size`): the fields of `RunDescription`.

    Args:
        delta: target delta in (0, 1).
        accountant: ``"pld"`` or ``"rdp"``.
        **run: the run, as in `RunDescription`: `schedule`, `num_examples`,
            `batch_size` (expected B, q = B / N), `steps` (with a schedule,
            defaults to its total) or `epochs` (passes over the data, not
            with a schedule; as many steps as the sampler of `sampling`
            draws, see `tf_megadp.steps.steps_for_epochs`),
            `noise_multiplier`, `sampling` (``"poisson"``, or ``"shuffle"``,
            reported as Poisson with a warning), `max_batch_size`
            (truncation of constant-batch Poisson steps) and `prior` (the
            ledger of a release on the same data the run continues, composed
            first).

    Returns:
        epsilon (a float; 0.0 for zero steps).

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule.

    Example:
    ```python
    compute_epsilon(num_examples=60_000, batch_size=256, steps=10_000,
                    noise_multiplier=1.1, delta=1e-5)     # 1.978
    compute_epsilon(num_examples=60_000, batch_size=256, epochs=3,
                    noise_multiplier=1.1, delta=1e-5)     # 704 steps
    ```
    """
    return PrivacyAccountant.for_run(delta, accountant=accountant, **run).epsilon()


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    *,
    accountant: str = DEFAULT_ACCOUNTANT,
    **run: Any,
) -> float:
    """The smallest noise multiplier whose run meets (target_epsilon, target_delta).

    The inverse of `compute_epsilon`: `compute_epsilon(noise_multiplier=s, ...)`
    is at most `target_epsilon` (and within 1 % of it) for the returned s.
    With a schedule, phases that set their own noise multiplier keep it and
    the others share the calibrated one.

    Args:
        target_epsilon: the budget, > 0.
        target_delta: delta in (0, 1).
        accountant: ``"pld"`` or ``"rdp"``.
        **run: the run, as in `compute_epsilon`, without `noise_multiplier`.

    Returns:
        sigma, a float.

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule; or, with PLD, a target so large that its sigma
            lies where one PLD evaluation would exceed `PLD_GRID_BUDGET`
            grid points (the message gives the largest target PLD
            calibrates for the run; ``accountant="rdp"`` calibrates any).

    Example:
    ```python
    sigma = calibrate_noise_multiplier(
        3.0, 1e-5, num_examples=60_000, batch_size=256, steps=10_000)  # 0.886
    sigma = calibrate_noise_multiplier(
        3.0, 1e-5, num_examples=60_000, batch_size=256, epochs=40)
    ```
    """
    # Every probe below replaces the noise multiplier: 1.0 only completes
    # the description, which checks the run before any search.
    return _calibrate(RunDescription(noise_multiplier=1.0, **run), target_epsilon,
                      target_delta, accountant)


def _calibrate(run: RunDescription, target_epsilon: float, target_delta: float,
               accountant: str) -> float:
    """`calibrate_noise_multiplier` of the described `run`."""
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
        raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}.")
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}.")
    if run.schedule is not None and all(
        phase.noise_multiplier is not None for phase in run.schedule.phases
    ):
        raise ValueError(
            "Every phase of the schedule sets its own noise_multiplier: there is "
            "nothing to calibrate. Set noise_multiplier=None on the phases to "
            "calibrate."
        )

    def probe(sigma: float) -> RunDescription:
        return dataclasses.replace(run, noise_multiplier=sigma)

    if run.ledger().total_steps == 0:
        raise ValueError("There are no steps to calibrate (steps = 0).")
    accountant_ = PrivacyAccountant(run.num_examples, target_delta, accountant=accountant,
                                    ledger=run.ledger())

    def epsilon(sigma: float) -> float:
        return accountant_.epsilon(probe(sigma).ledger())

    # Bracket the root ourselves: epsilon is infinite at sigma = 0, where
    # dp_accounting's default bracket search would start. For PLD, start from
    # the RDP solution: RDP is looser, so its sigma is close above PLD's, and
    # RDP evaluations are ~20x cheaper than PLD ones.
    high = 1.0
    floor = 0.0
    if accountant == "pld":
        try:
            high = _calibrate(run, target_epsilon, target_delta, "rdp")
        except ValueError:
            pass  # RDP cannot account this run (frequent truncation): start at 1.
        # Below `floor`, one PLD evaluation would cost more than the budget:
        # never probe there (a huge target_epsilon once ran 9 minutes past 8 GB).
        floor = _pld_floor(probe)
        high = max(high, floor)
    while epsilon(high) > target_epsilon:
        high *= 2.0
        if high > 1e6:
            raise ValueError(
                f"No noise multiplier up to 1e6 reaches epsilon {target_epsilon}: "
                "the phases with their own noise_multiplier already exceed it."
            )
    # The RDP seed is usually within 10 % above the PLD answer: a narrow
    # bracket saves PLD evaluations (about 1 s each).
    shrink = 0.9 if accountant == "pld" else 0.5
    low = high
    while epsilon(low) <= target_epsilon:
        high, low = low, low * shrink
        if accountant == "pld" and high <= floor:
            _refuse_beyond_the_grid(target_epsilon, floor, epsilon(floor))
        low = max(low, floor)
        if low < 1e-6:
            return high

    # The search composes events itself (outside `engines.epsilon`): keep its
    # unconverged-order records quiet too.
    with quiet_unconverged_orders():
        return float(
            mechanism_calibration.calibrate_dp_mechanism(
                make_fresh_accountant=lambda: TruncationAwareAccountant(accountant),
                make_event_from_param=lambda sigma: probe(sigma).dp_event(),
                target_epsilon=target_epsilon,
                target_delta=accountant_.delta,
                bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
                tol=low * 1e-3,
            )
        )


# The largest one-step PLD (points of its privacy-loss grid,
# `engines.pld_grid_points`) that a PLD calibration builds: sigma ~ 0.13 for
# a Poisson step. Measured on the shared 2-core machine, `tf-megadp
# calibrate` of 704 steps at q = 0.0043 (N = 60,000, B = 256, 3 epochs):
# target 200 (sigma 0.160, 750,000 points) answered in 71 s at 1.3 GB peak;
# target 1000 refused in 12 s at 0.7 GB, where the search without this bound
# had taken 201 s and 5.1 GB (in a process with TensorFlow imported; down to
# sigma 0.078, 2,000,000 points), and a new user's run 9 minutes past 8 GB. Time and memory grow as 1 / sigma^2.
PLD_GRID_BUDGET = 1_000_000


def _pld_floor(probe) -> float:
    """The smallest noise multiplier whose run's PLD steps stay within `PLD_GRID_BUDGET`.

    The grid shrinks as sigma grows; bisected on the sizes alone (nothing is
    built), to 0.1 %.
    """
    def points(sigma: float) -> int:
        # Rare truncation (every tf_megadp sampler's) is composed as Poisson.
        return pld_grid_points(probe(sigma).dp_event(), truncated_as_poisson=True)

    high = 1.0
    while points(high) > PLD_GRID_BUDGET:
        high *= 2.0
        if high > 1e6:
            raise PrivacyConfigurationError(
                "The phases with their own noise_multiplier alone need a PLD of more "
                f"than {PLD_GRID_BUDGET:,} points per step: account this run with "
                "accountant='rdp'.")
    low = high / 2.0
    while points(low) <= PLD_GRID_BUDGET and low > 1e-6:
        high, low = low, low / 2.0
    while high - low > high * 1e-3:
        middle = (low + high) / 2.0
        if points(middle) <= PLD_GRID_BUDGET:
            high = middle
        else:
            low = middle
    return high


def _refuse_beyond_the_grid(target_epsilon: float, floor: float, largest: float):
    raise PrivacyConfigurationError(
        f"target_epsilon={target_epsilon:g} needs a noise multiplier below {floor:.4g}, "
        "where one PLD evaluation builds a privacy-loss grid of more than "
        f"{PLD_GRID_BUDGET:,} points per step, and its time and memory grow as "
        "1 / sigma^2 (minutes and gigabytes per search). The largest target "
        f"that PLD calibrates for this run is epsilon = {math.floor(largest * 100) / 100:g} "
        f"(sigma = {floor:.4g}), "
        "and an epsilon that large already promises little. Lower target_epsilon, or "
        "calibrate with accountant='rdp' (--accountant rdp; fast at any sigma, a looser "
        "but valid bound), or set the noise_multiplier yourself (0: a non-private baseline)."
    )
