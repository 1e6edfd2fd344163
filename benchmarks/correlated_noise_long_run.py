"""Where correlated noise is meant to pay: DP-SGD, BandMF, BLT and lambda-CGD at equal epsilon on a long run.

Matrix-factorization noise cancels part of the noise of earlier steps in
the model's sum of updates, so it pays on runs of many steps and few
epochs, at moderate or large epsilon (where amplification by sampling,
which only DP-SGD and cyclic BandMF get, matters least). The BERT job is
too slow on a CPU for thousands of steps (benchmarks/correlated_noise_utility.py
runs it for 50), so this study takes a task that is: a synthetic binary
classification (N examples of dimension 32, labels from a random
two-layer teacher with label noise), a one-hidden-layer MLP, SGD with
momentum, the same steps, batch and learning rate for every mechanism.
Each mechanism's noise multiplier is calibrated to the same (epsilon,
delta) over its own sampler (`tf_megadp.make_private_with_epsilon`):

- DP-SGD: independent noise, Poisson sampling;
- BandMF: cyclic Poisson (cycle = b), b chosen by `BandMF.for_run` at the
  budget (issue 50: b = 1, DP-SGD itself, is a candidate), or --bands;
- BLT (d = --buffers): fixed-order epochs, no amplification;
- lambda-CGD: fixed-order epochs, no amplification, no buffer; lambda
  the one of least prefix-sum error for the participation (--lam auto) or
  given.

Each (mechanism, seed) trains once; the seed fixes the model's
initialization and the sampler's draws (seeded samplers: not for release);
the noise key comes from OS entropy, so a rerun draws other noise. Prints per run sigma,
the ledger's epsilon, the held-out accuracy and loss, and per mechanism
the mean with the standard error over seeds, and the machine's load beside
each timing: the machine may be shared, so times are indications only.

    python benchmarks/correlated_noise_long_run.py                        # 3 seeds
    python benchmarks/correlated_noise_long_run.py --seeds 0 --epochs 1   # a quick look
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from scipy import optimize  # noqa: E402

import tf_megadp  # noqa: E402
from tf_megadp.accounting import matrix_factorization as mf  # noqa: E402
from step_overhead import load_average  # noqa: E402

DIMENSION = 32


def make_data(num_train: int, num_test: int, seed: int = 1234):
    """(x_train, y_train, x_test, y_test): a random two-layer teacher's labels, 10 % flipped."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_train + num_test, DIMENSION)).astype("float32")
    hidden = np.tanh(x @ rng.standard_normal((DIMENSION, 16)) / math.sqrt(DIMENSION))
    score = hidden @ rng.standard_normal(16)
    y = (score > np.median(score)).astype("int32")
    flip = rng.random(y.shape) < 0.1
    y = np.where(flip, 1 - y, y)
    return x[:num_train], y[:num_train], x[num_train:], y[num_train:]


