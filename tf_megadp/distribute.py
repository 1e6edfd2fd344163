"""Running the DP step under `tf.distribute`: strategies and per-replica data.

The DP step itself is strategy-agnostic: under any strategy, each replica
clips its own examples and sums them into replica-local accumulators; at the
end of a logical step each replica adds Gaussian noise of variance
sigma^2 C^2 / R, and the inner Keras optimizer all-reduces (SUM) once, so the
global sum carries N(0, sigma^2 C^2) exactly once, divided by the global
logical batch B. This module holds what changes between machines: choosing
the strategy, and handing every replica its own micro-batches of a logical
step.

Data layout. A logical step of k micro-steps on R replicas has k * m * R
static slots (a Poisson step is padded to that capacity with zero-weight
examples). Each micro-step is one element of m * R rows, as
`tf_megadp.PoissonSampler.as_dataset` yields them; rows [r*m, (r+1)*m) are
replica r's micro-batch. `distribute_micro_batches` gives every input
pipeline (one per worker or TPU host) exactly the rows of its own replicas,
so every slot is processed once and only once.

Example:
```python
strategy = tf_megadp.distribute.resolve_strategy("mirrored")
with strategy.scope():
    model = tf_megadp.make_private(build_model())
    model.compile(optimizer=tf_megadp.DPOptimizer(...), loss=...)
data = tf_megadp.distribute.distribute_micro_batches(strategy, micro_steps)
model.fit(data, steps_per_epoch=k * logical_steps)
```

Under `MultiWorkerMirroredStrategy` with several workers Keras's `fit` cannot
run; a custom loop with `tf_megadp.PrivateStep` runs the same private step
there (and under every other strategy).
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Callable, Sequence

import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import BatchSizeSchedule

__all__ = [
    "STRATEGIES",
    "configure_cpu_replicas",
    "resolve_strategy",
    "distribute_micro_batches",
    "replica_micro_batches",
    "check_schedule_matches_strategy",
    "shared_sampling_secret",
    "is_chief",
    "barrier",
    "build_without_reading",
]

STRATEGIES = ("default", "mirrored", "multiworker", "tpu")

# The sampling secret: 128 bits, as NumPy's SeedSequence draws from the OS.
SECRET_BITS = 128
# Broadcast in 16-bit pieces carried as float32: every all-reduce TensorFlow
# has (collective ops on CPU and GPU, NCCL, TPU) sums float32, not every one
# sums integers, and a sum of one piece below 2**16 and zeros is exact in
# float32 (24-bit significand).
_PIECE_BITS = 16


def configure_cpu_replicas(count: int) -> list:
    """Splits the host CPU into `count` logical devices (replicas for tests).

    This is how a `MirroredStrategy` with several replicas runs on a machine
    without accelerators. It must run before TensorFlow initialises its
    devices (before the first op, strategy or model).

    Args:
        count: number of logical CPU devices (>= 1).

    Returns:
        The logical CPU devices.

    Raises:
        RuntimeError: TensorFlow's devices are already initialised (with
            another split; the same split again returns its devices).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is not None and len(configured) == count:
        # Already split this way (a second job in the same process): the
        # devices exist, and TensorFlow refuses to set them again.
        return tf.config.list_logical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError as error:
        raise RuntimeError(
            "configure_cpu_replicas must run before TensorFlow initialises its "
            "devices: call it first thing, before building models, datasets or "
            f"strategies ({error})."
        ) from error
    return tf.config.list_logical_devices("CPU")


