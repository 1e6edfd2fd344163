"""User-level privacy: epsilon for each USER, however many examples they wrote.

The data is generated here: users write a skewed number of examples (a few
write hundreds, most write a handful), and each user's examples share a
personal offset, as one person's messages share a style. The run
Poisson-samples users (`tf_megadp.PrivacyUnitSampler`), takes at most
`--examples-per-unit` examples of each sampled user, and clips each user's
summed gradient (`DPOptimizer(examples_per_unit=...)`), so the reported
epsilon bounds what one user risks. For contrast, it prints what the same
noise would report per example, and what that per-example guarantee gives
the most prolific user by group privacy.

    python examples/user_level.py
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_megadp  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=2_000)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--examples-per-unit", type=int, default=4,
                        help="k: the most examples of one user in a logical step")
    parser.add_argument("--batch-size", type=int, default=200,
                        help="expected USERS per logical step")
    parser.add_argument("--micro-batch-size", type=int, default=50, help="user slots")
    parser.add_argument("--epochs", type=float, default=5, help="passes over the users")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    return parser.parse_args(argv)


def generated_users(users: int, features: int, seed: int = 0):
    """(x, y, user of each example): Zipf-like example counts, a personal offset per user."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.zipf(1.8, users), 300)
    user = np.repeat(np.arange(users), counts)
    teacher = rng.normal(size=(features, 3))
    offsets = rng.normal(scale=0.5, size=(users, features))
    x = (rng.normal(size=(user.size, features)) + offsets[user]).astype("float32")
    y = np.argmax(x @ teacher + rng.normal(scale=0.5, size=(user.size, 3)), axis=1)
    return x, y.astype("int32"), user


def main(argv=None) -> dict:
    args = parse_args(argv)
    x, y, user = generated_users(args.users + args.users // 4, args.features)
    # Held-out USERS: whole people the model never saw.
    train = user < args.users
    keras.utils.set_random_seed(0)
    sampler = tf_megadp.PrivacyUnitSampler.from_arrays(
        x[train], y[train], unit_ids=user[train], examples_per_unit=args.examples_per_unit,
        privacy_unit="user", batch_size=args.batch_size, epochs=args.epochs,
        micro_batch_size=args.micro_batch_size)
    model = tf_megadp.make_private(keras.Sequential([
        keras.Input((args.features,)), keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.Adam(1e-2), l2_norm_clip=1.0,
            noise_multiplier=args.noise_multiplier, schedule=sampler.schedule,
            examples_per_unit=sampler.examples_per_unit),  # clip each user's sum
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"])
    privacy = tf_megadp.PrivacyCallback(delta=args.delta)
    model.fit(sampler.as_dataset(), callbacks=[privacy], shuffle=False, verbose=0)
    _, accuracy = model.evaluate(x[~train], y[~train], verbose=0)

    # The same noise and steps with the example as the unit: q = B_examples / N_examples.
    sizes = sampler.unit_sizes()
    examples = int(train.sum())
    expected_rows = args.batch_size * float(np.mean(np.minimum(sizes, args.examples_per_unit)))
    per_example = tf_megadp.compute_epsilon(
        num_examples=examples, batch_size=max(1, round(expected_rows)),
        steps=sampler.schedule.total_steps, noise_multiplier=args.noise_multiplier,
        delta=args.delta)
    largest = int(sizes.max())
    report = privacy.report()
    print(f"{sampler.num_units:,} users wrote {examples:,} examples (the most prolific: "
          f"{largest}); at most {args.examples_per_unit} per user and step "
          f"({sampler.capped_examples:,} example draws left out by the cap).")
    print(f"held-out users' accuracy {accuracy:.3f}; epsilon per {report['privacy_unit']} "
          f"{privacy.epsilon:.2f} at delta {args.delta:g}.")
    print(f"Per example, the same noise would report epsilon {per_example:.2f}: for a "
          f"user of {largest} examples, group privacy gives only "
          f"{largest * per_example:.1f}.")
    return {"epsilon": privacy.epsilon, "accuracy": float(accuracy), "report": report,
            "per_example_epsilon": per_example, "group_epsilon": largest * per_example,
            "users": sampler.num_units}


if __name__ == "__main__":
    main()
