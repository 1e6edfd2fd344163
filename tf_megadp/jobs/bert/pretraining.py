"""The main job: DP masked-LM pretraining of a keras-hub BERT, end to end.

`run_pretraining(PretrainConfig(...))` prepares (or reuses) the token shards
of a corpus, splits off a held-out set, plans the logical steps with one
`BatchSizeSchedule`, calibrates sigma for a target epsilon, trains a
`keras_hub.models.BertMaskedLM` from scratch with `DPOptimizer` on honest
Poisson batches, and writes everything into one output directory:
checkpoints, TensorBoard logs, `history.csv`, `report.json` and `report.png`.
`tf-megadp pretrain` and `examples/pretrain_bert_mlm.py` are thin wrappers.

The run's settings are one `PretrainConfig` (`tf_megadp.jobs.bert.config`,
re-exported here); a planned one (with `hardware`) is planned again with the
measured N and vocabulary size before it trains. On R replicas of one host
the sampler's m * R-row micro-steps go to `fit` unchanged and Keras splits
them. Under several workers (`MultiWorkerMirroredStrategy`), where Keras
3.15's `fit` cannot run, the same private step trains in a custom loop
(`tf_megadp.PrivateStep`) that drives the same callbacks, and only the
chief writes the run's files.

The job's parts: `prepare` (corpus shards, vocabulary, held-out split,
canaries), `training` (model, inner optimizer, the private fit or loop,
checkpoints), `run_files` (what the job adds to a run's folder,
`tf_megadp.jobs.common.run_folder`, and its summary); this module plans
the privacy and runs them in order.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
import warnings
from typing import Any

from tf_megadp.jobs.bert.config import (  # noqa: F401 (the job's names, for the audit job)
    MODEL_PRESETS,
    PRECISIONS,
    PretrainConfig,
    PretrainError,
)
from tf_megadp.jobs.common.privacy import plan_privacy
from tf_megadp.jobs.bert.config_file import load_run_config, run_config_from_dict
from tf_megadp.jobs.bert.prepare import canary_split, prepare_data, vocabulary_report
from tf_megadp.jobs.bert.run_files import (
    TRAINING_CORPUS_VOCABULARY_WARNING,
    CANARIES_NAME,
    pretrain_settings,
    saved_initial_weights,
)
from tf_megadp.jobs.common.run_folder import CHECKPOINT_NAME, check_same_run
from tf_megadp.jobs.bert.training import build_model, run_training

__all__ = ["MODEL_PRESETS", "PRECISIONS", "PretrainConfig", "PretrainError", "build_model",
           "canary_split", "load_run_config", "prepare_data", "run_config_from_dict",
           "run_pretraining"]


def _check_planned_hardware(config: PretrainConfig, replicas: int,
                            vocabulary_size: int, init=None) -> dict[str, Any]:
    """A planned run trains on the hardware and model its plan was made for.

    Returns:
        The plan (`tf_megadp.jobs.bert.plan.make_plan`), whose calibrated sigma
        and epsilon the run takes instead of computing them again.
    """
    from tf_megadp.jobs.bert import plan

    if replicas != config.hardware.replicas:
        raise PretrainError(
            f"The run is planned for {config.hardware.replicas} replicas "
            f"({config.hardware.name}), but the strategy has {replicas}: its static "
            "capacities and per-core memory would not be the plan's. Run it on that "
            "slice, or set hardware.replicas and plan again.")
    # A learned vocabulary may come out a little smaller than asked; the
    # plan is redone below with the measured size. A larger one is not
    # the model that was planned.
    if vocabulary_size > config.vocabulary_size:
        raise PretrainError(
            f"The run is planned for vocabulary_size {config.vocabulary_size}, but its "
            f"vocabulary has {vocabulary_size} tokens; set model.vocabulary_size to "
            f"{vocabulary_size} and plan again.")
    # Raises InfeasiblePlanError naming the number, exactly as `tf-megadp plan` does.
    return plan.make_plan(config, vocabulary_size=vocabulary_size, init=init)


@dataclasses.dataclass(frozen=True)
class _TestingSeeds:
    """Test-only reproducibility: never reachable from a flag or a config file.

    Comparing two runs (R replicas against one device) needs the same
    Poisson draws, masks, dropout and noise, which the job otherwise draws
    from fresh OS entropy: the sampling seed also fixes the masks' keys
    (the sampler's), the noise seed the dropout key (the optimizer's). Both
    library seeds warn and mark the run (its privacy report says the
    sampling and the noise are seeded: not for release); the values are
    written nowhere.
    """

    sampling_seed: int
    noise_seed: int
    noise_multiplier: float | None = None


def run_pretraining(config: PretrainConfig, *, log=print,
                    testing: _TestingSeeds | None = None) -> dict[str, Any]:
    """Runs (or resumes) one pretraining job and returns its report.

    Everything that can be checked before training is checked first, so bad
    input raises `PretrainError` before the output directory is created. A
    config with `hardware` is planned first (`tf_megadp.jobs.bert.plan.make_plan`,
    with the measured N and vocabulary size): an infeasible plan, or a
    strategy with another replica count, stops the run before it trains.

    Args:
        config: the run.
        log: where progress lines go.
        testing: tests only (`_TestingSeeds`); never set it for a real run.
    """
    from tf_megadp.jobs.bert import initial_weights

    config.validate()
    init = None
    # A resume takes the record of its start from its checkpoint; its
    # settings may still name the init's shape by the defaults.
    if config.init_from and (not config.resume or os.path.exists(config.init_from)):
        # Shape, vocabulary and origin from the init: refused here, before
        # the corpus is read.
        init = initial_weights.read_initial_weights(config.init_from)
        config = initial_weights.configured(config, init)
        config.validate()
    # The run trains with (and its checkpoint keeps) a number; where the
    # number came from goes to the report.
    learning_rate, learning_rate_source = config.learning_rate_choice()
    config = dataclasses.replace(config, learning_rate=learning_rate)
    phases = config.phases()
    started = time.time()
    if config.vocabulary_from_training_corpus:
        warnings.warn(TRAINING_CORPUS_VOCABULARY_WARNING, UserWarning, stacklevel=2)

    output_dir = config.output_dir or os.path.join(
        "runs", time.strftime("pretrain-%Y%m%d-%H%M%S"))
    from tf_megadp.run.training_state import has_training_state

    # A checkpoint counts once committed: a run killed before its first one
    # (or while writing it) starts again.
    has_checkpoint = has_training_state(os.path.join(output_dir, CHECKPOINT_NAME))
    if config.resume:
        # Before the corpus and TensorFlow: a refused resume fails at once.
        check_same_run(pretrain_settings(output_dir), config)
        init = saved_initial_weights(output_dir)
    if not config.resume and has_checkpoint:
        raise PretrainError(
            f"{output_dir} already holds a run; pass --resume to continue it or choose "
            "another --output-dir."
        )

    from tf_megadp import distribute

    if config.cpu_replicas:
        distribute.configure_cpu_replicas(config.cpu_replicas)
        strategy = distribute.resolve_strategy(
            "mirrored", devices=[f"/cpu:{index}" for index in range(config.cpu_replicas)])
    else:
        strategy = distribute.resolve_strategy(config.strategy, tpu=config.tpu)
    several_workers = distribute._worker_count(strategy) > 1
    if several_workers and config.non_private:
        raise PretrainError(
            "The non-private baseline trains with Keras's fit, which cannot run under "
            "MultiWorkerMirroredStrategy with several workers (docs/tpu.md): run it on "
            "one host (strategies default, mirrored, tpu)."
        )
    chief = distribute.is_chief(strategy)
    replicas = strategy.num_replicas_in_sync
    log(f"Preparing the corpus ({'default offline corpus' if not config.corpus else 'user corpus'}; "
        f"vocabulary from {vocabulary_report(config)['source']})...")
    if not chief:
        # The chief prepares the cache first: workers sharing its folder
        # then only read it (without a shared folder each prepares its own).
        distribute.barrier(strategy)
    _, train, heldout = prepare_data(config, log)
    if not config.vocabulary and train.vocabulary_size < config.vocabulary_size:
        # WordPiece stops when no pair of pieces is frequent enough to merge.
        log(f"Vocabulary: {train.vocabulary_size} tokens, fewer than the "
            f"{config.vocabulary_size} asked (--vocabulary-size): its corpus has no more "
            f"pieces worth a token. The model is built for {train.vocabulary_size} "
            "(report.json: vocabulary.size, vocabulary.requested_size).")
    # N: the privacy units of the training split (sequences, or users).
    population = len(train) if not config.privacy_unit else train.manifest["num_units"]
    if config.privacy_unit:
        log(f"Corpus: N = {population:,} privacy units ({config.privacy_unit!r}) writing "
            f"{len(train):,} training sequences of {train.sequence_length} tokens, at most "
            f"{config.examples_per_unit} per unit and step; {len(heldout):,} held out.")
    else:
        log(f"Corpus: N = {len(train):,} training sequences of {train.sequence_length} tokens "
            f"(the privacy unit), {len(heldout):,} held out.")
    canaries = None
    if config.canaries:
        train, canaries, _ = canary_split(config, train)
        # The canaries are training sequences too (never with a privacy unit).
        population = len(train)
    if chief:
        distribute.barrier(strategy)
    if max(phase[1] for phase in phases) > population:
        raise PretrainError(
            f"The logical batch ({max(phase[1] for phase in phases)}) is larger than the "
            f"training corpus ({population} privacy units); lower --batch-size."
        )
    if config.num_examples is not None and config.num_examples != population:
        raise PretrainError(
            f"The run is planned for num_examples N={config.num_examples}, but the training "
            f"split holds {population} privacy units: its sampling rates and epsilon would "
            f"not be this run's. Set training.num_examples (--num-examples) to {population} "
            "and plan again.")
    plan = None
    if config.hardware is not None:
        plan = _check_planned_hardware(config, replicas, train.vocabulary_size, init)
    schedule = config.make_schedule(population, replicas)
    # --bands auto: the mechanism's choice by the run's expected error (DP-SGD
    # itself among the candidates), fixed before planning.
    config, noise_choice = config.with_chosen_noise(schedule)
    if noise_choice is not None:
        log(f"--bands auto: {config.noise} with {noise_choice['parameter']} "
            f"{noise_choice['chosen']} (expected prefix-sum RMSE by candidate, in units of C: "
            + ", ".join(f"{value}: {error:.4g}"
                        for value, error in noise_choice["expected_errors"].items()) + ").")
    prior = init.composed_ledger(config) if init is not None else None
    sigma, delta, planned_epsilon = plan_privacy(config, schedule, prior=prior, plan=plan,
                                                 init_from=config.init_from)
    if testing is not None and testing.noise_multiplier is not None:
        sigma = testing.noise_multiplier

    # Only the chief writes the run's files (the other workers of a
    # multi-worker run write nothing there).
    created = chief and not os.path.exists(output_dir)
    if chief:
        os.makedirs(output_dir, exist_ok=True)
    try:
        if canaries is not None and chief:
            from tf_megadp.audit.canaries import save_canaries

            save_canaries(os.path.join(output_dir, CANARIES_NAME), canaries)
        return run_training(config, schedule, sigma, delta, planned_epsilon, train, heldout,
                            strategy, output_dir, started, log, testing,
                            learning_rate_source=learning_rate_source, init=init,
                            noise_choice=noise_choice)
    except BaseException:
        if created and not has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
