"""The training of a pretraining run: the model, the inner optimizer, the private fit or loop, checkpoints."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from tf_megadp.files import write_json_atomically
from tf_megadp.jobs.bert.config import (
    MODEL_PRESETS,
    PretrainConfig,
    PretrainError,
)
from tf_megadp.jobs.bert.prepare import vocabulary_report
from tf_megadp.jobs.bert.run_files import (
    CANARIES_NAME,
    CANARY_REPETITIONS,
    PATH_FIELDS,
    RELEASED_OUTSIDE_EPSILON,
    mechanism_description,
    run_summary,
)
from tf_megadp.jobs.common import fitting, run_folder
from tf_megadp.jobs.common.run_folder import (
    CHECKPOINT_NAME,
    HISTORY_NAME,
    INIT_KEY,
    LORA_FACTORS_KEY,
    MODEL_NAME,
    PLOT_NAME,
    PRIVACY_REPORT_NAME,
    REPORT_NAME,
    VOCABULARY_NAME,
    config_dict,
)


def build_model(config: PretrainConfig, vocabulary_size: int):
    """The job's `keras_hub.models.BertMaskedLM` for `config` (preset, L, dropout, precision).

    Under `precision="mixed_bfloat16"` (or "mixed_float16") the encoder
    computes in bfloat16 (float16) and the MLM head in float32. keras-hub
    0.32's `MaskedLMHead` does not autocast its variables (`autocast=False`,
    as it reads the shared token embedding) and adds its float32 output bias
    to logits cast to the compute dtype: in bfloat16 that addition raises.
    With a float32 head the tied embedding still runs the vocabulary
    projection in 16 bits (its own layer autocasts), the logits are cast to
    float32 before the bias, and the softmax over V classes is float32, as
    TPU recipes keep it.
    Variables stay float32 either way; tf_megadp keeps per-example norms,
    accumulators and noise in float32.

    Args:
        config: the run's settings.
        vocabulary_size: V of the prepared vocabulary.
    """
    import keras_hub

    layers, hidden, heads, intermediate = config.architecture()
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary_size,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        max_sequence_length=config.max_sequence_length or config.sequence_length,
        dropout=config.dropout,
        # float32 is Keras's default: only a mixed policy is passed on.
        dtype=None if config.precision == "float32" else config.precision,
    )
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    if config.precision != "float32":
        # The head's own call (gather, dense, norm, projection, bias) follows
        # its policy; its sub-layers keep the backbone's 16-bit policy.
        model.masked_lm_head.dtype_policy = "float32"
    return model


def _inner_optimizer(config: PretrainConfig, schedule, accumulation_steps: int | None):
    """AdamW with linear warmup and cosine decay over the logical steps.

    The learning rate of each phase is scaled with its batch as
    `config.learning_rate_scaling` says (`BatchScaledSchedule`), and the
    weights are averaged when `config.ema_momentum` is set.

    `accumulation_steps` is for the non-private baseline, which accumulates
    with Keras's own `gradient_accumulation_steps`; Keras then advances the
    learning-rate schedule every micro-batch, so its horizon is scaled to match.
    """
    import keras

    from tf_megadp.jobs.bert.config import LEARNING_RATE_SCALINGS
    from tf_megadp.jobs.common.fitting import warmup_cosine_learning_rate
    from tf_megadp.learning_rate import BatchScaledSchedule

    scale = accumulation_steps or 1
    learning_rate = warmup_cosine_learning_rate(config.learning_rate, config.warmup_steps,
                                                schedule.total_steps, scale)
    power = LEARNING_RATE_SCALINGS[config.learning_rate_scaling]
    if power:
        learning_rate = BatchScaledSchedule.for_batch_schedule(
            learning_rate, schedule, reference_batch_size=config.reference_batch_size,
            power=power, steps_per_logical_step=scale)
    ema = {} if config.ema_momentum is None else {"use_ema": True,
                                                  "ema_momentum": config.ema_momentum}
    return keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=config.weight_decay,
                                  beta_1=config.beta_1, beta_2=config.beta_2,
                                  gradient_accumulation_steps=accumulation_steps, **ema)


# The second word of a fixed evaluation set's masking key (public, from
# --seed): evaluation sets are not trained on, so their masks may be public.
_FIXED_SET_KEY = -1


def masked_rows(rows: np.ndarray, batcher, seed: int):
    """(x, y, sample_weight) as NumPy arrays: `rows` masked once, a function of `seed` alone.

    For fixed evaluation sets (held-out split, audit), outside the DP step:
    the key [seed, -1] is public.

    Args:
        rows: int [n, L] token rows.
        batcher: the `MaskedLMBatcher` whose masking to apply.
        seed: the public masking seed of this set.

    Returns:
        `(x, y, sample_weight)` of the n rows.
    """
    import tensorflow as tf

    x, y, w = batcher(
        tf.constant(rows.astype(np.int32)), tf.ones([len(rows)], tf.float32),
        key=tf.constant([seed, _FIXED_SET_KEY], tf.int64))
    return {k: v.numpy() for k, v in x.items()}, y.numpy(), w.numpy()


def heldout_batches(heldout, batcher, micro_batch_size: int, seed: int):
    """Fixed masked batches of the held-out set, identical at every evaluation (and in every run).

    Args:
        heldout: the held-out `TokenShards`.
        batcher: the run's `MaskedLMBatcher`.
        micro_batch_size: m; the rows are cut to a multiple of m.
        seed: the run's public seed.

    Returns:
        `(x, y, sample_weight)`, as `masked_rows`.
    """
    rows = heldout.read(np.arange(len(heldout)))
    size = len(rows) - len(rows) % micro_batch_size or len(rows)
    return masked_rows(rows[:size], batcher, seed)


def unigram_accuracy(train, heldout_y, heldout_w, vocabulary_size: int) -> float:
    """Accuracy of always predicting the most frequent training token (id > 4)."""
    counts = np.zeros(vocabulary_size, np.int64)
    for start in range(0, len(train), 65536):
        rows = train.read(np.arange(start, min(start + 65536, len(train))))
        counts += np.bincount(rows.ravel(), minlength=vocabulary_size)
    counts[:5] = 0  # [PAD], [UNK], [CLS], [SEP], [MASK] are never targets.
    best = int(np.argmax(counts))
    return float(np.sum((heldout_y == best) * heldout_w) / np.sum(heldout_w))


def _divisor_at_most(total: int, wanted: int) -> int:
    for count in range(min(wanted, total), 0, -1):
        if total % count == 0:
            return count
    return 1


def _compile_kwargs(private: bool):
    import keras

    return {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy(name="mlm_accuracy")],
        # Keras leaves XLA off on CPU-only machines; the DP step compiles its
        # per-example pass with XLA, so the baseline must too to compare fairly.
        "jit_compile": not private,
        # mixed_float16: the DPOptimizer scales each example's loss by its fixed
        # loss_scale; Keras's LossScaleOptimizer (a dynamic scale, not private)
        # is left out, also when a checkpoint's optimizer is compiled on resume.
        # The baseline keeps it.
        "auto_scale_loss": not private,
    }


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every phase of `run_training` reads: the run's settings, data and place.

    Attributes:
        config: the run's settings.
        schedule: its `BatchSizeSchedule`.
        sigma, delta: the run's noise multiplier and delta (None for the
            non-private baseline).
        train, heldout: the training and held-out `TokenShards`.
        strategy: the `tf.distribute` strategy.
        output_dir: where the run's files go.
        started: `time.time()` when the job started.
        log: prints one progress message.
        testing: the test-only seeds, or None.
        init: the `InitialWeights` the run started from (--init-from), or None.
        noise_choice: what --bands auto chose (`PrivacySettings.with_chosen_noise`),
            or None.
    """

    config: PretrainConfig
    schedule: Any
    sigma: float | None
    delta: float | None
    train: Any
    heldout: Any
    strategy: Any
    output_dir: str
    started: float
    log: Callable[[str], None]
    testing: Any = None
    init: Any = None
    noise_choice: dict[str, Any] | None = None

    @property
    def private(self) -> bool:
        return not self.config.non_private


