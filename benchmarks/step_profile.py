"""The DP step's time, phase by phase, beside the non-private step's (issue 49).

In ONE process, on one private model (`clipping="auto"`, the default
secret rechecks, the DP step as `fit` runs it) and its non-private twin
(XLA), on the same micro-batch of m rows:

1. **The passes**, each compiled alone with XLA and timed in interleaved
   rotating rounds (medians):

   - non-private `forward` (the loss) and `forward + backward` (the
     gradient);
   - DP `records`: ghost clipping's recorded forward and backward pass
     (`tf_megadp.clipping.ghost.gradient_records`), every record kept alive;
   - DP `records + norms (<family>)`: the same plus the per-example squared
     norms of one family of variables, by the form of their records:
     `built` (per-example gradients formed, small kernels), `Gram` (T x T
     Grams, large kernels), `embedding rows` (token-equality Gram),
     `exact` (per-example gradients of layers without a rule), `tied`
     (a variable with records of several forms, cross terms included);
     the family's cost is the difference to `records`;
   - DP `clip_and_sum`: the strategy's whole pass as the step calls it
     (norms, clip factors, clipped sums, its secret recheck draws);
   - DP `noise`: one Gaussian draw per parameter
     (`tf_megadp.gaussian.standard_normal`, what the noise stage draws once
     per logical step) added to a sum.

2. **The fit**: rounds of `fit` calls of `--steps` micro-batches on the
   same arrays (one logical step per micro-batch), DP and non-private
   interleaved, plus one DP call per round after `strategy.reset_checks`
   (what every fit on new data, model or state costs). A callback times
   every micro-batch; from those:

   - `step`: the median micro-batch that is not the first of its call;
   - `first step's independence check`: the first micro-batch of a reset
     call minus that of a kept call;
   - `ledger (host)`: the time inside the private fit's ledger callback
     (`tf_megadp.run.callbacks.LedgerKeeper`), per call and per step;
   - `a call beyond its steps`: its wall time minus its micro-batches
     (Keras's `fit` set-up, callbacks, the private fit's bookkeeping).

   The DP step minus `clip_and_sum` and `noise` is what the rest of the
   step costs (accumulation, the inner optimizer, the in-graph ledger and
   checks); the non-private step minus its gradient is its optimizer.

The tags and generation checks of a sampler's micro-batches are not on
this array path; `benchmarks/step_checks.py` times them. Run (nothing else
running; the load is printed):

    python benchmarks/step_profile.py --size tiny --micro-batch 32          # tiny BERT
    python benchmarks/step_profile.py --size tiny --micro-batch 64 --seq 64 --vocab 512 --masks 10  # the main job
    python benchmarks/step_profile.py --size tiny --micro-batch 32 --lora-rank 8                     # LoRA
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402
from fit_call_cost import BatchTimer  # noqa: E402
from per_example_pass import interleaved_times  # noqa: E402
from step_overhead import (EVERY_POSITION, SIZES, add_model_arguments, build_model,  # noqa: E402
                           compile_model, head, load_average, make_data)
from tf_megadp.clipping import Explicit, Gather, Outer, ghost  # noqa: E402
from tf_megadp.clipping.ghost_rules import plan_rules  # noqa: E402
from tf_megadp.clipping.terms import squared_norm_of_sum  # noqa: E402
from tf_megadp.gaussian import fold_in, standard_normal  # noqa: E402
from tf_megadp.run.callbacks import LedgerKeeper  # noqa: E402


def new_models(args):
    """(non-private XLA model, private model), built alike from seed 0."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    public = build_model(args.size, args)
    compile_model(public, keras.optimizers.Adam(1e-4), jit_compile=True)
    keras.utils.set_random_seed(0)
    private = build_model(args.size, args)
    tf_megadp.make_private(private)
    private.compile(
        optimizer=tf_megadp.DPOptimizer(keras.optimizers.Adam(1e-4), l2_norm_clip=1.0,
                                        noise_multiplier=1.0, clipping="auto",
                                        accumulation_steps=1),
        loss=loss, weighted_metrics=["sparse_categorical_accuracy"])
    return public, private


