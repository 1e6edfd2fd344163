"""The `tf-megadp` command line.

Each subcommand is a small `_add_<name>_parser(subparsers)` that declares its
arguments and sets `handler`; this module only parses, and hands the work to
the library (`epsilon`, `calibrate`), to the BERT job (`plan`, `pretrain`,
`audit`, `evaluate`: `tf_megadp.jobs.bert`), to the fine-tuning job
(`finetune`: `tf_megadp.jobs.finetune`) or to the causal-LM job
(`causal-lm`: `tf_megadp.jobs.causal_lm`), each imported by its handler, so that
the accounting subcommands never load keras-hub). Run from the `tf-megadp`
launcher (tf_megadp_cli.py), `--help`, `epsilon`, `calibrate` and `plan`
never import TensorFlow; `pretrain`, `audit` and `evaluate` import it quietly
(`_import_tensorflow_quietly`) once their arguments are checked, so that a
refused `pretrain --resume` fails in about a second. `main` declares only
the arguments of the subcommand given (`build_parser(command)`). To add a
subcommand, write both functions and list the parser builder in `_SUBCOMMANDS`.

Bad arguments print one line on stderr and exit with status 2.

Example:
```
tf-megadp epsilon --num-examples 60000 --batch-size 256 --noise-multiplier 1.1 \\
    --steps 10000 --delta 1e-5
tf-megadp calibrate --target-epsilon 3 --num-examples 60000 --batch-size 256 \\
    --epochs 40 --delta 1e-5 --json
```
"""

from __future__ import annotations

import os

# TensorFlow reads this when its C++ runtime loads; set it before any import
# of TensorFlow can happen.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402


__all__ = ["main", "build_parser", "run_config_from_args"]

_PROGRAM = "tf-megadp"