class _HeldOut(NamedTuple):
    """The held-out set, masked once, and the accuracy a model that learned nothing reaches."""

    x: dict[str, np.ndarray]
    y: np.ndarray
    sample_weight: np.ndarray
    unigram_accuracy: float


@dataclasses.dataclass
class _Start:
    """Where this start of the run begins: a fresh model, or the run's checkpoint.

    Attributes:
        history: one evaluation per epoch of the earlier starts (appended to
            by this one).
        resumes: the logical step each --resume of this run started from.
        resumed_from: the logical step this start resumed from (0: fresh).
        learning_rate_source: where the learning rate came from.
    """

    history: list[dict[str, Any]]
    resumes: list[int]
    resumed_from: int
    learning_rate_source: str


def run_training(config, schedule, sigma, delta, planned_epsilon, train, heldout,
                 strategy, output_dir, started, log, testing=None,
                 learning_rate_source="given", init=None,
                 noise_choice=None) -> dict[str, Any]:
    """Trains the planned run (or continues it with --resume), releases it and reports.

    Args:
        config: the run's settings.
        schedule: the `BatchSizeSchedule` the run follows.
        sigma, delta, planned_epsilon: the planned privacy (ignored by the
            non-private baseline).
        train, heldout: the prepared `TokenShards`.
        strategy: the `tf.distribute` strategy.
        output_dir: the run's directory.
        started: `time.time()` when the job started.
        log: prints one progress message.
        testing: test-only seeds, or None.
        learning_rate_source: where the learning rate came from.
        init: the `InitialWeights` of --init-from (of the run's first
            start, on a resume), or None.
        noise_choice: what --bands auto chose, or None.

    Returns:
        The run's report (report.json).
    """
    from tf_megadp import distribute

    job = _Job(config, schedule, sigma, delta, train, heldout, strategy, output_dir, started,
               log, testing, init, noise_choice)
    batcher, heldout_set = _prepare_evaluation(job)
    model, start = _model_of_this_start(job, learning_rate_source)
    logical_done = _announce_progress(job, model)
    sampler = _sampler_of_this_start(job, logical_done)
    # Fed to fit as the sampler returned it (a derived dataset is refused).
    # With R replicas on this host, Keras splits each m * R-row micro-step
    # along its rows, replica r taking rows [r*m, (r+1)*m): the layout
    # distribute.replica_micro_batches gives one input pipeline. keras-hub
    # tasks cannot take a tf.distribute DistributedDataset in fit.
    # Keras's fit cannot run under several workers: there the same private
    # step runs in a custom loop that drives the same callbacks, and checks
    # each micro-batch's tag (the tagged dataset's elements are (batch, tag)).
    several_workers = distribute._worker_count(strategy) > 1
    dataset = sampler.as_dataset(batcher, tagged=job.private and several_workers)
    if not job.private:  # The private fit does this itself.
        distribute.build_without_reading(model, dataset.element_spec)
    epochs, steps_per_epoch = _epochs_of(sampler, config.eval_every)
    # The epochs of earlier starts (one per evaluation in the history): a
    # resumed run's epochs, in history.csv and TensorBoard, count on from them.
    initial_epoch = len(start.history)

    chief = distribute.is_chief(strategy)
    privacy = _privacy_callback(job, chief) if job.private else None
    checkpointer = run_folder.Checkpointer(output_dir, lambda: _checkpoint_record(job, start),
                                           enabled=chief)
    callbacks = [privacy] if privacy else []
    callbacks.append(_evaluation_callback(job, heldout_set, start.history, privacy, checkpointer,
                                          logical_done, several_workers))
    if chief:
        callbacks += run_folder.log_callbacks(output_dir, config.resume)
    _announce_training(job, start.learning_rate_source, planned_epsilon, sampler)
    train_time = fitting.fit_run(
        model, dataset, strategy=strategy, several_workers=several_workers,
        callbacks=callbacks, epochs=initial_epoch + epochs, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch, verbose=run_folder.progress_verbosity(config.verbose))

    final_steps = start.history[-1]["step"] if start.history else logical_done
    if not epochs:
        checkpointer.save(model)
    if chief:
        # The vocabulary is public unless --vocabulary-from-training-corpus.
        run_folder.export_release(model, output_dir, os.path.join(
            job.train.directory, job.train.manifest["vocabulary_file"]))
    report = run_folder.publishable(
        _report(job, model, sampler, privacy, start, heldout_set, final_steps=final_steps,
                train_time=train_time), output_dir, PATH_FIELDS)
    if chief:
        write_json_atomically(os.path.join(output_dir, REPORT_NAME), report)
        if start.history:
            run_folder.plot_history(start.history, os.path.join(output_dir, PLOT_NAME),
                                    "heldout_mlm_accuracy", "held-out MLM accuracy",
                                    job.private)
    log(run_summary(report, output_dir))
    return report


