"""Time and peak memory of the DP step versus the non-private step, on the paths users take.

For each BertMaskedLM size and micro-batch m, in ONE process, the script runs
three training paths, each with the non-private model and with DPOptimizer
under every requested clipping strategy:

- `train_on_batch`: one micro-batch per call.
- `fit_arrays`: `model.fit` on NumPy arrays, batch_size=m (one logical step
  per micro-batch, as most users start).
- `fit_poisson`: `model.fit` on `PoissonSampler.from_arrays(...).as_dataset()`
  (q = B/N = 1/4, expected batch B = m, k = schedule's micro-batches per
  step, padding included); the non-private model is fed the same dataset.

Every path is timed per micro-batch, XLA compilation excluded (the first
`--warmup` rounds are dropped), median over `--repeats` rounds. For
`train_on_batch` and `fit_arrays` the models run interleaved: in each round
every model runs once (one call, or one `fit` epoch of `--steps`
micro-batches timed by a callback), in a rotating order, so that load from
other processes falls on all of them alike. A Poisson dataset can be read
only once, so for `fit_poisson` each model gets its own sampler (same seed,
same steps) and one `fit` call whose epochs are the rounds. The
non-private baseline is run both ways Keras offers (`jit_compile=False`,
which Keras's default "auto" resolves to on a CPU, and `jit_compile=True`);
the ratios are to the faster of the two. Peak memory is the largest peak
growth of resident memory during one timed round (`_measure.PeakRss`).
Each row also prints the 1-minute load average when its path finished: the
machine may be shared.

Run:

    python benchmarks/step_overhead.py --quick        # tiny m=32, mini m=256
    python benchmarks/step_overhead.py --sizes tiny --micro-batches 32,64,128
    python benchmarks/step_overhead.py                # whole grid (hours on 2 cores)
    python benchmarks/step_overhead.py --sizes fullhead,gpt2 --micro-batches 32 \
        --paths fit_arrays --clipping auto --steps 8   # every position scored

Besides the BertMaskedLM sizes, two models score every position through the
vocabulary head (loss on all `--seq` tokens, `--vocab` classes):

- `fullhead`: Embedding(vocab, 128), 2 blocks of MultiHeadAttention +
  LayerNorm + Dense(512, gelu) + Dense(128), a Dense(vocab) head on every
  position (issue 42's shape).
- `gpt2`: keras-hub `GPT2CausalLM` from `GPT2Backbone` (2 layers, hidden
  128, 2 heads, intermediate 512; the head is the tied token embedding),
  built from its constructors: nothing is downloaded.

With `--lora-rank R`, every model of a cell, the non-private ones included,
is built and then given keras-hub's `backbone.enable_lora(R)` (LoRA on the
attention query and value projections, the rest of the backbone frozen,
the head trainable): the ratios are then DP LoRA against non-private LoRA.

    python benchmarks/step_overhead.py --sizes mini --micro-batches 64 --lora-rank 8 \
        --paths train_on_batch,fit_arrays --clipping ghost,auto

With `--dp-jit-compile` the DP models are compiled whole with XLA, as
`TPUStrategy` always compiles a step (issue 49's row):

    python benchmarks/step_overhead.py --sizes tiny --micro-batches 32 --paths fit_arrays \
        --clipping ghost,auto --dp-jit-compile

Vectorized clipping is skipped where its per-example gradients alone would
exceed `--memory-budget-gib` (the row says so), so that the grid cannot
exhaust a shared machine.
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
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402
from _measure import PeakRss  # noqa: E402

tf.get_logger().setLevel("ERROR")

# name: (layers, hidden, heads)
SIZES = {"nano": (2, 64, 2), "tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8)}
# Models whose loss scores every position (next-token / all-token targets).
EVERY_POSITION = ("fullhead", "gpt2")
PATHS = ("train_on_batch", "fit_arrays", "fit_poisson")
# The non-private baselines: Keras's default on CPU (no XLA) and XLA.
BASELINES = {"keras default": False, "XLA": True}
QUICK = [("tiny", 32), ("mini", 256)]


def load_average() -> float:
    with open("/proc/loadavg") as handle:
        return float(handle.read().split()[0])


def add_model_arguments(parser) -> None:
    """The BertMaskedLM options `build_model` and `make_data` read."""
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--masks", type=int, default=20)
    # 0, the main job's setting: dropout makes the non-private XLA step on a
    # CPU about twice as slow, so its ratios would flatter the DP step.
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="give every keras-hub backbone LoRA of this rank (0: none)")


def build_full_head(args):
    """Issue 42's encoder: every one of the `--seq` positions goes through a Dense(vocab) head."""
    tokens = keras.Input((args.seq,), dtype="int32", name="token_ids")
    x = keras.layers.Embedding(args.vocab, 128)(tokens)
    for _ in range(2):
        attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=64)(x, x)
        x = keras.layers.LayerNormalization()(x + attention)
        hidden = keras.layers.Dense(512, activation="gelu")(x)
        x = x + keras.layers.Dense(128)(hidden)
    return keras.Model(tokens, keras.layers.Dense(args.vocab)(x), name="fullhead")


