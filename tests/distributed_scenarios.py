"""Multi-replica scenarios for tests/test_distribute.py, run in fresh processes.

TensorFlow fixes its logical devices (and a process's cluster role) when it
first initialises, so every scenario set runs in its own interpreter:

    python tests/distributed_scenarios.py replicas R OUT.json
    python tests/distributed_scenarios.py worker INDEX PORT0,PORT1 OUT.json

    python tests/distributed_scenarios.py job_worker INDEX PORT0,PORT1 OUT.json   (slow test)
    python tests/distributed_scenarios.py job R OUT.json
    python tests/distributed_scenarios.py job_resumed R OUT.json                  (slow test)
    python tests/distributed_scenarios.py private_resume R OUT.json               (slow test)

Each writes its measurements as JSON; the assertions live in the test file.
The data, models and single-device runs are defined here once so that the
test process can reproduce the single-process side of every comparison.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from tf_megadp.files import write_json_atomically  # noqa: E402

MICRO_BATCH = 3        # m, per replica
ACCUMULATION = 2       # k
LOGICAL_STEPS = 3
CLIP = 0.8
NOISE_WIDTH = 50_000   # output units of the noise model: 250_000 coordinates
NOISE_SIGMA = 1.3
NOISE_CLIP = 0.7


def dense_data(replicas, steps=LOGICAL_STEPS, seed=0):
    n = MICRO_BATCH * ACCUMULATION * replicas * steps
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 6)) * 2).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    w = np.ones(n, "float32")
    w[::5] = 0.0  # padding slots, as in a Poisson step padded to capacity
    x[7] = np.inf  # one real example with a non-finite gradient: dropped, counted
    return x, y, w


def dense_model(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="tanh"),
        keras.layers.Dense(3),
    ])


def compiled(model, *, noise_multiplier=0.0, clip=CLIP, learning_rate=0.5,
             momentum=0.9, accumulation=ACCUMULATION, seed=0, clipping="vectorized",
             jit_compile="auto"):
    import warnings

    import keras

    import tf_megadp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DPOptimizer with noise_multiplier=0")
        optimizer = tf_megadp.DPOptimizer(
            keras.optimizers.SGD(learning_rate, momentum=momentum),
            l2_norm_clip=clip, noise_multiplier=noise_multiplier,
            accumulation_steps=accumulation, seed=seed, clipping=clipping,
        )
    # The scenarios check that the count is global, so they log it (off by
    # default: it is a statistic outside epsilon).
    tf_megadp.make_private(model, log_nonfinite_examples=True)
    model.compile(
        optimizer=optimizer,
        loss=__import__("keras").losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def single_device_weights(replicas):
    """The reference run: one device, micro-batches of m * R, same logical steps."""
    import tensorflow as tf

    x, y, w = dense_data(replicas)
    model = compiled(dense_model())
    model.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(MICRO_BATCH * replicas),
              epochs=1, verbose=0)
    return [v.numpy() for v in model.trainable_variables]


def global_micro_batches(x, y, w):
    """Micro-steps of m * R rows, as the Poisson sampler emits them."""
    import tensorflow as tf

    def make(context):
        return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(
            MICRO_BATCH * context.num_replicas_in_sync, drop_remainder=True)

    return make


def local_values(strategy, variable):
    return [np.asarray(v) for v in strategy.experimental_local_results(variable.value)]


def replicas_identical(strategy, variables):
    for variable in variables:
        values = local_values(strategy, variable)
        if not all(np.array_equal(values[0], v) for v in values[1:]):
            return False
    return True


# -- Scenario sets ---------------------------------------------------------------


def run_private_step(step, strategy, data, micro_steps, chief_saves_to=None):
    """The user's custom loop: one tf.function call of `step.run` per micro-step.

    With `chief_saves_to`, the chief alone saves the training state there
    after the first logical step, as the job's checkpoints do under several
    workers: the save records the step's ledger first, on the chief only.
    """
    import tensorflow as tf

    import tf_megadp
    from tf_megadp import distribute

    train = tf.function(lambda iterator: step.run(next(iterator)))
    iterator = iter(data)
    logs = {}
    for micro_step in range(micro_steps):
        logs = train(iterator)
        if (chief_saves_to and micro_step == ACCUMULATION - 1
                and distribute.is_chief(strategy)):
            tf_megadp.save_training_state(step.model, chief_saves_to,
                                          extra={"logical_steps": step.logical_step})
    step.record()
    return {name: np.asarray(value).item() for name, value in logs.items()}


def accumulators_of(optimizer):
    """The DPOptimizer's in-memory accumulators (never saved, so only read live)."""
    return optimizer.accumulation_stage.state.accumulators


