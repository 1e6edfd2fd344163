"""Does the Poisson input pipeline keep up with training, in flat memory?

Prints three things:

1. examples/s that the full input pipeline delivers: Poisson draw, random-access
   reads from memory-mapped shards, padding to static micro-batches, and
   `MaskedLMBatcher` (tf.data, as fed to `fit`);
2. examples/s that one training step of a tiny BertMaskedLM consumes (2 layers,
   hidden 128, 2 heads, seq 128, micro-batch 32): the tf_megadp DP step, and
   the plain Keras step for reference;
3. resident memory while sampling the same expected batch from a
   10-million-row corpus and from a 10-thousand-row corpus, each measured in
   a fresh subprocess (RssAnon: the process's own memory; RssFile: mapped
   shard pages; VmHWM: the peak of both).

Run (writes about 2.6 GB of synthetic shards to a temporary folder, then
deletes them):

    python benchmarks/input_pipeline.py
    python benchmarks/input_pipeline.py --skip-memory --train-steps 5
    python benchmarks/input_pipeline.py --only-memory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

VOCAB = 8192
LENGTH = 128
MICRO_BATCH = 32


def synthetic_shards(directory: str, rows: int, seed: int = 0) -> None:
    """BERT-shaped rows ([CLS] tokens [SEP] [PAD]...) of random token ids."""
    from tf_megadp import write_token_shards

    rng = np.random.default_rng(seed)
    # One block of distinct rows, repeated: building 10M random rows would
    # dominate the benchmark and the sampler never looks at the content.
    block_rows = min(rows, 1 << 16)
    block = rng.integers(5, VOCAB, (block_rows, LENGTH), dtype=np.int64)
    lengths = rng.integers(LENGTH // 2, LENGTH - 1, block_rows)
    block[:, 0] = 1
    block[np.arange(block_rows), lengths] = 2
    block[np.arange(LENGTH)[None, :] > lengths[:, None]] = 0

    def blocks():
        done = 0
        while done < rows:
            take = min(block_rows, rows - done)
            yield block[:take]
            done += take

    write_token_shards(directory, blocks(), sequence_length=LENGTH, vocabulary_size=VOCAB, checksum=f"synthetic-{rows}-{seed}")


def memory_status() -> dict[str, int]:
    """Selected /proc/self/status fields, in KiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[name] = int(value.split()[0])
    return fields


def rss_child(directory: str, batch_size: int, steps: int) -> None:
    """Samples `steps` logical steps and prints memory figures as JSON."""
    from tf_megadp import BatchSizeSchedule, PoissonSampler, TokenShards

    shards = TokenShards(directory)
    schedule = BatchSizeSchedule.constant(steps, batch_size, num_examples=len(shards), micro_batch_size=MICRO_BATCH)
    sampler = PoissonSampler(shards, schedule)
    before = memory_status()
    start = time.perf_counter()
    examples = 0
    for rows, weights in sampler.micro_batches():
        examples += int(weights.sum())
    elapsed = time.perf_counter() - start
    after = memory_status()
    print(json.dumps({"rows": len(shards), "before": before, "after": after, "examples_per_s": examples / elapsed}))


