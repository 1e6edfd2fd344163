"""`run_causal_lm`: one causal-LM run, end to end, on the shared run machinery.

A pretraining run prepares (or reuses) the packed corpus and holds out
its split; a fine-tuning run reads prompt/completion pairs and starts
from a `tf-megadp causal-lm` release (`--init-from`, checked as `tf-megadp
pretrain --init-from` checks a start: a DP release's ledger is composed,
a start of unknown origin needs the user's statement). Either builds a
GPT-2 or a Llama (`families`) from keras-hub's constructors, plans its privacy
(`plan_privacy`), trains with DP-SGD on Poisson-sampled logical batches
of rows, or of users with `--privacy-unit` (`PrivacyUnitSampler`, each
user's rows clipped together), or the non-private baseline on the same
batches, scores the held-out
split, and writes the run folder (`tf_megadp.jobs.common.run_folder`):
the release, its privacy report, report.json, the checkpoint that
`--resume` continues.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from tf_megadp.files import write_json_atomically
from tf_megadp.jobs.causal_lm import data
from tf_megadp.jobs.causal_lm.config import CausalLMConfig
from tf_megadp.jobs.causal_lm.families import (
    DEFAULT_FAMILY,
    FAMILIES,
    build_model,
    family_of_task,
)
from tf_megadp.jobs.common import fitting, run_folder
from tf_megadp.jobs.common.errors import JobError
from tf_megadp.jobs.common.lora import describe_training
from tf_megadp.jobs.common.privacy import new_dp_optimizer, plan_privacy
from tf_megadp.jobs.common.run_folder import (
    CHECKPOINT_NAME,
    INIT_KEY,
    LORA_FACTORS_KEY,
    PLOT_NAME,
    PRIVACY_REPORT_NAME,
    REPORT_NAME,
    VOCABULARY_NAME,
)
from tf_megadp.jobs.common.verdicts import learned_beyond, verdict_line

__all__ = ["CAUSAL_LM_TASKS", "COMMAND", "PreparedRun", "RunData", "prepare_run", "run_causal_lm"]

COMMAND = "tf-megadp causal-lm"
# The settings that name files or folders of this machine (report.json names
# them relative to the run folder, or by name).
PATH_FIELDS = ("corpus", "output_dir", "cache_dir", "init_from", "train", "test")
# The keras-hub tasks a fine-tuning run starts from (one per family), and the
# command that writes them.
CAUSAL_LM_TASKS = (tuple(family.task for family in FAMILIES.values()), COMMAND)
RELEASED_OUTSIDE_EPSILON = (
    "held-out accuracy and perplexity, and the unigram baseline's: computed on the held-out "
    "split, which is not trained on and not protected by DP (publish them only if that text "
    "may be published)",
    "training loss and accuracy on training batches (history.csv, tensorboard/, report.json "
    "history): exact statistics of the sampled batches",
    "num_examples, training_sequences and the held-out target count: exact counts (of "
    "privacy units, training rows, held-out targets)",
    "wall_time_s, train_time_s: timings; train_time_parts_s: the train time in fit (the "
    "steps) and in each of the job's callbacks (evaluation, checkpoints, logs)",
)


class RunData(NamedTuple):
    """What a run trains on and is scored on, pretraining or fine-tuning alike."""

    train: tuple  # (x, y, sample_weight)
    test: tuple
    unit_ids: np.ndarray | None  # each training row's privacy unit (--privacy-unit), or None
    vocabulary_size: int
    vocabulary_file: str
    vocabulary: dict[str, Any]  # report.json's account of it
    description: str
    privacy_unit: str
    family: str  # a FAMILIES name
    model: str  # a MODEL_PRESETS name
    # The most tokens the model reads: GPT-2's position table's rows; Llama's
    # (rotary positions, no table) the tokens a row gives it, as trained.
    context: int
    init: Any  # the fine-tuned start's `InitialWeights`, or None


class PreparedRun(NamedTuple):
    """A run checked and planned, before anything is written: what `--plan` prints and a run trains.

    Attributes:
        config: the settings, with the family the run trains.
        output_dir: the run's folder (not yet created for a new run).
        data: what it trains on and is scored on.
        schedule: its `BatchSizeSchedule`, N counting the privacy units.
        sigma, delta, epsilon: its privacy plan (`plan_privacy`; epsilon is
            the full schedule's, a composed start's ledger included).
        logical_done: the logical steps a resumed run has already taken.
    """

    config: CausalLMConfig
    output_dir: str
    data: RunData
    schedule: Any
    sigma: float
    delta: float
    epsilon: float
    logical_done: int


def prepare_run(config: CausalLMConfig, *, log: Callable[[str], None] = print) -> PreparedRun:
    """Checks and plans one causal-LM run without training it or writing its folder.

    Everything that can be checked before training is checked here: bad
    input raises `JobError` before the output directory is created. The
    prepared corpus is cached (`--cache-dir`), as the run would.

    Args:
        config: the run (`config.resume`: the saved run in `output_dir`).
        log: where progress lines go.

    Returns:
        The `PreparedRun`.
    """
    from tf_megadp.run.training_state import has_training_state
    from tf_megadp.steps import BatchSizeSchedule

    config.validate()
    output_dir = config.output_dir or os.path.join(
        "runs", time.strftime("causal-lm-%Y%m%d-%H%M%S"))
    if config.resume:
        run_folder.check_same_run(run_folder.saved_settings(output_dir, COMMAND), config)
    elif has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
        raise JobError(f"{output_dir} already holds a run; pass --resume to continue it or "
                       "choose another --output-dir.")
    run_data = (_pairs_data(config, output_dir) if config.fine_tuning
                else _corpus_data(config, log))
    # The run records the family it trains (a fine-tuning run's is the start's),
    # so that a resume that changes it is refused by `check_same_run`.
    config = dataclasses.replace(config, family=run_data.family)
    n = _population(run_data)
    if config.batch_size > n:
        raise JobError(f"--batch-size {config.batch_size} is larger than the {n} privacy units "
                       "of the training split: lower it.")
    schedule = BatchSizeSchedule.constant(
        config.steps, config.batch_size, num_examples=n,
        micro_batch_size=config.micro_batch_size,
        truncation_probability=config.max_truncation_probability)
    init = run_data.init
    prior = init.composed_ledger(config) if init is not None and not config.non_private else None
    sigma, delta, epsilon = plan_privacy(
        config, schedule, prior=prior, init_from=init.path if init is not None else None)
    logical_done = (int(run_folder.saved_extra(output_dir).get("logical_steps", 0))
                    if config.resume else 0)
    return PreparedRun(config, output_dir, run_data, schedule, sigma, delta, epsilon,
                       logical_done)


def run_causal_lm(config: CausalLMConfig, *, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    """Runs (or resumes, `config.resume`) one causal-LM job and returns its report.

    Pretraining from scratch on packed sequences, or, with `config.train`,
    fine-tuning `config.init_from` on prompt/completion pairs, as
    `prepare_run` checked and planned it.

    Args:
        config: the run.
        log: where progress lines go.

    Returns:
        The report, as written to report.json.
    """
    from tf_megadp.run.training_state import has_training_state

    started = time.time()
    run = prepare_run(config, log=log)
    output_dir = run.output_dir
    baseline = data.unigram_baseline(run.data.train[1], run.data.train[2], run.data.test[1],
                                     run.data.test[2], run.data.vocabulary_size)
    created = not os.path.exists(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    try:
        return _train(run, baseline, started, log)
    except BaseException:
        if created and not has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
            import shutil

            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def _population(run_data: RunData) -> int:
    """N, the privacy units of the training split: its units (`--privacy-unit`), else its rows.

    Args:
        run_data: the run's data.

    Returns:
        The number of distinct unit ids of the training rows, or of the rows.
    """
    if run_data.unit_ids is None:
        return len(run_data.train[1])
    return int(np.unique(run_data.unit_ids).size)


def _corpus_data(config: CausalLMConfig, log) -> RunData:
    """Pretraining: the packed corpus, its held-out split, the public vocabulary.

    With `config.privacy_unit`, each training row's unit comes from the
    masked-LM job's preparation (`prepare_data` reads the field and packs
    no row across two units; `units.load_unit_ids`).
    """
    from tf_megadp.jobs.bert.prepare import vocabulary_report
    from tf_megadp.jobs.bert.units import load_unit_ids

    corpus, train, heldout = data.corpus_splits(config, log)
    if config.privacy_unit:
        field, k = config.privacy_unit, config.examples_per_unit
        unit_ids = load_unit_ids(train)
        privacy_unit = (f"one {field}: every document with the same {field!r} (all its packed "
                        f"sequences of {config.sequence_length} tokens; at most {k} of them in "
                        "a step, their summed gradient clipped to C)")
    else:
        unit_ids = None
        privacy_unit = (f"one packed sequence of {config.sequence_length} tokens: a document "
                        "longer than a sequence, or one sharing sequences with others, is "
                        "protected only by group privacy over the sequences it touches")
    return RunData(
        train=data.next_token_examples(train.read(np.arange(len(train)))),
        test=data.next_token_examples(heldout.read(np.arange(len(heldout)))),
        unit_ids=unit_ids,
        vocabulary_size=train.vocabulary_size,
        vocabulary_file=os.path.join(corpus.directory, corpus.manifest["vocabulary_file"]),
        vocabulary=vocabulary_report(data.corpus_settings(config)),
        description=str(corpus.manifest.get("source")),
        privacy_unit=privacy_unit, family=config.family or DEFAULT_FAMILY,
        model=config.model, context=config.sequence_length - 1, init=None)


def _pairs_data(config: CausalLMConfig, output_dir: str) -> RunData:
    """Fine-tuning: the pairs, tokenized with the start's vocabulary; the start itself."""
    import keras_hub

    from tf_megadp.jobs.bert import initial_weights, text

    if config.resume:
        init = initial_weights.InitialWeights.from_dict(
            run_folder.saved_extra(output_dir)[INIT_KEY])
        family = config.family or DEFAULT_FAMILY  # The run's saved family.
    else:
        init = initial_weights.read_initial_weights(config.init_from, CAUSAL_LM_TASKS)
        family = _start_family(config, init)
        if not config.non_private:
            init.origin(config)  # Refuses a start of unknown origin, naming the statement.
    if init.vocabulary is None or init.vocabulary_public is False:
        raise JobError(
            f"--init-from {init.path}: fine-tuning needs the public vocabulary beside it "
            f"({VOCABULARY_NAME} of a `{COMMAND}` run, whose report says it is public).")
    if init.max_sequence_length is None:
        raise JobError(
            f"--init-from {init.path}: a {FAMILIES[family].label} has no position table, and "
            f"no {REPORT_NAME} beside it says how many tokens its run trained on (its "
            f"model.context): put its run's {REPORT_NAME} beside it.")
    if config.sequence_length - 1 > init.max_sequence_length:
        read = ("reads at most" if FAMILIES[family].position_table
                else "was trained on rows of")  # Rotary positions beyond are untrained.
        raise JobError(
            f"--sequence-length {config.sequence_length}: the start {read} "
            f"{init.max_sequence_length} tokens; pass at most {init.max_sequence_length + 1}.")
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=text.read_vocabulary_file(init.vocabulary), lowercase=True)
    train_pairs, test_pairs = data.read_pairs(config)
    return RunData(
        train=data.completion_examples(*train_pairs, tokenizer, config.sequence_length),
        test=data.completion_examples(*test_pairs, tokenizer, config.sequence_length),
        unit_ids=None,
        vocabulary_size=init.vocabulary_size, vocabulary_file=init.vocabulary,
        vocabulary={"source": ("public: the vocabulary of the start "
                               + os.path.basename(init.path)),
                    "public": True, "file": VOCABULARY_NAME},
        description=f"{len(train_pairs[0]):,} prompt/completion pairs",
        privacy_unit=("one prompt/completion pair (its row of "
                      f"{config.sequence_length} tokens)"),
        family=family, model=init.preset_name(), context=init.max_sequence_length, init=init)


