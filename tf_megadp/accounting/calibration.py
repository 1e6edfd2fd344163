"""A run's epsilon (`compute_epsilon`) and its inverse (`calibrate_noise_multiplier`)."""

from __future__ import annotations

import math

import dp_accounting
from dp_accounting import mechanism_calibration

from tf_megadp.accounting.accountant import PrivacyAccountant
from tf_megadp.accounting.engines import (
    DEFAULT_ACCOUNTANT,
    _quiet_unconverged_orders,
    _TruncationAwareAccountant,
)
from tf_megadp.accounting.events import entry_event
from tf_megadp.accounting.ledger import PrivacyLedger, ledger_for_run
from tf_megadp.steps import BatchSizeSchedule

__all__ = ["compute_epsilon", "calibrate_noise_multiplier"]


def compute_epsilon(
    *,
    delta: float,
    schedule: BatchSizeSchedule | None = None,
    num_examples: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    noise_multiplier: float | None = None,
    sampling: str = "poisson",
    max_batch_size: int | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    epochs: float | None = None,
) -> float:
    """Epsilon of a DP-SGD run at `delta`.

    Describe the run either by a `BatchSizeSchedule` (plus `noise_multiplier`
    for phases that do not set their own; Poisson steps are truncated at each
    phase's capacity) or by constant `num_examples`, `batch_size`, `steps` (or
    `epochs`) and `noise_multiplier` (optionally truncated at
    `max_batch_size`).

    Args:
        delta: target delta in (0, 1).
        schedule: a `BatchSizeSchedule`.
        num_examples: N.
        batch_size: expected logical batch size B (q = B / N).
        steps: logical steps; with a schedule, defaults to its total.
        noise_multiplier: sigma.
        sampling: ``"poisson"`` or ``"shuffle"`` (reported as Poisson, with a
            warning).
        max_batch_size: truncation of untruncated-schedule Poisson steps.
        accountant: ``"pld"`` or ``"rdp"``.
        epochs: instead of `steps` (not with a schedule): passes over the
            data; as many steps as the sampler of `sampling` draws, see
            `tf_megadp.steps.steps_for_epochs`.

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
    return PrivacyAccountant.for_run(
        delta,
        schedule=schedule,
        num_examples=num_examples,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=noise_multiplier,
        sampling=sampling,
        max_batch_size=max_batch_size,
        accountant=accountant,
        epochs=epochs,
    ).epsilon()


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    *,
    schedule: BatchSizeSchedule | None = None,
    num_examples: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    sampling: str = "poisson",
    max_batch_size: int | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    epochs: float | None = None,
) -> float:
    """The smallest noise multiplier whose run meets (target_epsilon, target_delta).

    The inverse of `compute_epsilon`: `compute_epsilon(noise_multiplier=s, ...)`
    is at most `target_epsilon` (and within 1 % of it) for the returned s.
    With a schedule, phases that set their own noise multiplier keep it and
    the others share the calibrated one.

    Args:
        target_epsilon: the budget, > 0.
        target_delta: delta in (0, 1).
        schedule, num_examples, batch_size, steps, sampling, max_batch_size,
        accountant, epochs: as in `compute_epsilon`.

    Returns:
        sigma, a float.

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule.

    Example:
    ```python
    sigma = calibrate_noise_multiplier(
        3.0, 1e-5, num_examples=60_000, batch_size=256, steps=10_000)  # 0.886
    sigma = calibrate_noise_multiplier(
        3.0, 1e-5, num_examples=60_000, batch_size=256, epochs=40)
    ```
    """
    if epochs is not None:
        # Resolved once, so the search below and its RDP seed see plain steps.
        steps = ledger_for_run(
            schedule=schedule, num_examples=num_examples, batch_size=batch_size,
            steps=steps, noise_multiplier=1.0, sampling=sampling,
            max_batch_size=max_batch_size, epochs=epochs,
        )[1].total_steps
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
        raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}.")
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}.")
    if schedule is not None and all(
        phase.noise_multiplier is not None for phase in schedule.phases
    ):
        raise ValueError(
            "Every phase of the schedule sets its own noise_multiplier: there is "
            "nothing to calibrate. Set noise_multiplier=None on the phases to "
            "calibrate."
        )

    def ledger_for(sigma: float) -> PrivacyLedger:
        return ledger_for_run(
            schedule=schedule,
            num_examples=num_examples,
            batch_size=batch_size,
            steps=steps,
            noise_multiplier=sigma,
            sampling=sampling,
            max_batch_size=max_batch_size,
        )[1]

    first = ledger_for(1.0)  # Validates the settings before any search.
    if first.total_steps == 0:
        raise ValueError("There are no steps to calibrate (steps = 0).")
    accountant_ = PrivacyAccountant(
        schedule.num_examples if schedule is not None else num_examples,
        target_delta,
        accountant=accountant,
        ledger=first,
    )

    def epsilon(sigma: float) -> float:
        return accountant_.epsilon(ledger_for(sigma))

    # Bracket the root ourselves: epsilon is infinite at sigma = 0, where
    # dp_accounting's default bracket search would start. For PLD, start from
    # the RDP solution: RDP is looser, so its sigma is close above PLD's, and
    # RDP evaluations are ~20x cheaper than PLD ones.
    high = 1.0
    if accountant == "pld":
        try:
            high = calibrate_noise_multiplier(
                target_epsilon,
                target_delta,
                schedule=schedule,
                num_examples=num_examples,
                batch_size=batch_size,
                steps=steps,
                sampling=sampling,
                max_batch_size=max_batch_size,
                accountant="rdp",
            )
        except ValueError:
            pass  # RDP cannot account this run (frequent truncation): start at 1.
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
    low = high * shrink
    while epsilon(low) <= target_epsilon:
        high, low = low, low * shrink
        if low < 1e-6:
            return high

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.ComposedDpEvent(
            [
                entry_event(entry, accountant_.num_examples)
                for entry in ledger_for(sigma)
            ]
        )

    # The search composes events itself (outside `_epsilon`): keep its
    # unconverged-order records quiet too.
    with _quiet_unconverged_orders():
        return float(
            mechanism_calibration.calibrate_dp_mechanism(
                make_fresh_accountant=lambda: _TruncationAwareAccountant(accountant),
                make_event_from_param=make_event,
                target_epsilon=target_epsilon,
                target_delta=accountant_.delta,
                bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
                tol=low * 1e-3,
            )
        )
