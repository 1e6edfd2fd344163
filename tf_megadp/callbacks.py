"""Keras callbacks that keep a DP run's privacy spend visible and bounded.

`PrivacyCallback` watches the `DPOptimizer`'s logical-step counter, records
each completed logical step in the optimizer's `privacy_ledger` variable (so
`model.save` and `ModelCheckpoint` carry the spend, and a resumed run
continues it), writes `epsilon` and `delta` into the Keras `logs`, and, given
a `target_epsilon`, stops training before the logical step that would exceed
the budget.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras
import numpy as np

from tf_megadp.accounting import (
    DEFAULT_ACCOUNTANT,
    SAMPLING_KINDS,
    LedgerEntry,
    PrivacyAccountant,
    PrivacyLedger,
)
from tf_megadp.optimizer import DPOptimizer

__all__ = ["PrivacyCallback", "read_ledger"]


def read_ledger(optimizer: DPOptimizer) -> PrivacyLedger:
    """The `PrivacyLedger` stored in a built `DPOptimizer`.

    Args:
        optimizer: the `DPOptimizer` (e.g. `model.optimizer` after
            `keras.models.load_model`).

    Returns:
        The ledger of the logical steps recorded so far.
    """
    rows = int(keras.ops.convert_to_numpy(optimizer.privacy_ledger_rows))
    table = keras.ops.convert_to_numpy(optimizer.privacy_ledger)
    return PrivacyLedger.from_rows(table[:rows])


def _write_ledger(optimizer: DPOptimizer, ledger: PrivacyLedger) -> None:
    rows = ledger.to_rows()
    capacity = optimizer.privacy_ledger.shape[0]
    if len(rows) > capacity:
        raise RuntimeError(
            f"The privacy ledger needs {len(rows)} rows but the optimizer stores "
            f"{capacity}: the sampling rate or noise multiplier changed too often. "
            "Change them per phase of a BatchSizeSchedule instead of per step."
        )
    table = np.zeros(optimizer.privacy_ledger.shape, np.float64)
    table[: len(rows)] = rows
    optimizer.privacy_ledger.assign(table)
    optimizer.privacy_ledger_rows.assign(len(rows))


class PrivacyCallback(keras.callbacks.Callback):
    """Reports epsilon during `fit`, persists the ledger, enforces a budget.

    Place it before `CSVLogger` and `TensorBoard` in the callback list so that
    they see the `epsilon` and `delta` it adds to each epoch's logs (the
    progress bar and `History` always see them).

    Args:
        num_examples: N, the number of training examples (privacy units).
            Optional when the optimizer has a `BatchSizeSchedule`, whose N is
            used (and must match if both are given).
        delta: the delta of the reported (epsilon, delta); at most 1/N.
        batch_size: the expected logical batch size B (q = B / N) when the
            optimizer has no schedule. Default: the optimizer's
            `normalize_by`, which for Poisson sampling is the expected batch
            size.
        sampling: ``"poisson"`` (default) or ``"shuffle"`` (reported as if
            Poisson, with a warning; see `tf_megadp.accounting`).
        max_batch_size: without a schedule, the static size at which Poisson
            steps are truncated (default: not truncated). With a schedule,
            Poisson steps are truncated at each phase's capacity.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        target_epsilon: optional budget. At the end of every logical step, if
            one more step would make epsilon exceed it, training stops, so
            the run never spends more than the budget. Needs
            `steps_per_execution=1` to stop exactly at a step boundary.
        log_every_steps: also write `epsilon` and `delta` into the batch logs
            every this many logical steps.
        report_path: write the publishable JSON report here when training
            ends (atomically).
        verbose: 1 prints when the budget stops training; 0 is silent.

    Example:
    ```python
    callback = tf_megadp.PrivacyCallback(num_examples=60_000, delta=1e-5,
                                         target_epsilon=3.0)
    model.fit(dataset, epochs=10, callbacks=[callback])
    callback.epsilon              # spent so far
    callback.report()             # publishable dict; see PrivacyAccountant
    ```
    """

    def __init__(
        self,
        num_examples: int | None = None,
        delta: float | None = None,
        *,
        batch_size: int | None = None,
        sampling: str = "poisson",
        max_batch_size: int | None = None,
        accountant: str = DEFAULT_ACCOUNTANT,
        target_epsilon: float | None = None,
        log_every_steps: int | None = None,
        report_path: str | os.PathLike | None = None,
        verbose: int = 1,
    ):
        super().__init__()
        if delta is None:
            raise ValueError("PrivacyCallback needs delta (at most 1/num_examples).")
        if sampling not in SAMPLING_KINDS:
            raise ValueError(f"sampling must be one of {SAMPLING_KINDS}, got {sampling!r}.")
        if target_epsilon is not None and not (
            isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < float("inf")
        ):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
        if log_every_steps is not None and (
            isinstance(log_every_steps, bool)
            or not isinstance(log_every_steps, int)
            or log_every_steps < 1
        ):
            raise ValueError(
                f"log_every_steps must be a positive integer, got {log_every_steps!r}."
            )
        # Validates N, delta and the accountant now rather than at fit time.
        self._accountant = (
            PrivacyAccountant(num_examples, delta, accountant=accountant)
            if num_examples is not None
            else None
        )
        self.num_examples = num_examples
        self.delta = delta
        self.batch_size = batch_size
        self.sampling = sampling
        self.max_batch_size = max_batch_size
        self.accountant_name = accountant
        self.target_epsilon = target_epsilon
        self.log_every_steps = log_every_steps
        self.report_path = report_path
        self.verbose = verbose
        self.stopped_at_step: int | None = None
        self._seen_steps = 0
        self._stop_at: int | None = None
        self._budget_entry: LedgerEntry | None = None

    # -- What one logical step is --------------------------------------------------

    @property
    def _optimizer(self) -> DPOptimizer:
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError(
                "PrivacyCallback needs a model compiled with tf_megadp.DPOptimizer "
                f"(and made private with tf_megadp.make_private); got {optimizer!r}."
            )
        return optimizer

    def _step_entry(self, step: int) -> LedgerEntry:
        """The ledger entry of logical step `step` (0-based), one step long."""
        optimizer = self._optimizer
        schedule = optimizer.schedule
        max_batch_size = 0
        if schedule is not None:
            phase = schedule.phase_at(step)
            batch_size = phase.batch_size
            if self.sampling == "poisson":
                max_batch_size = schedule.capacity(phase)
        else:
            batch_size = self.batch_size or optimizer.normalize_by
            if batch_size is None:
                raise ValueError(
                    "PrivacyCallback needs the expected logical batch size: pass "
                    "batch_size=B, or give DPOptimizer normalize_by=B or a "
                    "BatchSizeSchedule."
                )
            max_batch_size = self.max_batch_size or 0
        return LedgerEntry(
            1,
            sampling_rate=batch_size / self._accountant.num_examples,
            noise_multiplier=optimizer.noise_multiplier_at(step),
            max_batch_size=max_batch_size,
            sampling=self.sampling,
        )

    def _record_until(self, iterations: int) -> None:
        """Records logical steps `_seen_steps .. iterations - 1` in the ledger."""
        if iterations <= self._seen_steps:
            return
        for step in range(self._seen_steps, iterations):
            self._accountant.ledger.append(self._step_entry(step))
        self._seen_steps = iterations
        _write_ledger(self._optimizer, self._accountant.ledger)

    def _iterations(self) -> int:
        return int(keras.ops.convert_to_numpy(self._optimizer.iterations))

    # -- Results -------------------------------------------------------------------

    @property
    def epsilon(self) -> float:
        """Epsilon spent by the logical steps recorded so far."""
        if self._accountant is None:
            return 0.0
        return self._accountant.epsilon()

    @property
    def ledger(self) -> PrivacyLedger:
        """A copy of the steps recorded so far."""
        return self._accountant.ledger.copy() if self._accountant else PrivacyLedger()

    def _settings(self) -> dict[str, Any]:
        optimizer = self._optimizer
        return {
            "l2_norm_clip": optimizer.l2_norm_clip,
            "noise_multiplier": optimizer.noise_multiplier,
            "accumulation_steps": optimizer.accumulation_steps,
            "normalize_by": optimizer.normalize_by,
            "schedule": optimizer.schedule.to_dict() if optimizer.schedule else None,
            "optimizer": type(optimizer.inner_optimizer).__name__,
            "target_epsilon": self.target_epsilon,
        }

    def report(self) -> dict[str, Any]:
        """The publishable report of the run (see `PrivacyAccountant.report`)."""
        return self._accountant.report(self._settings())

    # -- Keras hooks ---------------------------------------------------------------

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        schedule = optimizer.schedule
        num_examples = self.num_examples
        if schedule is not None:
            if num_examples is not None and num_examples != schedule.num_examples:
                raise ValueError(
                    f"PrivacyCallback num_examples={num_examples} differs from the "
                    f"optimizer's schedule (num_examples={schedule.num_examples})."
                )
            num_examples = schedule.num_examples
        if num_examples is None:
            raise ValueError(
                "PrivacyCallback needs num_examples (or a DPOptimizer with a "
                "BatchSizeSchedule)."
            )
        if self.target_epsilon is not None and getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError(
                "PrivacyCallback(target_epsilon=...) must see every micro-batch to "
                "stop exactly before the step that would exceed the budget: compile "
                "with steps_per_execution=1."
            )
        # The optimizer's ledger is the source of truth: it survives save/load.
        ledger = read_ledger(optimizer)
        iterations = self._iterations()
        if ledger.total_steps > iterations:
            raise ValueError(
                f"The optimizer's privacy ledger records {ledger.total_steps} logical "
                f"steps but its iteration counter is {iterations}: the checkpoint is "
                "inconsistent. Restore the optimizer and its ledger together."
            )
        self._accountant = PrivacyAccountant(
            num_examples, self.delta, accountant=self.accountant_name, ledger=ledger
        )
        self._seen_steps = ledger.total_steps
        self._stop_at = None
        self._budget_entry = None
        self.stopped_at_step = None
        self._step_entry(iterations)  # Fails now, not after a step, if not private.
        if iterations > self._seen_steps:
            warnings.warn(
                f"{iterations - self._seen_steps} logical steps were taken without a "
                "PrivacyCallback; recording them with the optimizer's current "
                "settings and this callback's sampling assumptions.",
                UserWarning,
                stacklevel=2,
            )
            self._record_until(iterations)
        if self.target_epsilon is not None and not self._next_step_fits(iterations):
            raise RuntimeError(
                f"The privacy budget is spent: epsilon is {self.epsilon:.4g} after "
                f"{iterations} logical steps and one more step would exceed "
                f"target_epsilon={self.target_epsilon:g}. Raise target_epsilon or "
                "stop training."
            )

    def _next_step_fits(self, step: int) -> bool:
        """Whether logical step `step` keeps epsilon within the budget."""
        entry = self._step_entry(step)
        if entry != self._budget_entry or step >= self._stop_at:
            # Epsilon grows with each step, so one search tells how many steps
            # like `entry` still fit; recompute only when the step changes or
            # that many have been taken. With a schedule, asking about the
            # rest of the phase first usually settles it in one evaluation.
            schedule = self._optimizer.schedule
            limit = None
            if schedule is not None and step < schedule.total_steps:
                limit = schedule.phase_ends[schedule.phase_index(step)] - step
            self._budget_entry = entry
            self._stop_at = step + self._accountant.steps_within_budget(
                self.target_epsilon, entry, limit=limit
            )
        return step < self._stop_at

    def on_train_batch_end(self, batch, logs=None):
        iterations = self._iterations()
        if iterations == self._seen_steps:
            return  # Mid-accumulation: no noisy update was released.
        previous = self._seen_steps
        self._record_until(iterations)
        if logs is not None and self.log_every_steps and (
            iterations // self.log_every_steps > previous // self.log_every_steps
        ):
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta
        if self.target_epsilon is not None and not self._next_step_fits(iterations):
            self.model.stop_training = True
            self.stopped_at_step = iterations
            if self.verbose:
                print(
                    f"PrivacyCallback: stopping after logical step {iterations}: "
                    f"epsilon = {self.epsilon:.4g} (delta = {self.delta:g}); one more "
                    f"step would exceed target_epsilon = {self.target_epsilon:g}."
                )

    def on_epoch_end(self, epoch, logs=None):
        self._record_until(self._iterations())
        if logs is not None:
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta

    def on_train_end(self, logs=None):
        self._record_until(self._iterations())
        if self.report_path is not None:
            self._accountant.save_report(self.report_path, self._settings())