def _import_tensorflow_quietly() -> None:
    """Imports TensorFlow with its C++ start-up lines kept out of the terminal.

    The runtime prints them (CUDA probing, CPU features) through absl
    logging before any Python setting can reach it, and reads
    TF_CPP_MIN_LOG_LEVEL only when it loads: so stderr points at /dev/null
    while TensorFlow loads and initialises its devices, and is restored
    before any of our own output (Python exceptions come after). A process
    that has TensorFlow already (tests, a host program) is left alone.
    """
    if "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow as tf

        tf.config.list_physical_devices()
        tf.get_logger().setLevel("ERROR")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, not a usage dump."""

    def error(self, message: str):
        raise UsageError(message)


# -- Shared argument groups -----------------------------------------------------


def _add_run_arguments(parser: argparse.ArgumentParser, *, with_noise: bool) -> None:
    """The description of a training run, shared by `epsilon` and `calibrate`."""
    # Here, not at the top: `tf-megadp --help` needs no accounting (nor SciPy).
    from tf_megadp.accounting import DEFAULT_ACCOUNTANT, accountant_names, sampling_kinds
    from tf_megadp.accounting.noise import default_noise, noise_class, noise_kinds

    run = parser.add_argument_group("the run (or --schedule)")
    run.add_argument("--num-examples", type=int, metavar="N",
                     help="N, the number of privacy units: training examples, or "
                          "users with --privacy-unit")
    run.add_argument("--batch-size", type=int, metavar="B",
                     help="expected logical batch size B, in the same units "
                          "(sampling rate q = B/N)")
    run.add_argument("--steps", type=int, metavar="T",
                     help="logical steps (with --schedule: defaults to its total)")
    run.add_argument("--epochs", type=float, metavar="E",
                     help="instead of --steps: passes over the data, "
                          "steps = ceil(E * N / B) (not with --schedule)")
    if with_noise:
        run.add_argument("--noise-multiplier", type=float, metavar="SIGMA",
                         help="sigma (with --schedule: for phases without their own)")
    run.add_argument("--schedule", metavar="FILE",
                     help="a BatchSizeSchedule as JSON or YAML (to_dict layout); "
                          "Poisson steps are truncated at each phase's capacity")
    run.add_argument("--max-batch-size", type=int, metavar="M",
                     help="Poisson steps truncated at M examples (default: none)")
    parser.add_argument("--delta", type=float, required=True,
                        help="delta, in (0, 1); at most 1/N")
    parser.add_argument("--sampling", choices=sampling_kinds(), default="poisson",
                        help="how batches are drawn (default: poisson; shuffle is "
                             "reported as Poisson, which understates the loss; "
                             "fixed_order: one secret order, the same every epoch)")
    noise = parser.add_argument_group(
        f"correlated noise (default: {default_noise().kind}, DP-SGD)")
    noise.add_argument("--noise", choices=noise_kinds(), default=default_noise().kind,
                       help="the gradient noise (sigma is then the noise multiplier on its "
                            "unit-norm strategy): " + "; ".join(
                                f"{kind}: {noise_class(kind).summary}" for kind in noise_kinds()))
    noise.add_argument("--noise-parameter", "--bands", dest="noise_parameter", type=float, metavar="P",
                       help="the mechanism's one parameter: " + ", ".join(
                           f"{noise_class(kind).option} of {kind}" for kind in noise_kinds()
                           if noise_class(kind).option))
    noise.add_argument("--cycle-length", type=int, metavar="L",
                       help="cyclic Poisson sampling: L groups, step t samples group t mod L "
                            "at q = B L / N (default 1: Poisson)")
    parser.add_argument("--accountant", choices=accountant_names(), default=DEFAULT_ACCOUNTANT,
                        help="privacy accountant (default: pld)")
    parser.add_argument("--privacy-unit", metavar="NAME",
                        help="user-level privacy (tf_megadp.PrivacyUnitSampler): the unit, "
                             "e.g. user; N counts units and B expected units per step "
                             "(default: one training example)")
    parser.add_argument("--json", action="store_true",
                        help="print a machine-readable JSON report")


def _load_schedule(path: str):
    from tf_megadp.steps import BatchSizeSchedule

    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read()
    except OSError as error:
        raise UsageError(f"cannot read schedule {path!r}: {error.strerror}") from error
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise UsageError(f"schedule {path!r} is not valid YAML: {error}") from error
    else:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(
                f"schedule {path!r} is not valid JSON (use .yaml for YAML): {error}"
            ) from error
    if not isinstance(config, dict):
        raise UsageError(f"schedule {path!r} must hold a mapping, got {type(config).__name__}.")
    try:
        return BatchSizeSchedule.from_dict(config)
    except (ValueError, TypeError) as error:
        raise UsageError(f"schedule {path!r}: {error}") from error


def _run_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `compute_epsilon` / `calibrate_noise_multiplier`."""
    keywords = {
        "num_examples": args.num_examples,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "epochs": args.epochs,
        "max_batch_size": args.max_batch_size,
        "sampling": args.sampling,
        "accountant": args.accountant,
        "schedule": _load_schedule(args.schedule) if args.schedule else None,
        "noise": _noise(args),
        "cycle_length": args.cycle_length,
    }
    if keywords["schedule"] is None:
        for flag, name in (("--num-examples", "num_examples"), ("--batch-size", "batch_size")):
            if keywords[name] is None:
                raise UsageError(f"{flag} is required (or pass --schedule FILE).")
        if args.steps is None and args.epochs is None:
            raise UsageError("--steps or --epochs is required (or pass --schedule FILE).")
    # Both, or --epochs with --schedule, are refused by the accounting code,
    # whose message names the fix in terms of these same flags' names.
    return keywords


def _noise(args: argparse.Namespace):
    """The mechanism of --noise and its --noise-parameter (None: the default noise)."""
    from tf_megadp.accounting.noise import default_noise, noise_class

    cls = noise_class(args.noise)
    if cls.option is None and args.noise_parameter is not None:
        raise UsageError(
            f"--bands needs --noise with a parameter (--noise {args.noise} takes none); "
            "--noise-parameter is its other name.")
    if cls.option is not None and args.noise_parameter is None:
        raise UsageError(f"--noise {args.noise} needs --bands (or --noise-parameter): its "
                         f"{cls.option}.")
    try:
        mechanism = cls.from_option(args.noise_parameter)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return None if mechanism == default_noise() else mechanism


