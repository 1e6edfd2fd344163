"""`run_finetuning`: one fine-tuning run, end to end, on the shared run machinery.

The run reads its task, starts from its BERT (checked as `tf-megadp
pretrain --init-from` checks a start: a DP release's ledger is composed, a
start of unknown origin needs the user's statement), tokenizes the texts
with that BERT's vocabulary, plans its privacy (`plan_privacy`), trains
with DP-SGD on Poisson-sampled logical batches (or the non-private
baseline on the same batches), evaluates on the test split, and writes
the run folder (`tf_megadp.jobs.common.run_folder`): the release, its
privacy report, report.json, the checkpoint that `--resume` continues.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import numpy as np

from tf_megadp.files import write_json_atomically
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
from tf_megadp.jobs.finetune.config import DEFAULT_TEMPLATE, FinetuneConfig

__all__ = ["COMMAND", "DEFAULT_TASK_PROMPT", "classifier_inputs", "run_finetuning"]

COMMAND = "tf-megadp finetune"
# The default task's prompt: its template and one word per package (each a
# single token of the public vocabulary: what the text is about).
DEFAULT_TASK_PROMPT = {"template": "[MASK] : {text}",
                       "words": {"scipy": "integral", "scikit-learn": "estimator",
                                 "matplotlib": "axes"}}
# The settings that name files or folders of this machine (report.json names
# them relative to the run folder, or by name).
PATH_FIELDS = ("train", "test", "init_from", "output_dir", "cache_dir")
RELEASED_OUTSIDE_EPSILON = (
    "test accuracy and the majority class accuracy: computed on the test split, which is "
    "not trained on and not protected by DP (publish them only if that text may be "
    "published)",
    "training loss and accuracy on training batches (history.csv, tensorboard/, "
    "report.json history): exact statistics of the sampled batches",
    "the task's class counts and num_examples: exact counts",
    "wall_time_s, train_time_s: timings; train_time_parts_s: the train time in fit (the "
    "steps) and in each of the job's callbacks (evaluation, checkpoints, logs)",
)


def run_finetuning(config: FinetuneConfig, *, log: Callable[[str], None] = print
                   ) -> dict[str, Any]:
    """Runs (or resumes, `config.resume`) one fine-tuning job and returns its report.

    Everything that can be checked before training is checked first: bad
    input raises `JobError` before the output directory is created.

    Args:
        config: the run.
        log: where progress lines go.
    """
    from tf_megadp.run.training_state import has_training_state

    config.validate()
    started = time.time()
    output_dir = config.output_dir or os.path.join(
        "runs", time.strftime("finetune-%Y%m%d-%H%M%S"))
    if config.resume:
        run_folder.check_same_run(run_folder.saved_settings(output_dir, COMMAND), config)
    elif has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
        raise JobError(f"{output_dir} already holds a run; pass --resume to continue it or "
                       "choose another --output-dir.")
    init = _start_of(config, output_dir)
    if config.sequence_length > init.max_sequence_length:
        raise JobError(
            f"--sequence-length {config.sequence_length} exceeds the {init.max_sequence_length} "
            f"positions of --init-from {init.path}: pass --sequence-length "
            f"{init.max_sequence_length} or less.")
    learning_rate, learning_rate_source = config.learning_rate_choice()
    task, template, words = _task(config)
    log(f"Task: {task.description}: {len(task.train_texts):,} training and "
        f"{len(task.test_texts):,} test examples, {len(task.labels)} classes (majority class "
        f"{task.majority_class_accuracy():.3f}).")
    tokenizer = _tokenizer(init)
    x_train, x_test, label_ids = _inputs(config, task, template, words, tokenizer)
    logical_done = _logical_steps_done(config, output_dir)
    batch_size = config.batch_size or config.batch_size_for(len(task.train_texts))
    if batch_size > len(task.train_texts):
        raise JobError(f"--batch-size {batch_size} is larger than the {len(task.train_texts)} "
                       "training examples: lower it.")
    import tf_megadp

    sampler = tf_megadp.PoissonSampler.from_arrays(
        x_train, task.train_labels, batch_size=batch_size, epochs=config.epochs,
        micro_batch_size=config.micro_batch_size, start_step=logical_done,
        end_step=_end_step(config, logical_done, batch_size, len(task.train_texts)))
    schedule = sampler.schedule
    prior = init.composed_ledger(config) if not config.non_private else None
    sigma, delta, planned_epsilon = plan_privacy(config, schedule, prior=prior,
                                                 init_from=init.path)
    created = not os.path.exists(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    try:
        return _train(config, init, task, template, words, label_ids, x_test, sampler,
                      sigma, delta, planned_epsilon, learning_rate, learning_rate_source,
                      output_dir, started, log)
    except BaseException:
        if created and not has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
            import shutil

            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def _start_of(config: FinetuneConfig, output_dir: str):
    """The `InitialWeights` of the run: its checkpoint's record on a resume, else --init-from."""
    from tf_megadp.jobs.bert import initial_weights

    if config.resume:
        saved = run_folder.saved_extra(output_dir).get(INIT_KEY)
        return initial_weights.InitialWeights.from_dict(saved)
    if not config.init_from:
        raise JobError(
            "--init-from PATH: the BERT to fine-tune (the model.keras of `tf-megadp "
            "public-model` or of another run, or a local keras-hub preset folder).")
    init = initial_weights.read_initial_weights(config.init_from)
    if not config.non_private:
        init.origin(config)  # Refuses a start of unknown origin, naming the statement.
    if init.vocabulary is None:
        raise JobError(f"--init-from {init.path} has no vocabulary beside it ({VOCABULARY_NAME}):"
                       " the texts are tokenized with the model's own vocabulary.")
    if init.vocabulary_public is False:
        raise JobError(
            f"--init-from {init.path} reads a vocabulary learned from its own training corpus "
            "(NOT private): the release would publish it again. Start from a model "
            "pretrained with a public vocabulary.")
    return init


