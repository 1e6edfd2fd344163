"""Step time and memory of correlated noise (BandMF, BLT, lambda-CGD) against independent noise, one process.

Tiny BertMaskedLM (2 layers, hidden 128) under the private `fit`, clipping
"auto", the same schedule for every mechanism (B = m expected examples per
logical step, k micro-batches of m, sigma = 1): only the noise differs.

- independent noise (DP-SGD), Poisson sampling;
- `BandMF(num_bands=b)` for each `--bands`, cyclic Poisson with cycle_length = b;
- `BLT(num_buffers=d)` for each `--buffers`, fixed order;
- `LambdaCGD(lam)` for each `--lambdas`, fixed order: no buffer (z_(t-1)
  is drawn again), so its memory must be DP-SGD's.

Timing: every model trains `--rounds` rounds of `--steps` logical steps,
each round one `fit` call on its own sampler of the schedule's next steps
(a sampler's dataset is read once), and the models' rounds are interleaved
in a rotating order, so that load from other processes falls on every
mechanism alike. A round's time per logical step is measured between the
ends of its first and last steps (the fit's start and any retracing are
left out); the first round of every model is warm-up (compilation). The
summary is the median over the other rounds.

Memory: the exact bytes of the noise buffers per replica ((b - 1) or d
float32 copies of the trainable weights), the resident-memory growth when
the optimizer is built (accumulators, ledger and buffers; beyond the
independent optimizer's), and the largest peak growth of resident memory
during a timed round (the step's temporaries; `_measure.PeakRss`).

The noise stage alone: after the rounds, the optimizer's noise stage for
one logical step (`NoiseStage.noisy_sums`: every variable's draws, its
mechanism's stream with its buffer writes, the noisy sums), compiled once
and timed `--update-repeats` times (median), as a share of the independent
step: the step-time difference of two loaded runs is noisier than the
update it would measure. Independent noise's is the draw alone, so the
difference is what a mechanism adds (lambda-CGD: a second draw).

Each row prints the 1-minute load average: the machine may be shared.

    python benchmarks/correlated_noise_step.py                  # b = 4, 16; BLT d = 4
    python benchmarks/correlated_noise_step.py --micro-batch 64 --rounds 8
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402
from _measure import PeakRss, rss_bytes, time_per_call  # noqa: E402
from step_overhead import (  # noqa: E402
    add_model_arguments,
    build_model,
    compile_model,
    head,
    load_average,
    make_data,
)


class _StepTimes(keras.callbacks.Callback):
    """The end time of every logical step of one fit call (one micro-batch = one step here: k = 1)."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((int(self.model.optimizer.iterations.numpy()), time.perf_counter()))


