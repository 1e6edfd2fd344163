"""Keras callbacks of a private `fit`: the spend recorded, visible and bounded.

* `LedgerKeeper` (added by the private `fit` itself, first in the list, so
  no user can forget it): the run's `LedgerRecorder` as a callback, which
  records the spend after every batch.
* `PrivacyCallback` (the user's): writes `epsilon` and `delta` into the
  Keras `logs`, enforces a `target_epsilon` budget and writes the
  publishable report, with `tf_megadp.run.reporting.PrivacyReporting`, the
  code a custom loop's `tf_megadp.PrivacyReport` runs too.
"""

from __future__ import annotations

import os

import keras

from tf_megadp.accounting import DEFAULT_ACCOUNTANT
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.run.ledger_recorder import LedgerRecorder
from tf_megadp.run.reporting import PrivacyReporting
from tf_megadp.run.state import run_notes

__all__ = ["LedgerKeeper", "PrivacyCallback"]


class LedgerKeeper(LedgerRecorder, keras.callbacks.Callback):
    """The private `fit`'s `LedgerRecorder`, as a Keras callback.

    The private `fit` (see `tf_megadp.make_private`) puts one first in the
    callback list; there is no need to create one. It begins at the start
    of training, records after every batch, and ends partial logical steps
    where an example could otherwise enter one noisy sum twice: at the end
    of every epoch of data that no sampler drew, and at the end of `fit`.

    Args: as `LedgerRecorder` (Keras gives it the model).
    """

    def __init__(self, *args, **kwargs):
        keras.callbacks.Callback.__init__(self)
        LedgerRecorder.__init__(self, *args, **kwargs)

    def on_train_begin(self, logs=None):
        self.begin()
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        self.drain()

    def on_epoch_end(self, epoch, logs=None):
        self.drain()
        if self.kind.ends_step_at_pass:
            # The next epoch is a new pass over the data: a logical step that
            # continued into it could hold an example twice.
            self.end_partial_step("an epoch")

    def on_train_end(self, logs=None):
        self.drain()
        self.end_partial_step("a fit call")
        # After Keras's finalize (an EMA average is in the weights by now).
        run_notes(self.model).end_fit(self.model)
        if (self.kind.follows_schedule and not self._batches and not self.model.stop_training
                and not self.nothing_to_train):
            raise PrivacyConfigurationError(
                "fit consumed no micro-batch of the sampler's dataset. Under a "
                "tf.distribute strategy Keras reads one batch to build an unbuilt model "
                "and restarts the data, which a sampler refuses (its draws are read "
                "once). Build the model before fit (e.g. call it once on a batch of the "
                "right shapes, or model.build(...)), then pass a fresh sampler's dataset."
            )