def best_lambda(steps: int, epochs: int) -> float:
    """lambda-CGD's lambda of least prefix-sum RMSE for k epochs of s = n / k steps (fixed order)."""
    def rmse(lam):
        strategy = tf_megadp.LambdaCGD(lam).resolve(steps).column(steps)
        noise = np.zeros(steps)
        noise[0], noise[1] = 1.0, -lam
        sens = mf.minsep_sensitivity(strategy, steps, min_separation=-(-steps // epochs),
                                     max_participations=epochs)
        return sens.value * math.sqrt(mf.prefix_sum_mse(noise / math.sqrt(1 - lam ** 2)))

    return float(optimize.minimize_scalar(rmse, bounds=(0.0, 0.999), method="bounded").x)


def sampler_for(mechanism: str, x, y, args, seed: int):
    """The sampler the mechanism's accounting has a proof for, over the same schedule."""
    schedule = tf_megadp.BatchSizeSchedule.for_poisson(
        [(args.steps, args.batch_size)], num_examples=len(x), micro_batch_size=args.micro_batch)
    if mechanism in ("blt", "lambda_cgd"):
        # One batch size, one order: the schedule's phase with the same capacity.
        return tf_megadp.FixedOrderSampler.from_arrays(x, y, schedule=schedule, seed=seed)
    cycle = args.chosen_bands if mechanism == "bandmf" else 1
    return tf_megadp.PoissonSampler.from_arrays(x, y, schedule=schedule, cycle_length=cycle,
                                                seed=seed)


def noise_for(mechanism: str, args):
    return {"dpsgd": None, "bandmf": tf_megadp.BandMF(args.chosen_bands),
            "blt": tf_megadp.BLT(args.buffers),
            "lambda_cgd": tf_megadp.LambdaCGD(args.chosen_lambda)}[mechanism]


def run(mechanism: str, seed: int, data, args) -> dict:
    x, y, x_test, y_test = data
    sampler = sampler_for(mechanism, x, y, args, seed)
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((DIMENSION,)), keras.layers.Dense(64, "relu"),
                              keras.layers.Dense(2)])
    started = time.perf_counter()
    model = tf_megadp.make_private_with_epsilon(
        model, keras.optimizers.SGD(args.learning_rate, momentum=0.9), sampler,
        target_epsilon=args.target_epsilon, delta=args.delta, l2_norm_clip=1.0,
        accountant=args.accountant, noise=noise_for(mechanism, args), clipping="ghost",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_categorical_accuracy"])
    privacy = tf_megadp.PrivacyCallback(delta=args.delta, accountant=args.accountant)
    model.fit(sampler.as_dataset(), callbacks=[privacy], verbose=0)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
    result = {"mechanism": mechanism, "seed": seed, "sigma": model.optimizer.noise_multiplier,
              "steps": model.optimizer.logical_step, "accuracy": float(accuracy),
              "loss": float(loss), "epsilon": float(privacy.epsilon),
              "seconds": time.perf_counter() - started, "load": load_average()}
    print(f"{mechanism:10} seed {seed}  sigma {result['sigma']:8.4f}  steps {result['steps']:5d}  "
          f"epsilon {result['epsilon']:.3f}  test accuracy {accuracy:.4f}  loss {loss:.4f}  "
          f"{result['seconds']:.0f} s at load {result['load']:.2f}", flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--mechanisms", default="dpsgd,bandmf,blt,lambda_cgd")
    parser.add_argument("--num-train", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=100,
                        help="static rows of a Poisson step (B plus room for its variation)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--bands", default="auto", help="BandMF's bands, or auto (for_run)")
    parser.add_argument("--buffers", type=int, default=4, help="BLT's buffers")
    parser.add_argument("--lam", default="auto", help="lambda-CGD's lambda, or auto")
    parser.add_argument("--accountant", default="pld")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # seeded samplers and noise: once per run

    data = make_data(args.num_train, 5_000)
    args.steps = tf_megadp.accounting.steps_for_epochs(
        args.epochs, num_examples=args.num_train, batch_size=args.batch_size)
    epochs = math.ceil(args.epochs)
    args.chosen_bands = (tf_megadp.BandMF.for_run(
        num_examples=args.num_train, batch_size=args.batch_size, steps=args.steps,
        target_epsilon=args.target_epsilon, delta=args.delta).num_bands
        if args.bands == "auto" else int(args.bands))
    args.chosen_lambda = (best_lambda(args.steps, epochs) if args.lam == "auto"
                          else float(args.lam))
    commit = subprocess.run(["git", "log", "--oneline", "-1"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"commit: {commit}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; N = {args.num_train}, "
          f"B = {args.batch_size}, {args.steps} steps ({args.epochs:g} epochs); epsilon "
          f"{args.target_epsilon} at delta {args.delta:g} ({args.accountant}); SGD lr "
          f"{args.learning_rate} momentum 0.9; BandMF b = {args.chosen_bands} ({args.bands}), "
          f"BLT d = {args.buffers}, lambda-CGD lambda = {args.chosen_lambda:.4f} ({args.lam}); "
          f"load {load_average():.2f}", flush=True)
    mechanisms = args.mechanisms.split(",")
    results = [run(mechanism, int(seed), data, args)
               for seed in args.seeds.split(",") for mechanism in mechanisms]
    print(f"\n| mechanism | sigma | epsilon (ledger) | test accuracy, mean +- s.e. "
          f"({len(args.seeds.split(','))} seeds) | test loss, mean +- s.e. |")
    print("|---|---:|---:|---:|---:|")
    for mechanism in mechanisms:
        rows = [r for r in results if r["mechanism"] == mechanism]
        accuracy = np.array([r["accuracy"] for r in rows])
        loss = np.array([r["loss"] for r in rows])
        error = (lambda v: v.std(ddof=1) / math.sqrt(v.size) if v.size > 1 else float("nan"))
        print(f"| {mechanism} | {rows[0]['sigma']:.4f} | {max(r['epsilon'] for r in rows):.3f} | "
              f"{accuracy.mean():.4f} +- {error(accuracy):.4f} | "
              f"{loss.mean():.4f} +- {error(loss):.4f} |")
    print("uptime: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