def at_first_micro_step(strategy, save_path=None):
    """A callback that, after micro-step 1 of logical step 1, reads the accumulators.

    It keeps their cross-replica value (the sum over replicas) and replica
    0's and 1's own values of the last one, and, given `save_path`, writes a
    `save_weights` file there: a save in the middle of a logical step.
    """
    import keras

    class Probe(keras.callbacks.Callback):
        accumulators = per_replica = None

        def on_train_batch_end(self, batch, logs=None):
            if batch != 0:
                return
            optimizer = self.model.optimizer
            self.accumulators = [a.numpy().tolist() for a in accumulators_of(optimizer)]
            self.per_replica = local_values(strategy, accumulators_of(optimizer)[-1])
            if save_path is not None:
                self.model.save_weights(save_path)

    return Probe()


def equality_and_replica_checks(strategy, replicas, tmp_dir, result, checkpoint):
    """The whole run under the strategy and on one device, probed after micro-step 1.

    The same examples go through a single-device run with micro-batches of
    m * R; every comparison is against that run at the same point. A logical
    step never spans two `fit` calls, so the probe (and the mid-step save)
    happens inside the one `fit`.
    """
    import tensorflow as tf

    from tf_megadp import distribute

    x, y, w = dense_data(replicas)
    initial = [v.numpy() for v in dense_model().trainable_variables]
    slots = MICRO_BATCH * replicas
    path = os.path.join(tmp_dir, f"mid_step_{replicas}.weights.h5") if checkpoint else None

    with strategy.scope():
        model = compiled(dense_model())
    probe = at_first_micro_step(strategy, path)
    history = model.fit(
        distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w)),
        epochs=1, verbose=0, steps_per_epoch=ACCUMULATION * LOGICAL_STEPS, callbacks=[probe])
    single = compiled(dense_model())
    single_probe = at_first_micro_step(tf.distribute.get_strategy())
    single.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(slots), epochs=1, verbose=0,
               callbacks=[single_probe])

    # Each replica holds the clipped sum of ITS examples only; read in the
    # cross-replica context the accumulators hold their sum.
    accumulators = result["accumulators"] = {
        "single_device": single_probe.accumulators,
        "distributed": probe.accumulators,
    }
    result["replica_accumulators_differ"] = not all(
        np.allclose(probe.per_replica[0], p) for p in probe.per_replica[1:])

    if checkpoint:
        # The file saved in the middle of logical step 1, restored on a single
        # device and into a fresh model under the same strategy: the
        # un-noised partial sum must not come back.
        host = compiled(dense_model(seed=1))
        host.optimizer.build(host.trainable_variables)
        host.load_weights(path)
        accumulators["single_device_restored"] = [
            a.numpy().tolist() for a in accumulators_of(host.optimizer)]
        with strategy.scope():
            restored = compiled(dense_model(seed=1))
            restored.optimizer.build(restored.trainable_variables)
        restored.load_weights(path)
        result["restored_micro_steps"] = int(restored.optimizer.micro_steps.numpy())
        accumulators["restored"] = [
            a.numpy().tolist() for a in accumulators_of(restored.optimizer)]

    optimizer = model.optimizer
    result["logical_steps"] = int(optimizer.iterations.numpy())
    result["micro_steps"] = int(optimizer.micro_steps.numpy())
    result["loss"] = float(history.history["loss"][-1])
    result["nonfinite_logged"] = float(history.history["nonfinite_examples"][-1])
    result["nonfinite_counted"] = int(optimizer.nonfinite_examples.numpy())
    result["distributed_update"] = [
        (v.numpy() - i).tolist() for v, i in zip(model.trainable_variables, initial)]
    result["single_device_update"] = [
        (v.numpy() - i).tolist() for v, i in zip(single.trainable_variables, initial)]
    result["weights_identical_across_replicas"] = replicas_identical(
        strategy, list(model.trainable_variables) + list(optimizer.inner_optimizer.variables))