def _noise_phrase(entry: dict[str, Any]) -> str:
    """How a ledger entry's noise and participation read in the statement ("" for DP-SGD)."""
    from tf_megadp.accounting.noise import default_noise, read_noise_record

    parts = []
    mechanism, strategy = read_noise_record(entry["noise"])
    if mechanism != default_noise():
        parts.append(f"{mechanism.label()}, strategy {strategy}")
    if entry.get("cycle_length"):
        parts.append(f"cycle {entry['cycle_length']}")
    if entry.get("steps_per_epoch"):
        parts.append(f"fixed order, {entry['participations']} epochs of "
                     f"{entry['steps_per_epoch']} steps, sensitivity {entry['sensitivity']:.4g}")
    if entry.get("segment_start"):
        parts.append("opens a noise segment")
    return "".join(f", {part}" for part in parts)


def _statement(report: dict[str, Any]) -> str:
    """A human-readable privacy statement for a `PrivacyAccountant.report()`."""
    # Rounded up, so the printed epsilon never understates the spend.
    epsilon = math.ceil(report["epsilon"] * 1e4) / 1e4
    per_example = report["privacy_unit"] == "example"
    lines = [
        f"This training run is ({epsilon:.4f}, {report['delta']:.3g})-"
        "differentially private.",
        f"  privacy unit : {'one training example' if per_example else report['privacy_unit']}, "
        f"{report['neighbouring_relation'].replace('_', '-')} adjacency",
        f"  accountant   : {report['accountant'].upper()} "
        f"(dp_accounting {report['versions']['dp_accounting']})",
        f"  {'examples (N)' if per_example else 'units (N)   '} : {report['num_examples']}",
        f"  steps        : {report['steps']}",
    ]
    sampling = report["sampling"]
    lines.append(
        "  sampling     : "
        + ", ".join(sampling["kinds"])
        + (", accounted as truncated Poisson" if sampling["truncated"] else "")
    )
    for index, entry in enumerate(report["ledger"]):
        # A cyclic step samples one group of N / L at q = B L / N.
        batch = entry["sampling_rate"] * report["num_examples"] / max(
            1, entry.get("cycle_length", 0))
        truncation = (
            f", truncated at {entry['max_batch_size']}" if entry["max_batch_size"] else ""
        )
        lines.append(
            f"  phase {index}      : {entry['steps']} steps, q = {entry['sampling_rate']:.4g} "
            f"(B = {batch:.6g}), sigma = {entry['noise_multiplier']:.4g}{truncation}"
            + (f", count sigma = {entry['count_noise_multiplier']:.4g} (adaptive clipping; "
               f"together sigma = {_equivalent(entry):.4g})"
               if entry.get("count_noise_multiplier") else "")
            + _noise_phrase(entry)
        )
    for message in report["warnings"]:
        lines.append(f"  WARNING: {message}")
    return "\n".join(lines)