def _checkpoint_record(job: _Job, start: _Start) -> dict[str, Any]:
    """What the run's checkpoint keeps beside its training state."""
    return {
        "history": start.history,
        "resumes": start.resumes,
        "config": config_dict(job.config),
        # The saved config holds the rate as a number: where it came from
        # is kept beside it, so that a resumed run reports it.
        "learning_rate_source": start.learning_rate_source,
        # Where the run started (a resume reports it and composes the
        # same release ledger when it plans sigma again).
        INIT_KEY: job.init.to_dict() if job.init else None,
    }


def _prepare_evaluation(job: _Job):
    """(the training batcher, the held-out set): the public randomness of the run is set here."""
    import keras

    config = job.config
    # Public randomness only (initialisation, the held-out masks): the
    # sampling, the training masks (keyed by the sampler's secret and each
    # example's content), dropout (keyed by the private step's secret) and
    # the noise draw secret OS entropy, which this seed never reaches.
    keras.utils.set_random_seed(config.seed)
    return heldout_set(job.train, job.heldout, config)


def heldout_set(train, heldout, config: PretrainConfig):
    """(the run's batcher, the held-out set masked once, with its unigram baseline).

    What every evaluation of a run on these splits scores: the job's, and
    `tf-megadp evaluate`'s.

    Args:
        train, heldout: the prepared `TokenShards` of the two splits.
        config: the run's settings (max_predictions, micro_batch_size, seed).
    """
    from tf_megadp.jobs.bert import text

    batcher = text.MaskedLMBatcher.from_shards(train, max_predictions=config.max_predictions)
    x, y, w = heldout_batches(heldout, batcher, config.micro_batch_size, config.seed)
    unigram = unigram_accuracy(train, y, w, train.vocabulary_size)
    return batcher, _HeldOut(x, y, w, unigram)


