"""The flags of `tf-megadp finetune`, and the `FinetuneConfig` they give.

Every flag defaults to "not given" (argparse.SUPPRESS): a given flag
overrides the default field (or, with `--resume`, the run's saved one).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

__all__ = ["add_finetune_arguments", "finetune_config"]


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """Declares the fine-tuning job's flags on `parser`."""
    from tf_megadp.jobs.finetune.config import DEFAULT_TEMPLATE, OBJECTIVES, FinetuneConfig

    defaults = FinetuneConfig()
    hidden = argparse.SUPPRESS
    data = parser.add_argument_group("data")
    data.add_argument("--train", metavar="FILE", default=hidden,
                      help="labelled JSONL or CSV (default: the default task, which package a "
                           "docstring summary comes from: scipy, scikit-learn or matplotlib)")
    data.add_argument("--test", metavar="FILE", default=hidden,
                      help="the labelled test file (default: a held-out share of --train)")
    data.add_argument("--text-field", default=hidden,
                      help=f"the text's field (default {defaults.text_field!r})")
    data.add_argument("--label-field", default=hidden,
                      help=f"the label's field (default {defaults.label_field!r})")
    data.add_argument("--labels", default=hidden, type=_comma_list,
                      help="the class names in order, comma-separated (default: the training "
                           "labels, sorted)")
    data.add_argument("--label-words", default=hidden, type=_comma_list,
                      help="prompt: the word predicted at [MASK] for each label, in the order "
                           "of the labels, each one token of the vocabulary (default: the "
                           "labels themselves)")
    data.add_argument("--template", default=hidden,
                      help=f"prompt: the template, with {{text}} and one [MASK] (default "
                           f"{DEFAULT_TEMPLATE!r})")
    data.add_argument("--test-fraction", type=float, default=hidden,
                      help=f"share of --train held out without --test (default "
                           f"{defaults.test_fraction})")
    model = parser.add_argument_group("model")
    model.add_argument("--init-from", metavar="PATH", default=hidden,
                       help="the BERT to fine-tune: a run's model.keras (the public model of "
                            "`tf-megadp public-model`, or a DP release, whose ledger is "
                            "composed) or a local keras-hub preset folder")
    model.add_argument("--init-public", action="store_true", default=hidden,
                       help="state that --init-from was trained on public data only (a preset "
                            "no report describes)")
    model.add_argument("--init-data-disjoint", action="store_true", default=hidden,
                       help="state that --init-from was trained on data sharing no example "
                            "with --train: its ledger is not composed")
    model.add_argument("--objective", choices=list(OBJECTIVES), default=hidden,
                       help="prompt: the label as a word at [MASK] through the pretrained MLM "
                            "head (default); head: a classifier on [CLS]")
    model.add_argument("--lora-rank", type=int, default=hidden,
                       help="train LoRA factors of rank R on the attention query and value "
                            "projections, the rest of the backbone frozen")
    model.add_argument("--sequence-length", type=int, default=hidden,
                       help=f"tokens per example (default {defaults.sequence_length})")
    training = parser.add_argument_group("training")
    training.add_argument("--batch-size", type=int, default=hidden,
                          help="expected logical batch B (default: N / 4, within [64, 1024])")
    training.add_argument("--epochs", type=float, default=hidden,
                          help=f"passes over the data (default {defaults.epochs:g})")
    training.add_argument("--micro-batch-size", type=int, default=hidden,
                          help=f"examples per micro-batch (default {defaults.micro_batch_size})")
    training.add_argument("--learning-rate", type=float, default=hidden,
                          help="peak AdamW learning rate, decayed linearly to 0 (default: the "
                               "objective's, DP or non-private)")
    training.add_argument("--weight-decay", type=float, default=hidden,
                          help=f"AdamW's (default {defaults.weight_decay:g})")
    privacy = parser.add_argument_group("privacy")
    privacy.add_argument("--target-epsilon", type=float, default=hidden,
                         help=f"calibrate sigma to spend this (default {defaults.target_epsilon:g})")
    privacy.add_argument("--noise-multiplier", type=float, default=hidden,
                         help="sigma, instead of --target-epsilon")
    privacy.add_argument("--delta", type=float, default=hidden,
                         help="default 1 / N^1.1 for N training examples")
    privacy.add_argument("--l2-norm-clip", type=float, default=hidden,
                         help=f"C (default {defaults.l2_norm_clip:g}, Li et al.'s)")
    privacy.add_argument("--clipping", choices=["auto", "ghost", "vectorized"], default=hidden,
                         help="per-example clipping strategy (default auto)")
    privacy.add_argument("--accountant", default=hidden, help="pld (default) or rdp")
    privacy.add_argument("--non-private", action="store_true", default=hidden,
                         help="the baseline: no clipping, no noise, the same batches")
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", default=hidden, help="the run's folder (default runs/...)")
    run.add_argument("--resume", action="store_true", default=hidden,
                     help="continue the run in --output-dir with its saved settings")
    run.add_argument("--eval-every", type=int, default=hidden,
                     help=f"logical steps between test evaluations (default "
                          f"{defaults.eval_every})")
    run.add_argument("--checkpoint-every", type=int, default=hidden,
                     help="logical steps between checkpoints (default 0: by time only)")
    run.add_argument("--checkpoint-minutes", type=float, default=hidden,
                     help=f"minutes of training between checkpoints (default "
                          f"{defaults.checkpoint_minutes:g})")
    run.add_argument("--stop-after-steps", type=int, default=hidden,
                     help="end this invocation after N logical steps (resume later)")
    run.add_argument("--seed", type=int, default=hidden,
                     help="seeds the new weights (head, LoRA factors) only; never the "
                          "sampling nor the noise")
    run.add_argument("--verbose", default=hidden, type=_verbosity,
                     help="Keras fit verbosity (default auto)")


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _verbosity(text: str) -> int | str:
    return text if text == "auto" else int(text)


def finetune_config(args: argparse.Namespace):
    """The `FinetuneConfig` of the flags given (with `--resume`: the saved run's, then them)."""
    from tf_megadp.jobs.common import run_folder
    from tf_megadp.jobs.finetune.config import FinetuneConfig
    from tf_megadp.jobs.finetune.run import COMMAND

    given: dict[str, Any] = {name: value for name, value in vars(args).items()
                             if name not in ("handler", "command", "json")}
    if given.get("resume"):
        if not given.get("output_dir"):
            raise ValueError("--resume needs --output-dir, the folder of the run to continue.")
        saved = run_folder.saved_settings(given["output_dir"], COMMAND)
        config = FinetuneConfig(**{name: value for name, value in saved.items()
                                   if name != "stop_after_steps"})
    else:
        config = FinetuneConfig()
    if given.get("non_private"):
        given.update(noise_multiplier=None, target_epsilon=None)
    elif "noise_multiplier" in given and "target_epsilon" not in given and not given.get(
            "resume"):
        given["target_epsilon"] = None
    return dataclasses.replace(config, **given)