def custom_loop_checks(strategy, replicas, result):
    """A custom loop of `tf_megadp.PrivateStep` on the data of the equality checks (sigma 0).

    Compared in the test with the private fit under the same strategy and
    with the single-device fit.
    """
    import tf_megadp
    from tf_megadp import distribute

    x, y, w = dense_data(replicas)
    initial = [v.numpy() for v in dense_model().trainable_variables]
    with strategy.scope():
        model = compiled(dense_model())
        step = tf_megadp.PrivateStep(model)
    data = distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w))
    micro_steps = ACCUMULATION * LOGICAL_STEPS
    step.begin(data, num_examples=len(x), micro_batches_per_pass=micro_steps)
    logs = run_private_step(step, strategy, data, micro_steps)
    result["custom_loop"] = {
        "logical_steps": step.logical_step,
        "logs": {name: logs[name] for name in ("logical_step", "applied", "nonfinite_examples")},
        "update": [(v.numpy() - i).tolist() for v, i in zip(model.trainable_variables, initial)],
        "identical_across_replicas": replicas_identical(
            strategy, list(model.trainable_variables) + list(model.optimizer.inner_optimizer.variables)),
        "ledger": [[entry.sampling, entry.steps] for entry in tf_megadp.model_ledger(model)],
    }


def ghost_checks(strategy, replicas, result):
    """Ghost clipping: the distributed run equals its single-device run."""
    import tensorflow as tf

    from tf_megadp import distribute

    x, y, w = dense_data(replicas)
    initial = [v.numpy() for v in dense_model().trainable_variables]
    with strategy.scope():
        model = compiled(dense_model(), clipping="ghost")
    model.fit(distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w)),
              epochs=1, verbose=0, steps_per_epoch=ACCUMULATION * LOGICAL_STEPS)
    single = compiled(dense_model(), clipping="ghost")
    single.fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(MICRO_BATCH * replicas),
               epochs=1, verbose=0)
    result["ghost"] = {
        "logical_steps": int(model.optimizer.iterations.numpy()),
        "distributed_update": [
            (v.numpy() - i).tolist() for v, i in zip(model.trainable_variables, initial)],
        "single_device_update": [
            (v.numpy() - i).tolist() for v, i in zip(single.trainable_variables, initial)],
        "identical_across_replicas": replicas_identical(strategy, model.trainable_variables),
    }


def compiled_whole_checks(result):
    """The step compiled whole with XLA, as under TPUStrategy: traced once across fit calls.

    Three fit calls of two logical steps each, with seeded noise, and a
    non-private model's fit between them (issue 49). The strategy is a
    MirroredStrategy of one device: XLA on CPU cannot reach a variable on
    another logical CPU of the same process (TensorFlow's "tf.Variable on a
    different device" known issue; a plain float variable read by a
    jit-compiled replica function on "/cpu:1" fails the same way), so two
    emulated replicas cannot run any model compiled whole, Keras's own
    included. One replica still takes the strategy's path: replica context,
    mirrored variables and the cross-replica sum.
    """
    import tensorflow as tf

    from tf_megadp import distribute

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    replicas = 1
    x, y, w = dense_data(replicas)
    with strategy.scope():
        model = compiled(dense_model(), noise_multiplier=1.0, clipping="ghost",
                         jit_compile=True)
        other = dense_model(seed=1)
        other.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      jit_compile=True)
    traces = []
    step = model.train_step

    def train_step(data):
        traces.append(1)
        return step(data)

    model.train_step = train_step
    for _ in range(3):
        model.fit(distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w)),
                  epochs=1, verbose=0, steps_per_epoch=ACCUMULATION * 2)
        other.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH * replicas),
                  epochs=1, verbose=0)
    result["compiled_whole"] = {
        # One trace runs the step once per replica.
        "traces": len(traces),
        "logical_steps": int(model.optimizer.iterations.numpy()),
    }