def _model_of_this_start(job: _Job, learning_rate_source: str):
    """(model, `_Start`): the run's model restored from its checkpoint (--resume) or new, made private.

    Raises:
        PretrainError: the checkpoint holds a private run and this one is
            the baseline, or the other way round.
    """
    import tf_megadp

    from tf_megadp.jobs.bert import initial_weights, trainable

    start = _Start(history=[], resumes=[], resumed_from=0,
                   learning_rate_source=learning_rate_source)
    with job.strategy.scope():
        model = build_model(job.config, job.train.vocabulary_size)
        if job.config.resume:
            # LoRA first: the checkpoint holds the factors' optimizer state.
            trainable.restrict_training(model, job.config)
            start = _restore(job, model, learning_rate_source)
        else:
            if job.init is not None:
                # Before LoRA, whose factors a load would zero.
                initial_weights.load_into(model, job.init)
            trainable.restrict_training(model, job.config)
            model.compile(optimizer=_new_optimizer(job), **_compile_kwargs(job.private))
            model.optimizer.build(model.trainable_variables)
        if job.private:
            if not isinstance(model.optimizer, tf_megadp.DPOptimizer):
                raise PretrainError(
                    f"{job.output_dir} holds a non-private run; resume it with --non-private.")
            # Strict: data that no tf_megadp Poisson sampler drew is refused.
            tf_megadp.make_private(model, require_poisson_sampling=True)
            if job.init is not None and not job.config.resume:
                # A release's ledger starts this run's; other weights are named.
                initial_weights.declare(model, job.init, job.config)
        elif isinstance(_unwrapped(model.optimizer), tf_megadp.DPOptimizer):
            raise PretrainError(
                f"{job.output_dir} holds a private run; resume it without --non-private.")
    return model, start


