"""The training of a pretraining run: the model, the inner optimizer, the private fit or loop, checkpoints."""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from typing import Any

import numpy as np

from tf_megadp.files import atomic_write, write_json_atomically
from tf_megadp.jobs.bert.config import (
    MODEL_PRESETS,
    PretrainConfig,
    PretrainError,
)
from tf_megadp.jobs.bert.prepare import vocabulary_report
from tf_megadp.jobs.bert.run_files import (
    CANARIES_NAME,
    CANARY_REPETITIONS,
    CHECKPOINT_NAME,
    HISTORY_NAME,
    MODEL_NAME,
    PLOT_NAME,
    PRIVACY_REPORT_NAME,
    RELEASED_OUTSIDE_EPSILON,
    REPORT_NAME,
    VOCABULARY_NAME,
    _config_dict,
    _summary,
)


def build_model(config: PretrainConfig, vocabulary_size: int):
    """The job's `keras_hub.models.BertMaskedLM` for `config` (preset, L, dropout, precision).

    Under `precision="mixed_bfloat16"` the encoder computes in bfloat16 and
    the MLM head in float32. keras-hub 0.32's `MaskedLMHead` does not
    autocast its variables (`autocast=False`, as it reads the shared token
    embedding) and adds its float32 output bias to logits cast to the
    compute dtype: in bfloat16 that addition raises. With a float32 head the
    tied embedding still runs the vocabulary projection in bfloat16 (its
    own layer autocasts), the logits are cast to float32 before the bias,
    and the softmax over V classes is float32, as TPU recipes keep it.
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
        max_sequence_length=config.sequence_length,
        dropout=config.dropout,
        # float32 is Keras's default: only a mixed policy is passed on.
        dtype=None if config.precision == "float32" else config.precision,
    )
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    if config.precision != "float32":
        # The head's own call (gather, dense, norm, projection, bias) follows
        # its policy; its sub-layers keep the backbone's bfloat16 policy.
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
    from tf_megadp.learning_rate import BatchScaledSchedule

    total_steps = schedule.total_steps
    scale = accumulation_steps or 1
    warmup = min(config.warmup_steps, max(total_steps - 1, 0)) * scale
    learning_rate = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else config.learning_rate,
        decay_steps=max(total_steps * scale - warmup, 1),
        alpha=0.1,
        warmup_target=config.learning_rate if warmup else None,
        warmup_steps=warmup,
    )
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


def _heldout_batches(heldout, batcher, micro_batch_size: int, seed: int):
    """Fixed masked batches of the held-out set, identical at every evaluation."""
    rows = heldout.read(np.arange(len(heldout)))
    size = len(rows) - len(rows) % micro_batch_size or len(rows)
    return masked_rows(rows[:size], batcher, seed)


def _unigram_accuracy(train, heldout_y, heldout_w, vocabulary_size: int) -> float:
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


def _plot(history: list[dict[str, Any]], path: str, private: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    figure, accuracy_axis = plt.subplots(figsize=(7, 4))
    accuracy_axis.plot(steps, [h["heldout_mlm_accuracy"] for h in history], "o-", color="tab:blue")
    accuracy_axis.set_xlabel("logical step")
    accuracy_axis.set_ylabel("held-out MLM accuracy", color="tab:blue")
    if private:
        epsilon_axis = accuracy_axis.twinx()
        epsilon_axis.plot(steps, [h["epsilon"] for h in history], "s--", color="tab:red")
        epsilon_axis.set_ylabel("epsilon", color="tab:red")
    figure.tight_layout()
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=100))
    plt.close(figure)


class _Checkpointer:
    """Saves model and optimizer (so the privacy ledger) atomically at logical-step ends.

    Only the chief of several workers saves (`enabled`); the others' state
    is the same.
    """

    def __init__(self, output_dir: str, history: list, config: PretrainConfig, resumes: list,
                 learning_rate_source: str, enabled: bool = True):
        self.directory = os.path.join(output_dir, CHECKPOINT_NAME)
        self.history = history
        self.config = config
        self.learning_rate_source = learning_rate_source
        self.resumes = resumes
        self.enabled = enabled

    def save(self, model) -> None:
        from tf_megadp.run.training_state import save_training_state

        if not self.enabled:
            return

        save_training_state(model, self.directory, extra={
            "logical_steps": int(model.optimizer.iterations.numpy()),
            "history": self.history,
            "resumes": self.resumes,
            "config": _config_dict(self.config),
            # The saved config holds the rate as a number: where it came from
            # is kept beside it, so that a resumed run reports it.
            "learning_rate_source": self.learning_rate_source,
        })


def _history_csv_class():
    import keras

    class HistoryCsv(keras.callbacks.CSVLogger):
        """Keras's CSVLogger, without its val_<metric> columns.

        Without validation data in fit, Keras's logger adds a val_ column for
        every column, all "NA"; the job evaluates its held-out set itself
        (heldout_mlm_accuracy), so the file keeps the columns fit logs.
        """

        def on_epoch_end(self, epoch, logs=None):
            if self.keys is None:
                self.keys = sorted((logs or {}).keys())
            super().on_epoch_end(epoch, logs)

    return HistoryCsv


def _history_csv(path: str, append: bool):
    """The `CSVLogger` of the run's history.csv (see `_history_csv_class`)."""
    return _history_csv_class()(path, append=append)


