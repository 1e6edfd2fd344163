"""BERT-Large reality check on this CPU: one DP logical step, measured beside the plan.

The real BERT-Large shape (24 layers, hidden 1024, 16 heads, intermediate
4096, V = 30522, sequence 128, 20 masked positions) built by the job
(`tf_megadp.jobs.bert.pretraining.build_model`), AdamW inside `DPOptimizer`
as the job compiles it, one logical step of k = 1 micro-batch of m
sequences, for ghost and for vectorized clipping. Each clipping runs in its
own process (peak RSS is per process), and reports

* the time of the first step (tracing and XLA compilation included) and of
  the second (steady state);
* peak memory: the peak RSS growth from just before the model is built to
  the end of the second step (`_measure.PeakRss`), i.e. parameters,
  optimizer state, accumulators, activations, per-example work and the
  XLA buffers of the compiled step;

and beside them what `tf_megadp.jobs.bert.plan.make_plan` predicts for the
same shape, micro-batch, clipping and precision (memory per replica and
seconds per logical step at `--peak-tflops`). Run it alone on an idle
machine (it needs about 12 GiB free at m = 2):

    python benchmarks/bert_large_check.py                   # m = 2, both clippings
    python benchmarks/bert_large_check.py --micro-batch 1 --clipping ghost
    python benchmarks/bert_large_check.py --compare benchmarks/bert_large_check_cpu.json

`--compare FILE` runs nothing: it sets the measurements saved with `--json`
(benchmarks/bert_large_check_cpu.json: the run recorded in docs/tpu.md)
beside the plan as the code computes it now, so a change to the memory
model is checked against the measured step without measuring again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GIB = 2**30
SEQUENCE = 128
PREDICTIONS = 20
VOCABULARY = 30522


def run_config(args, clipping):
    """The job's run configuration of this check (a planned one-replica CPU run)."""
    from tf_megadp.jobs.bert.config import Hardware, PretrainConfig

    return PretrainConfig(
        name="bert_large_cpu_check", model="large", sequence_length=SEQUENCE,
        vocabulary_size=VOCABULARY, max_predictions=PREDICTIONS, precision=args.precision,
        micro_batch_size=args.micro_batch, clipping=clipping,
        # One logical step of k = 1: capacity m for expected batch m (the
        # truncation bound is irrelevant to memory and time).
        schedule=[(1, args.micro_batch, 1)], num_examples=1_000_000,
        max_truncation_probability=0.99, noise_multiplier=1.0, target_epsilon=None,
        delta=1e-6, warmup_steps=0,
        hardware=Hardware(name="this CPU", replicas=1, hbm_gib_per_replica=1024.0,
                          peak_tflops_per_replica=args.peak_tflops))