def noise_checks(strategy, replicas, result):
    """All-padding steps: the update is exactly -noise / B, SGD(lr=1)."""
    import keras
    import tensorflow as tf

    import tf_megadp

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(NOISE_WIDTH)])
        model = tf_megadp.make_private(model)
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=NOISE_CLIP,
            noise_multiplier=NOISE_SIGMA, accumulation_steps=1, seed=1234),
            loss="mse")
    steps = 2
    n = 2 * replicas * steps
    x = np.ones((n, 2), "float32")
    y = np.ones((n, NOISE_WIDTH), "float32")
    w = np.zeros(n, "float32")
    before = [v.numpy() for v in model.trainable_variables]
    sums_of_squares, coordinates = [], 0
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(2 * replicas)
    for step, batch in enumerate(data):
        model.fit(tf.data.Dataset.from_tensors(batch), epochs=1, verbose=0)
        after = [v.numpy() for v in model.trainable_variables]
        delta = np.concatenate([(a - b).ravel() for a, b in zip(after, before)]).astype(np.float64)
        sums_of_squares.append(float(np.sum(delta**2)))
        coordinates = delta.size
        before = after
    result["noise"] = {
        "sums_of_squares": sums_of_squares,
        "coordinates": coordinates,
        "divisor": 2 * replicas,
        "sigma": NOISE_SIGMA,
        "clip": NOISE_CLIP,
        "identical_across_replicas": replicas_identical(strategy, model.trainable_variables),
        "logical_steps": int(model.optimizer.iterations.numpy()),
    }


def correlated_noise_checks(strategy, replicas, result):
    """BandMF noise on R replicas, every gradient zero: one C^{-1} z in total (issue 39).

    Each replica streams its own draws z_r of variance 1/R through its own
    buffers; the all-reduced update must be -(sigma C / B) (C^{-1} z)_t with
    z = sum_r z_r / sqrt(R), the draws regenerated from the seed, and the
    ledger one cyclic segment.
    """
    import keras
    import tensorflow as tf

    import tf_megadp
    from tests import reference
    from tf_megadp.accounting import matrix_factorization as mf

    steps, batch, cycle, width, seed = 6, 4, 4, 2_000, 77
    schedule = tf_megadp.BatchSizeSchedule([tf_megadp.Phase(steps, batch, 1)], num_examples=64,
                                           micro_batch_size=8, num_replicas=replicas)
    x = np.arange(128, dtype="float32").reshape(64, 2) / 128
    sampler = tf_megadp.PoissonSampler.from_arrays(
        x, np.zeros((64, width), "float32"), schedule=schedule, cycle_length=cycle, seed=5)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tf_megadp.make_private(keras.Sequential([keras.Input((2,)),
                                                         keras.layers.Dense(width)]))
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(1.0), l2_norm_clip=NOISE_CLIP, noise_multiplier=NOISE_SIGMA,
            schedule=schedule, noise=tf_megadp.BandMF(num_bands=cycle), seed=seed),
            loss=reference.zero_loss)
    weights = [reference.flat(reference.weights(model))]

    class EveryStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            weights.append(reference.flat(reference.weights(self.model)))

    model.fit(sampler.as_dataset(), verbose=0, callbacks=[EveryStep()])
    streamed = -(batch / (NOISE_SIGMA * NOISE_CLIP)) * np.diff(np.stack(weights), axis=0)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    draws = np.stack([sum(reference.flat(reference.noise_draws(seed, t, shapes, replica=r))
                          for r in range(replicas)) / np.sqrt(replicas) for t in range(steps)])
    strategy_column = model.optimizer.noise_strategy.column(steps)
    expected = mf.banded_inverse_stream(model.optimizer.noise_strategy.coefficients, draws)
    inverse = np.linalg.inv(np.tril(np.array(
        [[strategy_column[i - j] if i >= j else 0.0 for j in range(steps)]
         for i in range(steps)])))
    try:
        reference.assert_covariance_is(streamed.T, inverse @ inverse.T)
        covariance_ok = True
    except AssertionError:
        covariance_ok = False
    result["correlated_noise"] = {
        "steps": int(model.optimizer.iterations.numpy()),
        "max_error": float(np.max(np.abs(streamed - expected))),
        "max_error_full_noise_per_replica": float(np.max(np.abs(
            streamed - expected * np.sqrt(replicas)))),
        "covariance_ok": covariance_ok,
        "identical_across_replicas": replicas_identical(strategy, model.trainable_variables),
        "ledger": [[e.sampling, e.noise, e.steps, e.segment_start]
                   for e in tf_megadp.model_ledger(model)],
    }


