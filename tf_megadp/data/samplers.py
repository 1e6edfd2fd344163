"""Samplers that build logical batches from token shards, arrays or indexable records.

The accountant assumes Poisson sampling: in every logical step each of the N
examples joins the batch independently with probability q_t. `PoissonSampler`
does exactly that, in two exact stages: the step size b ~ Binomial(N, q_t),
then a uniformly random b-subset of the N examples. The same sampler reads
from a small "record store": memory-mapped token shards (the constructor),
in-memory arrays (`PoissonSampler.from_arrays`) or any collection with
`len` and `records[i]` (`PoissonSampler.from_records`). Examples are read by
random access, so a step costs memory in proportion to its batch, never to N.

Accelerators need static shapes, so every step is emitted as exactly k_t
micro-batches of M = m * R rows (the schedule's capacity), the unused slots
filled with all-zero rows of weight 0. A step that samples more than capacity
examples keeps a uniformly random subset of capacity: that is the truncated
Poisson mechanism, which the accountant covers with
`TruncatedSubsampledGaussianDpEvent(max_batch_size=schedule.capacity(phase))`.
The schedule sizes capacity so that this almost never happens; when it does,
the sampler counts it and warns.

The DP guarantee holds only while the draws stay secret, so every sampler
takes its randomness from OS entropy by default and keeps it in memory only
(a `tf_megadp.secret.Secret`, which no `vars()`, repr or pickle shows); an explicit `seed=` warns and marks the run as seeded, and
`shared_secret=` lets several hosts draw the same steps. Every dataset a
sampler returns carries its `tf_megadp.data.sources.DataSource`.

`ShuffleSampler` gives fixed-size batches from shuffled epochs for users who
want them. Its privacy is *not* what Poisson accounting reports (Chua et al.,
2024): see its docstring.

Correlated noise (`tf_megadp.BandMF`, `tf_megadp.BLT`) needs samplers whose
examples join steps at known distances: `PoissonSampler(cycle_length=L)`
(cyclic Poisson: each example belongs to one of L secret groups and can
join only the steps of its group, L apart) and `FixedOrderSampler` (one
secret order, each example in the same slot of every epoch).

Each sampler names its sampling kind (`sampling_kind`); the kind, with the
`dp_accounting` event of one step, is registered once in
`tf_megadp.accounting.events`, where the "poisson" and "shuffle" kinds live,
so that the accounting never needs the data pipeline: a new sampler is one
class here plus its kind's registration and its row in
tests/test_accounting.py. The shared machinery is in `tf_megadp.data.base`,
the stores in `tf_megadp.data.stores` and `tf_megadp.data.shards`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tf_megadp.accounting.events import CYCLIC_POISSON, FIXED_ORDER, SHUFFLE_WARNING
from tf_megadp.data.base import Sampler, StepDraw
from tf_megadp.data.entropy import warn_at_caller
from tf_megadp.data.sampler_settings import SamplerSettings
from tf_megadp.data.shards import TokenShards
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import BatchSizeSchedule, Phase, steps_for_epochs

__all__ = ["FixedOrderSampler", "PoissonSampler", "ShuffleSampler", "SHUFFLE_WARNING"]

# The spawn keys of the secret streams of a cyclic sampler's groups and of a
# fixed-order sampler's order (PoissonSampler uses 0 to 4 for its draws).
_GROUPS, _ORDER = 5, 6

# Exact uniform subsets are drawn block by block so that no step allocates
# anything proportional to N (a permutation of 1e9 rows would be 8 GB).
_SUBSET_BLOCK = 1 << 20


def _uniform_subset(rng: np.random.Generator, population: int, size: int) -> np.ndarray:
    """A uniformly random `size`-subset of range(population), sorted.

    Exact for any population: the number of chosen rows in each block of a
    uniform subset is multivariate hypergeometric, and given those counts the
    rows within each block are a uniform subset of the block. Memory is
    O(size + block), never O(population).
    """
    if population <= _SUBSET_BLOCK:
        chosen = rng.choice(population, size=size, replace=False, shuffle=False)
        return np.sort(chosen.astype(np.int64))
    num_blocks = math.ceil(population / _SUBSET_BLOCK)
    block_sizes = np.full(num_blocks, _SUBSET_BLOCK, dtype=np.int64)
    block_sizes[-1] = population - _SUBSET_BLOCK * (num_blocks - 1)
    counts = rng.multivariate_hypergeometric(block_sizes, size, method="marginals")
    parts = []
    for block, (block_size, count) in enumerate(zip(block_sizes, counts)):
        if count:
            local = rng.choice(int(block_size), size=int(count), replace=False, shuffle=False)
            parts.append(np.sort(local.astype(np.int64)) + block * _SUBSET_BLOCK)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


class PoissonSampler(Sampler):
    """Exact Poisson sampling of logical batches, emitted as static micro-batches.

    For logical step t with rate q_t = schedule.sampling_rate(t), the step size
    is b ~ Binomial(N, q_t) and its examples are a uniform b-subset of the N:
    together, every example joins every step independently with probability
    q_t. The step becomes k_t micro-batches of m * R rows; padding rows are
    zeros with weight 0. If b exceeds the capacity k_t * m * R, a uniform
    subset of capacity examples is kept (truncated Poisson sampling,
    accounted with `max_batch_size = schedule.capacity(phase)`);
    `truncated_steps` counts such steps and each one raises a warning.

    The same sampler serves token shards (this constructor), in-memory arrays
    (`from_arrays`) and indexable collections of examples (`from_records`).

    Randomness is secret by default: 128 bits of OS entropy, held only in a
    `tf_megadp.secret.Secret` (never in an attribute `vars()` shows, the repr,
    a pickle or the `DataSource`). The DP guarantee holds only while the draws stay secret.
    `seed=` makes the draws reproducible, for tests and debugging: it warns,
    and the privacy report marks the run as seeded. Several hosts that must
    draw the same steps pass the same `shared_secret` (drawn from OS entropy
    and shared in memory, e.g. by `tf_megadp.distribute.shared_sampling_secret`).
    To resume, create a new sampler with `start_step=int(optimizer.iterations)`:
    it draws fresh steps, as private as the ones they replace. Randomness is
    expanded by NumPy's PCG64, which is not a cryptographic generator.

    With `cycle_length=L > 1` (cyclic Poisson sampling, for `tf_megadp.BandMF`
    noise with L >= its bands): the sampler's secret splits the N examples
    into L groups of floor(N / L) or ceil(N / L) (a secret permutation, 4
    bytes per example), and step t samples every example of group t mod L
    independently at q_t = B_t L / N, so the expected batch stays B_t and an
    example can join only steps L apart. Its steps are of kind
    "cyclic_poisson". Each phase of the schedule must start at a multiple
    of L (one q per round of L steps) and have B_t L <= N.

    Args:
        shards: the corpus, a `TokenShards`; N = len(shards) must equal
            `schedule.num_examples`.
        schedule: the `BatchSizeSchedule` shared with the optimizer and accountant.
        seed: a non-negative int for reproducible, non-private draws (warns).
        shared_secret: an int of at least 2**32 drawn from OS entropy and
            shared between hosts; cannot be combined with `seed`.
        start_step: first logical step to draw (`int(optimizer.iterations)`
            on resume).
        end_step: logical step to stop before; default `schedule.total_steps`.

    Example:
    ```python
    shards = tf_megadp.TokenShards("corpus/")
    schedule = tf_megadp.BatchSizeSchedule.for_poisson(
        [(50, 256), (50, 1024)], num_examples=len(shards), micro_batch_size=32)
    sampler = tf_megadp.PoissonSampler(shards, schedule)
    dataset = sampler.as_dataset(map_fn)   # e.g. the BERT job's MaskedLMBatcher
    ```
    """

    sampling_kind = "poisson"
    takes_cycles = True

    def __init__(self, shards: TokenShards, schedule: BatchSizeSchedule, **randomness: Any):
        super().__init__(shards, schedule, **randomness)
        self.steps_drawn = 0
        self.truncated_steps = 0
        self.truncated_examples = 0
        self._groups: tuple[np.ndarray, np.ndarray] | None = None
        if self.cycle_length > 1:
            self.sampling_kind = CYCLIC_POISSON
            _check_cycles(schedule, self.cycle_length)

    def _group(self, group: int) -> np.ndarray:
        """The examples of group `group` of a cyclic sampler (a view of its secret permutation)."""
        if self._groups is None:
            population = self.schedule.num_examples
            dtype = np.uint32 if population < 1 << 32 else np.int64
            permutation = np.arange(population, dtype=dtype)
            self._rng(_GROUPS).shuffle(permutation)
            # Group g is positions [g N // L, (g + 1) N // L): sizes differ by at most one.
            starts = (np.arange(self.cycle_length + 1) * population) // self.cycle_length
            self._groups = (permutation, starts)
        permutation, starts = self._groups
        return permutation[starts[group]:starts[group + 1]]

    @classmethod
    def _schedule_for(cls, num_examples: int, settings: SamplerSettings) -> BatchSizeSchedule:
        steps = steps_for_epochs(settings.epochs, num_examples=num_examples,
                                 batch_size=settings.batch_size)
        return BatchSizeSchedule.for_poisson(
            [(steps, settings.batch_size)],
            num_examples=num_examples,
            micro_batch_size=settings.micro_batch_size,
            num_replicas=settings.replicas,
            truncation_probability=(1e-9 if settings.truncation_probability is None
                                    else settings.truncation_probability),
        )

    def draw(self, step: int) -> StepDraw:
        """The examples of logical step `step` (the same on every call and host).

        A step this sampler's run draws again in the same process (resumed
        from a backup after a crash) is drawn afresh (`_continued_at`).

        Args:
            step: logical step, 0-based.

        Returns:
            A `StepDraw`.
        """
        phase = self.schedule.phase_at(step)
        capacity = self.schedule.capacity(phase)
        rng = self._step_rng(0, step)
        rate = self.schedule.sampling_rate(step)
        if self.cycle_length > 1:
            members = self._group(step % self.cycle_length)
            size = int(rng.binomial(members.size, rate * self.cycle_length))
            indices = np.sort(members[_uniform_subset(rng, members.size, size)].astype(np.int64))
        else:
            population = self.schedule.num_examples
            size = int(rng.binomial(population, rate))
            indices = _uniform_subset(rng, population, size)
        if size > capacity:
            keep = rng.choice(size, size=capacity, replace=False, shuffle=False)
            indices = indices[np.sort(keep)]
            self.truncated_steps += 1
            self.truncated_examples += size - capacity
            # At the 1st, 10th, 100th... truncated step: a run's log is not a
            # line per step (the report counts them all).
            if str(self.truncated_steps).rstrip("0") == "1":
                warn_at_caller(
                    f"Poisson step {step} sampled {size} examples, more than its capacity "
                    f"{capacity}; kept a uniform subset of {capacity} (truncated steps so "
                    f"far: {self.truncated_steps}; warned again at 10, 100, ...). The "
                    f"accountant covers this through max_batch_size={capacity}; if it "
                    "recurs, build the schedule with a smaller truncation_probability.",
                    RuntimeWarning,
                )
        self.steps_drawn += 1
        return StepDraw(step, indices, size, capacity)


class ShuffleSampler(Sampler):
    """Fixed-size batches from shuffled epochs. NOT what Poisson accounting assumes.

    Each epoch is a fresh random permutation of the examples; logical step t
    takes the next B_t = phase.batch_size of it (a step never straddles two
    epochs: the leftover examples of an epoch are skipped). Every example
    appears exactly once per epoch, so the batches are neither independent
    across steps nor of random size. Accountants (including tf_megadp's) can
    only report such a run *as if* it were Poisson-sampled, which understates
    its real privacy loss (Chua et al., 2024, "How Private are DP-SGD
    Implementations?"). Prefer `PoissonSampler`; use this one to compare. Its
    datasets carry `sampling="shuffle"`, so the report says so.

    Randomness follows the same rule as `PoissonSampler` (secret by default,
    `seed=` warns, `shared_secret=` for several hosts). A resumed sampler
    reshuffles the interrupted epoch with its fresh randomness. Holds one
    permutation (4 bytes per example below 2**32 examples). `from_arrays` and
    `from_records` build a schedule of E * floor(N / B) steps.

    Args:
        shards, schedule, seed, shared_secret, start_step, end_step: as in
            `PoissonSampler`.
    """

    sampling_kind = "shuffle"

    def __init__(self, shards: TokenShards, schedule: BatchSizeSchedule, **randomness: Any):
        super().__init__(shards, schedule, **randomness)
        warn_at_caller(
            "ShuffleSampler: fixed-size shuffled batches do not satisfy the Poisson "
            "sampling assumption of DP-SGD accounting; the reported epsilon "
            "understates the privacy loss (Chua et al., 2024). Use PoissonSampler "
            "for a guarantee that matches the number.",
            UserWarning,
        )
        self._epoch = -1
        self._permutation: np.ndarray | None = None
        # (step, epoch, offset) of the next step's first row; steps are drawn in
        # order, so positions advance incrementally from here.
        self._cursor = (0, 0, 0)

    @classmethod
    def _schedule_for(cls, num_examples: int, settings: SamplerSettings) -> BatchSizeSchedule:
        return _fixed_batch_schedule(cls, num_examples, settings)

    def _position(self, step: int) -> tuple[int, int]:
        """(epoch, offset in that epoch's permutation) of the first row of `step`."""
        at, epoch, offset = self._cursor if self._cursor[0] <= step else (0, 0, 0)
        population = self.schedule.num_examples
        while True:
            size = self.schedule.phase_at(at).batch_size
            if offset + size > population:
                epoch, offset = epoch + 1, 0
            if at == step:
                self._cursor = (step, epoch, offset)
                return epoch, offset
            offset += size
            at += 1

    def draw(self, step: int) -> StepDraw:
        """The examples of step `step`: B_t consecutive entries of its epoch's permutation."""
        phase = self.schedule.phase_at(step)
        epoch, offset = self._position(step)
        if epoch != self._epoch:
            population = self.schedule.num_examples
            dtype = np.uint32 if population < 1 << 32 else np.int64
            permutation = np.arange(population, dtype=dtype)
            self._rng(1, epoch).shuffle(permutation)
            self._epoch, self._permutation = epoch, permutation
        chosen = self._permutation[offset : offset + phase.batch_size]
        indices = np.sort(chosen.astype(np.int64))
        return StepDraw(step, indices, phase.batch_size, self.schedule.capacity(phase))


def _check_cycles(schedule: BatchSizeSchedule, cycle_length: int) -> None:
    """Refuses a schedule that cyclic Poisson sampling of `cycle_length` groups cannot draw.

    Every group is sampled at q = B L / N <= 1, and every round of L steps
    (from a multiple of L) at one q, capacity and noise: the accountant
    composes rounds, and a round whose groups are sampled differently has
    no single event.
    """
    for index, phase in enumerate(schedule.phases):
        if phase.batch_size * cycle_length > schedule.num_examples:
            raise PrivacyConfigurationError(
                f"Cyclic Poisson sampling of phase {index} (batch size {phase.batch_size}) in "
                f"{cycle_length} groups needs q = B L / N = "
                f"{phase.batch_size * cycle_length / schedule.num_examples:.4g} > 1 "
                f"({schedule.num_examples} examples). Lower cycle_length to at most "
                f"{schedule.num_examples // phase.batch_size}, or the batch size.")
    for index, end in enumerate(schedule.phase_ends[:-1]):
        before, after = schedule.phases[index], schedule.phases[index + 1]
        if end % cycle_length and (
                (before.batch_size, before.accumulation_steps, before.noise_multiplier)
                != (after.batch_size, after.accumulation_steps, after.noise_multiplier)):
            raise PrivacyConfigurationError(
                f"Phase {index + 1} of the schedule starts at step {end}, inside a round of "
                f"cycle_length = {cycle_length} steps: that round would sample its groups at "
                "two rates, and its groups' guarantees would differ. Start every phase at a "
                f"multiple of {cycle_length} (e.g. phases of {cycle_length * (end // cycle_length + 1)} "
                "steps), or keep one batch size.")


class FixedOrderSampler(Sampler):
    """One secret order of the examples, the same every epoch: (k, s)-participation.

    The sampler's secret draws one permutation of the N examples (or
    units) once; epoch e takes its first s * B of them in s = floor(N / B)
    steps of B, in the same order every epoch, so every example sits in the
    same slot of every epoch: it joins at most one step in s, at least s
    steps apart, and at most k of them in k epochs (the N - s B leftover
    examples never join). This is the participation under which
    matrix-factorization noise (`tf_megadp.BandMF`, `tf_megadp.BLT`) is
    accounted without amplification (kind "fixed_order": one Gaussian
    mechanism of sensitivity sens(C) per noise segment, for removing an
    example that leaves every other example in its slot). With independent
    noise it is accounted the same way (C = I: sens = sqrt(k)).

    Static shapes as `ShuffleSampler`: every step is k micro-batches of
    m * R rows, the unused slots padding. One batch size for the whole run
    (the slots would move otherwise). A continued sampler, and a replayed
    step, keep the order: it is what the accounting counts on.

    Args:
        shards, schedule, seed, shared_secret, start_step, end_step: as in
            `PoissonSampler` (no `cycle_length`).

    Example:
    ```python
    sampler = tf_megadp.FixedOrderSampler.from_arrays(
        x, y, batch_size=250, epochs=4, micro_batch_size=50)
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.5), l2_norm_clip=1.0, noise_multiplier=4.0,
        schedule=sampler.schedule, noise=tf_megadp.BLT(num_buffers=4))
    ```
    """

    sampling_kind = FIXED_ORDER

    def __init__(self, shards: TokenShards, schedule: BatchSizeSchedule, **randomness: Any):
        super().__init__(shards, schedule, **randomness)
        sizes = sorted({phase.batch_size for phase in schedule.phases})
        if len(sizes) > 1:
            raise PrivacyConfigurationError(
                f"A FixedOrderSampler keeps one batch size, so that every example keeps its "
                f"slot in every epoch; the schedule has {sizes}. Use one batch size, or "
                "PoissonSampler(cycle_length=L) (cyclic Poisson) for a growing batch.")
        self.steps_per_epoch = schedule.num_examples // sizes[0]
        self._order: np.ndarray | None = None

    @classmethod
    def _schedule_for(cls, num_examples: int, settings: SamplerSettings) -> BatchSizeSchedule:
        return _fixed_batch_schedule(cls, num_examples, settings)

    def draw(self, step: int) -> StepDraw:
        """The examples of step `step`: slot `step mod s` of the secret order."""
        if self._order is None:
            population = self.schedule.num_examples
            order = np.arange(population, dtype=np.uint32 if population < 1 << 32 else np.int64)
            self._rng(_ORDER).shuffle(order)
            self._order = order
        phase = self.schedule.phase_at(step)
        slot = step % self.steps_per_epoch
        chosen = self._order[slot * phase.batch_size:(slot + 1) * phase.batch_size]
        return StepDraw(step, np.sort(chosen.astype(np.int64)), phase.batch_size,
                        self.schedule.capacity(phase))


def _fixed_batch_schedule(sampler: type, num_examples: int,
                          settings: SamplerSettings) -> BatchSizeSchedule:
    """One phase of `settings.epochs` passes in batches of exactly B (shuffled or fixed order)."""
    if settings.truncation_probability is not None:
        raise ValueError(f"{sampler.__name__} never truncates: drop truncation_probability.")
    steps = steps_for_epochs(settings.epochs, num_examples=num_examples,
                             batch_size=settings.batch_size, sampling=sampler.sampling_kind)
    slots = settings.micro_batch_size * settings.replicas
    return BatchSizeSchedule(
        [Phase(steps, settings.batch_size, math.ceil(settings.batch_size / slots))],
        num_examples=num_examples,
        micro_batch_size=settings.micro_batch_size,
        num_replicas=settings.replicas,
    )