def measure_memory(batch_size: int, steps: int, sizes: list[int]) -> None:
    print(f"\n== Resident memory, Poisson sampling, expected batch {batch_size}, {steps} steps, L={LENGTH} uint16")
    print("RSS after opening the shards -> after sampling (MiB); VmHWM: peak RSS of the process")
    print(f"{'corpus rows':>12} {'file GB':>8} {'RssAnon':>16} {'RssFile':>14} {'VmHWM':>8} {'reads ex/s':>11}")
    for rows in sizes:
        directory = tempfile.mkdtemp(prefix="tf_megadp_bench_")
        try:
            synthetic_shards(directory, rows)
            size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 1e9
            output = subprocess.run(
                [sys.executable, __file__, "--rss-child", directory, "--batch", str(batch_size), "--steps", str(steps)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            result = json.loads(output.strip().splitlines()[-1])
            before, after = result["before"], result["after"]
            anon = f"{before['RssAnon'] / 1024:.0f} -> {after['RssAnon'] / 1024:.0f}"
            mapped = f"{before['RssFile'] / 1024:.0f} -> {after['RssFile'] / 1024:.0f}"
            print(
                f"{rows:>12,} {size:>8.2f} {anon:>16} {mapped:>14} "
                f"{after['VmHWM'] / 1024:>8.0f} {result['examples_per_s']:>11,.0f}"
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def measure_pipeline(directory: str, batch_size: int, steps: int) -> float:
    from tf_megadp import BatchSizeSchedule, PoissonSampler, TokenShards
    from tf_megadp.jobs.bert.text import MaskedLMBatcher

    shards = TokenShards(directory)
    schedule = BatchSizeSchedule.constant(steps, batch_size, num_examples=len(shards), micro_batch_size=MICRO_BATCH)
    sampler = PoissonSampler(shards, schedule)
    dataset = sampler.as_dataset(MaskedLMBatcher.from_shards(shards))
    iterator = iter(dataset)
    next(iterator)  # tracing of the masking map is not throughput
    start = time.perf_counter()
    slots = real = 0
    for x, y, weight in iterator:
        slots += int(x["token_ids"].shape[0])
        real += int(np.count_nonzero(np.asarray(weight).sum(axis=1)))
    elapsed = time.perf_counter() - start
    print(f"\n== Input pipeline (Poisson draw + memmap reads + padding + MLM masking, tf.data), {len(shards):,} rows")
    print(f"micro-batch slots/s: {slots / elapsed:,.0f}   real examples/s: {real / elapsed:,.0f}   ({slots} slots in {elapsed:.2f} s)")
    return slots / elapsed


def measure_training(train_steps: int) -> dict[str, float]:
    import keras
    import keras_hub

    import tf_megadp
    from _measure import time_per_call

    rng = np.random.default_rng(0)
    masks = int(np.ceil(0.15 * LENGTH))
    x = {
        "token_ids": rng.integers(5, VOCAB, (MICRO_BATCH, LENGTH)).astype("int32"),
        "segment_ids": np.zeros((MICRO_BATCH, LENGTH), "int32"),
        "padding_mask": np.ones((MICRO_BATCH, LENGTH), bool),
        "mask_positions": np.sort(rng.integers(1, LENGTH - 1, (MICRO_BATCH, masks)), axis=1).astype("int32"),
    }
    y = rng.integers(5, VOCAB, (MICRO_BATCH, masks)).astype("int32")
    w = np.ones((MICRO_BATCH, masks), "float32")

    def model():
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=128, intermediate_dim=512, max_sequence_length=LENGTH
        )
        return keras_hub.models.BertMaskedLM(backbone, preprocessor=None)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = {}
    private = tf_megadp.make_private(model())
    private.compile(
        optimizer=tf_megadp.DPOptimizer(keras.optimizers.Adam(1e-3), l2_norm_clip=1.0, noise_multiplier=1.0, accumulation_steps=4, seed=0),
        loss=loss,
    )
    seconds = time_per_call(lambda: private.train_on_batch(x, y, sample_weight=w), warmup=2, repeats=train_steps)
    results["dp"] = MICRO_BATCH / seconds
    plain = model()
    # XLA, like the DP step's per-example pass; Keras's "auto" means no XLA on CPU.
    plain.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=True)
    seconds = time_per_call(lambda: plain.train_on_batch(x, y, sample_weight=w), warmup=2, repeats=train_steps)
    results["plain"] = MICRO_BATCH / seconds
    print(f"\n== Training step, tiny BertMaskedLM (2 layers, hidden 128, 2 heads, seq {LENGTH}, micro-batch {MICRO_BATCH})")
    print(f"DP step (tf_megadp): {results['dp']:,.0f} examples/s   plain Keras step: {results['plain']:,.0f} examples/s")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=4096, help="expected logical batch (default 4096)")
    parser.add_argument("--steps", type=int, default=50, help="logical steps sampled per measurement")
    parser.add_argument("--pipeline-rows", type=int, default=100_000)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--large-rows", type=int, default=10_000_000)
    parser.add_argument("--small-rows", type=int, default=10_000)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--only-memory", action="store_true")
    args = parser.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child, args.batch, args.steps)
        return
    if args.only_memory:
        measure_memory(args.batch, args.steps, [args.large_rows, args.small_rows])
        return
    directory = tempfile.mkdtemp(prefix="tf_megadp_bench_")
    try:
        synthetic_shards(directory, args.pipeline_rows)
        supply = measure_pipeline(directory, min(args.batch, args.pipeline_rows // 2), 10)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    demand = measure_training(args.train_steps)
    print(f"\npipeline / DP step consumption: {supply / demand['dp']:.1f}x   pipeline / plain step: {supply / demand['plain']:.1f}x")
    if not args.skip_memory:
        measure_memory(args.batch, args.steps, [args.large_rows, args.small_rows])


if __name__ == "__main__":
    main()
