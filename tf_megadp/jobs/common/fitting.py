"""A job's training and scoring: the private fit, or the same private step in a custom loop.

Keras 3.15's `fit` and `evaluate` cannot run under
`MultiWorkerMirroredStrategy` with several workers (docs/tpu.md). There a
job trains with `fit_with_private_step`, which runs the private `fit`'s own
step in a custom loop and drives the same callbacks at the same points, and
scores with `weighted_accuracy`, the accuracy `evaluate` computes.

Every job also takes its learning rate (`warmup_cosine_learning_rate`) and
the division of its micro-steps into equal `fit` epochs, one evaluation
each (`epochs_dividing`), from here.
"""

from __future__ import annotations

import time
import warnings
from typing import NamedTuple

__all__ = ["TrainTime", "epochs_dividing", "fit_run", "fit_with_private_step",
           "warmup_cosine_learning_rate", "weighted_accuracy"]

# The hooks a job's callbacks implement between the first and the last step.
_TIMED_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
                "on_train_batch_begin", "on_train_batch_end")


class TrainTime(NamedTuple):
    """Where a start's train time went.

    Attributes:
        total_s: the wall time of its fit.
        callbacks_s: seconds inside each of the job's callbacks (evaluation,
            checkpoints, the privacy report, logs), by the callback's class.
    """

    total_s: float
    callbacks_s: dict[str, float]

    @property
    def fit_s(self) -> float:
        """The rest: the steps, and Keras's and the private fit's own bookkeeping."""
        return self.total_s - sum(self.callbacks_s.values())

    def report(self) -> dict[str, float]:
        """report.json's `train_time_parts_s`."""
        return {"fit": round(self.fit_s, 3),
                **{name: round(seconds, 3) for name, seconds in self.callbacks_s.items()}}


def _timed_callbacks(callbacks: list, seconds: dict) -> None:
    """Makes each callback add the time of its hooks to `seconds[its class name]`."""
    for callback in callbacks:
        name = type(callback).__name__.lstrip("_")
        seconds.setdefault(name, 0.0)
        for hook in _TIMED_HOOKS:
            method = getattr(callback, hook)

            def timed(*args, method=method, name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    seconds[name] += time.perf_counter() - start

            setattr(callback, hook, timed)


def warmup_cosine_learning_rate(peak: float, warmup_steps: int, logical_steps: int,
                                micro_steps_per_update: int = 1):
    """A job's learning rate: linear warm-up to `peak`, then cosine decay to a tenth of it.

    Args:
        peak: the learning rate after the warm-up.
        warmup_steps: logical steps of warm-up (at most all steps but one).
        logical_steps: the run's logical steps.
        micro_steps_per_update: how often the optimizer's iteration count
            advances per logical step: 1 for a `DPOptimizer`, k for the
            non-private baseline, which accumulates with Keras's own
            `gradient_accumulation_steps` and so advances the schedule every
            micro-batch (its horizon is scaled to match).

    Returns:
        A `keras.optimizers.schedules.CosineDecay`.
    """
    import keras

    warmup = min(warmup_steps, max(logical_steps - 1, 0)) * micro_steps_per_update
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else peak,
        decay_steps=max(logical_steps * micro_steps_per_update - warmup, 1),
        alpha=0.1,
        warmup_target=peak if warmup else None,
        warmup_steps=warmup,
    )


def epochs_dividing(micro_steps: int, wanted: int) -> int:
    """The largest epoch count <= `wanted` that divides `micro_steps` (fit's epochs are equal).

    Args:
        micro_steps: the micro-steps this start trains (0: none left).
        wanted: the epochs asked for (one per evaluation).

    Returns:
        The count; 0 when nothing is left to train.
    """
    for count in range(min(wanted, micro_steps), 0, -1):
        if micro_steps % count == 0:
            return count
    return 0


