"""A differentially private classifier trained by your own loop, not `model.fit`.

The loop is the TensorFlow custom-training-loop pattern: a `tf.function`
called once per micro-batch. `tf_megadp.PrivateStep` is the step it calls:
each example's gradient is clipped, the clipped sums of a logical step are
accumulated, and Gaussian noise is added once per logical step, exactly as
the private `fit` does. `tf_megadp.PrivacyReport` gives epsilon and the
budget check; `step.checkpoint()` saves and resumes the run with its privacy
ledger (never the noise key nor an un-noised sum).

The data is generated here (a noisy linear teacher); batches are honest
Poisson draws from secret OS entropy, and N is measured from the arrays.

    python examples/custom_loop.py
    python examples/custom_loop.py --checkpoint-dir run --stop-after-steps 20   # then again without
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=20_000, help="N, generated")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1024, help="expected logical batch B")
    parser.add_argument("--micro-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--target-epsilon", type=float, default=None,
                        help="stop before a step would spend more")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save here every --checkpoint-every steps; resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="stop after this many logical steps (to try resuming)")
    return parser.parse_args(argv)


def make_data(args):
    rng = np.random.default_rng(0)  # Public, generated data: the seed is not a secret.
    teacher = rng.normal(size=(args.features, args.classes))
    x = rng.normal(size=(args.examples + 2_000, args.features)).astype("float32")
    y = np.argmax(x @ teacher + rng.normal(size=(len(x), args.classes)), axis=1).astype("int32")
    return (x[:args.examples], y[:args.examples]), (x[args.examples:], y[args.examples:])


def main(argv=None):
    args = parse_args(argv)
    (x, y), (x_test, y_test) = make_data(args)
    # The schedule of the whole run: B, k micro-batches per logical step, N.
    schedule = tf_megadp.PoissonSampler.from_arrays(
        x, y, batch_size=args.batch_size, epochs=args.epochs,
        micro_batch_size=args.micro_batch_size).schedule

    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((args.features,)),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(args.classes),
    ])
    step = tf_megadp.PrivateStep(
        model,
        tf_megadp.DPOptimizer(keras.optimizers.Adam(args.learning_rate),
                              l2_norm_clip=args.l2_norm_clip,
                              noise_multiplier=args.noise_multiplier, schedule=schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    manager = None
    if args.checkpoint_dir:
        # Weights, optimizer state and privacy ledger; never the noise key.
        manager = tf.train.CheckpointManager(step.checkpoint(), args.checkpoint_dir,
                                             max_to_keep=2)
        if manager.restore_or_initialize():
            print(f"resumed at logical step {step.logical_step}")

    # Fresh secret draws from the step the run is at.
    end_step = schedule.total_steps
    if args.stop_after_steps:
        end_step = min(end_step, step.logical_step + args.stop_after_steps)
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, y, schedule=schedule, start_step=step.logical_step, end_step=end_step)
    step.begin(sampler)  # Checks the sampler against the optimizer; starts the ledger.
    privacy = tf_megadp.PrivacyReport(step, delta=args.delta,
                                      target_epsilon=args.target_epsilon)

    @tf.function
    def train(batch):
        return step.run(batch)

    for batch in sampler.as_dataset(tagged=True):
        logs = train(batch)
        if not logs["applied"]:
            continue  # Mid logical step: nothing was released.
        logical_step = int(logs["logical_step"])
        if manager is not None and logical_step % args.checkpoint_every == 0:
            manager.save(checkpoint_number=logical_step)
        if logical_step % 10 == 0:
            print(f"step {logical_step}: loss {float(logs['loss']):.3f}, "
                  f"epsilon {privacy.epsilon:.3f}")
            model.reset_metrics()  # The loss printed is the mean since the last print.
        if not privacy.within_budget():
            print(f"stopping: one more step would exceed epsilon {args.target_epsilon}")
            break
    if manager is not None:
        manager.save(checkpoint_number=step.logical_step)

    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    epsilon = privacy.epsilon
    print(f"test accuracy {accuracy:.3f} at epsilon {epsilon:.3f}, delta {args.delta:g} "
          f"({step.logical_step} of {schedule.total_steps} Poisson-sampled logical steps)")
    return {"logical_steps": step.logical_step, "epsilon": epsilon, "accuracy": accuracy,
            "report": privacy.report()}


if __name__ == "__main__":
    main()