def build_gpt2(args):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocab, num_layers=2, num_heads=2, hidden_dim=128,
        intermediate_dim=512, max_sequence_length=args.seq, dropout=args.dropout)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def build_model(size, args):
    model = _build_model(size, args)
    if args.lora_rank:
        if size == "fullhead":
            raise SystemExit("--lora-rank needs a keras-hub backbone; 'fullhead' has none.")
        model.backbone.enable_lora(args.lora_rank)
    return model


def _build_model(size, args):
    if size == "fullhead":
        return build_full_head(args)
    if size == "gpt2":
        return build_gpt2(args)
    layers, hidden, heads = SIZES[size]
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=args.vocab,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
        max_sequence_length=args.seq,
        dropout=args.dropout,
    )
    return keras_hub.models.BertMaskedLM(backbone, preprocessor=None)


def make_data(rows, args, rng, size="tiny"):
    seq, masks = args.seq, args.masks
    if size in EVERY_POSITION:
        tokens = rng.integers(0, args.vocab, (rows, seq + 1)).astype("int32")
        x = tokens[:, :-1]
        if size == "gpt2":
            x = {"token_ids": x, "padding_mask": np.ones((rows, seq), "int32")}
        return x, tokens[:, 1:], np.ones((rows, seq), "float32")
    x = {
        "token_ids": rng.integers(0, args.vocab, (rows, seq)).astype("int32"),
        "segment_ids": np.zeros((rows, seq), "int32"),
        "padding_mask": np.ones((rows, seq), "int32"),
        "mask_positions": np.sort(rng.integers(0, seq, (rows, masks)), axis=1).astype("int32"),
    }
    y = rng.integers(0, args.vocab, (rows, masks)).astype("int32")
    w = np.ones((rows, masks), "float32")
    return x, y, w


def head(x, rows):
    if not isinstance(x, dict):
        return x[:rows]
    return {key: value[:rows] for key, value in x.items()}


def compile_model(model, optimizer, jit_compile):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"],
        jit_compile=jit_compile,
    )


def clipping_strategy(spec):
    """`--clipping` entry: a strategy name, or `name:p` for ghost/auto with that recheck probability.

    `auto:0` never rechecks after the first call of each fit; `auto` uses the
    default (`tf_megadp.clipping.independence.RECHECK_PROBABILITY`).
    """
    name, _, probability = spec.partition(":")
    if not probability:
        return name
    strategy = {"ghost": tf_megadp.GhostClipping, "auto": tf_megadp.AutoClipping}[name]
    return strategy(recheck_probability=float(probability))


def new_model(size, args, clipping, jit_compile, schedule=None):
    """A freshly built model: non-private when `clipping` is None."""
    keras.utils.set_random_seed(0)
    model = build_model(size, args)
    if clipping is None:
        compile_model(model, keras.optimizers.Adam(1e-4), jit_compile)
        return model
    tf_megadp.make_private(model)
    settings = {"schedule": schedule} if schedule is not None else {"accumulation_steps": 1}
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-4), l2_norm_clip=1.0, noise_multiplier=1.0,
        clipping=clipping_strategy(clipping), seed=0, **settings)
    compile_model(model, optimizer, jit_compile=args.dp_jit_compile)
    return model


