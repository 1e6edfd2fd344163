"""Time and peak memory of the DP step versus the non-private Keras step.

Both steps run in one process on the same tiny BertMaskedLM and the same
micro-batch; the script prints `dp_step / nonprivate_step` for time and for
peak-memory growth. Run:

    python benchmarks/step_overhead.py                    # defaults of issue 2
    python benchmarks/step_overhead.py --micro-batch 64 --repeats 20
    python benchmarks/step_overhead.py --clipping ghost,vectorized
    python benchmarks/step_overhead.py --sweep --clipping ghost,vectorized

`--sweep` runs tiny/mini/small BERT (hidden 128/256/512, 2/4/4 layers) at
`--micro-batches` and prints one table row per (model, micro-batch, clipping).
Vectorized clipping is skipped where its per-example gradients alone would
exceed `--memory-budget-gib` (the row says so), so that the sweep cannot
exhaust a shared machine.

The non-private baseline is the stock Keras `train_step`, compiled with XLA
like the DP step's per-example pass (a non-XLA baseline is printed as well).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402
from _measure import PeakRss, time_per_call  # noqa: E402

tf.get_logger().setLevel("ERROR")


def build_model(args):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        max_sequence_length=args.seq,
        dropout=args.dropout,
    )
    return keras_hub.models.BertMaskedLM(backbone, preprocessor=None)


def make_batch(args, rng):
    m, seq, masks = args.micro_batch, args.seq, args.masks
    x = {
        "token_ids": rng.integers(0, args.vocab, (m, seq)).astype("int32"),
        "segment_ids": np.zeros((m, seq), "int32"),
        "padding_mask": np.ones((m, seq), "int32"),
        "mask_positions": np.sort(rng.integers(0, seq, (m, masks)), axis=1).astype("int32"),
    }
    y = rng.integers(0, args.vocab, (m, masks)).astype("int32")
    w = np.ones((m, masks), "float32")
    return x, y, w


def compile_model(model, optimizer, jit_compile):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"],
        jit_compile=jit_compile,
    )


def measure(model, batch, args):
    """(median seconds per step, peak RSS growth of the timed steps)."""
    x, y, w = batch
    step = lambda: model.train_on_batch(x, y, sample_weight=w)
    # Warm up (XLA compilation included) before measuring memory: the peak
    # must be the step's working set, not the compiler's.
    for _ in range(args.warmup):
        step()
    gc.collect()  # models of earlier rows must not count
    with PeakRss() as memory:
        seconds = time_per_call(step, 0, args.repeats)
    return seconds, memory.peak_increase


def private_model(args, clipping):
    model = tf_megadp.make_private(build_model(args))
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-4),
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        accumulation_steps=1,
        clipping=clipping,
        seed=0,
    )
    compile_model(model, optimizer, jit_compile=False)
    return model


SIZES = {"tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8)}


def per_example_gradient_bytes(model, micro_batch):
    return 4 * micro_batch * sum(v.shape.num_elements() for v in model.trainable_variables)


def sweep(args, clippings):
    """One row per (model size, micro-batch, clipping): ratios to the non-private step."""
    print(f"seq={args.seq} vocab={args.vocab} masks={args.masks} dropout={args.dropout} "
          f"warmup={args.warmup} repeats={args.repeats}")
    print(f"{'model':6} {'m':>4} {'clipping':10} {'base ms':>9} {'dp ms':>9} {'time x':>7} "
          f"{'base MiB':>9} {'dp MiB':>9} {'mem x':>7}")
    budget = args.memory_budget_gib * 2**30
    for size in args.sizes.split(","):
        args.layers, args.hidden, args.heads = SIZES[size]
        for micro_batch in [int(m) for m in args.micro_batches.split(",")]:
            args.micro_batch = micro_batch
            batch = make_batch(args, np.random.default_rng(0))
            # Fresh models for every shape: each step is traced once, with a
            # static micro-batch axis, as in training, and no earlier shape's
            # graphs or compilations linger in the timed steps.
            keras.backend.clear_session()
            keras.utils.set_random_seed(0)
            baseline = build_model(args)
            compile_model(baseline, keras.optimizers.Adam(1e-4), jit_compile=True)
            base_time, base_memory = measure(baseline, batch, args)
            del baseline
            for clipping in clippings:
                head = f"{size:6} {micro_batch:4d} {clipping:10}"
                keras.utils.set_random_seed(0)
                model = private_model(args, clipping)
                estimate = per_example_gradient_bytes(model, micro_batch)
                if clipping == "vectorized" and estimate > budget:
                    print(f"{head} skipped: per-example gradients alone need "
                          f"{estimate / 2**30:.1f} GiB > budget", flush=True)
                    continue
                dp_time, dp_memory = measure(model, batch, args)
                del model
                print(f"{head} {base_time * 1e3:9.1f} {dp_time * 1e3:9.1f} "
                      f"{dp_time / base_time:7.2f} {base_memory / 2**20:9.1f} "
                      f"{dp_memory / 2**20:9.1f} {dp_memory / max(base_memory, 1):7.2f}",
                      flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--masks", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--clipping", default="vectorized",
                        help="comma-separated strategies: vectorized, ghost, auto")
    parser.add_argument("--sweep", action="store_true",
                        help="tiny/mini/small BERT over --micro-batches (sets layers/hidden/heads)")
    parser.add_argument("--sizes", default="tiny,mini,small")
    parser.add_argument("--micro-batches", default="32,64,128,256,512")
    parser.add_argument("--memory-budget-gib", type=float, default=6.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    clippings = args.clipping.split(",")
    if args.sweep:
        sweep(args, clippings)
        return

    rng = np.random.default_rng(0)
    batch = make_batch(args, rng)
    keras.utils.set_random_seed(0)

    baseline = build_model(args)
    compile_model(baseline, keras.optimizers.Adam(1e-4), jit_compile=True)
    base_time, base_memory = measure(baseline, batch, args)
    compile_model(baseline, keras.optimizers.Adam(1e-4), jit_compile=False)
    plain_time, _ = measure(baseline, batch, args)

    for clipping in clippings:
        dp_time, dp_memory = measure(private_model(args, clipping), batch, args)
        print(
            f"BertMaskedLM layers={args.layers} hidden={args.hidden} heads={args.heads} "
            f"seq={args.seq} vocab={args.vocab} micro_batch={args.micro_batch} "
            f"clipping={clipping}"
        )
        print(f"nonprivate_step (XLA)   {base_time * 1e3:9.1f} ms   peak +{base_memory / 2**20:8.1f} MiB")
        print(f"nonprivate_step (no XLA){plain_time * 1e3:9.1f} ms")
        print(f"dp_step                 {dp_time * 1e3:9.1f} ms   peak +{dp_memory / 2**20:8.1f} MiB")
        print(f"time ratio dp_step / nonprivate_step (XLA):    {dp_time / base_time:.2f}")
        print(f"time ratio dp_step / nonprivate_step (no XLA): {dp_time / plain_time:.2f}")
        print(f"peak-memory ratio dp_step / nonprivate_step:   {dp_memory / max(base_memory, 1):.2f}")


if __name__ == "__main__":
    main()