def _unwrapped(optimizer):
    """The optimizer inside the `LossScaleOptimizer` a baseline's mixed_float16 compile adds."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _restore(job: _Job, model, learning_rate_source: str) -> _Start:
    """Restores the run's checkpoint into `model` and says where this start resumes."""
    from tf_megadp.run.training_state import restore_training_state

    # Its settings were checked against config before the corpus was prepared.
    directory = os.path.join(job.output_dir, CHECKPOINT_NAME)
    state = restore_training_state(model, directory, _compile_kwargs(job.private))
    # Keras loads a LoRA layer's merged kernel into W and zeros A and B.
    run_folder.restore_lora_factors(model, job.output_dir, state.get(LORA_FACTORS_KEY))
    resumed_from = int(model.optimizer.iterations.numpy())
    return _Start(
        history=state.get("history", []),
        resumes=state.get("resumes", []) + [resumed_from],
        resumed_from=resumed_from,
        # A resume cannot change the rate (check_same_run), so the started
        # run's account of it still holds.
        learning_rate_source=state.get("learning_rate_source", learning_rate_source))


def _new_optimizer(job: _Job):
    """The optimizer of a new run: a `DPOptimizer` around AdamW, or the baseline's AdamW."""
    from tf_megadp.jobs.common.privacy import new_dp_optimizer

    config, schedule = job.config, job.schedule
    if not job.private:
        k = schedule.phases[0].accumulation_steps
        return _inner_optimizer(config, schedule, k if k > 1 else None)
    return new_dp_optimizer(
        config, _inner_optimizer(config, schedule, None), schedule, job.sigma,
        examples_per_unit=config.examples_per_unit if config.privacy_unit else 1,
        # Fixed, never Keras's dynamic scale (docs/concepts.md, "Float16 compute").
        loss_scale=config.loss_scale if config.precision == "mixed_float16" else None,
        seed=None if job.testing is None else job.testing.noise_seed)


def _announce_progress(job: _Job, model) -> int:
    """The logical steps the model has done, after saying so for a completed or resumed run."""
    # Keras's own accumulation (non-private) also counts logical steps in
    # iterations. A restored DPOptimizer is always at a logical-step boundary
    # (its mid-step state is never saved).
    logical_done = int(model.optimizer.iterations.numpy())
    total_steps = job.schedule.total_steps
    if logical_done >= total_steps:
        job.log(f"The run in {job.output_dir} already completed {logical_done} logical steps.")
    elif job.config.resume:
        spent = "non-private baseline"
        if job.private:
            import tf_megadp
            from tf_megadp import accounting

            ledger = tf_megadp.model_ledger(model)
            if ledger.infinite_epsilon_steps:
                # Steps without noise (sigma 0, a clipped baseline): the
                # accountant refuses them, and epsilon is infinite.
                spent = (f"epsilon so far infinite: {ledger.infinite_epsilon_steps} steps "
                         "without noise")
            else:
                so_far = accounting.PrivacyAccountant(
                    job.schedule.num_examples, job.delta, accountant=job.config.accountant,
                    ledger=ledger).epsilon()
                spent = f"epsilon so far {so_far:.2f}"
        job.log(f"Resuming at logical step {logical_done} of {total_steps} ({spent}).")
    return logical_done


