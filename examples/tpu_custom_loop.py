"""DP training in a TPU-style custom loop: `strategy.run` of a `tf_megadp.PrivateStep`.

The shape of most TPU pretraining scripts: one `tf.function` runs several
micro-steps (`for _ in tf.range(n)`) on every replica through
`strategy.run`, and the host loops over those calls. Here each call runs
the micro-steps of one logical step, so the privacy budget is checked at
every logical-step boundary. The same script runs on a TPU VM or pod slice,
several GPUs, several workers (`MultiWorkerMirroredStrategy`, one process
per worker with its `TF_CONFIG`), or CPU replicas:

    python examples/tpu_custom_loop.py --strategy mirrored --cpu-replicas 2   # CPU (tested)
    python examples/tpu_custom_loop.py --strategy tpu --tpu local             # a TPU VM (not run here)
    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/tpu_custom_loop.py --strategy multiworker             # on every worker

Every worker draws the same Poisson steps from one secret the chief draws
(`tf_megadp.distribute.shared_sampling_secret`, passed through the
strategy's all-reduce, never a file) and keeps its replicas' rows of them;
every replica clips its own examples; noise is added once per logical step.
The data is generated (a noisy linear teacher), the same on every worker.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_megadp  # noqa: E402
from tf_megadp import distribute  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=distribute.STRATEGIES, default="default")
    parser.add_argument("--tpu", default=None, help="TPU name, or 'local' on a TPU VM")
    parser.add_argument("--cpu-replicas", type=int, default=None,
                        help="split the CPU into R replicas (mirrored strategy)")
    parser.add_argument("--examples", type=int, default=50_000, help="N, generated")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4096, help="expected logical batch B")
    parser.add_argument("--micro-batch-size", type=int, default=128, help="m, per replica")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--target-epsilon", type=float, default=None)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save every logical step (the chief's files); resume from it")
    return parser.parse_args(argv)


def resolve(args):
    if args.cpu_replicas:
        distribute.configure_cpu_replicas(args.cpu_replicas)
        return distribute.resolve_strategy(
            "mirrored", devices=[f"/cpu:{i}" for i in range(args.cpu_replicas)])
    return distribute.resolve_strategy(args.strategy, tpu=args.tpu)


def main(argv=None, strategy=None):
    """Trains; returns the run's numbers. `strategy`: run under this one instead of the flags'."""
    args = parse_args(argv)
    strategy = strategy or resolve(args)
    replicas = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)  # Public, generated data: the same on every worker.
    teacher = rng.normal(size=(args.features, args.classes))
    x = rng.normal(size=(args.examples + 4_000, args.features)).astype("float32")
    y = np.argmax(x @ teacher + rng.normal(size=(len(x), args.classes)), axis=1).astype("int32")
    (x, y), (x_test, y_test) = (x[:args.examples], y[:args.examples]), (x[args.examples:],
                                                                       y[args.examples:])
    schedule = tf_megadp.PoissonSampler.from_arrays(
        x, y, batch_size=args.batch_size, epochs=args.epochs,
        micro_batch_size=args.micro_batch_size, num_replicas=replicas).schedule

    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((args.features,)),
            keras.layers.Dense(args.hidden, activation="gelu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(args.classes),
        ])
        step = tf_megadp.PrivateStep(
            model,
            tf_megadp.DPOptimizer(keras.optimizers.AdamW(args.learning_rate),
                                  l2_norm_clip=args.l2_norm_clip,
                                  noise_multiplier=args.noise_multiplier, schedule=schedule),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    manager = None
    if args.checkpoint_dir:
        # Every worker writes (reading distributed variables may need all of
        # them); only the chief's files are kept.
        directory = args.checkpoint_dir if distribute.is_chief(strategy) else tempfile.mkdtemp()
        manager = tf.train.CheckpointManager(step.checkpoint(), directory, max_to_keep=2)
        if manager.restore_or_initialize():
            print(f"resumed at logical step {step.logical_step}")

    # One secret for the whole cluster, drawn by the chief; never written anywhere.
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, y, schedule=schedule, start_step=step.logical_step,
        shared_secret=distribute.shared_sampling_secret(strategy))
    micro_steps = sampler.as_dataset(tagged=True)
    data = distribute.distribute_micro_batches(strategy, lambda context: micro_steps)
    step.begin(data)
    privacy = tf_megadp.PrivacyReport(step, delta=args.delta, target_epsilon=args.target_epsilon)

    @tf.function
    def train(iterator, micro_steps):
        logs = step.run(next(iterator))
        for _ in tf.range(micro_steps - 1):
            logs = step.run(next(iterator))
        return logs

    iterator = iter(data)
    while step.logical_step < schedule.total_steps:
        k = schedule.phase_at(step.logical_step).accumulation_steps
        model.reset_metrics()  # The logs' loss: this logical step's mean.
        logs = train(iterator, tf.constant(k))  # One logical step.
        if manager is not None:
            manager.save(checkpoint_number=step.logical_step)
        if step.logical_step % 10 == 0 or step.logical_step == schedule.total_steps:
            print(f"step {step.logical_step}: loss {float(logs['loss']):.3f}, "
                  f"epsilon {privacy.epsilon:.3f}")
        if not privacy.within_budget():
            print(f"stopping: one more step would exceed epsilon {args.target_epsilon}")
            break

    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    epsilon = privacy.epsilon
    print(f"{replicas} replicas: test accuracy {accuracy:.3f} at epsilon {epsilon:.3f}, "
          f"delta {args.delta:g} ({step.logical_step} logical steps)")
    return {"replicas": replicas, "logical_steps": step.logical_step, "epsilon": epsilon,
            "accuracy": accuracy, "schedule": schedule.to_dict(),
            "weights": [v.numpy().tolist() for v in model.trainable_variables]}


if __name__ == "__main__":
    main()