def family(terms) -> str:
    """The norm family of one variable, by the form of its records."""
    if len(terms) > 1:
        return "tied (several forms)"
    term = terms[0]
    if isinstance(term, Outer):
        return "built (small kernels)" if term.materialised else "Gram (large kernels)"
    if isinstance(term, Gather):
        return "embedding rows"
    if isinstance(term, Explicit):
        return "exact (no rule)"
    return type(term).__name__


def record_tensors(groups) -> list:
    """Every tensor the records hold, so that no phase lets XLA drop one."""
    tensors = []
    for terms in groups.values():
        for term in terms:
            tensors += [value for value in vars(term).values() if isinstance(value, tf.Tensor)]
    return tensors


def pass_calls(args, public, private, batch) -> tuple[dict, dict]:
    """(name -> zero-argument callable, family -> parameter count) of part 1."""
    x, y, w = batch
    rules = plan_rules(private, "any")

    @tf.function(jit_compile=True)
    def forward():
        return public.compute_loss(x=x, y=y, y_pred=public(x, training=True),
                                   sample_weight=w, training=True)

    @tf.function(jit_compile=True)
    def gradient():
        with tf.GradientTape() as tape:
            loss = forward.python_function()
        return tape.gradient(loss, public.trainable_variables)

    def recorded(norm_families):
        @tf.function(jit_compile=True, autograph=False)
        def call():
            groups, _, losses, _ = ghost.gradient_records(private, rules, x, y, w)
            kept = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                             for t in record_tensors(groups)])
            norms = [squared_norm_of_sum(terms) for terms in groups.values()
                     if family(terms) in norm_families]
            return kept, losses, (tf.add_n(norms) if norms else losses)
        return call

    groups = ghost.gradient_records(private, rules, x, y, w)[0]
    variables = private.trainable_variables
    sizes = collections.Counter()
    for index, terms in groups.items():
        sizes[family(terms)] += int(np.prod(variables[index].shape))
    calls = {"non-private: forward": forward, "non-private: forward + backward": gradient,
             "DP: records": recorded(())}
    for name in sorted(sizes):
        calls[f"DP: records + norms ({name})"] = recorded((name,))
    calls["DP: records + every norm"] = recorded(tuple(sizes))
    clipping = tf_megadp.AutoClipping()
    calls["DP: clip_and_sum"] = lambda: clipping.clip_and_sum(private, x, y, w, 1.0)
    key = tf.constant([1, 2], tf.uint32)

    @tf.function(jit_compile=True)
    def noise():
        return [v.value + standard_normal(v.shape, fold_in(key, i), v.dtype)
                for i, v in enumerate(private.trainable_variables)]

    calls["DP: noise"] = noise
    return calls, sizes


