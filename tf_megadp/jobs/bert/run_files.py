"""What the pretraining job adds to a run's folder (`tf_megadp.jobs.common.run_folder`).

Its own files (the audit's canaries and result), what its report.json
publishes outside epsilon, its resumed settings and its summary.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from tf_megadp.jobs.bert.config import PretrainConfig, PretrainError
from tf_megadp.jobs.common.run_folder import (INIT_KEY, REPORT_NAME, saved_extra, saved_settings,
                                             train_time_line)

CANARIES_NAME = "canaries.json"
AUDIT_NAME = "audit.json"
# Secret-sharer canaries "the key of W1 W2 is D D D" (a random name W1 W2 per
# canary): 1000 candidate secrets each, ranked exactly.
CANARY_CONTEXT = ("the key of", "is")
CANARY_SECRET_LENGTH = 3
CANARY_ALPHABET = tuple("0123456789")
CANARY_REPETITIONS = (1, 4, 16)
TRAINING_CORPUS_VOCABULARY = "training corpus (NOT private)"
TRAINING_CORPUS_VOCABULARY_WARNING = (
    "--vocabulary-from-training-corpus: the WordPiece vocabulary is learned from "
    "your corpus and published with the model (vocab.txt). It is NOT covered by "
    "epsilon: frequent enough words of the private text, names and identifiers "
    "included, appear in it verbatim. report.json marks the vocabulary "
    f"'{TRAINING_CORPUS_VOCABULARY}'. Drop the flag for a vocabulary learned from the "
    "public default corpus, or pass --vocabulary FILE with a public vocabulary."
)
# What report.json publishes beside the model that epsilon does not cover.
RELEASED_OUTSIDE_EPSILON = (
    "training loss and masked-LM accuracy on training batches (history.csv, "
    "tensorboard/, report.json history): exact statistics of the sampled batches",
    "held-out MLM accuracy: computed on the held-out split, which is not trained "
    "on and not protected by DP (publish it only if that text may be published)",
    "unigram baseline accuracy: the most frequent token of the training split, "
    "counted exactly",
    "num_examples, training_sequences, heldout_examples and heldout_masked_positions: "
    "exact counts (of privacy units, training and held-out sequences, held-out masked "
    "positions)",
    "wall_time_s, train_time_s, examples_per_s: timings; train_time_parts_s: the train time "
    "in fit (the steps) and in each of the job's callbacks (evaluation, checkpoints, logs)",
    "truncated_steps: how many Poisson steps overflowed their capacity",
    "the vocabulary (vocab.txt), when vocabulary.public is false",
)
# The command whose checkpoints hold these settings.
COMMAND = "tf-megadp pretrain"
# The operational fields that end one invocation, not the run: a resume does
# not take them from the checkpoint (a run stopped by --stop-after-steps 1
# and resumed with --resume alone stopped again one step later, each time).
_INVOCATION_FIELDS = frozenset({"stop_after_steps"})


def saved_initial_weights(output_dir: str):
    """The `InitialWeights` the run in `output_dir` started from (None: random weights)."""
    from tf_megadp.jobs.bert.initial_weights import InitialWeights

    saved = saved_extra(output_dir).get(INIT_KEY)
    return InitialWeights.from_dict(saved) if saved else None


def pretrain_settings(output_dir: str) -> dict[str, Any]:
    """The settings of the pretraining run in `output_dir`, from its checkpoint (no TensorFlow)."""
    return saved_settings(output_dir, COMMAND)


def resumed_config(saved: dict[str, Any], **given: Any) -> PretrainConfig:
    """The `PretrainConfig` of a saved run (`saved_settings`), with the fields `given` replaced.

    Fields a saved run lacks (an older release's) take their defaults, and
    so do the fields that ended the invocation that saved it
    (`stop_after_steps`): the resumed run goes on to the end of its schedule
    unless `given` says otherwise.
    """
    from tf_megadp.jobs.bert.config import Hardware

    fields = {field.name for field in dataclasses.fields(PretrainConfig)}
    unknown = sorted(set(saved) - fields)
    if unknown:
        raise PretrainError(
            f"--resume: the run's saved settings name fields this tf_megadp does not have "
            f"({', '.join(unknown)}); resume it with the release that started it.")
    values = {name: value for name, value in saved.items() if name not in _INVOCATION_FIELDS}
    if isinstance(values.get("hardware"), dict):
        values["hardware"] = Hardware(**values["hardware"])
    return dataclasses.replace(PretrainConfig(**values), **given)


# The settings that name files or folders of this machine.
PATH_FIELDS = ("corpus", "output_dir", "cache_dir", "vocabulary", "init_from")


def _learning_lines(report: dict[str, Any]) -> list[str]:
    """The summary's verdict against the unigram baseline, its learning rate and its N."""
    from tf_megadp.jobs.bert.baselines import NOT_LEARNED_MESSAGE
    from tf_megadp.jobs.common.verdicts import STANDARD_ERRORS
    from tf_megadp.jobs.bert.units import describe_population

    threshold = (f"{report['learned_threshold']:.4f}: the unigram baseline + "
                 f"{STANDARD_ERRORS:g} standard errors over "
                 f"{report['heldout_masked_positions']:,.0f} held-out masked positions")
    if report["learned"] is None:
        verdict = "not evaluated"
    elif report["learned"]:
        verdict = f"yes (above {threshold})"
    elif report["completed"]:
        verdict = f"NO: {NOT_LEARNED_MESSAGE} (not above {threshold})"
    else:
        total = sum(phase["steps"] for phase in report["schedule"]["phases"])
        verdict = (f"not yet (step {report['logical_steps']} of {total}; "
                   f"not above {threshold})")
    # report.json spells the sequence-level unit as privacy.json does: "example".
    population = describe_population(
        None if report["privacy_unit"] == "example" else report["privacy_unit"],
        report["num_examples"], report["training_sequences"])
    return [f"learned                 {verdict}",
            f"learning rate           {report['learning_rate']:g} "
            f"({report['learning_rate_source']})",
            f"trained on              {population}"]


def mechanism_description(noise, sampling: str, cycle_length: int | None) -> str:
    """The noise mechanism and the sampling it is accounted with, in words (log and summary).

    Args:
        noise: the run's noise mechanism (`tf_megadp.accounting.noise`), or
            None for DP-SGD's.
        sampling: the sampling kind.
        cycle_length: L of cyclic Poisson sampling.

    Returns:
        The mechanism's `label` on the sampling in words, e.g. "... on
        cyclic Poisson sampling (4 groups: step t samples group t mod 4)".
    """
    from tf_megadp.accounting.noise import default_noise

    samplings = {
        "poisson": "Poisson sampling",
        "cyclic_poisson": (f"cyclic Poisson sampling ({cycle_length} groups: step t samples "
                           f"group t mod {cycle_length})"),
        "fixed_order": "fixed-order sampling (one secret order, the same every epoch)",
    }
    return (f"{(noise or default_noise()).label()} on "
            f"{samplings.get(sampling, f'{sampling} sampling')}")


def _report_mechanism(report: dict[str, Any]) -> str:
    from tf_megadp.accounting.noise import read_noise_record

    noise = report.get("noise")
    mechanism = None if noise is None else read_noise_record(noise["record"])[0]
    return mechanism_description(mechanism, report["sampling"], report.get("cycle_length"))


def run_summary(report: dict[str, Any], output_dir: str) -> str:
    lines = [
        "",
        "=" * 64,
        f"held-out MLM accuracy   {report['heldout_mlm_accuracy']:.4f}"
        f"   (unigram baseline {report['unigram_baseline_accuracy']:.4f})",
    ]
    lines += _learning_lines(report)
    if report["private"]:
        lines.append(
            f"privacy                 epsilon = {report['epsilon']:.3f}, delta = {report['delta']:.3g}"
            f"  (sigma {report['noise_multiplier']:.4f}, C {report['l2_norm_clip']}, "
            f"{report['accountant'].upper()})")
        lines.append(f"mechanism               {_report_mechanism(report)}")
        if report["adaptive_clipping"]:
            lines.append(f"adaptive clip norm      C {report['adaptive_clipping']['clip_norm']:.4g} "
                         f"at the end (target quantile "
                         f"{report['adaptive_clipping']['target_quantile']:g})")
    else:
        lines.append("privacy                 NONE (non-private baseline)")
    lines.append(f"vocabulary              {report['vocabulary']['source']}")
    lines += [
        f"logical steps           {report['logical_steps']}   examples/s {report['examples_per_s']:.0f}"
        f"   wall time {report['wall_time_s']:.0f} s",
        f"time                    {train_time_line(report)}",
        f"report                  {os.path.join(output_dir, REPORT_NAME)}",
        "=" * 64,
    ]
    return "\n".join(lines)