def _named_unit(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The report of a user-level run names its unit (--privacy-unit)."""
    if args.privacy_unit:
        report["privacy_unit"] = args.privacy_unit
    return report


def _equivalent(entry: dict[str, Any]) -> float:
    from tf_megadp.accounting.mechanisms import equivalent_noise_multiplier

    return equivalent_noise_multiplier(entry["noise_multiplier"], entry["count_noise_multiplier"])


def _add_count_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--count-stddev", type=float, metavar="S", help=help_text)


def _print_report(report: dict[str, Any], as_json: bool, heading: str | None = None) -> None:
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return
    if heading:
        print(heading)
    print(_statement(report))


# -- epsilon --------------------------------------------------------------------


def _add_epsilon_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "epsilon", help=_HELP["epsilon"],
        description="Epsilon of a DP-SGD run at the given delta.",
    )
    _add_run_arguments(parser, with_noise=True)
    _add_count_argument(
        parser, "adaptive clipping: the noise std S of the count of unclipped examples "
                "(AdaptiveClipping(count_stddev=S)); --noise-multiplier is then the "
                "gradient's own multiplier, and the pair (gradient, count of multiplier "
                "2 S) is accounted. Without it, give the optimizer's noise_multiplier: "
                "adaptive clipping does not change epsilon.")
    parser.set_defaults(handler=_run_epsilon)


def _run_epsilon(args: argparse.Namespace) -> int:
    from tf_megadp import accounting

    keywords = _run_keywords(args)
    noise = args.noise_multiplier
    if noise is None and (
        keywords["schedule"] is None
        or any(phase.noise_multiplier is None for phase in keywords["schedule"].phases)
    ):
        raise UsageError("--noise-multiplier is required.")
    accountant = accounting.PrivacyAccountant.for_run(
        args.delta, noise_multiplier=noise, **keywords
    )
    if args.count_stddev is not None:
        if not args.count_stddev > 0:
            raise UsageError("--count-stddev must be > 0.")
        from tf_megadp.accounting.mechanisms import COUNT_SENSITIVITY

        accountant.ledger = accounting.PrivacyLedger(
            dataclasses.replace(entry, count_noise_multiplier=args.count_stddev
                                / COUNT_SENSITIVITY)
            for entry in accountant.ledger)
    _print_report(_named_unit(accountant.report(), args), args.json)
    return 0


# -- calibrate ------------------------------------------------------------------


def _add_calibrate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help=_HELP["calibrate"],
        description="The smallest noise multiplier sigma whose run meets "
                    "(--target-epsilon, --delta).",
    )
    parser.add_argument("--target-epsilon", type=float, required=True, metavar="E",
                        help="the privacy budget epsilon")
    _add_run_arguments(parser, with_noise=False)
    _add_count_argument(
        parser, "adaptive clipping: the noise std S of the count of unclipped examples; "
                "also prints the gradient's own multiplier (sigma^-2 - (2 S)^-2)^-1/2, "
                "and refuses an S too small for sigma")
    parser.set_defaults(handler=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> int:
    from tf_megadp import accounting

    keywords = _run_keywords(args)
    sigma = accounting.calibrate_noise_multiplier(
        args.target_epsilon, args.delta, **keywords
    )
    report = accounting.PrivacyAccountant.for_run(
        args.delta, noise_multiplier=sigma, **keywords
    ).report()
    report = _named_unit(report, args)
    report["noise_multiplier"] = sigma
    report["target_epsilon"] = args.target_epsilon
    heading = (f"noise multiplier: {sigma:.6g} (smallest meeting epsilon "
               f"{args.target_epsilon:g} at delta {args.delta:g})")
    if args.count_stddev is not None:
        from tf_megadp.accounting.mechanisms import gradient_noise_multiplier
        from tf_megadp.errors import PrivacyConfigurationError

        try:
            gradient, count = gradient_noise_multiplier(sigma, args.count_stddev)
        except PrivacyConfigurationError as error:
            raise UsageError(str(error)) from None
        report["adaptive_clipping"] = {"count_stddev": args.count_stddev,
                                       "gradient_noise_multiplier": gradient,
                                       "count_noise_multiplier": count}
        heading += (f"\nwith adaptive clipping (count_stddev {args.count_stddev:g}): the "
                    f"gradient's noise multiplier is {gradient:.6g}, the count's {count:.6g}; "
                    f"pass noise_multiplier={sigma:.6g} to DPOptimizer")
    _print_report(report, args.json, heading=heading)
    return 0


# -- pretrain -------------------------------------------------------------------


def run_config_from_args(args: argparse.Namespace, config_path: str | None):
    """The run's `PretrainConfig`: the file's (or the defaults), then the given flags.

    `pretrain` and `plan` both build their configuration here, so
    `pretrain --config FILE` runs exactly what `plan FILE` validated.
    """
    import dataclasses

    from tf_megadp.jobs.bert import pretraining
    from tf_megadp.jobs.bert.config import parse_schedule

    given = dict(vars(args))
    if given.get("resume") and not config_path:
        # --resume alone: the run's saved settings, then the flags given
        # (run_pretraining refuses any that is not operational, naming it).
        from tf_megadp.jobs.bert.run_files import pretrain_settings, resumed_config

        if not given.get("output_dir"):
            raise UsageError("--resume needs --output-dir, the folder of the run to continue.")
        config = resumed_config(pretrain_settings(given["output_dir"]))
    else:
        config = (pretraining.load_run_config(config_path) if config_path
                  else pretraining.PretrainConfig())
    for name in ("handler", "command", "config", "json"):
        given.pop(name, None)
    if "schedule" in given:
        given["schedule"] = parse_schedule(given["schedule"])
    if given.get("non_private"):
        given.update(noise_multiplier=None, target_epsilon=None)
    elif ("noise_multiplier" in given and "target_epsilon" not in given and not config_path
          and not given.get("resume")):
        # sigma instead of the default target; a file's target stays as a check.
        given["target_epsilon"] = None
    fields = {field.name for field in dataclasses.fields(config)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise UsageError(f"no run configuration field for {unknown}")
    config = dataclasses.replace(config, **given)
    if config.init_from and not config.resume:
        # The shape comes from the init: a shape flag given is checked
        # against it, even one equal to the default.
        from tf_megadp.jobs.bert.initial_weights import configured

        config = configured(config, given=given)
    return config


def _add_pretrain_parser(subparsers) -> None:
    from tf_megadp.jobs.bert.arguments import add_run_config_arguments

    parser = subparsers.add_parser(
        "pretrain", help=_HELP["pretrain"],
        description="Pretrains a keras-hub BertMaskedLM from scratch with DP-SGD on "
                    "Poisson-sampled logical batches, and reports held-out MLM accuracy "
                    "and (epsilon, delta). With no arguments: a BERT-nano on the offline "
                    "default corpus in a few minutes on a laptop CPU. With --config: the "
                    "run of a configuration file (tpu_configs/), planned and checked "
                    "first as `tf-megadp plan` does; flags override its fields.",
    )
    parser.add_argument("--config", metavar="FILE",
                        help="a run configuration (YAML, see tpu_configs/)")
    add_run_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print report.json at the end")
    parser.set_defaults(handler=_run_pretrain)


def _run_pretrain(args: argparse.Namespace) -> int:
    from tf_megadp.jobs.bert import pretraining

    config = run_config_from_args(args, args.config)
    if config.resume:
        # Refused (a changed privacy or model setting, named) before
        # TensorFlow loads; run_pretraining checks the same again.
        from tf_megadp.jobs.bert.run_files import pretrain_settings
        from tf_megadp.jobs.common.run_folder import check_same_run

        config.validate()
        check_same_run(pretrain_settings(config.output_dir), config)
    _import_tensorflow_quietly()
    report = pretraining.run_pretraining(config)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=2,
                         default=str))
    return 0


# -- plan -----------------------------------------------------------------------


def _add_plan_parser(subparsers) -> None:
    from tf_megadp.jobs.bert.arguments import add_run_config_arguments

    parser = subparsers.add_parser(
        "plan", help=_HELP["plan"],
        description="Validates a run configuration (see tpu_configs/) without running it "
                    "and prints per-core micro-batch, accumulation steps per phase, logical "
                    "steps, (epsilon, delta), FLOPs and time per logical step, and per-core "
                    "memory for vectorized and ghost clipping. An infeasible configuration "
                    "is an error naming the number that fails. Flags override the file's "
                    "fields as in `pretrain --config`.",
    )
    parser.add_argument("config", metavar="CONFIG", help="a run configuration (YAML)")
    add_run_config_arguments(parser)
    parser.add_argument("--json", action="store_true",
                        help="print a machine-readable JSON plan")
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from tf_megadp.jobs.bert import plan

    result = plan.make_plan(run_config_from_args(args, args.config))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(plan.format_plan(result))
    return 0


# -- audit ----------------------------------------------------------------------


def _add_audit_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "audit", help=_HELP["audit"],
        description="Audits a finished `tf-megadp pretrain` run: loss-based membership "
                    "inference (training vs held-out sequences), exposure of the canaries "
                    "it was trained with (`pretrain --canaries N`), and an empirical lower "
                    "bound on epsilon to set beside the accountant's. Writes audit.json "
                    "into the run directory. With --one-run instead: trains a tiny model "
                    "once with DP-SGD and canaries and prints one-run lower bounds on "
                    "epsilon (Steinke et al. 2023) beside the accountant's epsilon.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?",
                        help="the --output-dir of the run (not with --one-run)")
    parser.add_argument("--members", type=int, default=1000,
                        help="training (and at most as many held-out) sequences to attack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", help="where the run's prepared corpus is kept")
    parser.add_argument("--json", action="store_true", help="print audit.json at the end")
    # The audit package imports TensorFlow: quietly, before its flags are read.
    _import_tensorflow_quietly()
    from tf_megadp.audit.audit_run import add_one_run_arguments

    add_one_run_arguments(parser)
    parser.set_defaults(handler=_run_audit, audit_parser=parser)


def _run_audit(args: argparse.Namespace) -> int:
    _import_tensorflow_quietly()
    if args.one_run:
        if args.run_dir:
            args.audit_parser.error("--one-run trains its own model: do not give RUN_DIR.")
        from tf_megadp.audit.audit_run import run_one_run_from_args

        return run_one_run_from_args(args)
    if not args.run_dir:
        args.audit_parser.error("RUN_DIR is required (or --one-run for an audit run).")
    from tf_megadp.jobs.bert.audit import audit_pretraining_run

    result = audit_pretraining_run(args.run_dir, num_members=args.members,
                                   cache_dir=args.cache_dir, seed=args.seed)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "canaries"}, indent=2,
                         default=str))
    return 0


# -- evaluate -------------------------------------------------------------------


def _add_evaluate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate", help=_HELP["evaluate"],
        description="Scores a model without training it: the held-out masked-LM accuracy "
                    "of MODEL (a `tf-megadp pretrain` run's model.keras, or a local "
                    "keras-hub preset folder of a BertMaskedLM) on a corpus, beside the "
                    "unigram baseline (always predicting the training split's most "
                    "frequent token). The corpus is prepared, split and masked as a "
                    "pretraining run on it with the same settings: a run's model.keras on "
                    "its own corpus and settings scores its report's held-out accuracy.",
    )
    parser.add_argument("model", metavar="MODEL",
                        help="a run's model.keras, or a keras-hub preset directory")
    parser.add_argument("--corpus", nargs="+", metavar="PATH",
                        help="text/JSONL files or globs (default: the offline default corpus)")
    parser.add_argument("--vocabulary", metavar="FILE",
                        help="the model's vocabulary, if none lies beside it")
    parser.add_argument("--sequence-length", type=int,
                        help="tokens per sequence (default: the model's positions)")
    parser.add_argument("--document-separator", choices=["blank-line", "line"],
                        help="plain-text files: documents separated by blank lines (default), "
                             "or one per line")
    parser.add_argument("--heldout-fraction", type=float, help="as the run's (default 0.05)")
    parser.add_argument("--micro-batch-size", type=int,
                        help="as the run's (default 64): the held-out rows are cut to a "
                             "multiple of it, as a run cuts them")
    parser.add_argument("--seed", type=int, default=0,
                        help="the run's --seed: the held-out split and its masks")
    parser.add_argument("--cache-dir", help="where prepared corpora are kept")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE")
    parser.set_defaults(handler=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    _import_tensorflow_quietly()
    from tf_megadp.files import write_json_atomically
    from tf_megadp.jobs.bert.evaluation import evaluate_model

    result = evaluate_model(
        args.model, corpus=args.corpus, vocabulary=args.vocabulary,
        sequence_length=args.sequence_length, document_separator=args.document_separator,
        heldout_fraction=args.heldout_fraction, micro_batch_size=args.micro_batch_size,
        seed=args.seed, cache_dir=args.cache_dir)
    if args.json:
        write_json_atomically(args.json, result)
    return 0


# -- finetune -------------------------------------------------------------------


def _add_finetune_parser(subparsers) -> None:
    from tf_megadp.jobs.finetune.arguments import add_finetune_arguments

    parser = subparsers.add_parser(
        "finetune", help=_HELP["finetune"],
        description="Fine-tunes a BERT that has learned (--init-from: the public model of "
                    "`tf-megadp public-model`, a DP release, or a local keras-hub preset) on "
                    "labelled text with DP-SGD on Poisson-sampled batches, and reports its "
                    "test accuracy beside the majority class, with (epsilon, delta). By "
                    "default the label is a word predicted at the [MASK] of a template "
                    "through the pretrained MLM head (--objective prompt); --objective head "
                    "trains a classifier on [CLS]. Without --train: the default task (which "
                    "package a docstring summary comes from).",
    )
    add_finetune_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print report.json at the end")
    parser.set_defaults(handler=_run_finetune)


def _run_finetune(args: argparse.Namespace) -> int:
    from tf_megadp.jobs.finetune.arguments import finetune_config

    config = finetune_config(args)
    config.validate()  # Before TensorFlow loads: bad flags fail at once.
    _import_tensorflow_quietly()
    from tf_megadp.jobs.finetune.run import run_finetuning

    report = run_finetuning(config)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


# -- causal-lm ------------------------------------------------------------------


def _add_causal_lm_parser(subparsers) -> None:
    from tf_megadp.jobs.causal_lm.arguments import add_causal_lm_arguments

    parser = subparsers.add_parser(
        "causal-lm", help=_HELP["causal-lm"],
        description="Pretrains a keras-hub GPT-2 (--family llama: a Llama), built from its "
                    "constructors, from scratch "
                    "with DP-SGD on Poisson-sampled batches of packed sequences (one sequence "
                    "is the privacy unit): the offline default corpus of `tf-megadp pretrain`, "
                    "or --corpus. With --init-from RUN/model.keras --train FILE, fine-tunes "
                    "such a run's model on prompt/completion pairs instead (the loss on the "
                    "completions; one pair is the privacy unit). Reports held-out next-token "
                    "accuracy and perplexity beside the unigram baseline, with (epsilon, "
                    "delta).",
    )
    add_causal_lm_arguments(parser)
    parser.add_argument("--plan", action="store_true",
                        help="check the run and print its plan (N, schedule, sigma and epsilon, "
                             "FLOPs and memory of the DP and the non-private step) without "
                             "training it or writing its folder")
    parser.add_argument("--json", action="store_true",
                        help="print report.json at the end (with --plan: the plan as JSON)")
    parser.set_defaults(handler=_run_causal_lm)


def _run_causal_lm(args: argparse.Namespace) -> int:
    from tf_megadp.jobs.causal_lm.arguments import causal_lm_config

    config = causal_lm_config(args)
    config.validate()  # Before TensorFlow loads: bad flags fail at once.
    _import_tensorflow_quietly()
    if args.plan:
        from tf_megadp.jobs.causal_lm import plan

        result = plan.make_plan(config)
        print(json.dumps(result, indent=2, default=str) if args.json
              else plan.format_plan(result))
        return 0
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    report = run_causal_lm(config)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


# -- public-model ---------------------------------------------------------------


def _add_public_model_parser(subparsers) -> None:
    from tf_megadp.jobs.bert.public_model import public_model_help

    help_text, recipes = public_model_help()
    parser = subparsers.add_parser("public-model", help=_HELP["public-model"],
                                   description=help_text)
    parser.add_argument("--minutes", type=int, default=None, metavar="M",
                        help=f"the recipe: {recipes}")
    hidden = argparse.SUPPRESS
    for flag, kind, text in (
            ("--model", str, "model preset (default: the recipe's)"),
            ("--vocabulary-size", int, "WordPiece vocabulary size (default: the recipe's)"),
            ("--sequence-length", int, "tokens per sequence (default: the recipe's)"),
            ("--steps", int, "training steps (default: the recipe's)"),
            ("--batch-size", int, "sequences per step (default: the recipe's)"),
            ("--micro-batch-size", int, "sequences per micro-batch (default: the recipe's)"),
            ("--learning-rate", float, "peak learning rate (default: the recipe's)"),
            ("--warmup-steps", int, "linear warm-up steps (default: the recipe's)"),
            ("--max-characters", int, "size cap of the public corpus (default: the recipe's)"),
            ("--public-sources", str, "comma-separated public sources (default: all of "
                                      "docstrings, more-docstrings, man, doc, package-docs)"),
            ("--heldout-fraction", float, "share of sequences held out for the accuracy"),
            ("--seed", int, "seeds the initialisation and the held-out split (default 0)")):
        parser.add_argument(flag, type=kind, default=hidden, help=text)
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default ~/.cache/tf_megadp): the model goes to its "
                             "public-models folder")
    parser.add_argument("--no-build", action="store_true",
                        help="print the path if the model is cached, else fail (exit 2)")
    parser.set_defaults(handler=_run_public_model)


def _run_public_model(args: argparse.Namespace) -> int:
    from tf_megadp.jobs.bert.public_model import DEFAULT_MINUTES, public_model, public_model_config

    overrides = {name: value for name, value in vars(args).items()
                 if name not in ("handler", "command", "minutes", "cache_dir", "no_build")}
    minutes = DEFAULT_MINUTES if args.minutes is None else args.minutes
    # Refused (a bad flag, named) before TensorFlow loads.
    public_model_config(minutes, cache_dir=args.cache_dir, **overrides)
    if not args.no_build:
        _import_tensorflow_quietly()
    path = public_model(minutes, cache_dir=args.cache_dir, build=not args.no_build,
                        **overrides)
    print(path)
    return 0


# -- Entry point ----------------------------------------------------------------

# One line per subcommand for `tf-megadp --help`; builders below.
_HELP = {
    "epsilon": "epsilon spent by a DP-SGD run",
    "calibrate": "smallest noise multiplier meeting a target epsilon",
    "pretrain": "DP masked-LM pretraining of a BERT (the main job)",
    "plan": "check a TPU run configuration and estimate its cost",
    "audit": "audit a pretraining run, or run a one-run audit of a tiny DP-SGD model",
    "evaluate": "held-out MLM accuracy of a model on a corpus, beside the unigram baseline",
    "finetune": "DP fine-tuning of a public BERT on labelled text (prompt or head)",
    "causal-lm": "DP next-token pretraining or fine-tuning of a GPT-2 or Llama (causal LM)",
    "public-model": "the public BERT fine-tuning starts from: built once without DP, cached",
}

_SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "epsilon": _add_epsilon_parser,
    "calibrate": _add_calibrate_parser,
    "plan": _add_plan_parser,
    "pretrain": _add_pretrain_parser,
    "audit": _add_audit_parser,
    "evaluate": _add_evaluate_parser,
    "finetune": _add_finetune_parser,
    "causal-lm": _add_causal_lm_parser,
    "public-model": _add_public_model_parser,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `tf-megadp` parser with every subcommand.

    Args:
        command: declare only this subcommand's arguments (the others are
            listed with their one-line help). `main` passes the command
            given, so that `tf-megadp epsilon` imports neither the BERT job
            nor the audit, whose flags need them (and the audit TensorFlow).
    """
    parser = _Parser(
        prog=_PROGRAM,
        description="Differentially private training at mega-batch scale.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, add_parser in _SUBCOMMANDS.items():
        if command is None or name == command:  # "": none (`tf-megadp --help`)
            add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=_HELP[name])
    return parser


_LIBRARY_INTERNAL_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `tf-megadp`; returns the exit status.

    Args:
        argv: the arguments (default: `sys.argv[1:]`).

    Returns:
        0 on success, 2 on bad arguments.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            arguments = sys.argv[1:] if argv is None else list(argv)
            # The subcommand is the first argument: the top level has no options but -h.
            given = arguments[0] if arguments and arguments[0] in _SUBCOMMANDS else ""
            args = build_parser(given).parse_args(arguments)
            status = args.handler(args)
        except (UsageError, ValueError, TypeError) as error:
            message = " ".join(str(error).split())
            print(f"{_PROGRAM}: error: {message}", file=sys.stderr)
            status = 2
    seen = set()
    for warning in caught:
        if issubclass(warning.category, _LIBRARY_INTERNAL_WARNINGS):
            continue  # Addressed to library authors, not to someone running a job.
        message = " ".join(str(warning.message).split())
        if message not in seen:
            seen.add(message)
            print(f"{_PROGRAM}: warning: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