def _sampler_of_this_start(job: _Job, logical_done: int):
    """The sampler of the steps this start trains: from `logical_done` to the end or the stop."""
    from tf_megadp import data, distribute
    from tf_megadp.jobs.bert.units import load_unit_ids

    config, total_steps = job.config, job.schedule.total_steps
    start_step = min(logical_done, total_steps)
    end_step = total_steps
    if config.stop_after_steps:
        end_step = min(total_steps, start_step + config.stop_after_steps)
    # The draws must stay secret: they come from a fresh 128-bit OS-entropy
    # secret (the chief's, shared in memory with every worker), never from
    # --seed, which report.json records. A resumed run draws fresh steps for
    # what remains, as private as those the interrupted run would have drawn.
    # The secret is passed straight on, so that no local of this frame (and
    # no traceback) holds it.
    # With a privacy unit, the sampler draws units and lays out k rows each.
    units = ({} if not config.privacy_unit else
             {"unit_ids": load_unit_ids(job.train), "privacy_unit": config.privacy_unit,
              "examples_per_unit": config.examples_per_unit})
    sampler_class = data.PrivacyUnitSampler if units else data.PoissonSampler
    # Correlated noise is accounted over the sampling its proof needs (its
    # mechanism's `accounted_sampling`: cyclic Poisson groups, or one secret
    # order kept every epoch). A resumed run draws a new order or new groups,
    # and its optimizer a new noise segment: each is accounted on its own.
    options = dict(units)
    sampling = config.noise_accounting()
    if sampling.get("sampling") == "fixed_order":
        sampler_class = data.FixedOrderSampler
    if sampling.get("cycle_length", 1) > 1:
        options["cycle_length"] = sampling["cycle_length"]
    if job.testing is None:
        return sampler_class(
            job.train, job.schedule,
            shared_secret=distribute.shared_sampling_secret(job.strategy),
            start_step=start_step, end_step=end_step, **options)
    return sampler_class(job.train, job.schedule, seed=job.testing.sampling_seed,
                         start_step=start_step, end_step=end_step, **options)


def _epochs_of(sampler, eval_every: int) -> tuple[int, int]:
    """(epochs, micro-steps per epoch) of this start: one evaluation every `eval_every` steps.

    One fit step consumes one micro-batch per replica, a sampler micro-step;
    the epochs divide the micro-steps evenly.
    """
    remaining_micro = sampler.total_micro_steps
    evaluations = max(1, math.ceil((sampler.end_step - sampler.start_step) / eval_every))
    epochs = _divisor_at_most(remaining_micro, evaluations) if remaining_micro else 0
    return epochs, remaining_micro // epochs if epochs else 0


def _privacy_callback(job: _Job, chief: bool):
    """The `PrivacyCallback`: epsilon in the logs, privacy.json (chief), the budget stop."""
    import tf_megadp

    config = job.config
    return tf_megadp.PrivacyCallback(
        delta=job.delta, accountant=config.accountant,
        report_path=os.path.join(job.output_dir, PRIVACY_REPORT_NAME) if chief else None,
        target_epsilon=config.target_epsilon if config.noise_multiplier is None else None)