def mixed_bfloat16_checks(strategy, replicas, result):
    """The full run under mixed_bfloat16, distributed, vs the float32 result."""
    import keras
    import tensorflow as tf

    from tf_megadp import distribute

    x, y, w = dense_data(replicas)
    initial = [v.numpy() for v in dense_model().trainable_variables]
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with strategy.scope():
            model = compiled(dense_model())
        model.fit(distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w)),
                  epochs=1, verbose=0, steps_per_epoch=ACCUMULATION * LOGICAL_STEPS)
        # Tracing (not compiling) the clipping function shows its dtypes.
        slots = slice(0, MICRO_BATCH)
        batch = model.optimizer.clipping_strategy._function_for(model).get_concrete_function(
            x[slots], y[slots], w[slots], tf.constant(CLIP, tf.float64),
            None).structured_outputs
        dtypes = {
            "compute": model.dtype_policy.compute_dtype,
            "variables": sorted({v.dtype for v in model.trainable_variables}),
            "accumulators": sorted({a.dtype for a in accumulators_of(model.optimizer)}),
            "norms": batch.norms.dtype.name,
            "clipped_sum": sorted({g.dtype.name for g in batch.gradient_sum if g is not None}),
            "losses": batch.losses.dtype.name,
        }
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result["mixed_bfloat16"] = {
        "update": [(v.numpy() - i).tolist() for v, i in zip(model.trainable_variables, initial)],
        "dtypes": dtypes,
    }


def sampling_secret_checks(strategy, result):
    """The sampling-secret broadcast: what goes in at replica 0 comes out, exactly.

    Values are written as decimal strings: they are test values, and JSON
    readers other than Python's lose integers above 2**53.
    """
    import secrets

    from tf_megadp import distribute

    local = secrets.randbits(distribute.SECRET_BITS)
    result["sampling_secret"] = {
        "local": str(local),
        "broadcast": str(distribute._broadcast_from_replica_zero(strategy, local)),
        "edges": [str(distribute._broadcast_from_replica_zero(strategy, value))
                  for value in (0, 1, (1 << distribute.SECRET_BITS) - 1)],
        "shared": [str(distribute.shared_sampling_secret(strategy)) for _ in range(2)],
    }


ACCOUNTING_LAYOUTS = 2


def accounting_checks(strategy, replicas, result):
    """Random Poisson layouts (N, m, B, epochs) fit on R replicas: what the callback reports.

    The test process recomputes epsilon with dp_accounting from the layout
    alone; nothing here computes the expected value.
    """
    import warnings

    import keras

    import tf_megadp
    from tf_megadp import distribute

    rng = np.random.default_rng(200 + replicas)
    layouts = []
    # Four replicas run only the first (seeded) layout: the loop-equals-fit
    # check needs it; the random-layout property runs on two.
    for _ in range(ACCOUNTING_LAYOUTS if replicas == 2 else 1):
        num_examples = int(rng.integers(30, 80))
        micro_batch = int(rng.integers(2, 5))
        batch_size = int(rng.integers(2, num_examples // 3))
        epochs = int(rng.integers(1, 3))
        x = rng.normal(size=(num_examples, 4)).astype("float32")
        y = rng.normal(size=(num_examples, 2)).astype("float32")
        # The first layout's draws are seeded (a test run): a custom loop
        # on the same draws and seeded noise must give fit's weights.
        sampling_seed = 300 + replicas if not layouts else None

        def sampler_and_model():
            sampler = tf_megadp.PoissonSampler.from_arrays(
                x, y, batch_size=batch_size, epochs=epochs, micro_batch_size=micro_batch,
                num_replicas=replicas, seed=sampling_seed)
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
                optimizer = tf_megadp.DPOptimizer(
                    keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
                    schedule=sampler.schedule, seed=1)
            return sampler, model, optimizer

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # seeded noise and draws: a test run
            sampler, model, optimizer = sampler_and_model()
            with strategy.scope():
                tf_megadp.make_private(model)
                model.compile(optimizer=optimizer, loss="mse")
            callback = tf_megadp.PrivacyCallback(1e-5, accountant="rdp")
            model.fit(sampler.as_dataset(), callbacks=[callback], verbose=0)
            if sampling_seed is not None:
                loop_sampler, loop_model, loop_optimizer = sampler_and_model()
                with strategy.scope():
                    step = tf_megadp.PrivateStep(loop_model, loop_optimizer, loss="mse")
                micro_steps = loop_sampler.as_dataset(tagged=True)
                data = distribute.distribute_micro_batches(strategy, lambda _: micro_steps)
                step.begin(data)
                run_private_step(step, strategy, data, loop_sampler.total_micro_steps)
                report = tf_megadp.PrivacyReport(step, 1e-5, accountant="rdp")
                loop = {
                    "steps_applied": step.logical_step,
                    "epsilon": report.epsilon,
                    "ledger": [e.to_dict() for e in report.ledger],
                    "weights_equal_fit": all(
                        np.array_equal(a.numpy(), b.numpy())
                        for a, b in zip(loop_model.trainable_variables, model.trainable_variables)),
                    "max_difference_from_fit": max(
                        float(np.max(np.abs(a.numpy() - b.numpy())))
                        for a, b in zip(loop_model.trainable_variables, model.trainable_variables)),
                }
        layouts.append({
            "num_examples": num_examples, "micro_batch": micro_batch,
            "batch_size": batch_size, "epochs": epochs,
            "steps_applied": int(optimizer.iterations.numpy()),
            "ledger": [{"steps": e.steps, "sampling_rate": e.sampling_rate,
                        "max_batch_size": e.max_batch_size, "sampling": e.sampling}
                       for e in callback.ledger],
            "epsilon": callback.epsilon,
            "ledger_entries": [e.to_dict() for e in callback.ledger],
            **({"custom_loop": loop} if sampling_seed is not None else {}),
        })
    result["accounting"] = layouts


WORKER_NOISE_SEED = 7


def noisy_fit_weights(strategy, replicas):
    """fit on R replicas with seeded noise: what the custom loop on R workers must equal."""
    from tf_megadp import distribute

    x, y, w = dense_data(replicas)
    with strategy.scope():
        model = compiled(dense_model(), noise_multiplier=1.0, seed=WORKER_NOISE_SEED)
    model.fit(distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w)),
              epochs=1, verbose=0, steps_per_epoch=ACCUMULATION * LOGICAL_STEPS)
    return [v.numpy().tolist() for v in model.trainable_variables]


