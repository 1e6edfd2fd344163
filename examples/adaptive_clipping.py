"""Adaptive clipping: a clip norm that finds itself, within the same epsilon.

Trains the quickstart's classifier (scikit-learn's handwritten digits, shipped
with scikit-learn: nothing is downloaded) on Poisson-sampled batches with
`DPOptimizer(..., adaptive_clipping=tf_megadp.AdaptiveClipping())`: C starts
at 0.01, far below the per-example gradient norms, and moves after every
logical step towards their median (Andrew et al., NeurIPS 2021). The count
that steers C is noised and paid from the same noise multiplier, so epsilon
is the one of sigma. Prints C's trajectory, the test accuracy and
(epsilon, delta).

    python examples/adaptive_clipping.py
    python examples/adaptive_clipping.py --epochs 2 --batch-size 128   # quicker
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_megadp  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--batch-size", type=int, default=256, help="expected logical batch B")
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--initial-clip-norm", type=float, default=0.01)
    parser.add_argument("--target-quantile", type=float, default=0.5)
    parser.add_argument("--noise-multiplier", type=float, default=1.3)
    args = parser.parse_args(argv)

    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels.astype("int32"), test_size=0.25, random_state=0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
        micro_batch_size=args.micro_batch_size)
    model = tf_megadp.make_private(model)
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-2),
        l2_norm_clip=args.initial_clip_norm,  # the initial C
        noise_multiplier=args.noise_multiplier,
        schedule=sampler.schedule,
        # The count's noise defaults to B / 20 (B / 10 > sigma is needed).
        adaptive_clipping=tf_megadp.AdaptiveClipping(target_quantile=args.target_quantile),
    )
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    privacy = tf_megadp.PrivacyCallback(delta=1e-5)
    model.fit(sampler.as_dataset(), callbacks=[privacy], shuffle=False, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)

    report = privacy.report()
    trajectory = report["settings"]["adaptive_clipping"]["trajectory"]
    shown = trajectory[:: max(1, len(trajectory) // 8)] + trajectory[-1:]
    print("C after logical step: " + ", ".join(f"{step}: {clip:.3g}" for step, clip in shown))
    entry = report["ledger"][0]
    print(f"noise multipliers per step: gradient {entry['noise_multiplier']:.4f}, count "
          f"{entry['count_noise_multiplier']:.4f}; together sigma = {args.noise_multiplier}")
    print(f"test accuracy {accuracy:.3f} at epsilon {privacy.epsilon:.2f}, delta 1e-5 "
          f"({sampler.schedule.total_steps} Poisson-sampled logical steps)")
    return {"accuracy": float(accuracy), "epsilon": float(privacy.epsilon), "report": report}


if __name__ == "__main__":
    main()