class LedgerClock:
    """Seconds spent inside the private fit's ledger callback (every LedgerKeeper hook)."""

    HOOKS = ("on_train_begin", "on_train_batch_end", "on_epoch_end", "on_train_end")

    def __init__(self):
        self.seconds = 0.0
        for hook in self.HOOKS:
            setattr(LedgerKeeper, hook, self._timed(getattr(LedgerKeeper, hook)))

    def _timed(self, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def fit_rounds(args, public, private, arrays) -> dict:
    """Part 2: mode -> list of (wall, micro-batch times, ledger seconds) per call."""
    x, y, w = arrays
    clock = LedgerClock()
    modes = {
        "non-private": lambda: public,
        "DP": lambda: private,
        "DP after reset_checks": lambda: (private.optimizer.clipping_strategy.reset_checks(private),
                                          private)[1],
    }
    calls = {mode: [] for mode in modes}
    for round_index in range(args.rounds + 1):
        names = list(modes)
        shift = round_index % len(names)
        for mode in names[shift:] + names[:shift]:
            model = modes[mode]()
            timer = BatchTimer()
            clock.take()
            start = time.perf_counter()
            model.fit(x, y, sample_weight=w, batch_size=args.micro_batch, epochs=1,
                      shuffle=False, verbose=0, callbacks=[timer])
            wall = time.perf_counter() - start
            if round_index:  # round 0 traces and compiles
                calls[mode].append((wall, timer.times, clock.take()))
    return calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES) + list(EVERY_POSITION))
    parser.add_argument("--micro-batch", type=int, default=32)
    add_model_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="micro-batches per fit call")
    parser.add_argument("--rounds", type=int, default=3, help="timed fit rounds")
    args = parser.parse_args(argv)
    # The arrays and seed warnings of a benchmark run (it publishes nothing).
    warnings.filterwarnings("ignore", category=UserWarning)
    m = args.micro_batch
    public, private = new_models(args)
    rows = m * args.steps
    x, y, w = make_data(rows, args, np.random.default_rng(0), args.size)
    batch = tf.nest.map_structure(tf.constant, (head(x, m), y[:m], w[:m]))
    public(batch[0])
    private(batch[0])
    print(f"{args.size} m={m} seq={args.seq} vocab={args.vocab} masks={args.masks} "
          f"lora={args.lora_rank} dropout={args.dropout}; trainable parameters "
          f"{sum(int(np.prod(v.shape)) for v in private.trainable_variables):,}; "
          f"load {load_average():.2f}")

    start_load = load_average()
    calls, sizes = pass_calls(args, public, private, batch)
    times = interleaved_times(calls, args.warmup, args.repeats)
    fits = fit_rounds(args, public, private, (x, y, w))
    print(f"load {start_load:.2f} -> {load_average():.2f}; passes: {args.warmup} warm-up and "
          f"{args.repeats} timed rounds; fits: {args.rounds} rounds of {args.steps} steps\n")

    def steady(mode):
        return statistics.median(t for _, batches, _ in fits[mode] for t in batches[1:])

    def first(mode):
        return statistics.median(batches[0] for _, batches, _ in fits[mode])

    def beyond(mode):
        return statistics.median(wall - sum(batches) for wall, batches, _ in fits[mode])

    np_step, dp_step = steady("non-private"), steady("DP")
    ledger = statistics.median(seconds for _, _, seconds in fits["DP"])
    records = times["DP: records"]
    rows = [("non-private step (fit, XLA)", np_step),
            ("  forward", times["non-private: forward"]),
            ("  forward + backward", times["non-private: forward + backward"]),
            ("  the rest (optimizer, metrics)",
             np_step - times["non-private: forward + backward"]),
            ("DP step (fit)", dp_step),
            ("  records (recorded forward + backward)", records)]
    for name in sorted(sizes):
        rows.append((f"  norms: {name}, {sizes[name]:,} parameters",
                     times[f"DP: records + norms ({name})"] - records))
    rows.append(("  norms: every family at once", times["DP: records + every norm"] - records))
    rows.append(("  clip factors and clipped sums",
                 times["DP: clip_and_sum"] - times["DP: records + every norm"]))
    rows.append(("  = clip_and_sum (the per-example pass)", times["DP: clip_and_sum"]))
    rows.append(("  noise (one draw per parameter)", times["DP: noise"]))
    rows.append(("  the rest (accumulation, optimizer, in-graph ledger and checks)",
                 dp_step - times["DP: clip_and_sum"] - times["DP: noise"]))
    rows.append(("first step's independence check (once per new fit)",
                 first("DP after reset_checks") - first("DP")))
    rows.append((f"ledger callback (host), per call of {args.steps} steps", ledger))
    rows.append(("a DP fit call beyond its steps", beyond("DP")))
    rows.append(("a non-private fit call beyond its steps", beyond("non-private")))
    width = max(len(name) for name, _ in rows)
    print(f"{'phase':{width}}  {'ms':>8}  {'x NP step':>9}")
    for name, seconds in rows:
        print(f"{name:{width}}  {seconds * 1e3:8.1f}  {seconds / np_step:9.2f}")
    call_np = np_step * args.steps + beyond("non-private")
    call_dp = dp_step * args.steps + beyond("DP")
    print(f"\nDP step / non-private step: {dp_step / np_step:.2f}x; a fit call of "
          f"{args.steps} steps: {call_dp / call_np:.2f}x ({call_dp:.2f} s / {call_np:.2f} s)")


if __name__ == "__main__":
    main()