class PrivacyCallback(PrivacyReporting, keras.callbacks.Callback):
    """Reports epsilon during `fit`, enforces a budget, writes the report.

    Epsilon is computed from the privacy ledger that the private `fit` keeps
    (see `LedgerKeeper`): the steps the compiled step applied, N measured
    from the data, and the way each step chose its examples. Nothing here is
    taken on trust: a value you pass is checked against what `fit` consumes.

    Place it before `CSVLogger` and `TensorBoard` in the callback list so that
    they see the `epsilon` and `delta` it adds to each epoch's logs (the
    progress bar and `History` always see them).

    Args:
        delta: the delta of the reported (epsilon, delta); at most 1/N.
        num_examples: N, only for data whose size `fit` cannot measure (a
            `tf.data.Dataset` or `PyDataset` that no tf_megadp sampler
            returned); the report then says N was stated. For arrays and
            sampler datasets N is measured, and a different value raises.
        batch_size: optional check of the expected logical batch size: a
            value different from what the run's steps hold raises.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        target_epsilon: optional budget. At the end of every logical step, if
            one more step would make epsilon exceed it, training stops, so
            the run never spends more than the budget (`stopped_at_step`
            says where; a run that ends its schedule or its data there was
            not stopped, and nothing is printed). Needs
            `steps_per_execution=1` to stop exactly at a step boundary.
        log_every_steps: also write `epsilon` and `delta` into the batch logs
            every this many logical steps.
        report_path: write the publishable JSON report here when training
            ends (atomically).
        verbose: 1 prints when the budget stops training; 0 is silent.

    Example:
    ```python
    callback = tf_megadp.PrivacyCallback(delta=1e-5, target_epsilon=3.0)
    model.fit(sampler.as_dataset(), callbacks=[callback])
    callback.epsilon              # spent so far
    callback.report()             # publishable dict
    ```
    """

    def __init__(
        self,
        delta: float | None = None,
        num_examples: int | None = None,
        *,
        batch_size: int | None = None,
        accountant: str = DEFAULT_ACCOUNTANT,
        target_epsilon: float | None = None,
        log_every_steps: int | None = None,
        report_path: str | os.PathLike | None = None,
        verbose: int = 1,
    ):
        super().__init__()
        if isinstance(delta, int) and not isinstance(delta, bool) and delta >= 1 and (
                num_examples is None or isinstance(num_examples, float)):
            raise TypeError(
                "PrivacyCallback takes delta first: PrivacyCallback(delta=1e-5). "
                "N is measured from the data; pass num_examples= only for data of "
                "unknown size."
            )
        if log_every_steps is not None and (
            isinstance(log_every_steps, bool)
            or not isinstance(log_every_steps, int)
            or log_every_steps < 1
        ):
            raise ValueError(
                f"log_every_steps must be a positive integer, got {log_every_steps!r}."
            )
        self.init_reporting(delta, num_examples, batch_size, accountant, target_epsilon)
        self.log_every_steps = log_every_steps
        self.report_path = report_path
        self.verbose = verbose
        self.stopped_at_step: int | None = None
        self._seen_iterations = 0
        self._epoch: int | None = None

    # -- Keras hooks ---------------------------------------------------------------

    def on_train_begin(self, logs=None):
        keeper = getattr(self.model, "_tf_megadp_keeper", None)
        optimizer = self.model_optimizer  # Raises first for a model without a DPOptimizer.
        if keeper is None or keeper.model is not self.model:
            raise PrivacyConfigurationError(
                "PrivacyCallback needs the private fit of tf_megadp.make_private(model)."
            )
        if self.target_epsilon is not None and getattr(self.model, "steps_per_execution", 1) != 1:
            raise ValueError(
                "PrivacyCallback(target_epsilon=...) must see every micro-batch to "
                "stop exactly before the step that would exceed the budget: compile "
                "with steps_per_execution=1."
            )
        self._micro_batches_seen = 0
        self._epoch = None
        self.stopped_at_step = None
        self._seen_iterations = optimizer.logical_step
        self.attach(keeper)

    def steps_left(self, step: int) -> int | None:
        """An upper bound on the logical steps this fit can still take (None: unknown).

        It bounds the budget search: without it, a search past the end of
        a schedule would look up to 2^24 steps ahead, many evaluations for
        steps this fit never takes (a later fit searches again).
        """
        steps, epochs = self.params.get("steps"), self.params.get("epochs")
        if not steps or not epochs:
            return None
        optimizer = self.model_optimizer
        left = steps * epochs - self._micro_batches_seen + optimizer.micro_step
        return max(1, left // optimizer.accumulation_steps_at(step) + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._micro_batches_seen += 1
        iterations = self.model_optimizer.logical_step
        if iterations == self._seen_iterations:
            return  # Mid-accumulation: no noisy update was released.
        previous, self._seen_iterations = self._seen_iterations, iterations
        if logs is not None and self.log_every_steps and (
            iterations // self.log_every_steps > previous // self.log_every_steps
        ):
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta
        if (self.target_epsilon is not None and self._more_steps_to_come(iterations, batch)
                and not self.next_step_fits(iterations)):
            self.model.stop_training = True
            self.stopped_at_step = iterations
            if self.verbose:
                schedule = self.model_optimizer.schedule
                planned = f" of {schedule.total_steps} planned" if schedule is not None else ""
                print(
                    f"PrivacyCallback: stopping after logical step {iterations}{planned}: "
                    f"epsilon = {self.epsilon:.4g} (delta = {self.delta:g}); one more "
                    f"step would exceed target_epsilon = {self.target_epsilon:g}."
                )

    def _more_steps_to_come(self, step: int, batch: int) -> bool:
        """Whether this fit goes on after logical step `step` (micro-batch `batch`) unless stopped.

        Not at the end of the optimizer's schedule, nor after the fit's last
        micro-batch (when Keras knows the steps of an epoch): a run that
        ends there was not stopped by the budget, whatever one more step
        would spend. Unknown lengths count as more to come.
        """
        schedule = self.model_optimizer.schedule
        if schedule is not None and step >= schedule.total_steps:
            return False
        steps, epochs = self.params.get("steps"), self.params.get("epochs")
        if not steps or not epochs or self._epoch is None:
            return True
        return (epochs - 1 - self._epoch) * steps + (steps - 1 - batch) > 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta

    def on_train_end(self, logs=None):
        if self.report_path is not None:
            self.save_report(self.report_path)
