"""The flags of `tf-megadp causal-lm`, and the `CausalLMConfig` they give.

Every flag defaults to "not given" (argparse.SUPPRESS): a given flag
overrides the default field (or, with `--resume`, the run's saved one).
"""

from __future__ import annotations

import argparse

from tf_megadp.jobs.common import flags

__all__ = ["add_causal_lm_arguments", "causal_lm_config"]


def add_causal_lm_arguments(parser: argparse.ArgumentParser) -> None:
    """Declares the causal-LM job's flags on `parser`."""
    from tf_megadp.jobs.bert.config import MODEL_PRESETS, SEPARATORS
    from tf_megadp.jobs.causal_lm.config import CausalLMConfig
    from tf_megadp.jobs.causal_lm.families import DEFAULT_FAMILY, FAMILIES

    defaults = CausalLMConfig()
    hidden = argparse.SUPPRESS
    data = parser.add_argument_group("data")
    data.add_argument("--corpus", nargs="+", metavar="FILE", default=hidden,
                      help="text or JSONL files (default: the offline default corpus of "
                           "`tf-megadp pretrain`, docstrings of installed packages)")
    data.add_argument("--document-separator", choices=list(SEPARATORS), default=hidden,
                      help="how plain-text files are cut into documents (default "
                           f"{defaults.document_separator})")
    data.add_argument("--max-characters", type=int, default=hidden,
                      help=f"size cap of the default corpus (default {defaults.max_characters:,})")
    data.add_argument("--vocabulary-size", type=int, default=hidden,
                      help="WordPiece vocabulary size, learned from the public default corpus "
                           f"(default {defaults.vocabulary_size})")
    data.add_argument("--sequence-length", type=int, default=hidden,
                      help="tokens per packed sequence, the privacy unit without "
                           "--privacy-unit (default "
                           f"{defaults.sequence_length})")
    data.add_argument("--heldout-fraction", type=float, default=hidden,
                      help=f"share of sequences held out (default {defaults.heldout_fraction})")
    data.add_argument("--privacy-unit", metavar="FIELD", default=hidden,
                      help="pretraining at user level: the JSONL field of --corpus naming each "
                           "document's unit (user, author, account); N, --batch-size and "
                           "--micro-batch-size then count units (docs/privacy.md, 'Choosing "
                           "the privacy unit')")
    data.add_argument("--examples-per-unit", type=int, metavar="K", default=hidden,
                      help="with --privacy-unit: the most sequences of one unit in a logical "
                           f"step, clipped together (default {defaults.examples_per_unit})")
    finetuning = parser.add_argument_group(
        "fine-tuning (with --train and --init-from; the loss on the completions only)")
    finetuning.add_argument("--train", metavar="FILE", default=hidden,
                            help="JSONL (or CSV) prompt/completion pairs to fine-tune on; one "
                                 "pair is one privacy unit")
    finetuning.add_argument("--test", metavar="FILE", default=hidden,
                            help="the pairs scored (default: a held-out share of --train)")
    finetuning.add_argument("--prompt-field", default=hidden,
                            help=f"the prompt's field (default {defaults.prompt_field!r})")
    finetuning.add_argument("--completion-field", default=hidden,
                            help=f"the completion's field (default "
                                 f"{defaults.completion_field!r})")
    finetuning.add_argument("--test-fraction", type=float, default=hidden,
                            help=f"share of --train held out without --test (default "
                                 f"{defaults.test_fraction})")
    finetuning.add_argument("--init-from", metavar="PATH", default=hidden,
                            help="the model.keras of a `tf-megadp causal-lm` run (a DP "
                                 "release's ledger is composed into this run's epsilon)")
    finetuning.add_argument("--init-public", action="store_true", default=hidden,
                            help="state that --init-from was trained on public data only")
    finetuning.add_argument("--init-data-disjoint", action="store_true", default=hidden,
                            help="state that --init-from was trained on data sharing no "
                                 "example with --train: its ledger is not composed")
    finetuning.add_argument("--lora-rank", type=int, default=hidden,
                            help="train LoRA factors of rank R on the attention query and value "
                                 "projections, every other weight of the start frozen")
    model = parser.add_argument_group("model")
    model.add_argument("--family", choices=list(FAMILIES), default=hidden,
                       help=f"decoder of a pretraining run: gpt2 (learned positions, tied "
                            f"head) or llama (rotary positions, untied head) (default "
                            f"{DEFAULT_FAMILY}; fine-tuning: the start's, and a different one "
                            "is refused)")
    model.add_argument("--model", choices=list(MODEL_PRESETS), default=hidden,
                       help=f"size of a pretraining run (default {defaults.model}; "
                            "fine-tuning: the start's)")
    training = parser.add_argument_group("training")
    training.add_argument("--batch-size", type=int, default=hidden,
                          help=f"expected logical batch B (default {defaults.batch_size})")
    training.add_argument("--steps", type=int, default=hidden,
                          help=f"logical steps (default {defaults.steps})")
    training.add_argument("--micro-batch-size", type=int, default=hidden,
                          help=f"sequences per micro-batch (default {defaults.micro_batch_size})")
    training.add_argument("--learning-rate", type=float, default=hidden,
                          help="peak AdamW learning rate (default: DP or non-private default)")
    training.add_argument("--warmup-steps", type=int, default=hidden,
                          help=f"linear warm-up steps (default {defaults.warmup_steps})")
    training.add_argument("--weight-decay", type=float, default=hidden,
                          help=f"AdamW's (default {defaults.weight_decay:g})")
    flags.add_privacy_flags(parser, defaults, examples="training sequences", clip_note="")
    run = flags.add_run_flags(parser, defaults, evaluation="held-out")
    run.add_argument("--cache-dir", default=hidden,
                     help="cache root of the prepared corpus (default ~/.cache/tf_megadp)")
    run.add_argument("--seed", type=int, default=hidden,
                     help="seeds the initialisation and the held-out split only; never the "
                          "sampling nor the noise")
    run.add_argument("--verbose", default=hidden, type=flags.verbosity,
                     help="Keras fit verbosity (default auto)")


def causal_lm_config(args: argparse.Namespace):
    """The `CausalLMConfig` of the flags given (with `--resume`: the saved run's, then them)."""
    from tf_megadp.jobs.causal_lm.config import CausalLMConfig
    from tf_megadp.jobs.causal_lm.run import COMMAND

    return flags.config_from_flags(args, CausalLMConfig, COMMAND)