def resolve_strategy(
    name: str = "default",
    *,
    tpu: str | None = None,
    devices: Sequence[str] | None = None,
) -> tf.distribute.Strategy:
    """The `tf.distribute.Strategy` for a `--strategy` flag.

    Args:
        name: ``"default"`` (no distribution), ``"mirrored"`` (all local
            GPUs, or `devices`), ``"multiworker"`` (one process per worker,
            cluster from the ``TF_CONFIG`` environment variable) or ``"tpu"``.
        tpu: for ``"tpu"``: the TPU name or address given to
            `TPUClusterResolver` (``"local"`` on a single TPU VM; the TPU
            name on every host of a pod slice).
        devices: for ``"mirrored"``: explicit device names, e.g.
            ``["/cpu:0", "/cpu:1"]`` after `configure_cpu_replicas(2)`.

    Returns:
        The strategy. Build the model, the `DPOptimizer` and call `compile`
        inside `strategy.scope()`.

    Example:
    ```python
    strategy = resolve_strategy("tpu", tpu="local")
    strategy.num_replicas_in_sync   # 8 on a v3-8
    ```
    """
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}.")
    if tpu is not None and name != "tpu":
        raise ValueError(f"tpu={tpu!r} is only used with strategy 'tpu', not {name!r}.")
    if devices is not None and name != "mirrored":
        raise ValueError(f"devices are only used with strategy 'mirrored', not {name!r}.")
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices=None if devices is None else list(devices))
    if name == "multiworker":
        _check_tf_config()
        return tf.distribute.MultiWorkerMirroredStrategy()
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "")
    if tpu != "local":
        # A TPU pod slice or TPU node is reached through a cluster of TPU
        # workers; the chips of a single TPU VM ("local") are in-process.
        tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def _check_tf_config() -> None:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise ValueError(
            "strategy 'multiworker' needs the TF_CONFIG environment variable on "
            "every worker, e.g. TF_CONFIG='{\"cluster\": {\"worker\": "
            "[\"host0:12345\", \"host1:12345\"]}, \"task\": {\"type\": \"worker\", "
            "\"index\": 0}}' (index differs per worker)."
        )
    try:
        config = json.loads(raw)
        workers = config["cluster"]["worker"]
        task = config["task"]
        index = int(task["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"TF_CONFIG must be JSON with cluster.worker and task.type/index: {error}"
        ) from error
    if task.get("type") not in ("worker", "chief") or not 0 <= index < len(workers):
        raise ValueError(
            f"TF_CONFIG task {task} does not name one of the {len(workers)} workers."
        )


def replica_micro_batches(
    dataset: tf.data.Dataset, input_context: tf.distribute.InputContext
) -> tf.data.Dataset:
    """Splits each micro-step of m * R rows into this pipeline's replica micro-batches.

    With R replicas in sync served by P input pipelines (workers or TPU
    hosts), pipeline p owns replicas p*L .. p*L + L - 1 with L = R / P. Of
    every micro-step element (leading axis m * R, e.g. what
    `tf_megadp.PoissonSampler.as_dataset` yields) it keeps rows
    [p*L*m, (p+1)*L*m) and emits them as L micro-batches of m rows, in
    replica order. Every pipeline must see the same micro-steps (samplers
    built with the same `shared_secret`, see `shared_sampling_secret`), so the
    union over replicas is every slot exactly once.

    Args:
        dataset: micro-steps in training order; every tensor has a static
            leading axis of m * R.
        input_context: the context `distribute_datasets_from_function` passes.

    Returns:
        This pipeline's micro-batches, L per micro-step.
    """
    replicas = input_context.num_replicas_in_sync
    pipelines = input_context.num_input_pipelines
    if replicas % pipelines:
        raise ValueError(
            f"{replicas} replicas cannot be split evenly over {pipelines} input pipelines."
        )
    local = replicas // pipelines
    first = input_context.input_pipeline_id * local

    def split(tensor):
        rows = tensor.shape[0]
        if rows is None or rows % replicas:
            raise ValueError(
                f"Every tensor of a micro-step needs a static leading axis of "
                f"micro_batch_size * {replicas} replicas; got shape {tensor.shape}."
            )
        m = rows // replicas
        mine = tensor[first * m:(first + local) * m]
        return tf.reshape(mine, [local, m] + tensor.shape[1:].as_list())

    def keep_local(*element):
        element = element[0] if len(element) == 1 else element
        return tf.nest.map_structure(split, element)

    return dataset.map(keep_local).unbatch()


def distribute_micro_batches(
    strategy: tf.distribute.Strategy,
    micro_steps: Callable[[tf.distribute.InputContext], tf.data.Dataset],
) -> tf.distribute.DistributedDataset:
    """Per-replica micro-batches for `model.fit` under `strategy`.

    Args:
        strategy: the strategy the model was compiled under.
        micro_steps: called once per input pipeline with its
            `tf.distribute.InputContext`; returns the dataset of ALL
            micro-steps (static leading axis m * R), identical on every
            pipeline.

    Returns:
        A distributed dataset: one m-row micro-batch per replica per fit step.
        When `micro_steps` returns a tf_megadp sampler's dataset, the
        distributed dataset carries the sampler's `DataSource`, so a private
        `fit` measures N and the Poisson sampling from it.

    Raises:
        PrivacyConfigurationError: `micro_steps` returned a dataset derived
            from a sampler's (which could replay its draws), or the input
            pipelines were fed by different samplers.

    Example:
    ```python
    secret = shared_sampling_secret(strategy)   # the same on every worker
    sampler = tf_megadp.PoissonSampler(shards, schedule, shared_secret=secret)
    micro_steps = sampler.as_dataset(batcher)
    data = distribute_micro_batches(strategy, lambda context: micro_steps)
    model.fit(data, steps_per_epoch=sampler.total_micro_steps)
    ```
    """
    from tf_megadp.data import sources, tags

    found = []
    tag_keys = []

    def dataset_fn(input_context):
        dataset = micro_steps(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"micro_steps must return a tf.data.Dataset, got {dataset!r}.")
        # Read before the split below, which derives a new dataset from it.
        found.append(sources.source_of(dataset))
        tag_keys.append(tags.tag_key_of(dataset))
        return replica_micro_batches(dataset, input_context)

    distributed = strategy.distribute_datasets_from_function(dataset_fn)
    described = [source for source in found if source is not None]
    if described and (len(described) != len(found)
                      or any(source != described[0] for source in described[1:])):
        raise PrivacyConfigurationError(
            "The input pipelines of this strategy were fed by different samplers "
            "(or some by none): every pipeline must return the dataset of the same "
            "sampler, built with the same shared_secret "
            "(tf_megadp.distribute.shared_sampling_secret(strategy))."
        )
    if described:
        # The split into replica micro-batches only routes each slot of the
        # sampler's steps to its replica (every slot once), so the steps are
        # still the sampler's Poisson draws. The DataSource marker is the
        # attribute sources.source_of reads first.
        sources.mark_distributed(distributed, described[0])
        if all(key is not None for key in tag_keys):
            # A sampler's tagged dataset: the split keeps each row's tag on
            # its row, which the replica's PrivateStep checks.
            tags.attach_tag_key(distributed, tag_keys[0])
    return distributed


def check_schedule_matches_strategy(
    schedule: BatchSizeSchedule, strategy: tf.distribute.Strategy
) -> None:
    """Fails unless `schedule` describes the replicas `strategy` runs.

    A logical step of phase t takes k_t micro-steps, each consuming one
    micro-batch per replica. If the schedule was planned for fewer replicas
    than the strategy has, every logical step would sample more examples than
    the accountant's q_t = B_t / N assumes.

    Raises:
        PrivacyConfigurationError: `schedule.num_replicas` differs from
            `strategy.num_replicas_in_sync`.
    """
    replicas = strategy.num_replicas_in_sync
    if schedule.num_replicas != replicas:
        raise PrivacyConfigurationError(
            f"The BatchSizeSchedule was planned for num_replicas="
            f"{schedule.num_replicas} but the strategy runs {replicas} replicas: "
            "each logical step would hold a different number of examples than "
            f"accounted. Rebuild the schedule with num_replicas={replicas}."
        )


def _worker_count(strategy: tf.distribute.Strategy) -> int:
    """Processes that build their own input pipeline and sampler under `strategy`.

    Only `MultiWorkerMirroredStrategy` runs one Python process per worker; the
    other strategies (default, mirrored, TPU with its single client) drive all
    replicas from this process.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    cluster = resolver.cluster_spec().as_dict()
    return max(1, len(cluster.get("chief", [])) + len(cluster.get("worker", [])))


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether this process is the one of several workers that writes the run's files.

    Under `MultiWorkerMirroredStrategy` every worker runs the same program;
    the chief (task "chief", or worker 0 without one) writes checkpoints,
    reports and the model, the others write nothing to the shared output.
    Every other strategy runs in one process, which is the chief.

    Args:
        strategy: the run's strategy; default the current one.
    """
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if _worker_count(strategy) == 1 or resolver is None:
        return True
    if resolver.task_type == "chief":
        return True
    cluster = resolver.cluster_spec().as_dict()
    return not cluster.get("chief") and resolver.task_type == "worker" and resolver.task_id == 0


def barrier(strategy: tf.distribute.Strategy) -> None:
    """Returns on every worker once every worker has called it (a collective; no-op on one)."""
    if _worker_count(strategy) > 1:
        _broadcast_from_replica_zero(strategy, 0)


def _broadcast_from_replica_zero(strategy: tf.distribute.Strategy, value: int) -> int:
    """`value` as the process holding replica 0 (the chief) passed it, on every worker.

    Every process passes its own `value`; replica 0 contributes its pieces
    to an all-reduce SUM and every other replica zeros, so the sum is replica
    0's value everywhere. Replica 0 lives on the chief (task "chief", or
    worker 0 without one): `MultiWorkerMirroredStrategy` numbers the chief's
    replicas first. Nothing is written anywhere; the value travels only
    through the collective.
    """
    pieces = SECRET_BITS // _PIECE_BITS
    mask = (1 << _PIECE_BITS) - 1
    mine = [float((value >> (_PIECE_BITS * i)) & mask) for i in range(pieces)]

    def contribution(context):
        if context.replica_id_in_sync_group == 0:
            return tf.constant(mine, tf.float32)
        return tf.zeros([pieces], tf.float32)

    per_replica = strategy.experimental_distribute_values_from_function(contribution)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    received = [float(piece) for piece in total.numpy()]
    # Fail closed: a piece outside [0, 2**16) or fractional means some replica
    # other than 0 contributed, and the workers may hold different secrets.
    if any(piece != int(piece) or not 0 <= piece <= mask for piece in received):
        raise RuntimeError(
            "The sampling secret's all-reduce returned pieces outside [0, 2**16): "
            "the replicas do not agree on the secret. Check that every worker runs "
            "the same program under the same MultiWorkerMirroredStrategy cluster."
        )
    return sum(int(piece) << (_PIECE_BITS * i) for i, piece in enumerate(received))


def shared_sampling_secret(strategy: tf.distribute.Strategy | None = None) -> int:
    """A fresh 128-bit secret for the Poisson sampler, the same on every worker.

    Every worker of a multi-worker run must draw the same Poisson steps (each
    keeps its own replicas' rows of them), yet the draws must stay secret: an
    adversary who can recompute which examples each step drew gets no
    amplification by subsampling. So the chief draws 128 bits of OS entropy
    (`secrets`) and broadcasts them through the strategy's own all-reduce;
    the secret never passes through a file, an environment variable or a
    config, which could be read or published. With one worker (default,
    mirrored and TPU strategies, whose single process drives every replica)
    this is a fresh local draw.

    Call it on every worker at the same point of the program (it is a
    collective operation), pass the result to the sampler
    (`PoissonSampler(..., shared_secret=...)`) and never log, print or save
    it. A resumed run calls it again: fresh draws for the remaining steps are
    as private as the draws the interrupted run would have made.

    Args:
        strategy: the run's strategy; default the current one
            (`tf.distribute.get_strategy()`).

    Returns:
        An int in [0, 2**128), equal on every worker of the strategy.

    Raises:
        RuntimeError: the workers did not agree on the secret.

    Example:
    ```python
    strategy = tf_megadp.distribute.resolve_strategy("multiworker")
    secret = tf_megadp.distribute.shared_sampling_secret(strategy)
    sampler = tf_megadp.PoissonSampler(shards, schedule, shared_secret=secret)
    ```
    """
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    # Drawn on every worker, so the code is the same everywhere; only the
    # chief's draw (replica 0's) survives the broadcast.
    local = secrets.randbits(SECRET_BITS)
    if _worker_count(strategy) == 1:
        return local
    return _broadcast_from_replica_zero(strategy, local)


def build_without_reading(model, element_spec) -> None:
    """Lets Keras build `model` from a sampler dataset's shapes, not its first batch.

    Under a tf.distribute strategy, Keras 3's `fit` reads one batch of the
    training data to build the model, then restarts the data. A sampler's
    dataset can be read once only (a restart would replay its draws, which
    it refuses), so Keras gets the per-replica shapes and dtypes instead,
    which is all the build uses. Without a strategy Keras builds while
    tracing and reads nothing early; then this does nothing. The private
    `fit` of `make_private` calls it for sampler datasets; call it before a
    plain (non-private) `fit` on one.

    Args:
        model: the compiled model, under its strategy.
        element_spec: the dataset's element spec (global micro-batches of
            m * R rows).
    """
    strategy = _keras_compat.model_strategy(model)
    if strategy is None:
        return
    replicas = strategy.num_replicas_in_sync
    per_replica = tf.nest.map_structure(
        lambda spec: tf.TensorSpec([spec.shape[0] // replicas, *spec.shape[1:]], spec.dtype),
        element_spec)

    def build(iterator=None, data_batch=None):
        with strategy.scope():
            _keras_compat.symbolic_build(model, per_replica)

    _keras_compat.replace_symbolic_build(model, build)