def _task(config: FinetuneConfig):
    """(the task, its template, its label words) (`--objective head` uses neither)."""
    from tf_megadp.jobs.finetune import data

    if config.train is None:
        task = data.default_task()
        template = config.template or DEFAULT_TASK_PROMPT["template"]
        words = config.label_words or [DEFAULT_TASK_PROMPT["words"][label]
                                       for label in task.labels]
    else:
        task = data.task_from_files(config.train, config.test, text_field=config.text_field,
                                    label_field=config.label_field, labels=config.labels,
                                    test_fraction=config.test_fraction)
        template = config.template or DEFAULT_TEMPLATE
        words = list(config.label_words or task.labels)
    return task, template, list(words)


def _tokenizer(init):
    import keras_hub

    from tf_megadp.jobs.bert import text

    # The job's token order (special tokens 0-4), which `load_into` gives
    # the model's tables.
    return keras_hub.models.BertTokenizer(
        vocabulary=text.read_vocabulary_file(init.vocabulary), lowercase=True)


def _inputs(config: FinetuneConfig, task, template: str, words, tokenizer):
    """(train inputs, test inputs, the label words' token ids or None) for the objective."""
    import tf_megadp

    if config.objective == "prompt":
        try:
            verbalizer = tf_megadp.Verbalizer(task.labels, words, tokenizer)
            prompt = tf_megadp.PromptTemplate(template)
            return (prompt.encode(task.train_texts, tokenizer, config.sequence_length),
                    prompt.encode(task.test_texts, tokenizer, config.sequence_length),
                    verbalizer.token_ids)
        except ValueError as error:
            raise JobError(f"--objective prompt: {error} (--label-words, --template)") from None
    return (classifier_inputs(task.train_texts, tokenizer, config.sequence_length),
            classifier_inputs(task.test_texts, tokenizer, config.sequence_length), None)


def classifier_inputs(texts, tokenizer, sequence_length: int) -> dict[str, np.ndarray]:
    """`[CLS] text [SEP]` rows for a classifier on [CLS], the text cut to fit."""
    pieces = tokenizer(list(texts))
    pieces = pieces.to_list() if hasattr(pieces, "to_list") else list(pieces)
    rows = np.full((len(texts), sequence_length), tokenizer.pad_token_id, np.int32)
    mask = np.zeros_like(rows)
    for row, ids in enumerate(pieces):
        ids = [tokenizer.cls_token_id] + list(ids)[:sequence_length - 2] + [tokenizer.sep_token_id]
        rows[row, :len(ids)] = ids
        mask[row, :len(ids)] = 1
    return {"token_ids": rows, "segment_ids": np.zeros_like(rows), "padding_mask": mask}


def _logical_steps_done(config: FinetuneConfig, output_dir: str) -> int:
    if not config.resume:
        return 0
    return int(run_folder.saved_extra(output_dir).get("logical_steps", 0))


def _end_step(config: FinetuneConfig, done: int, batch_size: int, n: int) -> int | None:
    if config.stop_after_steps is None:
        return None
    from tf_megadp.steps import steps_for_epochs

    return min(steps_for_epochs(config.epochs, num_examples=n, batch_size=batch_size),
               done + config.stop_after_steps)


