"""Seconds of one checkpoint of the pretraining job (issue 43: it checkpoints by default).

`tf-megadp pretrain` now checkpoints after the first logical step of every
start, every `--checkpoint-minutes` (10) of training and at the end. One
checkpoint is `tf_megadp.save_training_state` of the job's model: weights,
optimizer variables (AdamW moments, the privacy ledger) and the index,
each written to a temporary file and renamed. This script builds the job's
model (default: the README's BERT-nano, vocabulary 512, L = 64) with its
DPOptimizer, takes one logical step of fit so that every variable exists,
and times --repeats saves into a fresh folder (the median; the first save
is counted too), beside the time of one logical step of the default run
(B = 256), so that the cost reads as a fraction of training: at one save per
10 minutes it is the save time over 600 s.

The machine this was measured on has 2 CPU cores shared with other jobs:
the figures move with the load (the load average is printed).

Usage: python benchmarks/checkpoint_cost.py [--model nano] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    import tf_megadp
    from tf_megadp.jobs.bert.config import PretrainConfig
    from tf_megadp.jobs.bert.training import _compile_kwargs, _inner_optimizer, build_model

    config = PretrainConfig(model=args.model)
    vocabulary, length = config.vocabulary_size, config.sequence_length
    population = 20_000
    schedule = config.make_schedule(population, 1)
    model = build_model(config, vocabulary)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        _inner_optimizer(config, schedule, None), l2_norm_clip=1.0, noise_multiplier=1.0,
        schedule=schedule), **_compile_kwargs(True))
    # One logical step of the default run on random tokens: every variable built.
    rng = np.random.default_rng(0)
    rows = rng.integers(5, vocabulary, size=(population, length)).astype(np.int32)
    predictions = config.max_predictions or -(-15 * length // 100)
    positions = np.tile(np.arange(predictions, dtype=np.int32), (population, 1))
    x = {"token_ids": rows, "padding_mask": np.ones_like(rows, bool),
         "segment_ids": np.zeros_like(rows), "mask_positions": positions}
    y = rows[:, :predictions]
    weights = np.ones(y.shape, np.float32)
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, weights, schedule=schedule, seed=0)
    callback = tf_megadp.PrivacyCallback(delta=1e-6, accountant="rdp")
    tf_megadp.make_private(model)
    steps = schedule.phases[0].accumulation_steps
    started = time.perf_counter()
    model.fit(sampler.as_dataset(), steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[callback])
    first_step = time.perf_counter() - started
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, weights, schedule=schedule, seed=0,
                                                  start_step=1)
    started = time.perf_counter()
    model.fit(sampler.as_dataset(), steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[callback])
    step_seconds = time.perf_counter() - started

    with tempfile.TemporaryDirectory() as folder:
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            tf_megadp.save_training_state(model, os.path.join(folder, "checkpoint"),
                                          extra={"logical_steps": 2})
            seconds.append(time.perf_counter() - started)
        size = sum(p.stat().st_size for p in pathlib.Path(folder, "checkpoint").iterdir())
    median = statistics.median(seconds)
    print(f"CPU cores: {os.cpu_count()} (shared with other jobs); load average "
          f"{os.getloadavg()[0]:.2f}; TensorFlow {tf.__version__}")
    print(f"model BERT-{args.model}: {model.count_params():,} parameters, vocabulary "
          f"{vocabulary}, L = {length}; checkpoint {size / 2**20:.1f} MiB")
    print(f"one checkpoint            {median:.3f} s  (runs: "
          + ", ".join(f"{s:.3f}" for s in seconds) + ")")
    print(f"one logical step (B = {config.batch_size}) {step_seconds:.2f} s  "
          f"(the first, with compilation: {first_step:.1f} s)")
    print(f"checkpoint / logical step {median / step_seconds:.3f}; at one checkpoint per "
          f"{config.checkpoint_minutes:g} minutes: {median / (60 * config.checkpoint_minutes):.2%} "
          "of training time")


if __name__ == "__main__":
    main()
