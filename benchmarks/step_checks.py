"""Cost of the run-time checks of a custom loop's `PrivateStep` (issue 37, items 2 and 3).

In ONE process, three copies of the same tiny model train on the same
micro-batches, each through a `tf.function` around its step:

- `unchecked`: `PrivateStep` as it was before its run-time checks (the
  shared private step `tf_megadp.training.step.private_step` without its
  `admitted` gate), the baseline;
- `generation`: a `PrivateStep` begun with data no sampler drew, which
  checks in the graph that it is not stale (the model's generation);
- `tagged`: a `PrivateStep` begun with a `PoissonSampler`, fed its tagged
  dataset: the generation and each micro-batch's tag are checked.

The micro-batches are read into memory first (the pipeline is not timed),
the first `--warmup` calls are dropped, and the variants run interleaved in
rounds of `--calls` calls, in a rotating order, so that load from other
processes falls on all alike; the figure is the median time per call over
`--repeats` rounds, and the fastest round (the least disturbed on a shared
machine). The ratios are to `unchecked`.

Run:

    python benchmarks/step_checks.py            # m = 32, 3 -> 16 -> 2 Dense
    python benchmarks/step_checks.py --micro-batch 128 --repeats 40
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402
from tf_megadp.clipping import independence  # noqa: E402
from tf_megadp.training.step import private_step  # noqa: E402  (the baseline: no checks)


class UncheckedStep(tf_megadp.PrivateStep):
    """`PrivateStep` as it was before its run-time checks (the baseline)."""

    def __call__(self, data):
        self._check_current()
        outcome = private_step(self.model, data)
        self._calls.assign_add(1)
        logs = dict(outcome.logs)
        logs.pop(independence.LOG_KEY, None)
        logs["logical_step"] = tf.cast(self.optimizer.iterations, tf.int64)
        logs["applied"] = outcome.applied
        return logs


def tiny_model(hidden: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(2)])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20, help="calls per variant and round")
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # seeded noise and draws: a measurement

    m = args.micro_batch
    rounds = args.warmup + args.repeats
    needed = rounds * args.calls
    batch = 2 * m
    n = 64 * batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    probe = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=batch, micro_batch_size=m,
                                                 epochs=1, seed=1)
    epochs = int(np.ceil(needed / probe.total_micro_steps))
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=batch, micro_batch_size=m,
                                                   epochs=epochs, seed=1)
    tagged = [element for _, element in zip(range(needed), sampler.as_dataset(tagged=True))]
    plain = [element for element, _ in tagged]

    def optimizer():
        return tf_megadp.DPOptimizer(keras.optimizers.SGD(0.01), l2_norm_clip=1.0,
                                     noise_multiplier=1.0, schedule=sampler.schedule, seed=2)

    steps = {}
    unchecked = UncheckedStep(tiny_model(args.hidden), optimizer(), loss="mse")
    unchecked.begin((x, y), micro_batches_per_pass=needed)
    steps["unchecked"] = (tf.function(unchecked.run), plain)
    generation = tf_megadp.PrivateStep(tiny_model(args.hidden), optimizer(), loss="mse")
    generation.begin((x, y), micro_batches_per_pass=needed)
    steps["generation"] = (tf.function(generation.run), plain)
    checked = tf_megadp.PrivateStep(tiny_model(args.hidden), optimizer(), loss="mse")
    checked.begin(sampler)
    steps["tagged"] = (tf.function(checked.run), tagged)

    times = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            function, elements = steps[name]
            chunk = elements[round_index * args.calls:(round_index + 1) * args.calls]
            start = time.perf_counter()
            for element in chunk:
                function(element)
            elapsed = (time.perf_counter() - start) / len(chunk)
            if round_index >= args.warmup:
                times[name].append(elapsed)
    medians = {name: float(np.median(values)) for name, values in times.items()}
    # The fastest round is the least disturbed by other processes.
    fastest = {name: float(np.min(values)) for name, values in times.items()}
    print(f"tiny Dense 8 -> {args.hidden} -> 2, m = {m}, {args.repeats} rounds of "
          f"{args.calls} calls, load average {os.getloadavg()[0]:.2f} (2 shared cores: "
          "indicative only)")
    for name, seconds in medians.items():
        print(f"{name:>10}: median {seconds * 1e3:7.3f} ms per micro-batch (ratio to "
              f"unchecked {seconds / medians['unchecked']:.4f}), fastest round "
              f"{fastest[name] * 1e3:7.3f} ms (ratio {fastest[name] / fastest['unchecked']:.4f})")
    return medians


if __name__ == "__main__":
    main()
