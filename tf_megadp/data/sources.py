"""What feeds a private `fit`, as the accountant must know it.

Epsilon depends on two facts about the training data that no optimizer
setting can tell: how many examples there are (N) and how each logical step
chose its examples. A `DataSource` states both, together with how each was
established:

* a tf_megadp sampler (Poisson over token shards, arrays or indexable
  records) attaches its `DataSource` to the `tf.data.Dataset` it returns:
  N is measured, every step is a Poisson draw of the sampler's schedule;
* NumPy arrays and tensors passed to `fit` are measured by the private
  `fit` itself: N is their length, and their batches are fixed-size
  (sampling ``"shuffle"``), for which the Poisson epsilon is an estimate,
  not a proven guarantee;
* any other input (a `tf.data.Dataset` no sampler returned, a
  `keras.utils.PyDataset`, a generator) has no measurable N: the user states
  it (`PrivacyCallback(num_examples=...)`), and the report says it was
  stated.

A sampler's dataset must reach `fit` as it was returned: any transformation
(`cache`, `repeat`, `map`, ...) could replay or mix its draws, so `source_of`
refuses a dataset derived from a sampler's (it finds the sampler's marker in
the dataset graph).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from tf_megadp.accounting.events import SamplingKind, sampling_kind, sampling_kinds
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import BatchSizeSchedule

__all__ = [
    "DataSource", "attach_source", "mark_distributed", "refuse_repeated", "resumed_at",
    "source_of", "FIXED_SIZE_SAMPLING",
]

# The accountant's code for batches that no tf_megadp sampler drew.
FIXED_SIZE_SAMPLING = "shuffle"
_ATTRIBUTE = "_tf_megadp_source"
_RESUME_ATTRIBUTE = "_tf_megadp_resume"
_MARKER_PREFIX = "tf_megadp_sampler_"


@dataclasses.dataclass(frozen=True)
class DataSource:
    """How the logical steps of a run choose their examples.

    Attributes:
        sampling: the registered sampling kind of its steps: ``"poisson"``
            (a tf_megadp sampler drew every step), ``"shuffle"`` (fixed-size
            batches), or a kind a new sampler registered; what the ledger
            keeper does with the steps is the kind's (`SamplingKind`).
        num_examples: N, the number of privacy units.
        num_examples_measured: True when N was counted from the data, False
            when the user stated it.
        description: one line for logs and the privacy report.
        schedule: the Poisson sampler's `BatchSizeSchedule` (its q_t and
            static capacity per step); None for fixed-size batches.
        start_step: the first logical step the sampler draws.
        seeded: the sampling randomness came from an explicit seed, so
            anyone who can guess it can recompute every batch.
        end_step: the logical step the sampler stops before (None: unknown).
        privacy_unit: what one of the N units is: "example" (one row), or
            the name of the unit a `tf_megadp.PrivacyUnitSampler` groups
            examples by ("user", a JSONL field name).
        examples_per_unit: k, the rows of one unit's slot in a micro-batch
            (1 for "example"); the optimizer must clip with the same k.
        cycle_length: L of cyclic Poisson sampling (1: none).
        assignment: a public, random name of the sampler's secret
            assignment of examples to steps, the same for its continuations
            (None: data no sampler drew). Correlated noise continues a
            segment only over the same assignment.
    """

    sampling: str
    num_examples: int
    num_examples_measured: bool
    description: str
    schedule: BatchSizeSchedule | None = None
    start_step: int = 0
    seeded: bool = False
    end_step: int | None = None
    privacy_unit: str = "example"
    examples_per_unit: int = 1
    cycle_length: int = 1
    assignment: str | None = None

    def __post_init__(self):
        kind = sampling_kind(self.sampling)  # A ValueError for an unregistered kind.
        if kind.steps_only:
            raise ValueError(
                f"DataSource.sampling {self.sampling!r} is one of the ledger's own kinds, "
                "which record steps only; a DataSource says how steps draw their examples: "
                f"one of {sampling_kinds()}.")
        if kind.follows_schedule and self.schedule is None:
            raise ValueError(
                f"A {self.sampling!r} DataSource needs the sampler's schedule: its steps "
                "follow it.")
        if self.schedule is not None and self.schedule.num_examples != self.num_examples:
            raise ValueError(
                f"DataSource.num_examples={self.num_examples} differs from its "
                f"schedule's num_examples={self.schedule.num_examples}."
            )

    @property
    def kind(self) -> SamplingKind:
        """The registered `SamplingKind` of its steps."""
        return sampling_kind(self.sampling)

    def report(self) -> dict[str, Any]:
        """The source as it appears in the privacy report."""
        return {
            "sampling": self.sampling,
            "description": self.description,
            "num_examples_measured": self.num_examples_measured,
            "seeded_sampling": self.seeded,
            "privacy_unit": self.privacy_unit,
            "examples_per_unit": self.examples_per_unit,
            "cycle_length": self.cycle_length,
        }


def attach_source(dataset, source: DataSource, resume=None):
    """Marks `dataset` as drawn by a tf_megadp sampler described by `source`.

    Returns a dataset that yields the same elements, carries `source`, and
    holds a marker in its graph so that datasets derived from it are
    recognised (and refused) by `source_of`.

    Args:
        dataset: the sampler's `tf.data.Dataset`.
        source: its `DataSource`.
        resume: optional `step -> dataset`: the same sampler's dataset from
            logical step `step` on (see `resumed_at`).

    Returns:
        The marked `tf.data.Dataset`; pass it to `fit` as it is.
    """
    if not isinstance(source, DataSource):
        raise TypeError(f"source must be a DataSource, got {source!r}.")
    marked = dataset.take(-1, name=_MARKER_PREFIX + secrets.token_hex(4))
    setattr(marked, _ATTRIBUTE, source)
    if resume is not None:
        setattr(marked, _RESUME_ATTRIBUTE, resume)
    return marked


def resumed_at(data, step: int):
    """The sampler's dataset `data` continued from logical step `step`.

    A run restored from a preemption backup (`keras.callbacks.BackupAndRestore`
    in a private `fit`) passes the dataset the restarted script built, which
    starts where the run first started; its sampler must draw from the
    restored step on, each logical step whole.

    Args:
        data: a dataset a tf_megadp sampler returned.
        step: the restored logical step, at least the dataset's start step.

    Returns:
        A dataset of the same sampler, with the same randomness and
        `map_fn`, that draws logical steps `step`, `step + 1`, ... up to its
        end step.

    Raises:
        PrivacyConfigurationError: `data` cannot be resumed (it was not
            returned by a tf_megadp sampler, or `step` is before its start).
    """
    source = getattr(data, _ATTRIBUTE, None)
    resume = getattr(data, _RESUME_ATTRIBUTE, None)
    if source is None or resume is None:
        raise PrivacyConfigurationError(
            "A backup restored this run at logical step "
            f"{step}, but its data cannot continue from there: only a tf_megadp "
            "sampler's dataset knows its steps. Feed sampler.as_dataset()."
        )
    if step < source.start_step:
        raise PrivacyConfigurationError(
            f"The restored run is at logical step {step}, before the sampler's first "
            f"step {source.start_step}. Build the sampler with start_step <= {step}."
        )
    return resume(step)


def mark_distributed(distributed, source: DataSource):
    """Marks a `tf.distribute` dataset built from a sampler's dataset with its source.

    A `DistributedDataset` has no dataset graph to carry the marker, so the
    code that distributes a sampler's dataset (`tf_megadp.distribute`) hands
    the source on explicitly.

    Args:
        distributed: the distributed dataset.
        source: the sampler's `DataSource`.

    Returns:
        `distributed`, now carrying `source`.
    """
    if not isinstance(source, DataSource):
        raise TypeError(f"source must be a DataSource, got {source!r}.")
    setattr(distributed, _ATTRIBUTE, source)
    return distributed


def source_of(data) -> DataSource | None:
    """The `DataSource` a tf_megadp sampler attached to `data`, if any.

    Args:
        data: what is passed to `fit` as `x`.

    Returns:
        The sampler's `DataSource`, or None for data no sampler returned.

    Raises:
        PrivacyConfigurationError: `data` is a dataset derived from a
            sampler's dataset (for example through `cache` or `repeat`,
            which replay its draws).
    """
    source = getattr(data, _ATTRIBUTE, None)
    if source is not None:
        return source
    graph = _serialized_graph(data)
    if graph is None:
        return None
    if _MARKER_PREFIX.encode() in graph:
        raise PrivacyConfigurationError(
            "This dataset was derived from a tf_megadp sampler's dataset "
            "(cache, repeat, map, batch, ...). A transformation can replay or mix "
            "the sampler's draws, which the accountant does not cover. Pass the "
            "dataset that `sampler.as_dataset(map_fn)` returns to fit as it is; "
            "put per-micro-batch processing into its map_fn."
        )
    return None


def refuse_repeated(data) -> None:
    """Refuses a dataset that no sampler drew and that repeats its data.

    After `.repeat()` a pass over the data ends inside a logical step (k
    micro-batches) or inside one batch, whatever `steps_per_epoch` says, so
    one noisy sum can hold an example twice: `shuffle(...).batch(8).repeat()`,
    three batches a pass, k = 2, gave copies per noisy sum [1, 2, 1, 1, 2, 1].
    Without `repeat`, every `fit` epoch is one pass and the private `fit`
    ends a partial logical step at each epoch's end.

    Args:
        data: what is passed to `fit` as `x`.

    Raises:
        PrivacyConfigurationError: the dataset's graph holds a `RepeatDataset`.
    """
    graph = _serialized_graph(data)
    if graph is None:
        return
    import tensorflow as tf

    definition = tf.compat.v1.GraphDef.FromString(graph)
    nodes = list(definition.node)
    for function in definition.library.function:
        nodes += list(function.node_def)
    if any(node.op == "RepeatDataset" for node in nodes):
        raise PrivacyConfigurationError(
            "This dataset repeats its data (.repeat()): a pass over the data then ends "
            "inside a logical step or a batch, so one noisy sum can hold an example "
            "twice. Remove .repeat() and set fit(epochs=...): every epoch is then one "
            "pass, and the private fit ends a partial logical step at each epoch's end. "
            "Or feed a tf_megadp sampler's dataset (PoissonSampler.from_arrays(...)"
            ".as_dataset())."
        )


def _serialized_graph(data) -> bytes | None:
    """The serialized graph of a `tf.data.Dataset` (None for anything else)."""
    serialize = getattr(data, "_as_serialized_graph", None)
    if serialize is None:
        return None
    import tensorflow as tf

    try:
        return serialize(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN
        ).numpy()
    except (tf.errors.OpError, ValueError, TypeError):
        return None
