"""Held-out MLM accuracy of DP-SGD, BandMF, BLT and lambda-CGD at equal epsilon on the job's default corpus.

The BERT job's data and model (`tf_megadp.jobs.bert`: the offline default
corpus of docstrings, its public vocabulary, the "nano" BertMaskedLM, the
job's masking and held-out split), trained by `fit` with each mechanism's
noise multiplier calibrated to the same (epsilon, delta) over its own
sampler (`tf_megadp.make_private_with_epsilon`):

- DP-SGD: independent noise, Poisson sampling (q = B / N);
- `BandMF(num_bands=b)`: cyclic Poisson sampling with cycle_length = b;
- `BLT(num_buffers=d)`: fixed-order epochs (no amplification);
- `LambdaCGD(lam)` (with --mechanisms ...,lambda_cgd): fixed-order epochs,
  no buffer.

A long run where correlated noise is meant to pay is
benchmarks/correlated_noise_long_run.py (this job is too slow on a CPU for
thousands of steps).

The same steps, batch and AdamW for all (the job's defaults otherwise), a
few model-initialisation seeds each. Prints sigma, the held-out masked-token
accuracy (on the job's fixed held-out masks) and the epsilon each ledger
reports, then the mean per mechanism. Every row prints the load average.

    python benchmarks/correlated_noise_utility.py                     # 3 seeds, 120 steps
    python benchmarks/correlated_noise_utility.py --seeds 0 --steps 40   # a quick look
    python benchmarks/correlated_noise_utility.py --plot docs/correlated_noise_utility.png
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_megadp  # noqa: E402
from step_overhead import load_average  # noqa: E402
from tf_megadp.jobs.bert.config import PretrainConfig  # noqa: E402
from tf_megadp.jobs.common.privacy import default_delta  # noqa: E402
from tf_megadp.jobs.bert.masking import MaskedLMBatcher  # noqa: E402
from tf_megadp.jobs.bert.prepare import prepare_data  # noqa: E402
from tf_megadp.jobs.bert.training import (  # noqa: E402
    build_model, masked_rows, unigram_accuracy)


def _sampler(mechanism, train, args):
    """The job's token shards drawn as the mechanism's accounting needs them."""
    n, batch, m = len(train), args.batch_size, args.micro_batch_size
    if mechanism in ("blt", "lambda_cgd"):
        schedule = tf_megadp.BatchSizeSchedule(
            [tf_megadp.Phase(args.steps, batch, -(-batch // m))], num_examples=n,
            micro_batch_size=m)
        return tf_megadp.FixedOrderSampler(train, schedule)
    schedule = tf_megadp.BatchSizeSchedule.for_poisson([(args.steps, batch)], num_examples=n,
                                                       micro_batch_size=m)
    return tf_megadp.PoissonSampler(train, schedule,
                                    cycle_length=args.bands if mechanism == "bandmf" else 1)


def run(mechanism, seed, data, args) -> dict:
    train, heldout_x, heldout_y, heldout_w, vocabulary_size, config, delta = data
    noise = {"dpsgd": None, "bandmf": tf_megadp.BandMF(num_bands=args.bands),
             "blt": tf_megadp.BLT(num_buffers=args.buffers),
             "lambda_cgd": tf_megadp.LambdaCGD(args.lam)}[mechanism]
    sampler = _sampler(mechanism, train, args)
    keras.utils.set_random_seed(seed)
    model = build_model(config, vocabulary_size)
    batcher = MaskedLMBatcher(vocabulary_size, config.sequence_length)
    learning_rate = config.learning_rate_choice()[0] if args.learning_rate is None else (
        args.learning_rate)
    started = time.perf_counter()
    model = tf_megadp.make_private_with_epsilon(
        model, keras.optimizers.AdamW(learning_rate, weight_decay=config.weight_decay),
        sampler, target_epsilon=args.target_epsilon, delta=delta, l2_norm_clip=1.0,
        accountant=args.accountant, noise=noise,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"])
    privacy = tf_megadp.PrivacyCallback(delta=delta, accountant=args.accountant)
    # The job's masking turns each micro-batch of token rows into MLM inputs.
    model.fit(sampler.as_dataset(batcher), callbacks=[privacy], verbose=0)
    _, accuracy = model.evaluate(heldout_x, heldout_y, sample_weight=heldout_w,
                                 batch_size=args.micro_batch_size, verbose=0)
    result = {"mechanism": mechanism, "seed": seed, "sampling": sampler.source.sampling,
              "sigma": model.optimizer.noise_multiplier, "steps": model.optimizer.logical_step,
              "accuracy": float(accuracy), "epsilon": float(privacy.epsilon),
              "seconds": time.perf_counter() - started}
    print(f"{mechanism:7} seed {seed}  {result['sampling']:15} sigma {result['sigma']:7.3f}  "
          f"steps {result['steps']:4d}  held-out MLM accuracy {accuracy:.4f}  "
          f"epsilon {privacy.epsilon:.3f}  {result['seconds']:.0f} s  load {load_average():.2f}",
          flush=True)
    return result


def plot(results, path, title, unigram=None) -> None:
    """Held-out accuracy per mechanism: one point per seed, the mean as a bar; the unigram line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechanisms = list(dict.fromkeys(r["mechanism"] for r in results))
    figure, axis = plt.subplots(figsize=(4.8, 3.4))
    for index, mechanism in enumerate(mechanisms):
        accuracies = [r["accuracy"] for r in results if r["mechanism"] == mechanism]
        axis.bar(index, np.mean(accuracies), color="#c8d7e8", width=0.6)
        axis.plot([index] * len(accuracies), accuracies, "o", color="#1f4e79", ms=4)
    labels = {"dpsgd": "DP-SGD", "bandmf": "BandMF", "blt": "BLT", "lambda_cgd": "lambda-CGD"}
    axis.set_xticks(range(len(mechanisms)), [labels.get(m, m) for m in mechanisms])
    if unigram is not None:
        axis.axhline(unigram, color="gray", ls=":", label="unigram baseline")
        axis.legend(fontsize=7, loc="lower right")
    axis.set_ylabel("held-out MLM accuracy")
    axis.set_title(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--mechanisms", default="dpsgd,bandmf,blt")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--lam", type=float, default=0.9, help="lambda-CGD's lambda")
    parser.add_argument("--target-epsilon", type=float, default=5.36)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--accountant", default="pld")
    parser.add_argument("--cache-dir")
    parser.add_argument("--plot", metavar="PNG", help="save the accuracies as a plot here")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    config = PretrainConfig(cache_dir=args.cache_dir)
    _, train, heldout = prepare_data(config, log=None)
    vocabulary_size = train.vocabulary_size
    batcher = MaskedLMBatcher(vocabulary_size, config.sequence_length)
    heldout_x, heldout_y, heldout_w = masked_rows(
        heldout.read(np.arange(len(heldout))), batcher, config.seed)
    delta = default_delta(len(train))
    unigram = unigram_accuracy(train, heldout_y, heldout_w, vocabulary_size)
    commit = subprocess.run(["git", "log", "--oneline", "-1"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"commit: {commit}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; N = {len(train)} train, "
          f"{len(heldout)} held-out sequences of {config.sequence_length}, V = {vocabulary_size}, "
          f"model {config.model}; B = {args.batch_size}, m = {args.micro_batch_size}, "
          f"{args.steps} steps; epsilon {args.target_epsilon} at delta {delta:.3g} "
          f"({args.accountant}); BandMF b = {args.bands} (cycle {args.bands}), "
          f"BLT d = {args.buffers}; unigram baseline accuracy {unigram:.4f}")
    data = (train, heldout_x, heldout_y, heldout_w, vocabulary_size, config, delta)
    results = [run(mechanism, int(seed), data, args)
               for seed in args.seeds.split(",") for mechanism in args.mechanisms.split(",")]
    for mechanism in args.mechanisms.split(","):
        accuracies = [r["accuracy"] for r in results if r["mechanism"] == mechanism]
        print(f"{mechanism:7} mean held-out accuracy {np.mean(accuracies):.4f} "
              f"(+- {np.std(accuracies):.4f} over {len(accuracies)} seeds)")
    print("uptime: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.plot:
        plot(results, args.plot,
             f"nano BERT, default corpus, epsilon {args.target_epsilon}\n{args.steps} steps of "
             f"B = {args.batch_size}; BandMF b = {args.bands}, BLT d = {args.buffers}",
             unigram)


if __name__ == "__main__":
    main()