def _start_family(config: CausalLMConfig, init) -> str:
    """The family of the start `init` (its file's task); a different `--family` is refused."""
    family = family_of_task(init.task).name
    if config.family is not None and config.family != family:
        raise JobError(
            f"--family {config.family}: --init-from {init.path} is a "
            f"{FAMILIES[family].label} ({init.task.split('>')[-1]}); a fine-tuning run "
            "continues its start's family. Drop --family.")
    return family


def _compile_kwargs(private: bool) -> dict[str, Any]:
    import keras

    return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            # Keras leaves XLA off on CPU; the DP step compiles its
            # per-example pass with XLA, so the baseline must too to compare.
            "jit_compile": not private}


def _inner_optimizer(config: CausalLMConfig, learning_rate: float, schedule,
                     accumulation_steps: int | None):
    """AdamW with the jobs' warm-up and cosine decay over the logical steps."""
    import keras

    rate = fitting.warmup_cosine_learning_rate(learning_rate, config.warmup_steps,
                                               schedule.total_steps, accumulation_steps or 1)
    return keras.optimizers.AdamW(learning_rate=rate, weight_decay=config.weight_decay,
                                  gradient_accumulation_steps=accumulation_steps)


def _model(config, run_data, schedule, sigma, learning_rate, output_dir):
    """(model, its saved state): restored from the checkpoint (--resume) or new; made private.

    A fine-tuning run's new model takes the start's weights before it is
    compiled (then its LoRA factors, from the public seed), and, made
    private, declares them (a DP release's ledger is composed into its
    epsilon, other starts are named by their origin).
    """
    import keras

    import tf_megadp
    from tf_megadp.jobs.bert import initial_weights
    from tf_megadp.run.training_state import restore_training_state

    private = not config.non_private
    keras.utils.set_random_seed(config.seed)
    model = build_model(run_data.family, run_data.model, run_data.vocabulary_size,
                        run_data.context)
    model({name: value[:1] for name, value in run_data.test[0].items()})
    if run_data.init is not None and not config.resume:
        initial_weights.load_into(model, run_data.init)
    if config.lora_rank:
        model.backbone.enable_lora(config.lora_rank)
    state: dict[str, Any] = {"history": [], "resumes": []}
    if config.resume:
        state = restore_training_state(model, os.path.join(output_dir, CHECKPOINT_NAME),
                                       _compile_kwargs(private))
        run_folder.restore_lora_factors(model, output_dir, state.get(LORA_FACTORS_KEY))
        state["resumes"] = state.get("resumes", []) + [int(model.optimizer.iterations)]
    else:
        accumulation = schedule.phases[0].accumulation_steps
        inner = _inner_optimizer(config, learning_rate, schedule,
                                 None if private or accumulation == 1 else accumulation)
        # A unit's k rows are one slot of the sampler's micro-batch, clipped whole.
        model.compile(optimizer=(new_dp_optimizer(config, inner, schedule, sigma,
                                                  examples_per_unit=config.rows_per_unit)
                                 if private else inner), **_compile_kwargs(private))
    if private != isinstance(model.optimizer, tf_megadp.DPOptimizer):
        raise JobError(f"{output_dir} holds a {'non-' if private else ''}private run; resume it "
                       f"{'with' if private else 'without'} --non-private.")
    if private:
        # Strict: data that no tf_megadp Poisson sampler drew is refused.
        tf_megadp.make_private(model, require_poisson_sampling=True)
        if run_data.init is not None and not config.resume:
            initial_weights.declare(model, run_data.init, config)
    return model, state


