"""What every job's command does with its flags: a config from the flags given, over a saved run's.

A job's flags default to "not given" (argparse.SUPPRESS): a given flag
overrides the config's default field, or, with `--resume`, the field the
run saved.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

__all__ = ["add_privacy_flags", "add_run_flags", "config_from_flags", "verbosity"]

# Fields a resume never takes from the saved run: they end one invocation.
_INVOCATION_ONLY = ("stop_after_steps",)


def add_privacy_flags(parser: argparse.ArgumentParser, defaults: Any, *, examples: str,
                      clip_note: str = "") -> argparse._ArgumentGroup:
    """The privacy flags every job takes; the group, for a job's own flags.

    Args:
        parser: the job's parser.
        defaults: the job's default config (its `target_epsilon`, `l2_norm_clip`).
        examples: what one of N is, in `--delta`'s help ("training examples").
        clip_note: said after C's default in `--l2-norm-clip`'s help.
    """
    hidden = argparse.SUPPRESS
    privacy = parser.add_argument_group("privacy")
    privacy.add_argument("--target-epsilon", type=float, default=hidden,
                         help="calibrate sigma to spend this (default "
                              f"{defaults.target_epsilon:g})")
    privacy.add_argument("--noise-multiplier", type=float, default=hidden,
                         help="sigma, instead of --target-epsilon")
    privacy.add_argument("--delta", type=float, default=hidden,
                         help=f"default 1 / N^1.1 for N {examples}")
    privacy.add_argument("--l2-norm-clip", type=float, default=hidden,
                         help=f"C (default {defaults.l2_norm_clip:g}{clip_note})")
    privacy.add_argument("--clipping", choices=["auto", "ghost", "vectorized"], default=hidden,
                         help="per-example clipping strategy (default auto)")
    privacy.add_argument("--accountant", default=hidden, help="pld (default) or rdp")
    privacy.add_argument("--non-private", action="store_true", default=hidden,
                         help="the baseline: no clipping, no noise, the same batches")
    return privacy


def add_run_flags(parser: argparse.ArgumentParser, defaults: Any, *,
                  evaluation: str) -> argparse._ArgumentGroup:
    """The run flags every job takes (folder, resume, cadences); the group, for a job's own.

    Args:
        parser: the job's parser.
        defaults: the job's default config (its `eval_every`, `checkpoint_minutes`).
        evaluation: what an evaluation is, in `--eval-every`'s help ("test").
    """
    hidden = argparse.SUPPRESS
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", default=hidden, help="the run's folder (default runs/...)")
    run.add_argument("--resume", action="store_true", default=hidden,
                     help="continue the run in --output-dir with its saved settings")
    run.add_argument("--eval-every", type=int, default=hidden,
                     help=f"logical steps between {evaluation} evaluations (default "
                          f"{defaults.eval_every})")
    run.add_argument("--checkpoint-every", type=int, default=hidden,
                     help="logical steps between checkpoints (default 0: by time only)")
    run.add_argument("--checkpoint-minutes", type=float, default=hidden,
                     help=f"minutes of training between checkpoints (default "
                          f"{defaults.checkpoint_minutes:g})")
    run.add_argument("--stop-after-steps", type=int, default=hidden,
                     help="end this invocation after N logical steps (resume later)")
    return run


def config_from_flags(args: argparse.Namespace, config_class: type, command: str) -> Any:
    """The job's config: its defaults (or the saved run's with `--resume`), then the flags given.

    Args:
        args: the parsed flags of the job's command.
        config_class: the job's config dataclass.
        command: the command whose runs' checkpoints hold the settings
            (e.g. "tf-megadp finetune").

    Returns:
        A `config_class`. `--non-private` drops the noise and the budget; a
        noise multiplier given without a budget (and not on a resume)
        replaces the default budget.

    Raises:
        ValueError: `--resume` without `--output-dir`.
    """
    from tf_megadp.jobs.common import run_folder

    # What the command prints or does (--json, --plan), not what the run is.
    given: dict[str, Any] = {name: value for name, value in vars(args).items()
                             if name not in ("handler", "command", "json", "plan")}
    if given.get("resume"):
        if not given.get("output_dir"):
            raise ValueError("--resume needs --output-dir, the folder of the run to continue.")
        saved = run_folder.saved_settings(given["output_dir"], command)
        config = config_class(**{name: value for name, value in saved.items()
                                 if name not in _INVOCATION_ONLY})
    else:
        config = config_class()
    if given.get("non_private"):
        given.update(noise_multiplier=None, target_epsilon=None)
    elif "noise_multiplier" in given and "target_epsilon" not in given and not given.get(
            "resume"):
        given["target_epsilon"] = None
    return dataclasses.replace(config, **given)


def verbosity(text: str) -> int | str:
    """`--verbose`: Keras fit verbosity, "auto" or an integer."""
    return text if text == "auto" else int(text)