def _compile_kwargs(private: bool):
    import keras

    return {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy(name="mlm_accuracy")],
        # Keras leaves XLA off on CPU-only machines; the DP step compiles its
        # per-example pass with XLA, so the baseline must too to compare fairly.
        "jit_compile": not private,
    }


def _train(config, schedule, sigma, delta, planned_epsilon, corpus, train, heldout,
           strategy, output_dir, started, log, testing=None, learning_rate_source="given"):
    import keras

    import tf_megadp
    from tf_megadp import data, distribute
    from tf_megadp.jobs.bert import text
    from tf_megadp.jobs.bert.baselines import learning_verdict
    from tf_megadp.jobs.bert.units import describe_population, load_unit_ids
    from tf_megadp.run.export import export_model

    # Public randomness only (initialisation, the held-out masks): the
    # sampling, the training masks (keyed by the sampler's secret and each
    # example's content), dropout (keyed by the private step's secret) and
    # the noise draw secret OS entropy, which this seed never reaches.
    keras.utils.set_random_seed(config.seed)
    batcher = text.MaskedLMBatcher.from_shards(train, max_predictions=config.max_predictions)
    heldout_x, heldout_y, heldout_w = _heldout_batches(heldout, batcher, config.micro_batch_size, config.seed)
    unigram = _unigram_accuracy(train, heldout_y, heldout_w, train.vocabulary_size)
    total_steps = schedule.total_steps
    private = not config.non_private

    history: list[dict[str, Any]] = []
    resumed_from = 0
    # The logical step each --resume of this run started from.
    resumes: list[int] = []
    with strategy.scope():
        model = build_model(config, train.vocabulary_size)
        if config.resume:
            from tf_megadp.run.training_state import restore_training_state

            # Its settings were checked against config before the corpus was prepared.
            state = restore_training_state(
                model, os.path.join(output_dir, CHECKPOINT_NAME), _compile_kwargs(private))
            history = state.get("history", [])
            resumed_from = int(model.optimizer.iterations.numpy())
            resumes = state.get("resumes", []) + [resumed_from]
            # A resume cannot change the rate (check_same_run), so the
            # started run's account of it still holds.
            learning_rate_source = state.get("learning_rate_source", learning_rate_source)
        else:
            if private:
                optimizer = tf_megadp.DPOptimizer(
                    _inner_optimizer(config, schedule, None),
                    l2_norm_clip=config.l2_norm_clip, noise_multiplier=sigma,
                    schedule=schedule, clipping=config.clipping,
                    per_example_scaling=config.per_example_scaling,
                    automatic_scaling_stability=config.automatic_scaling_stability,
                    examples_per_unit=config.examples_per_unit if config.privacy_unit else 1,
                    adaptive_clipping=config.adaptive_clipping(),
                    seed=None if testing is None else testing.noise_seed)
            else:
                k = schedule.phases[0].accumulation_steps
                optimizer = _inner_optimizer(config, schedule, k if k > 1 else None)
            model.compile(optimizer=optimizer, **_compile_kwargs(private))
            model.optimizer.build(model.trainable_variables)
        if private:
            if not isinstance(model.optimizer, tf_megadp.DPOptimizer):
                raise PretrainError(f"{output_dir} holds a non-private run; resume it with --non-private.")
            # Strict: data that no tf_megadp Poisson sampler drew is refused.
            tf_megadp.make_private(model, require_poisson_sampling=True)
        elif isinstance(model.optimizer, tf_megadp.DPOptimizer):
            raise PretrainError(f"{output_dir} holds a private run; resume it without --non-private.")

    # Keras's own accumulation (non-private) also counts logical steps in
    # iterations. A restored DPOptimizer is always at a logical-step boundary
    # (its mid-step state is never saved).
    logical_done = int(model.optimizer.iterations.numpy())
    if logical_done >= total_steps:
        log(f"The run in {output_dir} already completed {logical_done} logical steps.")
    elif config.resume:
        spent = "non-private baseline"
        if private:
            from tf_megadp import accounting

            so_far = accounting.PrivacyAccountant(
                schedule.num_examples, delta, accountant=config.accountant,
                ledger=tf_megadp.model_ledger(model)).epsilon()
            spent = f"epsilon so far {so_far:.2f}"
        log(f"Resuming at logical step {logical_done} of {total_steps} ({spent}).")
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
             {"unit_ids": load_unit_ids(train), "privacy_unit": config.privacy_unit,
              "examples_per_unit": config.examples_per_unit})
    sampler_class = data.PrivacyUnitSampler if units else data.PoissonSampler
    if testing is None:
        sampler = sampler_class(
            train, schedule, shared_secret=distribute.shared_sampling_secret(strategy),
            start_step=start_step, end_step=end_step, **units)
    else:
        sampler = sampler_class(train, schedule, seed=testing.sampling_seed,
                                start_step=start_step, end_step=end_step, **units)

    # Fed to fit as the sampler returned it (a derived dataset is refused).
    # With R replicas on this host, Keras splits each m * R-row micro-step
    # along its rows, replica r taking rows [r*m, (r+1)*m): the layout
    # distribute.replica_micro_batches gives one input pipeline. keras-hub
    # tasks cannot take a tf.distribute DistributedDataset in fit.
    # Keras's fit cannot run under several workers: there the same private
    # step runs in a custom loop that drives the same callbacks, and checks
    # each micro-batch's tag (the tagged dataset's elements are (batch, tag)).
    several_workers = distribute._worker_count(strategy) > 1
    dataset = sampler.as_dataset(batcher, tagged=private and several_workers)
    if not private:  # The private fit does this itself.
        distribute.build_without_reading(model, dataset.element_spec)

    # One fit step consumes one micro-batch per replica: a sampler micro-step.
    remaining_micro = sampler.total_micro_steps
    evaluations = max(1, math.ceil((end_step - start_step) / config.eval_every))
    epochs = _divisor_at_most(remaining_micro, evaluations) if remaining_micro else 0
    steps_per_epoch = remaining_micro // epochs if epochs else 0
    # The epochs of earlier starts (one per evaluation in the history): a
    # resumed run's epochs, in history.csv and TensorBoard, count on from them.
    initial_epoch = len(history)

    chief = distribute.is_chief(strategy)
    callbacks = []
    privacy = None
    if private:
        privacy = tf_megadp.PrivacyCallback(
            delta=delta, accountant=config.accountant,
            report_path=os.path.join(output_dir, PRIVACY_REPORT_NAME) if chief else None,
            target_epsilon=config.target_epsilon if config.noise_multiplier is None else None)
        callbacks.append(privacy)
    checkpointer = _Checkpointer(output_dir, history, config, resumes, learning_rate_source,
                                 enabled=chief)

    accumulation = 1 if private else schedule.phases[0].accumulation_steps

    class _Evaluate(keras.callbacks.Callback):
        """Held-out MLM accuracy and epsilon at every epoch end, and checkpoints.

        A checkpoint is written at a logical-step boundary after the first
        logical step of this start, then every `checkpoint_every` steps and
        every `checkpoint_minutes` of training, whichever comes first, and
        at the end (the last epoch's end).
        """

        def on_train_begin(self, logs=None):
            self._last_saved = logical_done
            self._saved_at = time.monotonic()
            self._micro_steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self._micro_steps += 1
            optimizer = self.model.optimizer
            # Private: the DPOptimizer says; the baseline accumulates k micro-steps.
            at_boundary = (int(optimizer.micro_steps.numpy()) == 0 if private
                           else self._micro_steps % accumulation == 0)
            steps = int(optimizer.iterations.numpy())
            if not at_boundary or steps == self._last_saved:
                return
            due = (self._last_saved == logical_done  # the first step of this start
                   or (config.checkpoint_every and steps % config.checkpoint_every == 0)
                   or (config.checkpoint_minutes and time.monotonic() - self._saved_at
                       >= 60 * config.checkpoint_minutes))
            if due:
                checkpointer.save(self.model)
                self._last_saved, self._saved_at = steps, time.monotonic()

        def on_epoch_end(self, epoch, logs=None):
            # With weight averaging, the held-out accuracy is the average's:
            # the weights the run exports (fit leaves the average in the model).
            swap = [keras.callbacks.SwapEMAWeights()] if config.ema_momentum else None
            if several_workers:
                accuracy = _heldout_accuracy(self.model, heldout_x, heldout_y, heldout_w,
                                             config.micro_batch_size, swap)
            else:
                _, accuracy = self.model.evaluate(
                    heldout_x, heldout_y, sample_weight=heldout_w,
                    batch_size=config.micro_batch_size, verbose=0, callbacks=swap)
            steps = int(self.model.optimizer.iterations.numpy())
            record = {
                "step": steps,
                "heldout_mlm_accuracy": float(accuracy),
                "train_mlm_accuracy": float(logs.get("mlm_accuracy", float("nan"))),
                "loss": float(logs.get("loss", float("nan"))),
                "epsilon": float(privacy.epsilon) if privacy else math.inf,
                "wall_time_s": time.time() - started,
            }
            if config.adaptive_clipping_quantile is not None:
                record["clip_norm"] = float(self.model.optimizer.clip_norm.numpy())
            history.append(record)
            if logs is not None:
                logs["heldout_mlm_accuracy"] = float(accuracy)
            if epoch == self.params["epochs"] - 1:
                # Here, before fit's end replaces the weights by their average
                # (ema_momentum): a resumed run continues from the trained
                # weights, with the average in the optimizer.
                checkpointer.save(self.model)

    callbacks.append(_Evaluate())
    if chief:
        callbacks.append(_history_csv(os.path.join(output_dir, HISTORY_NAME), append=config.resume))
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(output_dir, "tensorboard"), update_freq="epoch"))

    layers, hidden, heads, intermediate = MODEL_PRESETS[config.model]
    log(
        f"Training BERT-{config.model} ({layers} layers, hidden {hidden}) on "
        f"{describe_population(config.privacy_unit, schedule.num_examples, len(train))}, "
        f"{train.sequence_length} tokens each; held-out {len(heldout):,} sequences.\n"
        f"Learning rate {config.learning_rate:g} ({learning_rate_source}).\n"
        f"Schedule: {schedule}; "
        + (f"sigma={sigma:.4f}, C={config.l2_norm_clip}, delta={delta:.3g}, planned "
           f"epsilon={planned_epsilon:.3f}." if private else "NON-PRIVATE baseline (no clipping, no noise).")
    )
    train_started = time.time()
    # Also with no epoch left (a run resumed after its last step): the
    # privacy callback then reports the ledger without training.
    with warnings.catch_warnings():
        # BertMaskedLM never uses the backbone's pooler; Keras's optimizer
        # warns about it on every non-private run.
        warnings.filterwarnings("ignore", message="Gradients do not exist for variables.*pooled")
        if several_workers:
            _fit_with_private_step(model, strategy, dataset, epochs=initial_epoch + epochs,
                                   initial_epoch=initial_epoch,
                                   steps_per_epoch=steps_per_epoch, callbacks=callbacks)
        else:
            model.fit(dataset, epochs=initial_epoch + epochs, initial_epoch=initial_epoch,
                      steps_per_epoch=steps_per_epoch or None,
                      shuffle=False, callbacks=callbacks, verbose=config.verbose)
    train_seconds = time.time() - train_started

    final_steps = history[-1]["step"] if history else logical_done
    if not epochs:
        checkpointer.save(model)
    if chief:
        # The release: the model without any optimizer state, and the
        # vocabulary it reads (public unless --vocabulary-from-training-corpus).
        export_model(model, os.path.join(output_dir, MODEL_NAME))
        vocabulary_file = os.path.join(train.directory, train.manifest["vocabulary_file"])
        atomic_write(os.path.join(output_dir, VOCABULARY_NAME),
                     lambda temporary: shutil.copyfile(vocabulary_file, temporary))
    accuracy = history[-1]["heldout_mlm_accuracy"] if history else float("nan")
    epsilon = float(privacy.epsilon) if privacy else math.inf
    report = {
        "heldout_mlm_accuracy": accuracy,
        # learned, unigram_baseline_accuracy, learned_threshold, heldout_masked_positions
        **learning_verdict(accuracy, unigram, float(np.sum(heldout_w))),
        "learning_rate": config.learning_rate,
        "learning_rate_source": learning_rate_source,
        "private": private,
        "epsilon": epsilon if private else None,
        "delta": delta if private else None,
        "noise_multiplier": sigma if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "adaptive_clipping": (tf_megadp.adaptive_clipping.report_section(model.optimizer)
                              if private else None),
        "accountant": config.accountant if private else None,
        "sampling": "poisson",
        "schedule": schedule.to_dict(),
        "logical_steps": final_steps,
        "completed": final_steps >= total_steps,
        "examples_processed_expected": schedule.examples_processed(),
        "wall_time_s": time.time() - started,
        "train_time_s": train_seconds,
        "examples_per_s": (sampler.total_micro_steps * sampler.micro_batch_rows)
        / max(train_seconds, 1e-9),
        "truncated_steps": sampler.truncated_steps,
        "resumed_from_step": resumed_from,
        "resumes": resumes,
        "model": {"preset": config.model, "layers": layers, "hidden": hidden, "heads": heads,
                  "vocabulary_size": train.vocabulary_size,
                  "sequence_length": train.sequence_length},
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
        "heldout_examples": len(heldout),
        "vocabulary": {**vocabulary_report(config), "size": train.vocabulary_size,
                       # What --vocabulary-size asked of a learned vocabulary (None: a file).
                       "requested_size": None if config.vocabulary else config.vocabulary_size},
        "released_outside_epsilon": list(RELEASED_OUTSIDE_EPSILON),
        "files": _file_guide(config, private),
        "history": history,
        "config": _config_dict(config),
    }
    if chief:
        write_json_atomically(os.path.join(output_dir, REPORT_NAME), report)
        if history:
            _plot(history, os.path.join(output_dir, PLOT_NAME), private)
    log(_summary(report, output_dir))
    return report


def _fit_with_private_step(model, strategy, dataset, *, epochs: int, steps_per_epoch: int,
                           callbacks: list, initial_epoch: int = 0) -> None:
    """`model.fit` of the sampler's dataset, as a custom loop of a `tf_megadp.PrivateStep`.

    Keras 3.15's `fit` cannot run under `MultiWorkerMirroredStrategy` with
    several workers (docs/tpu.md). This loop runs the private `fit`'s own
    step on every replica, each worker feeding its replicas' rows of the
    sampler's micro-steps (`distribute_micro_batches`), records the ledger
    after every micro-step as the private `fit` does, and drives the same
    callbacks at the same points: the privacy callback (epsilon, budget
    stop, report), evaluation and checkpoints, the CSV and TensorBoard logs.
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


def _heldout_accuracy(model, x, y, sample_weight, batch_size: int, swap=None) -> float:
    """The held-out masked-LM accuracy `evaluate` gives, without `evaluate`.

    Keras's `evaluate` cannot run under several workers either; this is its
    weighted accuracy over the masked positions, from the model's forward
    pass on this worker (its weights are every worker's).
    """
    import keras
    import numpy as np

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
