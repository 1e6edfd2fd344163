"""An "audit run": train a tiny model with DP-SGD once, with canaries, and bound its epsilon.

This is what `tf-megadp audit --one-run` does, and what the tests and
`benchmarks/one_run_audit_study.py` build on. The model is a linear
regression (`Dense(1)`) on `features` real features plus one spare feature
per canary that the real data leaves at 0, like token ids a tokenizer
reserves: canaries there are the only gradient their coordinates ever see,
which is what makes a white-box audit tight. Training uses the library's
own pieces end to end: a `PoissonSampler` over the data, the `DPOptimizer`
on the sampler's schedule with sigma calibrated to the target epsilon, and
`PrivacyCallback` for the epsilon the accountant reports.

Canaries:

* "gradient": `GradientCanaryAudit`, Dirac gradient canaries of norm C on
  the spare rows, white-box;
* "input": `InputCanaries` made by `dirac_canaries`, rows of the training
  data, scored black-box (final model's loss) and white-box (their rows'
  updates), both bounds holding together.

`planted_bug` trains with one of `tf_megadp.audit.planted_bugs.PLANTED_BUGS`
instead of the correct step, to check that the audit catches it.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import numpy as np

__all__ = ["add_one_run_arguments", "one_run_audit_run", "run_one_run_from_args"]

# The names of `planted_bugs.PLANTED_BUGS`, here so that building the CLI
# parser does not import TensorFlow (a test keeps the two in step).
PLANTED_BUG_NAMES = ("double-counted", "halved-noise", "unclipped-example")


def _real_data(num_examples: int, features: int, spare: int, rng: np.random.Generator):
    x = np.zeros((num_examples, features + spare), np.float32)
    x[:, :features] = rng.normal(size=(num_examples, features))
    weights = rng.normal(size=features)
    y = x[:, :features] @ weights + 0.1 * rng.normal(size=num_examples)
    return x, y.astype(np.float32)[:, None]


def one_run_audit_run(
    *,
    target_epsilon: float = 2.0,
    delta: float = 1e-6,
    canaries: str = "gradient",
    num_canaries: int = 5000,
    steps: int = 1000,
    sampling_rate: float = 0.005,
    num_examples: int = 2000,
    features: int = 8,
    l2_norm_clip: float = 1.0,
    learning_rate: float | None = None,
    micro_batch_size: int | None = None,
    planted_bug: str | None = None,
    noise_multiplier: float | None = None,
    confidence: float = 0.95,
    seed: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains the tiny audited model once and returns the one-run bounds beside epsilon.

    Args:
        target_epsilon: the epsilon sigma is calibrated to (at `delta`).
        delta: the run's delta; also the delta of the bounds. Keep it well
            below 1 / num_canaries (the bound's delta term grows with m).
        canaries: "gradient" or "input" (see the module docstring).
        num_canaries: m (one spare feature each).
        steps: logical steps T.
        sampling_rate: q, the Poisson rate of every example and canary.
        num_examples: real examples (input canaries add m rows).
        features: real features.
        l2_norm_clip: C.
        learning_rate: of the plain SGD inner optimizer; default 0.5 for
            gradient canaries, 0.1 for input ones (so that an unclipped
            canary does not overshoot its target).
        micro_batch_size: default 16 for input canaries (the first example of
            every micro-batch is where the planted clip bug bites) and the
            step's capacity for gradient canaries.
        planted_bug: None (the correct step) or a `PLANTED_BUGS` name.
        noise_multiplier: sigma, instead of calibrating it to target_epsilon
            (0 trains without noise: the bound is then limited by m only).
        confidence: the bounds' (joint) confidence.
        seed: None: coins, noise and sampling from OS entropy (a real audit).
            An int makes the run reproducible and NOT private (tests).
        log: where progress lines go.

    Returns:
        A JSON-ready dict: "theoretical_epsilon" (the accountant's, as
        `PrivacyCallback` reports it), "noise_multiplier", "delta", the
        settings, "white_box" and (input canaries) "black_box" results
        (`OneRunResult.as_dict`), "seconds".

    Example:
    ```python
    report = one_run_audit_run(target_epsilon=8.0, num_canaries=2000)
    report["white_box"]["epsilon_lower_bound"], report["theoretical_epsilon"]
    ```
    """
    import keras

    from tf_megadp.accounting import calibrate_noise_multiplier
    from tf_megadp.run.callbacks import PrivacyCallback
    from tf_megadp.data import PoissonSampler
    from tf_megadp.optimizer import DPOptimizer
    from tf_megadp.steps import BatchSizeSchedule, sampling_rate_of
    from tf_megadp.training import make_private
    from tf_megadp.audit.input_canaries import InputCanaries, dirac_canaries, dirac_canary_signal
    from tf_megadp.audit.planted_bugs import PLANTED_BUGS
    from tf_megadp.audit.white_box import CanaryCoordinates, GradientCanaryAudit

    if canaries not in ("gradient", "input"):
        raise ValueError(f"`canaries` must be 'gradient' or 'input', got {canaries!r}.")
    if planted_bug is not None and planted_bug not in PLANTED_BUGS:
        raise ValueError(f"Unknown planted_bug {planted_bug!r}; choose from {sorted(PLANTED_BUGS)}.")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"`sampling_rate` must be in (0, 1], got {sampling_rate!r}.")
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    x, y = _real_data(num_examples, features, num_canaries, rng)
    total = num_examples + (num_canaries if canaries == "input" else 0)
    batch_size = max(1, round(sampling_rate * total))
    if canaries == "input":
        micro_batch_size = micro_batch_size or 16
        learning_rate = 0.1 if learning_rate is None else learning_rate
    else:
        learning_rate = 0.5 if learning_rate is None else learning_rate
    if micro_batch_size is None:
        probe = BatchSizeSchedule.constant(
            steps, batch_size, num_examples=total, micro_batch_size=batch_size)
        micro_batch_size = probe.capacity(probe.phases[0])  # one micro-batch per step
    schedule = BatchSizeSchedule.constant(
        steps, batch_size, num_examples=total, micro_batch_size=micro_batch_size)
    if noise_multiplier is None:
        noise_multiplier = calibrate_noise_multiplier(target_epsilon, delta, schedule=schedule)

    keras.utils.set_random_seed(seed if seed is not None else int(rng.integers(2**31)))
    # Zero initial weights (a public choice): the finished model's canary rows
    # are then the sum of their updates, which is all a black-box attacker
    # can compare; a random initialization would hide them from it.
    model = keras.Sequential([keras.Input((features + num_canaries,)),
                              keras.layers.Dense(1, kernel_initializer="zeros")])
    rows = np.arange(features, features + num_canaries)
    coordinates = CanaryCoordinates.on_rows(model.layers[0].kernel, rows)
    description, optimizer_class, strategy_class = (
        PLANTED_BUGS[planted_bug] if planted_bug else ("none", DPOptimizer, None))
    base = strategy_class() if strategy_class else "vectorized"
    with warnings.catch_warnings():
        if seed is not None or noise_multiplier == 0:
            # A seeded or noise-free audit run is a test: its warnings are expected.
            warnings.simplefilter("ignore", UserWarning)
        if canaries == "gradient":
            audit = GradientCanaryAudit(model, schedule, coordinates, delta=delta,
                                        confidence=confidence, seed=seed)
            clipping = audit.clipping(base)
            sampler = PoissonSampler.from_arrays(x, y, schedule=schedule, seed=seed)
        else:
            x_canary, y_canary = dirac_canaries(num_canaries, features + num_canaries, features)
            audit = InputCanaries(x_canary, y_canary, delta=delta, confidence=confidence,
                                  seed=seed)
            x_all, y_all, w_all = audit.training_arrays(x, y)
            audit.with_white_box(model, schedule, coordinates, signal=dirac_canary_signal(3.0))
            clipping = audit.clipping(base)
            sampler = PoissonSampler.from_arrays(
                x_all, y_all, w_all, schedule=schedule, seed=seed)
        make_private(model)
        model.compile(
            optimizer=optimizer_class(
                keras.optimizers.SGD(learning_rate), l2_norm_clip=l2_norm_clip,
                noise_multiplier=noise_multiplier, schedule=schedule, clipping=clipping,
                seed=seed),
            loss="mse",
            steps_per_execution=50,
        )
        privacy = PrivacyCallback(delta=delta)
        log(f"Audit run: {canaries} canaries (m={num_canaries}), N={total}, B={batch_size}, "
            f"T={steps}, sigma={noise_multiplier:.4f}, planted bug: {description}.")
        model.fit(sampler.as_dataset(), verbose=0, shuffle=False, callbacks=[privacy])
        results = audit.finish(model)
    epsilon = float(privacy.epsilon) if noise_multiplier > 0 else math.inf
    report: dict[str, Any] = {
        "theoretical_epsilon": epsilon,
        "target_epsilon": target_epsilon,
        "noise_multiplier": float(noise_multiplier),
        "delta": delta,
        "canaries": canaries,
        "num_canaries": num_canaries,
        "num_examples": total,
        "batch_size": batch_size,
        "steps": steps,
        "sampling_rate": sampling_rate_of(batch_size, total),
        "micro_batch_size": micro_batch_size,
        "planted_bug": planted_bug,
        "planted_bug_description": description,
        "confidence": confidence,
        "seeded": seed is not None,
        "scoring": dict(audit.details),
    }
    for name, result in results.items():
        report[name] = result.as_dict()
    report["seconds"] = time.perf_counter() - started
    log(_summary(report))
    return report


