"""The files of a pretraining run: their names, the guide to them, the saved settings, the summary."""

from __future__ import annotations

import dataclasses
import os
from typing import Any


from tf_megadp.jobs.bert.config import (
    PretrainConfig,
    PretrainError,
)

CHECKPOINT_NAME = "checkpoint"
CANARIES_NAME = "canaries.json"
AUDIT_NAME = "audit.json"
# Secret-sharer canaries "the key of W1 W2 is D D D" (a random name W1 W2 per
# canary): 1000 candidate secrets each, ranked exactly.
CANARY_CONTEXT = ("the key of", "is")
CANARY_SECRET_LENGTH = 3
CANARY_ALPHABET = tuple("0123456789")
CANARY_REPETITIONS = (1, 4, 16)
MODEL_NAME = "model.keras"
VOCABULARY_NAME = "vocab.txt"
REPORT_NAME = "report.json"
PRIVACY_REPORT_NAME = "privacy.json"
TRAINING_CORPUS_VOCABULARY = "training corpus (NOT private)"
_TRAINING_CORPUS_VOCABULARY_WARNING = (
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
    "wall_time_s, train_time_s, examples_per_s: timings",
    "truncated_steps: how many Poisson steps overflowed their capacity",
    "the vocabulary (vocab.txt), when vocabulary.public is false",
)
PLOT_NAME = "report.png"
HISTORY_NAME = "history.csv"


_RUN_CONTROL_FIELDS = {"resume", "stop_after_steps", "verbose", "output_dir", "cache_dir"}


def _check_same_run(saved: dict[str, Any], config: PretrainConfig) -> None:
    """A resumed run must keep the settings its ledger and schedule were planned with."""
    current = _config_dict(config)
    changed = sorted(
        name for name in current
        if name not in _RUN_CONTROL_FIELDS and name in saved and saved[name] != current[name]
    )
    if changed:
        details = ", ".join(f"{name}: {saved[name]!r} -> {current[name]!r}" for name in changed)
        raise PretrainError(
            f"--resume with different settings ({details}); resume with the settings the "
            "run was started with."
        )


def _config_dict(config: PretrainConfig) -> dict[str, Any]:
    values = dataclasses.asdict(config)
    values["corpus"] = list(config.corpus) if config.corpus else None
    values["schedule"] = [list(p) for p in config.schedule] if config.schedule else None
    return values


def _learning_lines(report: dict[str, Any]) -> list[str]:
    """The summary's verdict against the unigram baseline, its learning rate and its N."""
    from tf_megadp.jobs.bert.baselines import NOT_LEARNED_MESSAGE, STANDARD_ERRORS
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
    population = describe_population(
        None if report["privacy_unit"] == "sequence" else report["privacy_unit"],
        report["num_examples"], report["training_sequences"])
    return [f"learned                 {verdict}",
            f"learning rate           {report['learning_rate']:g} "
            f"({report['learning_rate_source']})",
            f"trained on              {population}"]


def _summary(report: dict[str, Any], output_dir: str) -> str:
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
            f"  (sigma {report['noise_multiplier']:.4f}, C {report['l2_norm_clip']}, Poisson, "
            f"{report['accountant'].upper()})")
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
        f"report                  {os.path.join(output_dir, REPORT_NAME)}",
        "=" * 64,
    ]
    return "\n".join(lines)