def _sampler(config: CausalLMConfig, run_data: RunData, schedule, start_step: int,
             end_step: int | None):
    """The Poisson sampler of this start's steps: of units (`--privacy-unit`), else of rows.

    The draws come from OS entropy, never from --seed (which report.json records).

    Args:
        config: the run's settings (its unit field and k).
        run_data: the training rows, and their units or None.
        schedule: the run's `BatchSizeSchedule`, N counting the units.
        start_step, end_step: the logical steps this start trains.

    Returns:
        A `tf_megadp.PrivacyUnitSampler` (k rows per unit slot), or a
        `tf_megadp.PoissonSampler` of rows.
    """
    import tf_megadp

    steps = dict(schedule=schedule, start_step=start_step, end_step=end_step)
    if run_data.unit_ids is None:
        return tf_megadp.PoissonSampler.from_arrays(*run_data.train, **steps)
    return tf_megadp.PrivacyUnitSampler.from_arrays(
        *run_data.train, unit_ids=run_data.unit_ids,
        examples_per_unit=config.examples_per_unit, privacy_unit=config.privacy_unit, **steps)


def _train(run: PreparedRun, baseline, started, log):
    import tf_megadp
    from tf_megadp import distribute
    from tf_megadp.jobs.bert.units import describe_population

    config, run_data, schedule, output_dir = run.config, run.data, run.schedule, run.output_dir
    sigma, delta, planned_epsilon = run.sigma, run.delta, run.epsilon
    logical_done = run.logical_done
    private = not config.non_private
    learning_rate, learning_rate_source = config.learning_rate_choice()
    x_test, y_test, w_test = run_data.test
    end_step = None
    if config.stop_after_steps is not None:
        end_step = min(schedule.total_steps, logical_done + config.stop_after_steps)
    sampler = _sampler(config, run_data, schedule, min(logical_done, schedule.total_steps),
                       end_step)
    model, state = _model(config, run_data, schedule, sigma, learning_rate, output_dir)
    if state.get("learning_rate_source"):
        learning_rate_source = state["learning_rate_source"]
    dataset = sampler.as_dataset()
    if not private:
        distribute.build_without_reading(model, dataset.element_spec)
    history = state["history"]
    accumulation = schedule.phases[0].accumulation_steps
    remaining = sampler.total_micro_steps
    evaluations = max(1, math.ceil((sampler.end_step - sampler.start_step) / config.eval_every))
    epochs = fitting.epochs_dividing(remaining, evaluations)
    privacy = tf_megadp.PrivacyCallback(
        delta=delta, accountant=config.accountant,
        report_path=os.path.join(output_dir, PRIVACY_REPORT_NAME),
        target_epsilon=config.target_epsilon if config.noise_multiplier is None else None
    ) if private else None

    def evaluate(model) -> dict[str, float]:
        return data.heldout_scores(model, x_test, y_test, w_test, config.micro_batch_size)

    def record() -> dict[str, Any]:
        saved = {"history": history, "resumes": state["resumes"],
                 "config": run_folder.config_dict(config),
                 "learning_rate_source": learning_rate_source}
        if run_data.init is not None:
            saved[INIT_KEY] = run_data.init.to_dict()
        return saved

    checkpointer = run_folder.Checkpointer(output_dir, record)
    callbacks = ([privacy] if privacy else []) + [run_folder.progress_callback(
        private=private, accumulation=accumulation, logical_done=logical_done,
        checkpointer=checkpointer, checkpoint_every=config.checkpoint_every,
        checkpoint_minutes=config.checkpoint_minutes, evaluate=evaluate, history=history,
        privacy=privacy, started=started, train_metrics={"accuracy": "train_accuracy"})]
    callbacks += run_folder.log_callbacks(output_dir, config.resume)
    kind = ("fine-tuning " + os.path.basename(run_data.init.path) if run_data.init is not None
            else "pretraining")
    if config.lora_rank:
        kind += f", LoRA rank {config.lora_rank}"
    population = (describe_population(config.privacy_unit, schedule.num_examples,
                                      len(run_data.train[1]))
                  if config.privacy_unit else
                  f"N = {schedule.num_examples:,} (unit: {run_data.privacy_unit.split(':')[0]})")
    log(f"Causal LM ({kind}), {FAMILIES[run_data.family].label} {run_data.model}, on "
        f"{run_data.description}: {population}, "
        f"{len(y_test):,} held out; learning rate {learning_rate:g} ({learning_rate_source}); "
        f"schedule: {schedule}; "
        + (f"sigma={sigma:.4f}, C={config.l2_norm_clip}, delta={delta:.3g}, planned "
           f"epsilon={planned_epsilon:.3f}." if private
           else "NON-PRIVATE baseline (no clipping, no noise)."))
    initial_epoch = len(history)
    train_time = fitting.fit_run(
        model, dataset, strategy=distribute.resolve_strategy("default"), several_workers=False,
        callbacks=callbacks, epochs=initial_epoch + epochs, initial_epoch=initial_epoch,
        steps_per_epoch=remaining // epochs if epochs else 0,
        verbose=run_folder.progress_verbosity(config.verbose))
    if not epochs:
        checkpointer.save(model)
    run_folder.export_release(model, output_dir, run_data.vocabulary_file)
    report = run_folder.publishable(_report(
        config, run_data, model, sampler, privacy, sigma, delta, baseline, history,
        state["resumes"], learning_rate, learning_rate_source, started, train_time,
        logical_done, float(np.sum(w_test))), output_dir, PATH_FIELDS)
    write_json_atomically(os.path.join(output_dir, REPORT_NAME), report)
    if history:
        run_folder.plot_history(history, os.path.join(output_dir, PLOT_NAME), "heldout_accuracy",
                                "held-out next-token accuracy", private)
    log(_summary(report, output_dir))
    return report


