"""The flags of `tf-megadp finetune`, and the `FinetuneConfig` they give.

Every flag defaults to "not given" (argparse.SUPPRESS): a given flag
overrides the default field (or, with `--resume`, the run's saved one).
"""

from __future__ import annotations

import argparse

from tf_megadp.jobs.common import flags

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
    flags.add_privacy_flags(parser, defaults, examples="training examples",
                            clip_note=", Li et al.'s")
    run = flags.add_run_flags(parser, defaults, evaluation="test")
    run.add_argument("--seed", type=int, default=hidden,
                     help="seeds the new weights (head, LoRA factors) only; never the "
                          "sampling nor the noise")
    run.add_argument("--verbose", default=hidden, type=flags.verbosity,
                     help="Keras fit verbosity (default auto)")


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def finetune_config(args: argparse.Namespace):
    """The `FinetuneConfig` of the flags given (with `--resume`: the saved run's, then them)."""
    from tf_megadp.jobs.finetune.config import FinetuneConfig
    from tf_megadp.jobs.finetune.run import COMMAND

    return flags.config_from_flags(args, FinetuneConfig, COMMAND)