class Mechanism:
    """One model, its optimizer and the samplers of its rounds."""

    def __init__(self, name, noise, data, schedule, args, cycle_length=1, fixed_order=False):
        self.name, self.noise = name, noise
        self.data, self.schedule, self.args = data, schedule, args
        self.cycle_length, self.fixed_order = cycle_length, fixed_order
        keras.utils.set_random_seed(0)
        self.model = tf_megadp.make_private(build_model("tiny", args))
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.Adam(1e-4), l2_norm_clip=1.0, noise_multiplier=1.0,
            schedule=schedule, noise=noise, seed=0)
        compile_model(self.model, optimizer, jit_compile=False)
        gc.collect()
        before = rss_bytes()
        optimizer.build(self.model.trainable_variables)
        self.build_bytes = rss_bytes() - before
        self.parameters = sum(v.shape.num_elements() for v in self.model.trainable_variables)
        self.buffer_bytes = optimizer.noise_strategy.noise_buffers * 4 * self.parameters
        self.seconds, self.peaks = [], []

    def sampler(self, start, end):
        x, y, w = self.data
        kind = tf_megadp.FixedOrderSampler if self.fixed_order else tf_megadp.PoissonSampler
        extra = {} if self.fixed_order else {"cycle_length": self.cycle_length}
        return kind.from_arrays(x, y, w, schedule=self.schedule, start_step=start,
                                end_step=end, seed=0, **extra)

    def noise_update_seconds(self, repeats):
        """Median seconds of the step's noise stage alone: draws, stream, noisy sums.

        The optimizer's own graph code (`NoiseStage.noisy_sums`, the noise
        stage of a logical step) on the accumulators as they are, compiled
        once and called `repeats` times, measured directly rather than as
        the difference of two loaded step times.
        """
        stage = self.model.optimizer.noise_stage
        sums = self.model.optimizer.accumulation_stage.sums()
        connected = [True] * len(sums)

        @tf.function
        def update(step):
            noisy = stage.noisy_sums(sums, connected, step, tf.constant(0, tf.int64),
                                     tf.constant(1.0))
            return tf.add_n([tf.reduce_sum(tf.cast(n, tf.float32)) for n in noisy])

        steps = iter(range(1, 10**6))
        return time_per_call(lambda: update(tf.constant(next(steps), tf.int64)).numpy(),
                             warmup=2, repeats=repeats)

    def round(self, index):
        steps = self.args.steps
        timer = _StepTimes()
        dataset = self.sampler(index * steps, (index + 1) * steps).as_dataset()
        gc.collect()
        with PeakRss() as memory:
            self.model.fit(dataset, verbose=0, callbacks=[timer])
        steps_done = [t for step, t in timer.ends]
        seconds = (steps_done[-1] - steps_done[0]) / (len(steps_done) - 1)
        if index >= self.args.warmup:
            self.seconds.append(seconds)
            self.peaks.append(memory.peak_increase)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=32, help="m = B")
    parser.add_argument("--bands", default="4,16", help="BandMF bands, comma-separated")
    parser.add_argument("--buffers", default="4", help="BLT buffers, comma-separated")
    parser.add_argument("--lambdas", default="0.5", help="lambda-CGD lambdas, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="logical steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, warm-up included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--update-repeats", type=int, default=30,
                        help="calls of the noise update alone, timed after the rounds")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # seeded noise, zero-out adjacency: once per model

    m = args.micro_batch
    bands = [int(b) for b in args.bands.split(",") if b]
    buffers = [int(d) for d in args.buffers.split(",") if d]
    lambdas = [float(lam) for lam in args.lambdas.split(",") if lam]
    # N = 2 max(b) B, so that every cycle length samples its groups at q <= 1/2.
    rows = 2 * max(bands + [1]) * m
    x, y, w = make_data(rows, args, np.random.default_rng(0))
    total = args.steps * args.rounds
    # k = 2 micro-batches of m: room for a cyclic group's draw (at most 2 B examples).
    schedule = tf_megadp.BatchSizeSchedule([tf_megadp.Phase(total, m, 2)], num_examples=rows,
                                           micro_batch_size=m)
    data = (x, y, w)
    mechanisms = [Mechanism("independent", None, data, schedule, args)]
    mechanisms += [Mechanism(f"BandMF b={b}", tf_megadp.BandMF(num_bands=b), data, schedule,
                             args, cycle_length=b) for b in bands]
    mechanisms += [Mechanism(f"BLT d={d}", tf_megadp.BLT(num_buffers=d), data, schedule, args,
                             fixed_order=True) for d in buffers]
    mechanisms += [Mechanism(f"lambda={lam:g}", tf_megadp.LambdaCGD(lam), data, schedule, args,
                             fixed_order=True) for lam in lambdas]

    commit = subprocess.run(["git", "log", "--oneline", "-1"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"commit: {commit}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
          f"TF {tf.__version__}, Keras {keras.__version__}; tiny BertMaskedLM, "
          f"{mechanisms[0].parameters:,} trainable parameters; m = B = {m}, k = 2, "
          f"N = {rows}, seq={args.seq} vocab={args.vocab} masks={args.masks}; "
          f"{args.rounds} rounds of {args.steps} steps (warm-up {args.warmup})")
    for index in range(args.rounds):
        shift = index % len(mechanisms)
        for mechanism in mechanisms[shift:] + mechanisms[:shift]:
            mechanism.round(index)
        print(f"  round {index} done, load {load_average():.2f}", flush=True)

    for mechanism in mechanisms:
        mechanism.update = mechanism.noise_update_seconds(args.update_repeats)
    base = mechanisms[0]
    base_time = float(np.median(base.seconds))
    print(f"{'noise':14} {'ms/step':>9} {'x indep.':>9} {'+ % step':>9} {'update ms':>10} "
          f"{'% of step':>10} {'buffers MiB':>12} {'build MiB':>10} {'round peak MiB':>15}  "
          "rounds (ms/step)")
    for mechanism in mechanisms:
        seconds = float(np.median(mechanism.seconds))
        extra = mechanism.build_bytes - base.build_bytes
        # The update alone against the independent step: the share of a step
        # that correlating its noise costs.
        print(f"{mechanism.name:14} {seconds * 1e3:9.1f} {seconds / base_time:9.3f} "
              f"{100 * (seconds - base_time) / base_time:+9.1f} "
              f"{mechanism.update * 1e3:10.2f} {100 * mechanism.update / base_time:10.2f} "
              f"{mechanism.buffer_bytes / 2**20:12.1f} {extra / 2**20:+10.1f} "
              f"{max(mechanism.peaks) / 2**20:15.1f}  "
              + " ".join(f"{s * 1e3:.0f}" for s in mechanism.seconds), flush=True)
    print(f"load average at the end: {load_average():.2f}; uptime: "
          + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