# examples/tpu_custom_loop.py at test size: N, B, m per replica, one epoch (2 steps).
TPU_EXAMPLE_SIZE = ["--examples", "48", "--batch-size", "24", "--micro-batch-size", "6",
                    "--epochs", "1", "--features", "6", "--classes", "3", "--hidden", "8"]


def tpu_example(strategy):
    """Runs examples/tpu_custom_loop.py's main at test size under `strategy`.

    The scenario's own strategy: a second MirroredStrategy over the same CPU
    devices in one process would reuse its collective instance keys.
    """
    import runpy
    import warnings

    example = runpy.run_path(os.path.join(ROOT, "examples", "tpu_custom_loop.py"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return example["main"](TPU_EXAMPLE_SIZE, strategy=strategy)


def run_replicas(replicas, out_path):
    import tempfile

    from tf_megadp import distribute

    distribute.configure_cpu_replicas(replicas)
    strategy = distribute.resolve_strategy(
        "mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])
    result = {"replicas": strategy.num_replicas_in_sync}
    seconds = result["seconds"] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_dir:
        equality_and_replica_checks(strategy, replicas, tmp_dir, result,
                                    checkpoint=replicas == 2)
    seconds["equality"] = time.perf_counter() - start
    if replicas == 2:
        # Noise added on every replica would show as R times the variance
        # on two replicas as on four; four would cost CI the check again.
        noise_checks(strategy, replicas, result)
        correlated_noise_checks(strategy, replicas, result)
    seconds["noise"] = time.perf_counter() - start - seconds["equality"]
    accounting_checks(strategy, replicas, result)
    seconds["accounting"] = time.perf_counter() - start - sum(seconds.values())
    custom_loop_checks(strategy, replicas, result)
    seconds["custom_loop"] = time.perf_counter() - start - sum(seconds.values())
    if replicas == 2:
        mixed_bfloat16_checks(strategy, replicas, result)
        ghost_checks(strategy, replicas, result)
        compiled_whole_checks(result)
        sampling_secret_checks(strategy, result)
        result["noisy_fit_for_workers"] = noisy_fit_weights(strategy, replicas)
    seconds["total"] = time.perf_counter() - start
    write_json_atomically(out_path, result)


def run_worker(index, ports, out_path):
    workers = [f"127.0.0.1:{port}" for port in ports]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
    from tf_megadp import distribute

    strategy = distribute.resolve_strategy("multiworker")
    replicas = strategy.num_replicas_in_sync
    x, y, w = dense_data(replicas)
    import tf_megadp

    micro_steps = ACCUMULATION * LOGICAL_STEPS
    # In the folder of both workers' results, as the job's shared output.
    checkpoint = os.path.join(os.path.dirname(out_path), "chief_checkpoint")
    with strategy.scope():
        model = compiled(dense_model())
        noisy = compiled(dense_model(), noise_multiplier=1.0, seed=WORKER_NOISE_SEED)
    for each in (model, noisy):
        # Keras 3.15's fit cannot run under several workers; a custom loop
        # of the same private step can.
        with strategy.scope():
            step = tf_megadp.PrivateStep(each)
        data = distribute.distribute_micro_batches(strategy, global_micro_batches(x, y, w))
        step.begin(data, num_examples=len(x), micro_batches_per_pass=micro_steps)
        # The other worker trains on meanwhile: a save that waited for it in
        # a collective (PrivateStep.record's read of the refused count did)
        # fails or hangs.
        logs = run_private_step(step, strategy, data, micro_steps,
                                chief_saves_to=checkpoint if each is model else None)
        if each is model:
            model_logs = logs
    secret = {}
    sampling_secret_checks(strategy, secret)
    cpu_seconds = {"dense": time.process_time()}
    example = tpu_example(strategy)
    cpu_seconds["example"] = time.process_time() - sum(cpu_seconds.values())
    from tf_megadp.run.training_state import training_state_extra

    write_json_atomically(out_path, {
        **secret,
        "replicas": replicas,
        "chief_checkpoint": training_state_extra(checkpoint),
        "logical_steps": int(model.optimizer.iterations.numpy()),
        "nonfinite_logged": float(model_logs["nonfinite_examples"]),
        "weights": [v.numpy().tolist() for v in model.trainable_variables],
        "noisy_weights": [v.numpy().tolist() for v in noisy.trainable_variables],
        "tpu_example": example,
        "cpu_seconds": cpu_seconds,
    })


def run_job_worker(index, ports, out_path):
    """The job on worker INDEX of a loopback cluster (`job_on_worker`), for the slow test."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "task": {"type": "worker", "index": index}})
    from tf_megadp import distribute

    strategy = distribute.resolve_strategy("multiworker")
    write_json_atomically(out_path, job_on_worker(index, os.path.dirname(out_path), strategy))


# The job's command line on R replicas: m * R = JOB_ROWS rows per micro-step
# for every R, so that with the same test-only seeds every replica count
# draws, masks and sums the very same examples.
JOB_ROWS = 8
JOB_STEPS = 3


def job_argv(folder, corpus, replicas, output, *extra, strategy="mirrored"):
    """`tf-megadp pretrain` arguments of the pico job on R CPU replicas (or R workers)."""
    argv = ["pretrain", "--corpus", corpus, "--cache-dir", str(folder / "cache"),
            "--model", "pico", "--sequence-length", "16", "--vocabulary-size", "200",
            "--max-characters", "300000", "--micro-batch-size", str(JOB_ROWS // replicas),
            "--batch-size", "16", "--steps", str(JOB_STEPS), "--eval-every", str(JOB_STEPS),
            "--noise-multiplier", "1.0", "--accountant", "rdp", "--warmup-steps", "1",
            "--output-dir", str(output), *extra]
    if strategy == "multiworker":
        argv += ["--strategy", "multiworker"]
    elif replicas > 1:
        argv += ["--strategy", "mirrored", "--cpu-replicas", str(replicas)]
    return argv


def job_on_worker(index, shared, strategy):
    """The pico job on this worker of two (`--strategy multiworker`), sigma 0, test-only seeds.

    Both workers run the same command on one shared folder, as on machines
    with a shared file system: the chief prepares the corpus cache that the
    other then reads, and only the chief writes the run's output. The chief
    returns the exported weights, to compare with the one-device job of
    `run_job(1)`.
    """
    import pathlib

    import keras

    from tf_megadp import cli, distribute
    from tf_megadp.jobs.bert import pretraining
    from tests.test_pretraining import write_corpus

    folder = pathlib.Path(shared) / "job_workers"
    output = folder / "output"
    if index == 0:
        folder.mkdir()
        write_corpus(folder)
    distribute.barrier(strategy)  # The corpus file is written.
    args = cli.build_parser().parse_args(job_argv(
        folder, str(folder / "private.txt"), 2, output, strategy="multiworker"))
    seeded = pretraining._TestingSeeds(sampling_seed=11, noise_seed=12, noise_multiplier=0.0)
    report = pretraining.run_pretraining(cli.run_config_from_args(args, None),
                                         log=lambda *_: None, testing=seeded)
    result = {key: report[key] for key in ("logical_steps", "completed", "schedule")}
    result["heldout_accuracy"] = [record["heldout_mlm_accuracy"] for record in report["history"]]
    if index == 0:
        model = keras.models.load_model(output / "model.keras", compile=False)
        result["weights"] = [v.numpy().tolist() for v in model.trainable_variables]
        result["files"] = sorted(os.listdir(output))
    return result


def run_job(replicas, out_path, resumed=False):
    """The pico job from its command line on R replicas, then on one device.

    sigma = 0 with the job's test-only seeds (same draws and masks for every
    R): the trained weights of both, to compare. Both runs share one
    process and one corpus cache (the vocabulary is learned once); R
    replicas first, since TensorFlow splits the CPU before its first op.
    With `resumed` the R-replica run is interrupted after one step and
    resumed (a slow scenario), so the comparison also proves the resume
    exact; its ledger and data are returned.
    """
    import pathlib
    import tempfile

    import keras

    from tf_megadp.jobs.bert import pretraining
    from tests.test_pretraining import write_corpus

    seeded = pretraining._TestingSeeds(sampling_seed=11, noise_seed=12, noise_multiplier=0.0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        folder = pathlib.Path(tmp_dir)
        corpus = write_corpus(folder)
        for count in (replicas, 1):
            output = folder / f"seeded{count}"
            result = results[str(count)] = {"replicas": count}
            if resumed and count == replicas:
                result["resumed"] = _interrupted_and_resumed(folder, corpus, count, output,
                                                             testing=seeded)
                report = result["resumed"].pop("report")
            else:
                report = pretraining.run_pretraining(
                    _job_config(job_argv(folder, corpus, count, output)),
                    log=lambda *_: None, testing=seeded)
            model = keras.models.load_model(output / "model.keras", compile=False)
            result["weights"] = [v.numpy().tolist() for v in model.trainable_variables]
            result["seeded"] = {key: report[key] for key in ("logical_steps", "schedule")}
    write_json_atomically(out_path, results)


def run_private_resume(replicas, out_path):
    """The private job (secret draws, sigma 1) on R replicas, interrupted and resumed."""
    import pathlib
    import tempfile

    from tests.test_pretraining import write_corpus

    with tempfile.TemporaryDirectory() as tmp_dir:
        folder = pathlib.Path(tmp_dir)
        resumed = _interrupted_and_resumed(folder, write_corpus(folder), replicas,
                                           folder / "resumed")
    resumed.pop("report")
    write_json_atomically(out_path, {"replicas": replicas, "resumed": resumed})


def _job_config(argv):
    from tf_megadp import cli

    return cli.run_config_from_args(cli.build_parser().parse_args(argv), None)


def _interrupted_and_resumed(folder, corpus, replicas, output, testing=None):
    """The job stopped after its first step, then resumed: what its ledger says."""
    from tf_megadp.jobs.bert import pretraining

    first = pretraining.run_pretraining(
        _job_config(job_argv(folder, corpus, replicas, output, "--stop-after-steps", "1")),
        log=lambda *_: None, testing=testing)
    final = pretraining.run_pretraining(
        _job_config(job_argv(folder, corpus, replicas, output, "--resume")),
        log=lambda *_: None, testing=testing)
    with open(output / "privacy.json", encoding="utf-8") as stream:
        privacy = json.load(stream)
    return {
        "first_steps": first["logical_steps"], "completed": final["completed"],
        "resumed_from": final["resumed_from_step"],
        **{key: final[key] for key in ("epsilon", "delta", "noise_multiplier",
                                       "logical_steps", "schedule", "num_examples")},
        "ledger": privacy["ledger"], "steps": privacy["steps"], "data": privacy["data"],
        "report": final}


if __name__ == "__main__":
    if sys.argv[1] == "replicas":
        run_replicas(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "job":
        run_job(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "job_resumed":
        run_job(int(sys.argv[2]), sys.argv[3], resumed=True)
    elif sys.argv[1] == "private_resume":
        run_private_resume(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "worker":
        run_worker(int(sys.argv[2]), [int(p) for p in sys.argv[3].split(",")], sys.argv[4])
    elif sys.argv[1] == "job_worker":
        run_job_worker(int(sys.argv[2]), [int(p) for p in sys.argv[3].split(",")], sys.argv[4])
    else:
        raise SystemExit(f"unknown scenario set {sys.argv[1]!r}")
