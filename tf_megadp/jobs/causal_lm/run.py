"""`run_causal_lm`: one causal-LM pretraining run, end to end, on the shared run machinery.

The run prepares (or reuses) the packed corpus, holds out its split,
builds a GPT-2 from keras-hub's constructors, plans its privacy
(`plan_privacy`), trains with DP-SGD on Poisson-sampled logical batches
(or the non-private baseline on the same batches), scores the held-out
split, and writes the run folder (`tf_megadp.jobs.common.run_folder`):
the release, its privacy report, report.json, the checkpoint that
`--resume` continues.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import numpy as np

from tf_megadp.files import write_json_atomically
from tf_megadp.jobs.causal_lm import data
from tf_megadp.jobs.causal_lm.config import CausalLMConfig
from tf_megadp.jobs.common import fitting, run_folder
from tf_megadp.jobs.common.errors import JobError
from tf_megadp.jobs.common.privacy import new_dp_optimizer, plan_privacy
from tf_megadp.jobs.common.run_folder import (
    CHECKPOINT_NAME,
    MODEL_NAME,
    PLOT_NAME,
    PRIVACY_REPORT_NAME,
    REPORT_NAME,
    VOCABULARY_NAME,
)
from tf_megadp.jobs.common.verdicts import STANDARD_ERRORS, learned_beyond

__all__ = ["COMMAND", "build_model", "run_causal_lm"]

COMMAND = "tf-megadp causal-lm"
# The settings that name files or folders of this machine (report.json names
# them relative to the run folder, or by name).
PATH_FIELDS = ("corpus", "output_dir", "cache_dir")
RELEASED_OUTSIDE_EPSILON = (
    "held-out accuracy and perplexity, and the unigram baseline's: computed on the held-out "
    "split, which is not trained on and not protected by DP (publish them only if that text "
    "may be published)",
    "training loss and accuracy on training batches (history.csv, tensorboard/, report.json "
    "history): exact statistics of the sampled batches",
    "num_examples and the held-out target count: exact counts",
    "wall_time_s, train_time_s: timings",
)


def run_causal_lm(config: CausalLMConfig, *, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    """Runs (or resumes, `config.resume`) one causal-LM pretraining job and returns its report.

    Everything that can be checked before training is checked first: bad
    input raises `JobError` before the output directory is created.

    Args:
        config: the run.
        log: where progress lines go.

    Returns:
        The report, as written to report.json.
    """
    from tf_megadp.run.training_state import has_training_state

    config.validate()
    started = time.time()
    output_dir = config.output_dir or os.path.join(
        "runs", time.strftime("causal-lm-%Y%m%d-%H%M%S"))
    if config.resume:
        run_folder.check_same_run(run_folder.saved_settings(output_dir, COMMAND), config)
    elif has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
        raise JobError(f"{output_dir} already holds a run; pass --resume to continue it or "
                       "choose another --output-dir.")
    corpus, train, heldout = data.corpus_splits(config, log)
    if config.batch_size > len(train):
        raise JobError(f"--batch-size {config.batch_size} is larger than the {len(train)} "
                       "training sequences: lower it.")
    heldout_examples = data.next_token_examples(heldout.read(np.arange(len(heldout))))
    baseline = data.unigram_baseline(train, heldout_examples[1], heldout_examples[2],
                                     train.vocabulary_size)
    from tf_megadp.steps import BatchSizeSchedule

    schedule = BatchSizeSchedule.constant(config.steps, config.batch_size,
                                          num_examples=len(train),
                                          micro_batch_size=config.micro_batch_size)
    sigma, delta, planned_epsilon = plan_privacy(config, schedule)
    created = not os.path.exists(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    try:
        return _train(config, corpus, train, heldout_examples, baseline, schedule, sigma, delta,
                      planned_epsilon, output_dir, started, log)
    except BaseException:
        if created and not has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
            import shutil

            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def build_model(config: CausalLMConfig, vocabulary_size: int):
    """The run's `keras_hub.models.GPT2CausalLM`, from constructors (nothing is downloaded).

    Its head is the token embedding reused (tied), and it reads L - 1
    tokens. Dropout 0: the job's DP step and its non-private baseline
    then compare at the same cost (dropout doubles the XLA step on a CPU).
    """
    import keras_hub

    from tf_megadp.jobs.bert.config import MODEL_PRESETS

    layers, hidden, heads, intermediate = MODEL_PRESETS[config.model]
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, num_layers=layers, num_heads=heads, hidden_dim=hidden,
        intermediate_dim=intermediate, max_sequence_length=config.sequence_length - 1,
        dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


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


def _model(config, schedule, sigma, learning_rate, vocabulary_size, output_dir, sample):
    """(model, its saved state): restored from the checkpoint (--resume) or new; made private."""
    import keras

    import tf_megadp
    from tf_megadp.run.training_state import restore_training_state

    private = not config.non_private
    keras.utils.set_random_seed(config.seed)
    model = build_model(config, vocabulary_size)
    model(sample)
    state: dict[str, Any] = {"history": [], "resumes": []}
    if config.resume:
        state = restore_training_state(model, os.path.join(output_dir, CHECKPOINT_NAME),
                                       _compile_kwargs(private))
        state["resumes"] = state.get("resumes", []) + [int(model.optimizer.iterations)]
    else:
        accumulation = schedule.phases[0].accumulation_steps
        inner = _inner_optimizer(config, learning_rate, schedule,
                                 None if private or accumulation == 1 else accumulation)
        model.compile(optimizer=(new_dp_optimizer(config, inner, schedule, sigma)
                                 if private else inner), **_compile_kwargs(private))
    if private != isinstance(model.optimizer, tf_megadp.DPOptimizer):
        raise JobError(f"{output_dir} holds a {'non-' if private else ''}private run; resume it "
                       f"{'with' if private else 'without'} --non-private.")
    if private:
        # Strict: data that no tf_megadp Poisson sampler drew is refused.
        tf_megadp.make_private(model, require_poisson_sampling=True)
    return model, state


def _train(config, corpus, train, heldout_examples, baseline, schedule, sigma, delta,
           planned_epsilon, output_dir, started, log):
    import tf_megadp
    from tf_megadp import distribute

    private = not config.non_private
    learning_rate, learning_rate_source = config.learning_rate_choice()
    x_test, y_test, w_test = heldout_examples
    logical_done = (int(run_folder.saved_extra(output_dir).get("logical_steps", 0))
                    if config.resume else 0)
    x, y, w = data.next_token_examples(train.read(np.arange(len(train))))
    end_step = None
    if config.stop_after_steps is not None:
        end_step = min(schedule.total_steps, logical_done + config.stop_after_steps)
    # The draws come from OS entropy, never from --seed (which report.json records).
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, y, w, schedule=schedule, start_step=min(logical_done, schedule.total_steps),
        end_step=end_step)
    model, state = _model(config, schedule, sigma, learning_rate, train.vocabulary_size,
                          output_dir, {name: value[:1] for name, value in x_test.items()})
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
        return {"history": history, "resumes": state["resumes"],
                "config": run_folder.config_dict(config),
                "learning_rate_source": learning_rate_source}

    checkpointer = run_folder.Checkpointer(output_dir, record)
    callbacks = ([privacy] if privacy else []) + [run_folder.progress_callback(
        private=private, accumulation=accumulation, logical_done=logical_done,
        checkpointer=checkpointer, checkpoint_every=config.checkpoint_every,
        checkpoint_minutes=config.checkpoint_minutes, evaluate=evaluate, history=history,
        privacy=privacy, started=started, train_metrics={"accuracy": "train_accuracy"})]
    callbacks += run_folder.log_callbacks(output_dir, config.resume)
    log(f"Causal-LM pretraining of a GPT-2 {config.model} on {corpus.manifest.get('source')}: "
        f"N = {len(train):,} sequences of {config.sequence_length} tokens (the privacy unit), "
        f"{len(y_test):,} held out; learning rate {learning_rate:g} ({learning_rate_source}); "
        f"schedule: {schedule}; "
        + (f"sigma={sigma:.4f}, C={config.l2_norm_clip}, delta={delta:.3g}, planned "
           f"epsilon={planned_epsilon:.3f}." if private
           else "NON-PRIVATE baseline (no clipping, no noise)."))
    initial_epoch = len(history)
    train_seconds = fitting.fit_run(
        model, dataset, strategy=distribute.resolve_strategy("default"), several_workers=False,
        callbacks=callbacks, epochs=initial_epoch + epochs, initial_epoch=initial_epoch,
        steps_per_epoch=remaining // epochs if epochs else 0,
        verbose=run_folder.progress_verbosity(config.verbose))
    if not epochs:
        checkpointer.save(model)
    vocabulary_file = os.path.join(corpus.directory, corpus.manifest["vocabulary_file"])
    run_folder.export_release(model, output_dir, vocabulary_file)
    report = run_folder.publishable(_report(
        config, corpus, model, sampler, privacy, sigma, delta, baseline, history,
        state["resumes"], learning_rate, learning_rate_source, started, train_seconds,
        logical_done, float(np.sum(w_test))), output_dir, PATH_FIELDS)
    write_json_atomically(os.path.join(output_dir, REPORT_NAME), report)
    if history:
        run_folder.plot_history(history, os.path.join(output_dir, PLOT_NAME), "heldout_accuracy",
                                "held-out next-token accuracy", private)
    log(_summary(report, output_dir))
    return report


def _report(config, corpus, model, sampler, privacy, sigma, delta, baseline, history, resumes,
            learning_rate, learning_rate_source, started, train_seconds, logical_done,
            heldout_targets) -> dict[str, Any]:
    from tf_megadp.jobs.bert.config import MODEL_PRESETS
    from tf_megadp.jobs.bert.prepare import vocabulary_report

    private = not config.non_private
    last = history[-1] if history else {}
    accuracy = last.get("heldout_accuracy", float("nan"))
    learned, threshold = learned_beyond(accuracy, baseline.accuracy, heldout_targets)
    schedule = sampler.schedule
    steps = int(model.optimizer.iterations.numpy())
    layers, hidden, heads, intermediate = MODEL_PRESETS[config.model]
    return {
        "heldout_accuracy": accuracy,
        "heldout_perplexity": last.get("heldout_perplexity", float("nan")),
        "unigram_baseline_accuracy": baseline.accuracy,
        "unigram_baseline_perplexity": baseline.perplexity,
        "learned": learned,
        "learned_threshold": threshold,
        "heldout_target_tokens": heldout_targets,
        "model": {"family": "GPT-2 (keras_hub.models.GPT2CausalLM, tied head)",
                  "preset": config.model, "layers": layers, "hidden": hidden, "heads": heads,
                  "intermediate": intermediate, "vocabulary_size": int(model.backbone.
                                                                       vocabulary_size),
                  "context": config.sequence_length - 1},
        "trainable_parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "private": private,
        "epsilon": float(privacy.epsilon) if private else None,
        "delta": delta if private else None,
        "noise_multiplier": sigma if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "accountant": config.accountant if private else None,
        "privacy_unit": (f"one packed sequence of {config.sequence_length} tokens: a document "
                         "longer than a sequence, or one sharing sequences with others, is "
                         "protected only by group privacy over the sequences it touches"),
        "learning_rate": learning_rate,
        "learning_rate_source": learning_rate_source,
        "schedule": schedule.to_dict(),
        "sampling": sampler.sampling_kind,
        "logical_steps": steps,
        "completed": steps >= schedule.total_steps,
        "resumed_from_step": logical_done,
        "resumes": resumes,
        "num_examples": schedule.num_examples,
        "corpus": corpus.manifest.get("source"),
        "vocabulary": vocabulary_report(data.corpus_settings(config)),
        "wall_time_s": time.time() - started,
        "train_time_s": train_seconds,
        "released_outside_epsilon": list(RELEASED_OUTSIDE_EPSILON),
        "files": _file_guide(private),
        "history": history,
        "config": run_folder.config_dict(config),
    }


def _file_guide(private: bool) -> dict[str, str]:
    statistics = ("publish only if the statistics under released_outside_epsilon may "
                  "be public")
    guide = {
        MODEL_NAME: ("release: architecture and weights only (tf_megadp.export_model; its "
                     "weights carry their privacy ledger), "
                     + ("covered by epsilon" if private else "NOT private (baseline)")),
        VOCABULARY_NAME: "release: the public vocabulary (the offline default corpus's)",
        REPORT_NAME: f"this report: {statistics}",
        PLOT_NAME: f"held-out accuracy and epsilon per evaluation: {statistics}",
        run_folder.HISTORY_NAME: f"per-epoch training loss and metrics: {statistics}",
        "tensorboard": f"the same per-epoch logs: {statistics}",
        CHECKPOINT_NAME: ("keep like the training data: training state for --resume; never "
                          "publish"),
    }
    if private:
        guide[PRIVACY_REPORT_NAME] = "release: the privacy report (epsilon, ledger)"
    return guide


def _summary(report: dict[str, Any], output_dir: str) -> str:
    if report["learned"] is None:
        verdict = "not evaluated"
    elif report["learned"]:
        verdict = (f"yes (above {report['learned_threshold']:.4f}: the unigram baseline + "
                   f"{STANDARD_ERRORS:g} standard errors)")
    else:
        verdict = (f"NO: not above {report['learned_threshold']:.4f} (the unigram baseline + "
                   f"{STANDARD_ERRORS:g} standard errors)")
    privacy = (f"epsilon = {report['epsilon']:.3f}, delta = {report['delta']:.3g}  (sigma "
               f"{report['noise_multiplier']:.4f}, C {report['l2_norm_clip']}, "
               f"{report['accountant'].upper()}, Poisson sampling; unit: one packed sequence)"
               if report["private"] else "NONE (non-private baseline)")
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
        f"report                  {os.path.join(output_dir, REPORT_NAME)}",
        "=" * 64])
