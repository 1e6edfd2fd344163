"""What bounds the DP step: the clipping strategy's per-example pass timed alone.

For one BertMaskedLM size and micro-batch m, in one process, times (median
of repeats after warm-up, XLA compilation excluded, models interleaved in
rotating rounds as in step_overhead.py):

- `gradient (XLA)`: the non-private forward + backward of the micro-batch
  (`tape.gradient` of the mean loss), compiled with XLA, no optimizer update;
- `<strategy>.clip_and_sum`: the strategy's per-example norms, clip factors
  and clipped sum, exactly as the DP step calls it, no optimizer update.

The ratio of the two is the floor of the DP step's overhead: whatever the
rest of the step costs comes on top. Run:

    python benchmarks/per_example_pass.py --size tiny --micro-batch 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from step_overhead import (EVERY_POSITION, SIZES, add_model_arguments, build_model,  # noqa: E402
                           compile_model, head, load_average, make_data, median)
from tf_megadp.clipping import get_clipping_strategy  # noqa: E402


def add_arguments(parser) -> None:
    """The options of `pass_calls`: model size, micro-batch, strategies."""
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES) + list(EVERY_POSITION))
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--clipping", default="vectorized,ghost,auto")
    add_model_arguments(parser)


def pass_calls(args) -> dict:
    """Name -> zero-argument callable: the non-private gradient, then each strategy's pass.

    All share one model and one micro-batch; `gradient (XLA)` comes first.
    """
    m = args.micro_batch
    x, y, w = make_data(m, args, np.random.default_rng(0), args.size)
    x, y, w = tf.nest.map_structure(tf.constant, (head(x, m), y, w))
    keras.utils.set_random_seed(0)
    model = build_model(args.size, args)
    compile_model(model, keras.optimizers.Adam(1e-4), jit_compile=True)
    model(x)

    @tf.function(jit_compile=True)
    def gradient():
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                      sample_weight=w, training=True)
        return tape.gradient(loss, model.trainable_variables)

    calls = {"gradient (XLA)": gradient}
    for name in args.clipping.split(","):
        strategy = get_clipping_strategy(name)
        calls[f"{name}.clip_and_sum"] = (
            lambda strategy=strategy: strategy.clip_and_sum(model, x, y, w, 1.0))
    return calls


def run_to_completion(call) -> None:
    """Calls `call` and waits for every output (TensorFlow dispatches asynchronously)."""
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, call())


def interleaved_times(calls: dict, warmup: int, repeats: int) -> dict:
    """Name -> median seconds per call, the calls interleaved in rotating rounds."""
    names = list(calls)
    times = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            run_to_completion(calls[name])
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: median(values) for name, values in times.items()}


def describe(args) -> str:
    """One line naming the model shape, the micro-batch and the machine load."""
    return (f"{args.size} m={args.micro_batch} seq={args.seq} vocab={args.vocab} "
            f"dropout={args.dropout} load {load_average():.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    times = interleaved_times(pass_calls(args), args.warmup, args.repeats)
    base = times["gradient (XLA)"]
    print(f"{describe(args)} warmup={args.warmup} repeats={args.repeats}")
    for name, seconds in times.items():
        print(f"{name:28} {seconds * 1e3:9.1f} ms  {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