class _EpochTimer(keras.callbacks.Callback):
    """Seconds and peak RSS growth of every epoch of a `fit` call."""

    def __init__(self):
        super().__init__()
        self.times, self.peaks = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.memory = PeakRss().__enter__()
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)
        self.memory.__exit__(None, None, None)
        self.peaks.append(self.memory.peak_increase)


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def mean(values):
    return sum(values) / len(values)


# What a path reports over its timed rounds (--statistic): the median by
# default; the mean where a cost comes on some steps only (random rechecks).
SUMMARY = {"median": median, "mean": mean}


def one_round(model, path, data, args):
    """Runs one timed round of `path` (not fit_poisson); (seconds per micro-batch, peak bytes)."""
    x, y, w, _, m = data
    gc.collect()
    if path == "train_on_batch":
        with PeakRss() as memory:
            start = time.perf_counter()
            model.train_on_batch(head(x, m), y[:m], sample_weight=w[:m])
            seconds = time.perf_counter() - start
        return seconds, memory.peak_increase
    rows = args.steps * m
    timer = _EpochTimer()
    model.fit(head(x, rows), y[:rows], sample_weight=w[:rows], batch_size=m,
              epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    return timer.times[0] / args.steps, timer.peaks[0]


def interleaved(models, path, data, args):
    """Rounds in which every model runs once, in an order that rotates.

    Load from other processes on a shared machine then falls on every model
    alike, instead of on whichever happened to run while it peaked.

    Returns:
        One (median seconds per micro-batch, max peak bytes) per model, over
        the rounds after `args.warmup` (compilation is in the first).
    """
    times = [[] for _ in models]
    peaks = [[] for _ in models]
    for round_index in range(args.warmup + args.repeats):
        shift = round_index % len(models)
        for index in list(range(len(models)))[shift:] + list(range(len(models)))[:shift]:
            seconds, peak = one_round(models[index], path, data, args)
            if round_index >= args.warmup:
                times[index].append(seconds)
                peaks[index].append(peak)
    return [(SUMMARY[args.statistic](t), max(p)) for t, p in zip(times, peaks)]


def poisson_fit(model, data, args):
    """fit on a Poisson dataset, iterated once: (median s per micro-batch, max peak bytes).

    A sampler's dataset can be read only once, so the epochs of one `fit`
    call are the rounds, and models cannot be interleaved.
    """
    x, y, w, sampler, m = data
    micro_batches = args.steps * sampler.schedule.phases[0].accumulation_steps
    timer = _EpochTimer()
    model.fit(sampler.as_dataset(), epochs=args.warmup + args.repeats,
              steps_per_epoch=micro_batches, verbose=0, callbacks=[timer])
    return (SUMMARY[args.statistic](timer.times[args.warmup:]) / micro_batches,
            max(timer.peaks[args.warmup:]))


def poisson_sampler(x, y, w, m, args):
    """N = 4m examples, expected batch B = m: enough steps for every epoch of the fit."""
    rows = 4 * m
    logical_steps = args.steps * (args.warmup + args.repeats)
    return tf_megadp.PoissonSampler.from_arrays(
        head(x, rows), y[:rows], w[:rows], batch_size=m, micro_batch_size=m,
        epochs=logical_steps * m / rows, seed=0)


def per_example_gradient_bytes(size, args, micro_batch):
    model = build_model(size, args)
    count = sum(v.shape.num_elements() for v in model.trainable_variables)
    del model
    return 4 * micro_batch * count


def run_cell(size, m, paths, clippings, args):
    """Prints one row per (path, strategy) of one (size, micro-batch) cell."""
    rows = max(args.steps, 4) * m
    x, y, w = make_data(rows, args, np.random.default_rng(0), size)
    budget = args.memory_budget_gib * 2**30
    vectorized_bytes = per_example_gradient_bytes(size, args, m)
    runnable = []
    for clipping in clippings:
        if clipping.startswith("vectorized") and vectorized_bytes > budget:
            print(f"{size:5} {m:4d} {'all paths':14} {clipping:11} skipped: per-example "
                  f"gradients alone need {vectorized_bytes / 2**30:.1f} GiB > "
                  "--memory-budget-gib", flush=True)
        else:
            runnable.append(clipping)
    for path in paths:
        keras.backend.clear_session()
        gc.collect()
        poisson = path == "fit_poisson"
        # A Poisson dataset is iterated once: every model gets its own sampler
        # (same settings, same seed, hence the same steps).
        samplers = [poisson_sampler(x, y, w, m, args) if poisson else None
                    for _ in range(len(BASELINES) + len(runnable))]
        models = [new_model(size, args, None, jit) for jit in BASELINES.values()]
        models += [new_model(size, args, clipping, False,
                             sampler.schedule if poisson else None)
                   for clipping, sampler in zip(runnable, samplers[len(BASELINES):])]
        if poisson:
            results = [poisson_fit(model, (x, y, w, sampler, m), args)
                       for model, sampler in zip(models, samplers)]
        else:
            results = interleaved(models, path, (x, y, w, None, m), args)
        del models
        base = dict(zip(BASELINES, results))
        best = min(base, key=lambda name: base[name][0])
        base_time, base_memory = base[best]
        others = ", ".join(f"{name} {t * 1e3:.1f} ms" for name, (t, _) in base.items())
        load = load_average()
        print(f"{size:5} {m:4d} {path:14} {'non-private':11} {base_time * 1e3:9.1f} "
              f"{'':>7} {base_memory / 2**20:9.1f} {'':>6}  load {load:5.2f}  "
              f"best of [{others}]: {best}", flush=True)
        for clipping, (dp_time, dp_memory) in zip(runnable, results[len(BASELINES):]):
            print(f"{size:5} {m:4d} {path:14} {clipping:11} {dp_time * 1e3:9.1f} "
                  f"{dp_time / base_time:7.2f} {dp_memory / 2**20:9.1f} "
                  f"{dp_memory / max(base_memory, 1):6.2f}  load {load:5.2f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="only the issue's two targets: tiny m=32 and mini m=256")
    parser.add_argument("--sizes", default="tiny,mini,small")
    parser.add_argument("--micro-batches", default="32,64,128,256,512")
    parser.add_argument("--micro-batch", type=int,
                        help="one micro-batch size (same as --micro-batches M)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--clipping", default="vectorized,ghost,auto",
                        help="comma-separated strategies: vectorized, ghost, auto; ghost:P or "
                             "auto:P for a recheck probability P of the independence check")
    parser.add_argument("--statistic", choices=sorted(SUMMARY), default="median",
                        help="summary of the timed rounds (mean for costs on some steps only)")
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=2,
                        help="logical steps per timed fit epoch")
    parser.add_argument("--dp-jit-compile", action="store_true",
                        help="compile the DP models' step whole with XLA "
                             "(compile(jit_compile=True): what TPUStrategy always does)")
    parser.add_argument("--memory-budget-gib", type=float, default=6.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # fixed-size-batch and sigma notices, once per model

    if args.micro_batch is not None:
        args.micro_batches = str(args.micro_batch)
    if args.quick:
        cells = QUICK
    else:
        cells = [(size, int(m)) for size in args.sizes.split(",")
                 for m in args.micro_batches.split(",")]
    commit = subprocess.run(["git", "log", "--oneline", "-1"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"commit: {commit}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
          f"TF {tf.__version__}, Keras {keras.__version__}; seq={args.seq} vocab={args.vocab} "
          f"masks={args.masks} dropout={args.dropout} lora_rank={args.lora_rank} "
          f"warmup={args.warmup} "
          f"repeats={args.repeats} steps={args.steps} statistic={args.statistic}")
    print(f"{'model':5} {'m':>4} {'path':14} {'clipping':11} {'ms/mb':>9} {'time x':>7} "
          f"{'peak MiB':>9} {'mem x':>6}  (x: to the best non-private step of the path)")
    for size, m in cells:
        run_cell(size, m, args.paths.split(","), args.clipping.split(","), args)


if __name__ == "__main__":
    main()