def _model(config: FinetuneConfig, init, task, label_ids):
    """The classifier on the start's BERT: a `PromptClassifier` or a `BertTextClassifier`."""
    import keras
    import keras_hub

    import tf_megadp
    from tf_megadp.jobs.bert import initial_weights, training
    from tf_megadp.jobs.bert.config import PretrainConfig

    shape = PretrainConfig(model=init.preset_name(), vocabulary_size=init.vocabulary_size,
                           sequence_length=config.sequence_length,
                           max_sequence_length=init.max_sequence_length)
    masked_lm = training.build_model(shape, init.vocabulary_size)
    initial_weights.load_into(masked_lm, init)
    # The new weights (a head, LoRA factors) from the public seed.
    keras.utils.set_random_seed(config.seed)
    if config.objective == "prompt":
        model = tf_megadp.PromptClassifier(masked_lm, label_ids)
    else:
        model = keras_hub.models.BertTextClassifier(masked_lm.backbone,
                                                    num_classes=len(task.labels),
                                                    preprocessor=None, dropout=0.0)
    if config.lora_rank:
        masked_lm.backbone.enable_lora(config.lora_rank)
        if config.objective == "head":
            # The pooler feeds the head, and masked-LM pretraining never trained it.
            masked_lm.backbone.get_layer("pooled_dense").trainable = True
    return model


def _inner_optimizer(learning_rate: float, config: FinetuneConfig, schedule,
                     accumulation_steps: int | None):
    """AdamW, its learning rate decayed linearly to 0 over the logical steps (Li et al.)."""
    import keras

    scale = accumulation_steps or 1
    rate = keras.optimizers.schedules.PolynomialDecay(
        learning_rate, decay_steps=max(schedule.total_steps * scale, 1), end_learning_rate=0.0,
        power=1.0)
    return keras.optimizers.AdamW(learning_rate=rate, weight_decay=config.weight_decay,
                                  gradient_accumulation_steps=accumulation_steps)


def _compile_kwargs(private: bool) -> dict[str, Any]:
    import keras

    return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            # Keras leaves XLA off on CPU; the DP step compiles its
            # per-example pass with XLA, so the baseline must too to compare.
            "jit_compile": not private}


def _train(config, init, task, template, words, label_ids, x_test, sampler, sigma, delta,
           planned_epsilon, learning_rate, learning_rate_source, output_dir, started, log):
    import keras

    import tf_megadp
    from tf_megadp import distribute
    from tf_megadp.jobs.bert import initial_weights
    from tf_megadp.run.training_state import restore_training_state

    private = not config.non_private
    schedule = sampler.schedule
    accumulation = schedule.phases[0].accumulation_steps
    state: dict[str, Any] = {"history": [], "resumes": []}
    strategy = distribute.resolve_strategy("default")
    with strategy.scope():
        model = _model(config, init, task, label_ids)
        # Built on one example (a subclassed PromptClassifier is not built
        # by its constructor): its weights exist before they are declared.
        model({name: value[:1] for name, value in x_test.items()})
        keras.utils.set_random_seed(config.seed)
        if config.resume:
            state = restore_training_state(
                model, os.path.join(output_dir, CHECKPOINT_NAME), _compile_kwargs(private))
            run_folder.restore_lora_factors(model, output_dir, state.get(LORA_FACTORS_KEY))
            state["resumes"] = state.get("resumes", []) + [int(model.optimizer.iterations)]
        else:
            inner = _inner_optimizer(learning_rate, config, schedule,
                                     None if private or accumulation == 1 else accumulation)
            model.compile(optimizer=(new_dp_optimizer(config, inner, schedule, sigma)
                                     if private else inner), **_compile_kwargs(private))
        if private:
            # Strict: data that no tf_megadp Poisson sampler drew is refused.
            tf_megadp.make_private(model, require_poisson_sampling=True)
            if not config.resume:
                initial_weights.declare(model, init, config)
    dataset = sampler.as_dataset()
    if not private:
        distribute.build_without_reading(model, dataset.element_spec)
    history = state["history"]
    logical_done = int(model.optimizer.iterations.numpy())
    steps_per_epoch_of_run = max(1, config.eval_every * accumulation)
    remaining = sampler.total_micro_steps
    epochs = math.ceil(remaining / steps_per_epoch_of_run) if remaining else 0
    epochs = fitting.epochs_dividing(remaining, epochs)
    privacy = tf_megadp.PrivacyCallback(
        delta=delta, accountant=config.accountant,
        report_path=os.path.join(output_dir, PRIVACY_REPORT_NAME),
        target_epsilon=config.target_epsilon if config.noise_multiplier is None else None
    ) if private else None

    def evaluate(model) -> dict[str, float]:
        result = model.evaluate(x_test, task.test_labels, batch_size=config.micro_batch_size,
                                verbose=0, return_dict=True)
        return {"test_accuracy": float(result["accuracy"])}

    def record() -> dict[str, Any]:
        return {"history": history, "resumes": state["resumes"],
                "config": run_folder.config_dict(config),
                "learning_rate_source": learning_rate_source, INIT_KEY: init.to_dict()}

    checkpointer = run_folder.Checkpointer(output_dir, record)
    callbacks = ([privacy] if privacy else []) + [run_folder.progress_callback(
        private=private, accumulation=accumulation, logical_done=logical_done,
        checkpointer=checkpointer, checkpoint_every=config.checkpoint_every,
        checkpoint_minutes=config.checkpoint_minutes, evaluate=evaluate, history=history,
        privacy=privacy, started=started, train_metrics={"accuracy": "train_accuracy"})]
    callbacks += run_folder.log_callbacks(output_dir, config.resume)
    log(f"Fine-tuning ({config.objective}"
        + (f", LoRA rank {config.lora_rank}" if config.lora_rank else ", every weight")
        + f") from {os.path.basename(init.path)} ({init.trained}); learning rate "
        f"{learning_rate:g} ({learning_rate_source}); schedule: {schedule}; "
        + (f"sigma={sigma:.4f}, C={config.l2_norm_clip}, delta={delta:.3g}, planned "
           f"epsilon={planned_epsilon:.3f}." if private
           else "NON-PRIVATE baseline (no clipping, no noise)."))
    initial_epoch = len(history)
    train_time = fitting.fit_run(
        model, dataset, strategy=strategy, several_workers=False, callbacks=callbacks,
        epochs=initial_epoch + epochs, initial_epoch=initial_epoch,
        steps_per_epoch=remaining // epochs if epochs else 0,
        verbose=run_folder.progress_verbosity(config.verbose))
    if not epochs:
        checkpointer.save(model)
    run_folder.export_release(model, output_dir, init.vocabulary)
    report = run_folder.publishable(_report(
        config, init, task, template, words, model, sampler, privacy, sigma, delta, history,
        state["resumes"], learning_rate, learning_rate_source, started, train_time,
        logical_done), output_dir, PATH_FIELDS)
    write_json_atomically(os.path.join(output_dir, REPORT_NAME), report)
    if history:
        run_folder.plot_history(history, os.path.join(output_dir, PLOT_NAME), "test_accuracy",
                                "test accuracy", private)
    log(_summary(report, output_dir))
    return report