def _evaluation_callback(job: _Job, heldout_set: _HeldOut, history: list, privacy,
                         checkpointer, logical_done: int, several_workers: bool):
    """Held-out MLM accuracy and epsilon at every epoch end, and checkpoints on the run's cadence."""
    import keras

    config = job.config

    def evaluate(model) -> dict[str, float]:
        # With weight averaging, the held-out accuracy is the average's:
        # the weights the run exports (fit leaves the average in the model).
        swap = [keras.callbacks.SwapEMAWeights()] if config.ema_momentum else None
        if several_workers:
            accuracy = fitting.weighted_accuracy(model, heldout_set.x, heldout_set.y,
                                                 heldout_set.sample_weight,
                                                 config.micro_batch_size, swap)
        else:
            _, accuracy = model.evaluate(
                heldout_set.x, heldout_set.y, sample_weight=heldout_set.sample_weight,
                batch_size=config.micro_batch_size, verbose=0, callbacks=swap)
        return {"heldout_mlm_accuracy": float(accuracy)}

    def clip_norm(model) -> dict[str, float]:
        if config.adaptive_clipping_quantile is None:
            return {}
        return {"clip_norm": float(model.optimizer.clip_norm.numpy())}

    return run_folder.progress_callback(
        private=job.private,
        accumulation=1 if job.private else job.schedule.phases[0].accumulation_steps,
        logical_done=logical_done, checkpointer=checkpointer,
        checkpoint_every=config.checkpoint_every, checkpoint_minutes=config.checkpoint_minutes,
        evaluate=evaluate, history=history, privacy=privacy, started=job.started,
        train_metrics={"mlm_accuracy": "train_mlm_accuracy"}, extra_record=clip_norm)


def _announce_training(job: _Job, learning_rate_source: str, planned_epsilon: float,
                       sampler) -> None:
    """Says what is trained on what, with which learning rate, schedule and privacy."""
    from tf_megadp.jobs.bert.units import describe_population

    from tf_megadp.jobs.bert import trainable

    config, schedule, train = job.config, job.schedule, job.train
    layers, hidden, _, _ = MODEL_PRESETS[config.model]
    if job.init is not None:
        job.log(f"Initial weights: {job.init.path} ({job.init.trained}); "
                + job.init.report(config)["epsilon"] + ".")
    job.log(f"Trains {trainable.describe(config)}.")
    job.log(
        f"Training BERT-{config.model} ({layers} layers, hidden {hidden}) on "
        f"{describe_population(config.privacy_unit, schedule.num_examples, len(train))}, "
        f"{train.sequence_length} tokens each; held-out {len(job.heldout):,} sequences.\n"
        f"Learning rate {config.learning_rate:g} ({learning_rate_source}).\n"
        f"Schedule: {schedule}; "
        + (f"sigma={job.sigma:.4f}, C={config.l2_norm_clip}, delta={job.delta:.3g}, planned "
           f"epsilon={planned_epsilon:.3f}; "
           + mechanism_description(config.noise_mechanism(), sampler.sampling_kind,
                                   getattr(sampler, "cycle_length", None)) + "."
           if job.private
           else "NON-PRIVATE baseline (no clipping, no noise).")
    )