def _report(config, run_data, model, sampler, privacy, sigma, delta, baseline, history,
            resumes, learning_rate, learning_rate_source, started, train_time, logical_done,
            heldout_targets) -> dict[str, Any]:
    from tf_megadp.jobs.bert.config import MODEL_PRESETS

    private = not config.non_private
    last = history[-1] if history else {}
    accuracy = last.get("heldout_accuracy", float("nan"))
    learned, threshold = learned_beyond(accuracy, baseline.accuracy, heldout_targets)
    schedule = sampler.schedule
    steps = int(model.optimizer.iterations.numpy())
    layers, hidden, heads, intermediate = MODEL_PRESETS[run_data.model]
    return {
        "heldout_accuracy": accuracy,
        "heldout_perplexity": last.get("heldout_perplexity", float("nan")),
        "unigram_baseline_accuracy": baseline.accuracy,
        "unigram_baseline_perplexity": baseline.perplexity,
        "learned": learned,
        "learned_threshold": threshold,
        "heldout_target_tokens": heldout_targets,
        "objective": ("next token of the completion (fine-tuning)" if config.fine_tuning
                      else "next token (pretraining)"),
        "model": {"family": FAMILIES[run_data.family].description(),
                  "tied_head": FAMILIES[run_data.family].tied_head, "preset": run_data.model,
                  "layers": layers, "hidden": hidden, "heads": heads,
                  "intermediate": intermediate, "vocabulary_size": run_data.vocabulary_size,
                  "context": run_data.context},
        "trains": describe_training(config.lora_rank),
        "trainable_parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "private": private,
        "epsilon": float(privacy.epsilon) if private else None,
        "delta": delta if private else None,
        "noise_multiplier": sigma if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "accountant": config.accountant if private else None,
        "privacy_unit": run_data.privacy_unit,
        "learning_rate": learning_rate,
        "learning_rate_source": learning_rate_source,
        "schedule": schedule.to_dict(),
        "sampling": sampler.sampling_kind,
        "logical_steps": steps,
        "completed": steps >= schedule.total_steps,
        "resumed_from_step": logical_done,
        "resumes": resumes,
        "num_examples": schedule.num_examples,
        "training_sequences": len(run_data.train[1]),
        "examples_per_unit": config.rows_per_unit,
        "data": run_data.description,
        INIT_KEY: run_data.init.report(config) if run_data.init is not None else None,
        "vocabulary": run_data.vocabulary,
        "wall_time_s": time.time() - started,
        "train_time_s": train_time.total_s,
        "train_time_parts_s": train_time.report(),
        "released_outside_epsilon": list(RELEASED_OUTSIDE_EPSILON),
        "files": run_folder.file_guide(
            private, vocabulary="the public vocabulary the model reads",
            plot="held-out accuracy and epsilon per evaluation"),
        "history": history,
        "config": run_folder.config_dict(config),
    }


def _summary(report: dict[str, Any], output_dir: str) -> str:
    verdict = verdict_line(report["learned"], report["learned_threshold"], "the unigram baseline")
    privacy = run_folder.privacy_line(report)
    return "\n".join([
        "", "=" * 64,
        f"held-out accuracy       {report['heldout_accuracy']:.4f}   (unigram "
        f"{report['unigram_baseline_accuracy']:.4f})",
        f"held-out perplexity     {report['heldout_perplexity']:.2f}   (unigram "
        f"{report['unigram_baseline_perplexity']:.2f})",
        f"learned                 {verdict}",
        f"privacy                 {privacy}",
        f"logical steps           {report['logical_steps']}   wall time "
        f"{report['wall_time_s']:.0f} s",
        f"time                    {run_folder.train_time_line(report)}",
        f"report                  {os.path.join(output_dir, REPORT_NAME)}",
        "=" * 64])