def _report(config, init, task, template, words, model, sampler, privacy, sigma, delta, history,
            resumes, learning_rate, learning_rate_source, started, train_time,
            logical_done) -> dict[str, Any]:
    private = not config.non_private
    accuracy = history[-1]["test_accuracy"] if history else float("nan")
    majority = task.majority_class_accuracy()
    learned, threshold = learned_beyond(accuracy, majority, len(task.test_texts))
    schedule = sampler.schedule
    steps = int(model.optimizer.iterations.numpy())
    return {
        "test_accuracy": accuracy,
        "majority_class_accuracy": majority,
        "learned": learned,
        "learned_threshold": threshold,
        "objective": config.objective,
        "prompt": ({"template": template, "label_words": dict(zip(task.labels, words))}
                   if config.objective == "prompt" else None),
        "trains": describe_training(config.lora_rank),
        "trainable_parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "task": task.report(),
        "private": private,
        "epsilon": float(privacy.epsilon) if private else None,
        "delta": delta if private else None,
        "noise_multiplier": sigma if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "accountant": config.accountant if private else None,
        "learning_rate": learning_rate,
        "learning_rate_source": learning_rate_source,
        "schedule": schedule.to_dict(),
        "sampling": sampler.sampling_kind,
        "logical_steps": steps,
        "completed": steps >= schedule.total_steps,
        "resumed_from_step": logical_done,
        "resumes": resumes,
        "num_examples": schedule.num_examples,
        "privacy_unit": "example",
        INIT_KEY: init.report(config),
        "wall_time_s": time.time() - started,
        "train_time_s": train_time.total_s,
        "train_time_parts_s": train_time.report(),
        "released_outside_epsilon": list(RELEASED_OUTSIDE_EPSILON),
        "files": run_folder.file_guide(
            private, vocabulary="the start's public vocabulary, which the model reads",
            plot="test accuracy and epsilon per evaluation"),
        "history": history,
        "config": run_folder.config_dict(config),
    }


def _summary(report: dict[str, Any], output_dir: str) -> str:
    verdict = verdict_line(report["learned"], report["learned_threshold"], "the majority class")
    privacy = run_folder.privacy_line(report)
    return "\n".join([
        "", "=" * 64,
        f"test accuracy           {report['test_accuracy']:.4f}   (majority class "
        f"{report['majority_class_accuracy']:.4f})",
        f"learned                 {verdict}",
        f"objective               {report['objective']}, {report['trains']}",
        f"privacy                 {privacy}",
        f"logical steps           {report['logical_steps']}   wall time "
        f"{report['wall_time_s']:.0f} s",
        f"time                    {run_folder.train_time_line(report)}",
        f"report                  {os.path.join(output_dir, REPORT_NAME)}",
        "=" * 64])