def _report(job: _Job, model, sampler, privacy, start: _Start, heldout_set: _HeldOut, *,
            final_steps: int, train_time: fitting.TrainTime) -> dict[str, Any]:
    """The run's report.json: what it learned, what it spent, what it trained on, its files."""
    import tf_megadp
    from tf_megadp.jobs.bert import trainable
    from tf_megadp.jobs.bert.baselines import learning_verdict

    config, schedule, private, train = job.config, job.schedule, job.private, job.train
    history = start.history
    layers, hidden, heads, _ = MODEL_PRESETS[config.model]
    accuracy = history[-1]["heldout_mlm_accuracy"] if history else float("nan")
    epsilon = float(privacy.epsilon) if privacy else math.inf
    return {
        "heldout_mlm_accuracy": accuracy,
        # learned, unigram_baseline_accuracy, learned_threshold, heldout_masked_positions
        **learning_verdict(accuracy, heldout_set.unigram_accuracy,
                           float(np.sum(heldout_set.sample_weight))),
        "learning_rate": config.learning_rate,
        "learning_rate_source": start.learning_rate_source,
        "private": private,
        "epsilon": epsilon if private else None,
        "delta": job.delta if private else None,
        "noise_multiplier": job.sigma if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "adaptive_clipping": (tf_megadp.adaptive_clipping.report_section(model.optimizer)
                              if private else None),
        "accountant": config.accountant if private else None,
        "sampling": sampler.sampling_kind,
        # Cyclic Poisson sampling's groups (step t samples group t mod L).
        "cycle_length": (sampler.cycle_length if sampler.sampling_kind == "cyclic_poisson"
                         else None),
        # The correlated noise (--noise), the strategy it streamed, its bands.
        "noise": (model.optimizer.noise_strategy.describe()
                  if private and config.noise is not None else None),
        # --bands auto: the candidates' expected errors and the one chosen.
        "noise_choice": job.noise_choice,
        "schedule": schedule.to_dict(),
        "logical_steps": final_steps,
        "completed": final_steps >= schedule.total_steps,
        "examples_processed_expected": schedule.examples_processed(),
        "wall_time_s": time.time() - job.started,
        "train_time_s": train_time.total_s,
        "train_time_parts_s": train_time.report(),
        "examples_per_s": (sampler.total_micro_steps * sampler.micro_batch_rows)
        / max(train_time.total_s, 1e-9),
        "truncated_steps": getattr(sampler, "truncated_steps", 0),  # fixed order: never
        "resumed_from_step": start.resumed_from,
        "resumes": start.resumes,
        "model": {"preset": config.model, "layers": layers, "hidden": hidden, "heads": heads,
                  "vocabulary_size": train.vocabulary_size,
                  "sequence_length": train.sequence_length,
                  "max_sequence_length": config.max_sequence_length or train.sequence_length,
                  "parameters": _count(model.weights),
                  "trainable_parameters": _count(model.trainable_variables),
                  "trains": trainable.describe(config)},
        # Where the weights started: --init-from, or random (None).
        INIT_KEY: job.init.report(config) if job.init else None,
        "num_examples": schedule.num_examples,
        # What epsilon protects: one sequence, or every sequence of one unit.
        # privacy.json's spelling: "example" (here one sequence), or the unit's field.
        "privacy_unit": config.privacy_unit or "example",
        "training_sequences": len(train),
        "examples_per_unit": config.examples_per_unit if config.privacy_unit else 1,
        "capped_sequences": getattr(sampler, "capped_examples", 0),
        "canaries": ({"per_repetition": config.canaries, "repetitions": list(CANARY_REPETITIONS),
                      "controls": config.canaries, "file": CANARIES_NAME}
                     if config.canaries else None),
        "heldout_examples": len(job.heldout),
        "vocabulary": {**vocabulary_report(config), "size": train.vocabulary_size,
                       # What --vocabulary-size asked of a learned vocabulary (None: a file).
                       "requested_size": None if config.vocabulary else config.vocabulary_size},
        "released_outside_epsilon": list(RELEASED_OUTSIDE_EPSILON),
        "files": _file_guide(config, private),
        "history": history,
        "config": config_dict(config),
    }


def _count(variables) -> int:
    return int(sum(np.prod(variable.shape) for variable in variables))


def _file_guide(config: PretrainConfig, private: bool) -> dict[str, str]:
    """What each file of the output directory is, and whether it may be published."""
    statistics = ("publish only if the statistics under released_outside_epsilon may "
                  "be public")
    vocabulary = vocabulary_report(config)
    guide = {
        MODEL_NAME: ("release: architecture and weights only (tf_megadp.export_model), "
                     + ("covered by epsilon" if private else "NOT private (baseline)")),
        VOCABULARY_NAME: ("release: the public vocabulary the model reads" if vocabulary["public"]
                          else "NOT covered by epsilon: learned from the training corpus"),
        REPORT_NAME: f"this report: {statistics}",
        PLOT_NAME: f"held-out accuracy and epsilon per evaluation: {statistics}",
        HISTORY_NAME: f"per-epoch training loss and metrics: {statistics}",
        "tensorboard": f"the same per-epoch logs: {statistics}",
        CHECKPOINT_NAME: ("keep like the training data: training state (optimizer "
                          "moments, settings, history) for --resume; never publish"),
    }
    if private:
        guide[PRIVACY_REPORT_NAME] = "release: the privacy report (epsilon, ledger)"
    if config.canaries:
        guide[CANARIES_NAME] = "keep secret: the audit's canary secrets"
    return guide
