"""`make_private`: the one explicit opt-in that makes a Keras model's training private.

It replaces the model's `train_step` with the DP step: per-example losses,
clipped per-example gradients, accumulation into the `DPOptimizer`. The
model's class, weights, `predict` and saving are untouched; `fit` keeps the
privacy ledger, and `evaluate` (which `fit` also runs on validation data)
notes for the privacy report that its metrics were released outside epsilon.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import keras
import tensorflow as tf

from tf_megadp import distribute
from tf_megadp.clipping import independence
from tf_megadp.data import map_independence, sources, tags
from tf_megadp.data.fit_inputs import array_micro_batch_size, data_identity, fit_source
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer
from tf_megadp.run import weights_origin
from tf_megadp.run.backup import PrivateBackup
from tf_megadp.run.callbacks import LedgerKeeper, PrivacyCallback
from tf_megadp.run.saving import atomic_save, ledger_preserving_load, ledger_preserving_save
from tf_megadp.run.state import (
    EVALUATION_METRICS,
    advance_generation,
    current_generation,
    is_private,
    mark_private,
    run_notes,
    stale_step_error,
)
from tf_megadp.steps import BatchSizeSchedule
from tf_megadp.training.loss_scaling import unwrap_loss_scale_optimizer
from tf_megadp.training.step import check_no_example_mixing, private_step

__all__ = ["make_private", "make_private_with_epsilon", "is_private", "extend_schedule"]


def make_private(
    model: keras.Model,
    *,
    require_poisson_sampling: bool = False,
    log_nonfinite_examples: bool = False,
) -> keras.Model:
    """Turns on differentially private training for `model` (in place).

    After this call every training step of `model.fit` (and `train_on_batch`)
    is the DP step: each example's loss is the compiled loss evaluated on that
    example alone, its gradient is clipped to norm C, and the clipped sum is
    handed to the `DPOptimizer`, which adds noise once per logical step. The
    model must be compiled with a `DPOptimizer`; anything else raises.

    Every private `fit` keeps the privacy ledger from what it is fed (see
    `tf_megadp.data.sources`): N is measured from arrays and from tf_megadp
    samplers, and each applied step is recorded with the values the compiled
    step used. A logical step never spans two `fit` calls nor, for data that
    no sampler drew, two epochs: a partial logical step there is discarded
    (it was never released, so it costs no privacy). Compiling again with a
    new `DPOptimizer` carries the spent privacy over to it, also after
    `keras.models.load_model` (see docs/lifecycle.md).

    A `keras.callbacks.BackupAndRestore` passed to the private `fit` is
    restored before the run starts and written atomically at logical-step
    boundaries (`tf_megadp.run.backup`): a run killed at any moment and
    started again with the same script continues its ledger and its
    sampler's steps. The model's `save` and `save_weights` write
    atomically, and its `load_weights` builds the `DPOptimizer` first, so
    that the ledger in the file is loaded with the weights.

    The weights the model holds now (its initialisation, or public weights
    loaded before this call) start its ledger, unless they hold values an
    earlier DP run trained (their file carried its ledger): a private run
    then composes that ledger before its first step, or the user declares
    this run's data disjoint (`tf_megadp.declare_disjoint_data`). Weights
    set into it later (`set_weights`, `load_weights` of a file without a
    ledger) that no record describes are refused by a first private fit
    until `tf_megadp.declare_public_weights` or
    `tf_megadp.declare_disjoint_data` names them.

    The same object is returned, so `model = make_private(model)` and
    `make_private(model)` are equivalent. Saved models do not remember the
    opt-in: call `make_private` again after `keras.models.load_model`
    (training without it raises instead of silently running non-privately).

    Args:
        model: a Keras 3 model (Sequential, Functional or subclassed).
        require_poisson_sampling: refuse data that no tf_megadp Poisson
            sampler drew (arrays, other datasets), whose epsilon is only an
            estimate. The main job's default.
        log_nonfinite_examples: add the number of examples of the current
            logical step whose gradient was not finite to the training logs.
            Off by default: the exact count is a statistic outside epsilon
            (a record known to produce NaN reveals its membership).

    Returns:
        The same model, with a private train step.

    Raises:
        PrivacyConfigurationError: the model contains layers that mix
            examples (BatchNormalization), or overrides `train_step`.

    Example:
    ```python
    model = tf_megadp.make_private(keras.Sequential([...]))
    model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1),
                  l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    model.fit(x, y, batch_size=32, callbacks=[tf_megadp.PrivacyCallback(delta=1e-5)])
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"make_private expects a keras.Model, got {type(model).__name__}.")
    check_no_example_mixing(model)
    # mixed_float16: the DPOptimizer scales each example's loss itself.
    unwrap_loss_scale_optimizer(model)
    overridden = type(model).train_step is not keras.Model.train_step
    if overridden and not is_private(model):
        raise PrivacyConfigurationError(
            f"{type(model).__name__} overrides train_step, which make_private "
            "must replace with the DP step. Move custom loss logic into "
            "`compute_loss` (it is evaluated per example) and remove train_step."
        )
    model.train_step = functools.partial(
        _private_train_step, model, log_nonfinite_examples=bool(log_nonfinite_examples))
    model._tf_megadp_log_nonfinite = bool(log_nonfinite_examples)
    if not is_private(model):
        model.compile = _compile_advancing_generation(model, type(model).compile.__get__(model))
        model.fit = _private_fit(model, type(model).fit.__get__(model))
        model.evaluate = _noted_evaluate(model, type(model).evaluate.__get__(model))
        model.load_weights = ledger_preserving_load(model, type(model).load_weights.__get__(model))
        model.save = ledger_preserving_save(model, type(model).save.__get__(model))
        model.save_weights = atomic_save(type(model).save_weights.__get__(model), model)
        model.set_weights = weights_origin.set_weights_guard(
            model, type(model).set_weights.__get__(model))
    # Weights set after this point need a declaration before a first private fit.
    weights_origin.note_starting_weights(model)
    model._tf_megadp_require_poisson = bool(require_poisson_sampling)
    mark_private(model)
    # A train function traced before holds the previous train step: fit
    # traces it again, and a traced step kept from before refuses to run.
    model.train_function = None
    advance_generation(model)
    return model


def _compile_advancing_generation(model: keras.Model, original_compile):
    """A private model's `compile`: steps traced for the previous optimizer then refuse to run."""

    @functools.wraps(original_compile)
    def compile(*args, **kwargs):
        result = original_compile(*args, **kwargs)
        unwrap_loss_scale_optimizer(model)
        advance_generation(model)
        return result

    return compile


def make_private_with_epsilon(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    sampler,
    *,
    target_epsilon: float,
    delta: float,
    l2_norm_clip: float,
    accountant: str = "pld",
    clipping: str = "auto",
    noise=None,
    **compile_kwargs,
) -> keras.Model:
    """Makes `model` private with the noise that spends `target_epsilon` over `sampler`'s run.

    The noise multiplier is calibrated from what the sampler will draw (its
    N, the expected batch of every step, their number and the static
    capacity that truncates them), the `DPOptimizer` is built on the same
    schedule, and the model is compiled with it. Training all of
    `sampler.as_dataset()` then spends at most `target_epsilon` (within 1 %);
    add `PrivacyCallback(delta, target_epsilon=...)` to report it and to stop
    at the budget. When the model holds values an earlier DP run trained (a
    release loaded in any way), the budget covers that run's ledger too,
    which the private run composes first (`tf_megadp.declare_disjoint_data`
    states that its data share no example with this run's).

    Args:
        model: the Keras model.
        optimizer: the inner Keras optimizer (Adam, SGD, ...).
        sampler: a tf_megadp Poisson sampler (e.g.
            `PoissonSampler.from_arrays(x, y, batch_size=..., epochs=...,
            micro_batch_size=...)`, or a `PrivacyUnitSampler`, whose units
            are then clipped whole) starting at step 0.
        target_epsilon: the budget.
        delta: the target delta, at most 1/N.
        l2_norm_clip: C, the per-example gradient norm bound.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        clipping: the per-example clipping strategy (`DPOptimizer`'s `clipping`).
        noise: None (independent noise), or a registered noise mechanism
            (`DPOptimizer`'s `noise`, `tf_megadp.accounting.noise`): sigma is then
            calibrated for the mechanism with the sampler's cycle length (a
            `PoissonSampler(cycle_length=L)`) or fixed order (a
            `FixedOrderSampler`); a pairing without proof is refused.
        **compile_kwargs: passed to `model.compile` (loss, metrics, ...).

    Returns:
        The model, private and compiled.

    Example:
    ```python
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=256, epochs=3,
                                                   micro_batch_size=32)
    model = tf_megadp.make_private_with_epsilon(
        model, keras.optimizers.Adam(1e-3), sampler, target_epsilon=3.0, delta=1e-5,
        l2_norm_clip=1.0, loss="sparse_categorical_crossentropy")
    model.fit(sampler.as_dataset(), callbacks=[tf_megadp.PrivacyCallback(1e-5)])
    ```
    """
    from tf_megadp.accounting import PrivacyAccountant, calibrate_noise_multiplier

    source = getattr(sampler, "source", None)
    # Calibration plans the whole schedule, so the steps must follow it, and
    # the epsilon it targets must be a guarantee, not an estimate.
    if (source is None or not (source.kind.follows_schedule and source.kind.proven_guarantee)
            or source.start_step != 0):
        raise PrivacyConfigurationError(
            "make_private_with_epsilon calibrates the noise for a whole run of "
            "Poisson draws: pass a tf_megadp Poisson sampler that starts at step 0 "
            "(e.g. tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=..., "
            f"epochs=..., micro_batch_size=...)), got {sampler!r}."
        )
    make_private(model)
    # Values an earlier DP run trained spend its privacy first: the run
    # composes that ledger before its first step, so the budget covers both.
    prior = weights_origin.composable_ledger(model)
    if prior is not None:
        spent = PrivacyAccountant(source.num_examples, delta, accountant=accountant,
                                  ledger=prior).epsilon()
        if spent >= target_epsilon:
            raise PrivacyConfigurationError(
                f"This model holds values a DP run trained: its {prior.total_steps} logical "
                f"steps, which a private run composes first, already spend epsilon "
                f"{spent:.4g} at delta {delta:g} on these {source.num_examples} examples, "
                f"more than target_epsilon {target_epsilon}. Raise target_epsilon, or, if "
                "this run's data share no example with that run's, declare it before this "
                "call: tf_megadp.declare_disjoint_data(model, statement='...').")
    try:
        sigma = calibrate_noise_multiplier(
            target_epsilon, delta, schedule=source.schedule, sampling=source.sampling,
            cycle_length=source.cycle_length, noise=noise, accountant=accountant,
            prior=prior)
    except ValueError as error:
        if prior is None:
            raise
        raise PrivacyConfigurationError(
            f"This model holds values a DP run trained, whose {prior.total_steps} logical "
            f"steps the run composes first, and no noise reaches target_epsilon "
            f"{target_epsilon} on top of them ({error}) Raise target_epsilon, or, if this "
            "run's data share no example with that run's, declare it before this call: "
            "tf_megadp.declare_disjoint_data(model, statement='...').") from None
    model.compile(
        optimizer=DPOptimizer(optimizer, l2_norm_clip=l2_norm_clip, noise_multiplier=sigma,
                              schedule=source.schedule, clipping=clipping,
                              # A PrivacyUnitSampler's units are clipped whole.
                              examples_per_unit=source.examples_per_unit, noise=noise),
        **compile_kwargs,
    )
    return model


def _private_fit(model: keras.Model, original_fit):
    signature = inspect.signature(original_fit)

    @functools.wraps(original_fit)
    def fit(*args, **kwargs):
        arguments = {}
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)  # keras-hub tasks take fit(x, y, ..., **kwargs).
            else:
                arguments[name] = value
        if arguments.get("class_weight") is not None:
            raise PrivacyConfigurationError(
                "class_weight is not supported by the DP step. Put per-class "
                "weights into sample_weight of your dataset instead: they then "
                "scale each example's loss before clipping, which keeps the "
                "sensitivity bound."
            )
        if tags.tag_key_of(arguments.get("x")) is not None:
            raise PrivacyConfigurationError(
                "This is a sampler's tagged dataset, whose elements are (batch, tag) for "
                "a custom loop's PrivateStep. fit reads the sampler's dataset itself: "
                "pass sampler.as_dataset(...) without tagged=True.")
        callbacks = list(arguments.get("callbacks") or [])
        privacy = [c for c in callbacks if isinstance(c, PrivacyCallback)]
        source = fit_source(arguments)
        if source is not None and isinstance(arguments.get("x"), tf.data.Dataset):
            distribute.build_without_reading(model, arguments["x"].element_spec)
        data = arguments.get("x")
        callbacks, ran_out = _restore_backup(model, arguments, callbacks, source)
        if arguments.get("x") is not data:  # A sampler's dataset, continued.
            source = fit_source(arguments)
        if (source is not None and isinstance(arguments.get("x"), tf.data.Dataset)
                and "shuffle" not in arguments):
            # Its order is the sampler's draws. Keras ignores shuffle for a
            # dataset, and would warn of its default on every fit (issue 47).
            arguments["shuffle"] = False
        keeper = LedgerKeeper(
            source=source,
            stated_num_examples=privacy[0].num_examples if privacy else None,
            require_poisson_sampling=model._tf_megadp_require_poisson,
            micro_batch_size=array_micro_batch_size(arguments),
            nothing_to_train=arguments.get("initial_epoch", 0) >= arguments.get("epochs", 1),
            validation=(arguments.get("validation_data") is not None
                        or bool(arguments.get("validation_split"))),
        )
        # First, so that every other callback sees the ledger it kept. The
        # mixing guard raises when a step compiled whole with XLA (whose
        # assertions are dropped) reports that its batched forward pass mixed
        # examples.
        arguments["callbacks"] = [keeper, independence.RefuseMixingCallback()] + callbacks
        notes = run_notes(model)
        # The first step of a fit checks independence again, forward and
        # backward, unless it continues the last fit on the same data, model
        # and state (clipping.verdicts): mixing that depends on the data
        # shows on new data.
        strategy = getattr(model.optimizer, "clipping_strategy", None)
        if hasattr(strategy, "begin_fit"):
            strategy.begin_fit(model, data_identity(arguments))
        elif hasattr(strategy, "reset_checks"):
            strategy.reset_checks(model)
        try:
            with warnings.catch_warnings():
                if ran_out:
                    # Expected: see _restore_backup.
                    warnings.filterwarnings("ignore", message="Your input ran out of data")
                history = original_fit(**arguments)
            if hasattr(strategy, "end_fit"):
                strategy.end_fit(model)
            return history
        except tf.errors.InvalidArgumentError as error:
            # The independence assertions: the clipping strategy's in the
            # step, the sampler's on its map_fn in the input pipeline.
            converted = (independence.error_from_assertion(
                model, error, getattr(strategy, "name", "ghost"))
                or map_independence.error_from_assertion(error)
                or stale_step_error(error))
            if converted is None:
                raise
            raise converted from None
        finally:
            if notes.in_fit:  # fit raised: Keras skipped on_train_end
                notes.end_fit(model)

    return fit


def _restore_backup(model, arguments, callbacks, source):
    """Restores a `keras.callbacks.BackupAndRestore` backup before `fit` starts.

    The user's `BackupAndRestore` is replaced by a `tf_megadp.run.backup.PrivateBackup`
    with its settings. When a backup exists it is loaded now, and `fit`'s
    arguments continue the run from it: a sampler's dataset from the
    restored logical step (and the epoch holding it), other data from the
    epoch the backup was taken in.

    Returns:
        (callbacks, ran_out): the callbacks to use, and whether Keras will find
        the sampler's dataset shorter than its last epoch (a restored step
        inside an epoch shifts the epochs by the micro-batches before it).
        A backup that holds every step of the sampler sets `initial_epoch`
        to `epochs`: the fit trains nothing.
    """
    backups = [c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)]
    if not backups:
        return callbacks, False
    if len(backups) > 1:
        raise ValueError("Pass at most one keras.callbacks.BackupAndRestore to fit.")
    backup = PrivateBackup(backups[0], resumes_inside_epoch=bool(
        source is not None and source.schedule is not None))
    callbacks = [backup if c is backups[0] else c for c in callbacks]
    position = backup.restore(model)
    if position is None:
        return callbacks, False
    if source is None or source.schedule is None:
        arguments["initial_epoch"] = position["epoch"]
        return callbacks, False
    step = position["logical_step"]
    arguments["x"] = sources.resumed_at(arguments["x"], step)
    consumed = sum(source.schedule.phase_at(t).accumulation_steps
                   for t in range(source.start_step, step))
    steps_per_epoch = arguments.get("steps_per_epoch")
    if source.end_step is not None and step >= source.end_step:
        arguments["initial_epoch"] = arguments.get("epochs", 1)
    elif steps_per_epoch:
        arguments["initial_epoch"] = consumed // steps_per_epoch
    return callbacks, bool(steps_per_epoch and consumed % steps_per_epoch)


def _noted_evaluate(model: keras.Model, original_evaluate):
    """`evaluate` that notes, for the privacy report, that its metrics were released.

    Keras's `fit` evaluates its validation data through `model.evaluate`
    too. Whatever data is evaluated, its metrics are exact statistics
    computed outside the DP step.
    """

    @functools.wraps(original_evaluate)
    def evaluate(*args, **kwargs):
        run_notes(model).release(EVALUATION_METRICS)
        return original_evaluate(*args, **kwargs)

    return evaluate

def extend_schedule(
    model: keras.Model,
    phases,
    *,
    truncation_probability: float = 1e-9,
) -> BatchSizeSchedule:
    """Extends a private run with more phases: the one call to train further after its schedule.

    The model's `DPOptimizer` continues as it is (ledger, inner optimizer's
    moments and step count, settings); only its schedule gains phases
    after the ones already trained, and the compiled step is traced again.
    Train the new steps with a sampler of the returned schedule that starts
    where the run stopped; the privacy report then composes every step.

    Args:
        model: the private model, compiled with a `DPOptimizer` that follows
            a schedule (a run with a fixed `accumulation_steps` has no end:
            call `fit` again).
        phases: the phases to add, each a `tf_megadp.Phase` or a
            (steps, expected batch size) pair sized like
            `BatchSizeSchedule.for_poisson`.
        truncation_probability: as in `BatchSizeSchedule.for_poisson`.

    Returns:
        The extended schedule (the old phases, then the new ones).

    Raises:
        PrivacyConfigurationError: the model is not compiled with a
            `DPOptimizer` that follows a schedule.

    Example:
    ```python
    schedule = tf_megadp.extend_schedule(model, [(50, 512)])
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, y, schedule=schedule, start_step=int(model.optimizer.iterations))
    model.fit(sampler.as_dataset(), callbacks=[tf_megadp.PrivacyCallback(1e-5)])
    ```
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        raise PrivacyConfigurationError(
            f"extend_schedule extends a private run; the model is compiled with "
            f"{optimizer!r}, not a tf_megadp.DPOptimizer."
        )
    schedule = optimizer.extend_schedule(list(phases), truncation_probability)
    # The compiled step holds the phases as constants: trace it again (and
    # a custom loop's traced step refuses until it is).
    model.train_function = None
    advance_generation(model)
    return schedule


def _private_train_step(model: keras.Model, data, *, log_nonfinite_examples: bool = False):
    """The train step `make_private` installs: the logs of `private_step`.

    A train function kept from before a `compile` (or `make_private`) would
    train through the optimizer it was traced with, outside the ledger the
    model reports: it refuses at run time (`current_generation`).
    """
    return private_step(model, data, log_nonfinite_examples=log_nonfinite_examples,
                        admitted=current_generation(model)).logs
