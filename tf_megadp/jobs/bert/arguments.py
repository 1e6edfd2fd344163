"""The command-line flags of a BERT job run configuration, shared by `tf-megadp pretrain` and `plan`.

Every flag defaults to "not given" (argparse.SUPPRESS), so that a given
flag overrides the field of a `--config` file and a missing one leaves it
(`tf_megadp.cli.run_config_from_args` applies them).
"""

from __future__ import annotations

import argparse

from tf_megadp.accounting import accountant_names

__all__ = ["add_run_config_arguments"]


def add_run_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a run configuration, shared by `pretrain` and `plan`.

    Every flag defaults to "not given" (argparse.SUPPRESS): a given flag
    overrides the field of the `--config` file (or of the defaults), a
    missing one leaves it. See `run_config_from_args`.
    """
    from tf_megadp.jobs.bert.config import (DP_LEARNING_RATE, LEARNING_RATE_SCALINGS,
                                            MODEL_PRESETS, NON_PRIVATE_LEARNING_RATE,
                                            PRECISIONS, SEPARATORS, PretrainConfig)
    from tf_megadp.accounting.noise import noise_class
    from tf_megadp.jobs.common.privacy import AUTO, NOISES, PER_EXAMPLE_SCALINGS

    defaults = PretrainConfig()
    hidden = argparse.SUPPRESS
    data = parser.add_argument_group("data")
    data.add_argument("--corpus", nargs="+", metavar="PATH", default=hidden,
                      help="text/JSONL files or globs (default: the offline default corpus)")
    data.add_argument("--sequence-length", type=int, default=hidden,
                      help=f"tokens per sequence (default {defaults.sequence_length})")
    data.add_argument("--vocabulary-size", type=int, default=hidden,
                      help="size of the vocabulary learned from the public default corpus "
                           f"(default {defaults.vocabulary_size})")
    data.add_argument("--vocabulary", metavar="FILE", default=hidden,
                      help="a PUBLIC WordPiece vocabulary (one token per line, e.g. BERT's "
                           "vocab.txt) instead of one learned from the default corpus")
    data.add_argument("--vocabulary-from-training-corpus", action="store_true", default=hidden,
                      help="learn the vocabulary from --corpus itself: NOT private (it is "
                           "published with the model and shows the corpus's words "
                           "verbatim); warns, and report.json says so")
    data.add_argument("--document-separator", choices=list(SEPARATORS), default=hidden,
                      help="plain-text corpus files: documents separated by blank lines, or "
                           f"one per line (default {defaults.document_separator})")
    data.add_argument("--max-characters", type=int, default=hidden,
                      help="size cap of the default corpus")
    data.add_argument("--public-sources", metavar="NAMES", default=hidden,
                      help="sources of the offline default corpus and its vocabulary, "
                           "comma-separated: docstrings, more-docstrings, man, doc, "
                           "package-docs (scipy, scikit-learn and matplotlib held out; "
                           "default: docstrings of the standard library, numpy, keras and "
                           "tensorflow)")
    data.add_argument("--heldout-fraction", type=float, default=hidden)
    data.add_argument("--privacy-unit", metavar="FIELD", default=hidden,
                      help="user-level privacy: the JSONL field naming each document's "
                           "unit (author, account); batch sizes then count units "
                           "(docs/privacy.md, 'Choosing the privacy unit')")
    data.add_argument("--examples-per-unit", type=int, metavar="K", default=hidden,
                      help="with --privacy-unit: the most sequences of one unit in a "
                           "logical step (default 4)")
    data.add_argument("--canaries", type=int, metavar="N", default=hidden,
                      help="insert N secret canaries per repetition count (1, 4, 16) into the "
                           "training split for `tf-megadp audit` (default: none)")
    data.add_argument("--num-examples", type=int, metavar="N", default=hidden,
                      help="the N the run is planned for; another corpus size is refused")
    model = parser.add_argument_group("model and optimizer")
    model.add_argument("--model", choices=list(MODEL_PRESETS), default=hidden,
                       help=f"preset (default {defaults.model})")
    model.add_argument("--init-from", metavar="PATH", default=hidden,
                       help="continue pretraining from PATH: the model.keras of a run of "
                            "this job or a local keras-hub preset directory; its shape and "
                            "vocabulary are the run's, and the ledger a DP release's "
                            "weights carry is composed into epsilon; a model no file "
                            "describes needs --init-public or --init-data-disjoint")
    model.add_argument("--init-data-disjoint", action="store_true", default=hidden,
                       help="state that --init-from was trained on data sharing no example "
                            "with this corpus: its ledger is not composed (recorded in the "
                            "report)")
    model.add_argument("--init-public", action="store_true", default=hidden,
                       help="state that --init-from was trained on public data only (a "
                            "preset no report describes): nothing is composed, and the "
                            "report says you declared it")
    model.add_argument("--lora-rank", type=int, metavar="R", default=hidden,
                       help="train LoRA factors of rank R on the backbone's attention query "
                            "and value projections (keras-hub enable_lora), the rest of the "
                            "backbone frozen, the MLM head trained")
    model.add_argument("--freeze-embeddings", action="store_true", default=hidden,
                       help="keep the token, position and segment embeddings (and so the "
                            "tied MLM decoder) as they start")
    model.add_argument("--precision", choices=list(PRECISIONS), default=hidden,
                       help="dtype policy: mixed_bfloat16 (TPUs) computes in bfloat16, "
                            "mixed_float16 (GPUs without bfloat16) in float16; both keep "
                            "variables, norms, accumulators, noise and logits in float32")
    model.add_argument("--loss-scale", type=float, metavar="S", default=hidden,
                       help="the fixed loss scale of a private mixed_float16 run (default "
                            f"{defaults.loss_scale:g}, Keras's initial scale; a power of two); "
                            "an example whose scaled gradient overflows contributes zero")
    model.add_argument("--learning-rate", type=float, default=hidden,
                       help=f"peak AdamW learning rate (default {DP_LEARNING_RATE:g}; "
                            f"{NON_PRIVATE_LEARNING_RATE:g} with --non-private)")
    model.add_argument("--warmup-steps", type=int, default=hidden)
    model.add_argument("--weight-decay", type=float, default=hidden)
    model.add_argument("--learning-rate-scaling", choices=list(LEARNING_RATE_SCALINGS),
                       default=hidden,
                       help="scale the learning rate of each phase with its batch B: "
                            "lr * (B / --reference-batch-size)^(0, 1/2, 1) "
                            f"(default {defaults.learning_rate_scaling})")
    model.add_argument("--reference-batch-size", type=int, default=hidden,
                       help="the batch at which --learning-rate applies as given "
                            f"(default {defaults.reference_batch_size})")
    model.add_argument("--ema-momentum", type=_optional_fraction, metavar="M|none",
                       default=hidden,
                       help="average the weights (EMA, no privacy cost) with this momentum; "
                            "evaluation and the exported model use the average; 'none' "
                            f"turns it off (default {defaults.ema_momentum})")
    model.add_argument("--clipping", default=hidden,
                       help=f"per-example clipping strategy (default {defaults.clipping})")
    model.add_argument("--dropout", type=float, default=hidden)
    batches = parser.add_argument_group("logical steps")
    batches.add_argument("--micro-batch-size", type=int, default=hidden,
                         help=f"m, per replica (default {defaults.micro_batch_size})")
    batches.add_argument("--batch-size", type=int, default=hidden,
                         help=f"expected logical batch (Poisson; default {defaults.batch_size})")
    batches.add_argument("--steps", type=int, default=hidden,
                         help=f"logical steps (default {defaults.steps})")
    batches.add_argument("--schedule", metavar="STEPSxBATCH,...", default=hidden,
                         help="growing batch, e.g. 40x256,40x1024 (overrides --batch-size/--steps)")
    privacy = parser.add_argument_group("privacy")
    privacy.add_argument("--target-epsilon", type=float, default=hidden,
                         help=f"calibrate sigma to spend this epsilon (default {defaults.target_epsilon})")
    privacy.add_argument("--noise-multiplier", type=float, default=hidden,
                         help="sigma, instead of --target-epsilon")
    privacy.add_argument("--noise", choices=list(NOISES), default=hidden,
                         help="correlated noise, trained with the sampling its accounting "
                              "has a proof for; sigma is calibrated for it (default: "
                              "independent noise; docs/privacy.md, 'Correlated noise'): "
                              + "; ".join(f"{kind}: {noise_class(kind).summary}"
                                          for kind in NOISES))
    privacy.add_argument("--bands", type=_noise_parameter, metavar="P", default=hidden,
                         help="the --noise mechanism's parameter ("
                              + ", ".join(f"{noise_class(kind).option} of {kind}"
                                          for kind in NOISES)
                              + f"), or {AUTO} for the mechanism's choice by the run's "
                              f"expected error (default {defaults.bands})")
    privacy.add_argument("--delta", type=float, default=hidden, help="default 1/N^1.1")
    privacy.add_argument("--l2-norm-clip", type=float, default=hidden,
                         help=f"C, the per-example gradient norm bound (default {defaults.l2_norm_clip})")
    privacy.add_argument("--per-example-scaling", choices=list(PER_EXAMPLE_SCALINGS),
                         default=hidden,
                         help="clip: g * min(1, C/||g||); automatic: g * C/(||g|| + gamma), "
                              "normalized clipping (Bu et al. 2022), same sensitivity C "
                              f"(default {defaults.per_example_scaling})")
    privacy.add_argument("--automatic-scaling-stability", type=float, metavar="GAMMA",
                         default=hidden,
                         help="gamma of automatic clipping "
                              f"(default {defaults.automatic_scaling_stability})")
    privacy.add_argument("--adaptive-clipping-quantile", type=float, metavar="GAMMA",
                         default=hidden,
                         help="adaptive clipping (Andrew et al. 2021): move C after every "
                              "logical step towards this quantile of the per-example norms, "
                              "--l2-norm-clip being the initial C; same epsilon (default: off)")
    privacy.add_argument("--adaptive-clipping-learning-rate", type=float, metavar="ETA",
                         default=hidden,
                         help="eta of adaptive clipping's geometric update "
                              f"(default {defaults.adaptive_clipping_learning_rate})")
    privacy.add_argument("--adaptive-clipping-count-stddev", type=float, metavar="S",
                         default=hidden,
                         help="noise std of adaptive clipping's count of unclipped examples "
                              "(default: the expected batch / 20)")
    privacy.add_argument("--accountant", choices=accountant_names(), default=hidden)
    privacy.add_argument("--non-private", action="store_true", default=hidden,
                         help="baseline: same data, model and optimizer; no clipping or noise")
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", default=hidden, help="default: a new folder under ./runs/")
    run.add_argument("--resume", action="store_true", default=hidden,
                     help="continue the run in --output-dir with its saved settings; "
                          "other flags may change only how it runs (--eval-every, "
                          "--checkpoint-every, --checkpoint-minutes, --stop-after-steps, "
                          "--cache-dir)")
    run.add_argument("--stop-after-steps", type=int, default=hidden,
                     help="end this invocation after this many logical steps (resume later)")
    run.add_argument("--eval-every", type=int, default=hidden,
                     help="logical steps between held-out evaluations")
    run.add_argument("--checkpoint-every", type=int, default=hidden,
                     help="logical steps between checkpoints (default 0: none by step "
                          "count)")
    run.add_argument("--checkpoint-minutes", type=float, default=hidden,
                     help="minutes of training between checkpoints (default "
                          f"{defaults.checkpoint_minutes:g}; 0: none by time); a run also "
                          "checkpoints after its first logical step and at its end")
    run.add_argument("--strategy", default=hidden,
                     choices=["default", "mirrored", "multiworker", "tpu"])
    run.add_argument("--tpu", default=hidden,
                     help="TPU name for --strategy tpu ('local' on a TPU VM)")
    run.add_argument("--cpu-replicas", type=int, metavar="R", default=hidden,
                     help="with --strategy mirrored: split the CPU into R logical devices")
    run.add_argument("--seed", type=int, default=hidden,
                     help="seeds model initialisation, the held-out split and its masks, "
                          "and canaries (all public); never the Poisson sampling, the "
                          "training masks, dropout or the DP noise, which come from secret "
                          "OS entropy")
    run.add_argument("--cache-dir", default=hidden, help="where prepared corpora are kept")


def _optional_fraction(text: str) -> float | None:
    """A number, or None for 'none'/'off' (a flag that can turn a default off)."""
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _noise_parameter(text: str) -> int | float | str:
    """--bands: an integer (bands, buffers), a number (lambda) or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number or 'auto', got {text!r}") from None