def measure(args, clipping) -> dict:
    """One process: build, compile, two DP logical steps; time and peak RSS."""
    import numpy as np

    from _measure import PeakRss, rss_bytes
    from tf_megadp.jobs.bert import pretraining, training

    import keras

    import tf_megadp

    config = run_config(args, clipping)
    m = args.micro_batch
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(5, VOCABULARY, (2 * m, SEQUENCE)).astype("int32"),
        "segment_ids": np.zeros((2 * m, SEQUENCE), "int32"),
        "padding_mask": np.ones((2 * m, SEQUENCE), "int32"),
        "mask_positions": np.sort(rng.choice(SEQUENCE, (2 * m, PREDICTIONS)), axis=1).astype("int32"),
    }
    y = rng.integers(5, VOCABULARY, (2 * m, PREDICTIONS)).astype("int32")
    w = np.ones((2 * m, PREDICTIONS), "float32")
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.started)

    baseline = rss_bytes()
    with PeakRss() as peak, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras.utils.set_random_seed(0)
        model = pretraining.build_model(config, VOCABULARY)
        optimizer = tf_megadp.DPOptimizer(
            training._inner_optimizer(config, config.make_schedule(config.num_examples, 1),
                                         None), l2_norm_clip=1.0,
            noise_multiplier=1.0, accumulation_steps=1, clipping=clipping)
        tf_megadp.make_private(model)
        model.compile(optimizer=optimizer, **training._compile_kwargs(True))
        model.fit(x, y, sample_weight=w, batch_size=m, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Clock()])
    return {
        "clipping": clipping, "micro_batch": m, "precision": args.precision,
        "parameters": int(model.count_params()),
        "first_step_s": times[0], "step_s": times[1],
        "peak_rss_increase_bytes": peak.peak_increase, "baseline_rss_bytes": baseline,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--clipping", default="ghost,vectorized")
    parser.add_argument("--precision", default="float32", choices=["float32", "mixed_bfloat16"])
    parser.add_argument("--peak-tflops", type=float, default=0.16,
                        help="this CPU's peak float32 TFLOP/s for the plan's step time "
                             "(default: 2 cores x 2.5 GHz x 32 FLOP/cycle AVX-512 FMA)")
    parser.add_argument("--timeout", type=int, default=1500, help="seconds per clipping")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--compare", metavar="FILE",
                        help="compare saved measurements (--json output) with the plan")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(measure(args, args.child)), flush=True)
        return 0

    from tf_megadp.jobs.bert import plan

    saved = {}
    if args.compare:
        with open(args.compare, encoding="utf-8") as stream:
            saved = {row["clipping"]: row for row in json.load(stream)}
        args.clipping = ",".join(saved)
    rows = []
    for clipping in args.clipping.split(","):
        if saved:
            args.micro_batch = saved[clipping]["micro_batch"]
            args.precision = saved[clipping]["precision"]
        predicted = plan.make_plan(run_config(args, clipping))
        memory = predicted["memory_bytes"][clipping]
        if saved:
            row = dict(saved[clipping])
            done = None
        else:
            row = None
        command = [sys.executable, os.path.abspath(__file__), "--child", clipping,
                   "--micro-batch", str(args.micro_batch), "--precision", args.precision,
                   "--peak-tflops", str(args.peak_tflops)]
        if row is None:
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{clipping}: no result within {args.timeout} s")
                continue
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(f"{clipping}: failed (exit {done.returncode})\n{done.stderr[-3000:]}")
                continue
            row = json.loads(lines[-1][len("RESULT "):])
        row["plan_memory_bytes"] = memory
        row["plan_step_s"] = predicted["phases"][0]["seconds_per_logical_step"]
        row["memory_ratio"] = row["peak_rss_increase_bytes"] / memory["total"]
        rows.append(row)
        print(f"{clipping:10s} m={row['micro_batch']} {row['precision']}: step {row['step_s']:.1f} s "
              f"(first, with compilation, {row['first_step_s']:.0f} s; plan "
              f"{row['plan_step_s']:.1f} s at {args.peak_tflops:g} TFLOP/s), peak memory "
              f"{row['peak_rss_increase_bytes'] / GIB:.2f} GiB vs plan {memory['total'] / GIB:.2f} "
              f"GiB (parameters {memory['parameters'] / GIB:.2f} + optimizer state "
              f"{memory['optimizer_state'] / GIB:.2f} + step buffers "
              f"{memory.get('step_buffers', 0) / GIB:.2f} + activations "
              f"{memory['activations'] / GIB:.2f} + clipping {memory['clipping'] / GIB:.2f}); "
              f"measured/plan {row['memory_ratio']:.2f}", flush=True)
    if args.json and not saved:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump(rows, stream, indent=2)
    return 0 if rows and plan_agrees(rows) else 1


# The measured peak also holds TensorFlow's and XLA's own memory (compilation
# included), which no buffer of the step names: an additive remainder, 2.60
# (vectorized) and 2.64 GiB (ghost) on the saved CPU measurement, 2.1-2.4
# in the one before it. The plan must not exceed the peak
# (every counted buffer exists) and may fall short by at most UNMODELLED_GIB;
# the clippings' remainders must agree within CLIPPING_SPECIFIC_GIB, or one
# clipping holds a buffer the plan misses (or counts one the code lacks).
UNMODELLED_GIB = 3.0
CLIPPING_SPECIFIC_GIB = 0.5


def plan_agrees(rows) -> bool:
    """Whether measured peaks and planned memory agree (rows as `--json` writes them)."""
    remainders = [(r["peak_rss_increase_bytes"] - r["plan_memory_bytes"]["total"]) / GIB
                  for r in rows]
    return (all(0 <= r <= UNMODELLED_GIB for r in remainders)
            and max(remainders) - min(remainders) <= CLIPPING_SPECIFIC_GIB)


if __name__ == "__main__":
    sys.exit(main())