def fit_run(model, dataset, *, strategy, several_workers: bool, callbacks: list, epochs: int,
            initial_epoch: int, steps_per_epoch: int, verbose) -> TrainTime:
    """Trains this start's epochs (a private custom loop under several workers).

    Also with no epoch left (a run resumed after its last step): the
    privacy callback then reports the ledger without training.

    Returns:
        Its wall time, and the part of it inside each callback: a job's
        evaluation and checkpoint cadence count in its train time, and a
        DP run's is compared with its non-private twin's.
    """
    callback_seconds: dict[str, float] = {}
    _timed_callbacks(callbacks, callback_seconds)
    train_started = time.perf_counter()
    with warnings.catch_warnings():
        # keras-hub tasks that never use the backbone's pooler: Keras's
        # optimizer warns about it on every non-private run.
        warnings.filterwarnings("ignore", message="Gradients do not exist for variables.*pooled")
        if several_workers:
            fit_with_private_step(model, strategy, dataset, epochs=epochs,
                                  initial_epoch=initial_epoch,
                                  steps_per_epoch=steps_per_epoch, callbacks=callbacks)
        else:
            model.fit(dataset, epochs=epochs, initial_epoch=initial_epoch,
                      steps_per_epoch=steps_per_epoch or None,
                      shuffle=False, callbacks=callbacks, verbose=verbose)
    return TrainTime(time.perf_counter() - train_started, callback_seconds)


def fit_with_private_step(model, strategy, dataset, *, epochs: int, steps_per_epoch: int,
                          callbacks: list, initial_epoch: int = 0) -> None:
    """`model.fit` of a sampler's tagged dataset, as a custom loop of a `tf_megadp.PrivateStep`.

    The loop runs the private `fit`'s own step on every replica, each worker
    feeding its replicas' rows of the sampler's micro-steps
    (`distribute_micro_batches`), records the ledger after every micro-step
    as the private `fit` does, and drives the same callbacks at the same
    points: the privacy callback (epsilon, budget stop, report), evaluation
    and checkpoints, the CSV and TensorBoard logs.
    """
    import keras
    import tensorflow as tf

    import tf_megadp
    from tf_megadp import distribute
    from tf_megadp.data import sources
    from tf_megadp.run.ledger_recorder import LedgerRecorder

    hooks = keras.callbacks.CallbackList(callbacks, model=model, epochs=epochs,
                                         steps=steps_per_epoch, verbose=0)
    model.stop_training = False
    if epochs == initial_epoch:
        # A run resumed after its last step: the ledger is checked and
        # reported, nothing is trained.
        LedgerRecorder(sources.source_of(dataset), model=model, nothing_to_train=True,
                       require_poisson_sampling=True).begin()
        hooks.on_train_begin()
        hooks.on_train_end()
        return
    step = tf_megadp.PrivateStep(model)
    data = distribute.distribute_micro_batches(strategy, lambda context: dataset)
    step.begin(data)
    train = tf.function(lambda iterator: step.run(next(iterator)))
    iterator = iter(data)
    logs = {}
    hooks.on_train_begin()
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        hooks.on_epoch_begin(epoch)
        for batch in range(steps_per_epoch):
            hooks.on_train_batch_begin(batch)
            logs = {name: float(value) for name, value in train(iterator).items()
                    if name not in ("logical_step", "applied")}
            step.record()  # Before any callback reads the ledger.
            hooks.on_train_batch_end(batch, logs)
            if model.stop_training:
                break
        logs = dict(logs)
        hooks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    # As fit: the weights' average replaces them (with use_ema), then the end.
    model.optimizer.finalize_variable_values(model.trainable_variables)
    hooks.on_train_end(logs)


def weighted_accuracy(model, x, y, sample_weight, batch_size: int, swap=None) -> float:
    """The weighted accuracy `evaluate` gives, without `evaluate`: argmax of the logits against `y`.

    Keras's `evaluate` cannot run under several workers; this is its
    weighted accuracy from the model's forward pass on this worker (its
    weights are every worker's). It needs no compiled model: `tf-megadp
    evaluate` scores a model with it too.

    Args:
        model: the model; its logits' last axis holds the classes (or tokens).
        x: the inputs, a dict of arrays of one leading axis.
        y: the labels, of the logits' shape without the last axis.
        sample_weight: weights of y's shape (None: 1 each).
        batch_size: rows per forward pass.
        swap: callbacks that swap weights in for the evaluation
            (`keras.callbacks.SwapEMAWeights`).
    """
    import keras
    import numpy as np

    if sample_weight is None:
        sample_weight = np.ones(np.shape(y), np.float32)
    for callback in swap or ():
        callback.set_model(model)
        callback.on_test_begin()
    try:
        correct = weight = 0.0
        for start in range(0, len(y), batch_size):
            rows = slice(start, start + batch_size)
            logits = model({name: value[rows] for name, value in x.items()}, training=False)
            hits = np.argmax(keras.ops.convert_to_numpy(logits), axis=-1) == y[rows]
            correct += float(np.sum(hits * sample_weight[rows]))
            weight += float(np.sum(sample_weight[rows]))
    finally:
        for callback in swap or ():
            callback.on_test_end()
    return correct / weight
