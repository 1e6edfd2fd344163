"""What each `fit` call after the first costs beyond its steps, with and without issue 42's rule.

Users who call `fit` once per epoch, or in short chunks (keras-tuner, a
notebook loop), pay a private fit's fixed cost at every call. Before issue
42 that included the full independence check at the first step of every
fit (+1.5 steps at BERT-mini, m = 256); now a fit that continues the last
one on the same data, model and state keeps its verdict
(`tf_megadp.clipping.verdicts`).

In ONE process, on one private BertMaskedLM (`clipping="auto"`, the default
secret rechecks) and its non-private twin (XLA), the same arrays every time,
rounds of:

- `keep`: `fit` of `--steps` micro-batches, as a user calls it now;
- `reset`: the same, after `strategy.reset_checks(model)`: what every fit
  did before issue 42 (the full check at its first step);
- `non-private`: the twin's `fit` of `--steps` micro-batches.

The two private modes run on the same model and compiled step, in an order
that rotates, so that load from other processes falls on both alike. A
callback times every micro-batch; the DP step is the median of the
micro-batches that are not the first of their fit. Each fit call's extra is
(its wall time - steps x step) / step, in steps: what the call costs beyond
its micro-batches (the check, Keras's own `fit` set-up, the private fit's
bookkeeping). The first fit of each model (tracing, XLA compilation, the
first check) is printed apart.

Run:

    python benchmarks/fit_call_cost.py --size mini --micro-batch 256     # issue 42's shape
    python benchmarks/fit_call_cost.py --size tiny --micro-batch 32 --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_megadp  # noqa: E402
from step_overhead import SIZES, add_model_arguments, build_model, make_data  # noqa: E402


def load_average() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


class BatchTimer(keras.callbacks.Callback):
    """Seconds of every micro-batch of one fit."""

    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def new_model(args, private):
    keras.utils.set_random_seed(0)
    model = build_model(args.size, args)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if not private:
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss, jit_compile=True)
        return model
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-4), l2_norm_clip=1.0, noise_multiplier=1.0,
        clipping="auto"), loss=loss)
    return model


def timed_fit(model, data, args, reset=False):
    """(wall seconds of the fit call, seconds of each of its micro-batches)."""
    x, y, w = data
    if reset:
        model.optimizer.clipping_strategy.reset_checks(model)
    timer = BatchTimer()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed-size batches, not Poisson
        model.fit(x, y, sample_weight=w, batch_size=args.micro_batch, epochs=1,
                  shuffle=False, verbose=0, callbacks=[timer])
    return time.perf_counter() - start, timer.times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="mini")
    parser.add_argument("--micro-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="micro-batches per fit call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then N kept fit calls, each after the twin's fit, under cProfile: "
                             "the functions that take a call's time beyond its steps")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    rows = args.steps * args.micro_batch
    x, y, w = make_data(rows, args, np.random.default_rng(0), args.size)
    data = (x, y, w)
    layers, hidden, heads = SIZES[args.size]
    print(f"BertMaskedLM {args.size} ({layers} layers, hidden {hidden}, {heads} heads), "
          f"T={args.seq}, V={args.vocab}, m={args.micro_batch}, {args.steps} micro-batches "
          f"per fit, {args.rounds} rounds; load {load_average()}", flush=True)
    private, twin = new_model(args, True), new_model(args, False)
    for name, model in (("private", private), ("non-private", twin)):
        seconds, _ = timed_fit(model, data, args)
        print(f"  first fit, {name}: {seconds:.1f} s (tracing, compilation; "
              f"private: the first check)", flush=True)
    walls = {"keep": [], "reset": [], "non-private": []}
    steady, twin_steady = [], []
    runs = [("keep", private, False), ("reset", private, True), ("non-private", twin, False)]
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for mode, model, reset in runs[shift:] + runs[:shift]:
            seconds, batches = timed_fit(model, data, args, reset=reset)
            walls[mode].append(seconds)
            (twin_steady if mode == "non-private" else steady).extend(batches[1:])
        print(f"  round {round_index + 1}: " + ", ".join(
            f"{mode} {walls[mode][-1]:.1f} s" for mode in walls) + f"; load {load_average()}",
            flush=True)
    step, twin_step = statistics.median(steady), statistics.median(twin_steady)
    print(f"  DP step (median of {len(steady)} micro-batches, none the first of its fit): "
          f"{step:.2f} s; non-private step {twin_step:.2f} s ({step / twin_step:.2f}x)")
    for mode in walls:
        unit = twin_step if mode == "non-private" else step
        extras = [(wall - args.steps * unit) / unit for wall in walls[mode]]
        print(f"  fit call, {mode:11s}: median {statistics.median(walls[mode]):.1f} s, "
              f"extra {statistics.median(extras):+.2f} steps "
              f"(each: {', '.join(f'{e:+.2f}' for e in extras)})")
    print(f"  load {load_average()}", flush=True)
    if args.profile:
        profile_kept_calls(private, twin, data, args)


def profile_kept_calls(private, twin, data, args) -> None:
    """cProfile of `args.profile` kept fit calls, each after the twin's fit (where the cost shows)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(args.profile):
        timed_fit(twin, data, args)
        profiler.enable()
        timed_fit(private, data, args)
        profiler.disable()
    print(f"  cProfile of {args.profile} kept fit calls, each after the twin's fit "
          "(cumulative seconds; the steps are the train function's calls):")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