def _summary(report: dict[str, Any]) -> str:
    epsilon = report["theoretical_epsilon"]
    lines = [f"theoretical epsilon {epsilon:.3f} at delta {report['delta']:g}"
             if math.isfinite(epsilon) else "theoretical epsilon inf (no noise)"]
    for name in ("white_box", "black_box"):
        if name in report:
            result = report[name]
            lines.append(
                f"{name.replace('_', '-'):9s} one-run lower bound {result['epsilon_lower_bound']:.3f} "
                f"({result['num_correct']}/{result['num_guesses']} guesses right, "
                f"{100 * result['confidence']:.0f}% confidence)")
    return "\n".join(lines)


# -- `tf-megadp audit --one-run` -------------------------------------------------


def add_one_run_arguments(parser) -> None:
    """Adds the `--one-run` options to the `tf-megadp audit` parser (see tf_megadp/cli.py).

    Args:
        parser: an `argparse.ArgumentParser` (or subparser).
    """
    group = parser.add_argument_group(
        "one-run audit", "--one-run trains a tiny linear model once with DP-SGD and canaries "
        "and prints one-run lower bounds beside the accountant's epsilon (minutes on a CPU).")
    group.add_argument("--one-run", action="store_true",
                       help="run an audit run instead of auditing RUN_DIR")
    group.add_argument("--epsilon", type=float, default=2.0,
                       help="target epsilon the noise is calibrated to (default 2)")
    group.add_argument("--delta", type=float, default=1e-6,
                       help="delta of the run and of the bounds (default 1e-6; keep it << 1/m)")
    group.add_argument("--canary-kind", choices=("gradient", "input"), default="gradient",
                       help="white-box gradient canaries, or input canaries scored white- "
                            "and black-box (default gradient)")
    group.add_argument("--num-canaries", type=int, default=5000, help="m (default 5000)")
    group.add_argument("--steps", type=int, default=1000, help="logical steps (default 1000)")
    group.add_argument("--sampling-rate", type=float, default=0.005,
                       help="Poisson rate q of examples and canaries (default 0.005)")
    group.add_argument("--plant-bug", choices=PLANTED_BUG_NAMES,
                       help="train with a deliberately broken DP step (to see the audit fail it)")
    group.add_argument("--output", help="also write the report as JSON to this file")


def run_one_run_from_args(args) -> int:
    """Runs `one_run_audit_run` from the parsed `--one-run` options; returns the exit code."""
    import json

    from tf_megadp.files import write_json_atomically

    report = one_run_audit_run(
        target_epsilon=args.epsilon, delta=args.delta, canaries=args.canary_kind,
        num_canaries=args.num_canaries, steps=args.steps, sampling_rate=args.sampling_rate,
        planted_bug=args.plant_bug, seed=getattr(args, "audit_seed", None))
    if args.output:
        write_json_atomically(args.output, report)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
    return 0
