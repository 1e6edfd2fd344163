"""The steps of a run: one description of the logical steps for everyone.

`BatchSizeSchedule.phase_tensors(step)` gives the compiled step its phase's
k, B and sigma as tensors, from the same phases the sampler and the
accountant read.

A `BatchSizeSchedule` is the single source of truth for how big each logical
step is. The Poisson sampler reads its sampling rate q_t, the `DPOptimizer`
reads its accumulation steps k_t and its divisor B_t, and the accountant
composes one subsampled Gaussian event per phase from the same numbers. Passing
one object to all three is what keeps them from disagreeing.

Each number of a step is computed by exactly one function here, which the
sampler, the optimizer, the callbacks, the accountant, the CLI and the BERT
job call (never retype):

* `sampling_rate_of`: q = B / N (and `check_batch_fits`: B <= N);
* `step_capacity`: the static slots of a logical step, k * m * R;
* `steps_for_epochs`: the logical steps of E passes over the data;
* `noise_multiplier_of`: sigma of a phase, or the optimizer's default.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
from typing import Any, Iterable, Sequence

import numpy as np
from scipy import stats

from tf_megadp._validate import check_num_examples, check_positive_int
from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "Phase",
    "BatchSizeSchedule",
    "check_batch_fits",
    "noise_multiplier_of",
    "sampling_rate_of",
    "step_capacity",
    "steps_for_epochs",
]


def sampling_rate_of(batch_size: int | float, num_examples: int) -> float:
    """q = B / N, the probability that one example joins a step of expected size B.

    Args:
        batch_size: B, the expected logical batch (for a fixed-size step,
            the rows it held).
        num_examples: N.

    Returns:
        q, a float.

    Example:
    ```python
    sampling_rate_of(256, 60_000)   # 0.004266...
    ```
    """
    return batch_size / num_examples


def check_batch_fits(batch_size: int, num_examples: int, where: str = "") -> None:
    """Refuses an expected batch B larger than N: q = B / N would exceed 1.

    Args:
        batch_size: B.
        num_examples: N.
        where: what the batch belongs to, for the message (e.g. "Phase 2 has ").

    Raises:
        ValueError: B > N.
    """
    if batch_size > num_examples:
        raise ValueError(
            f"{where}batch_size {batch_size} is larger than num_examples {num_examples}, so "
            "the expected batch exceeds the data: the sampling rate would exceed 1 "
            "(q = B / N). Use a smaller batch_size."
        )


def step_capacity(accumulation_steps: int, micro_batch_size: int, num_replicas: int = 1) -> int:
    """k * m * R: the static example slots of one logical step.

    Args:
        accumulation_steps: k, micro-batches per logical step.
        micro_batch_size: m, rows per replica and micro-batch.
        num_replicas: R.

    Returns:
        The capacity, an int (a tensor where any argument is one).
    """
    return accumulation_steps * micro_batch_size * num_replicas


def noise_multiplier_of(phase: "Phase", default: float | None) -> float | None:
    """sigma of `phase`: its own noise multiplier, or `default` where it sets none."""
    return default if phase.noise_multiplier is None else float(phase.noise_multiplier)


def steps_for_epochs(
    epochs: float, *, num_examples: int, batch_size: int, sampling: str = "poisson"
) -> int:
    """Logical steps of `epochs` passes over N examples at (expected) batch B.

    One epoch of Poisson steps is N / B steps in expectation (each example
    joins each step with probability q = B / N), as in tensorflow-privacy's
    `compute_dp_sgd_privacy` and Opacus; the count is rounded up, so the
    accounted run is never shorter than the one asked for (cyclic Poisson
    alike: each of its L groups is sampled at L B / N once every L steps).
    A shuffled or fixed-order epoch is floor(N / B) full batches (the
    leftover examples are skipped), and
    E epochs are floor(E * floor(N / B)) steps. `epochs` is read as the
    decimal the user wrote (0.3 epochs of N = 1000, B = 100 is 3 steps, not 4
    from binary round-off), so the sampler, the accountant and the CLI count
    the same steps.

    Args:
        epochs: passes over the data, a finite number > 0.
        num_examples: N.
        batch_size: expected logical batch B.
        sampling: ``"poisson"``, ``"cyclic_poisson"``, ``"shuffle"`` or
            ``"fixed_order"``.

    Returns:
        The number of logical steps, an int >= 1.

    Raises:
        PrivacyConfigurationError: `epochs` is not a finite number > 0, or
            a shuffled run of `epochs` is less than one step.

    Example:
    ```python
    steps_for_epochs(3, num_examples=60_000, batch_size=256)      # 704
    steps_for_epochs(1.1, num_examples=100, batch_size=10)        # 11
    ```
    """
    if (
        isinstance(epochs, bool)
        or not isinstance(epochs, (int, float, np.integer, np.floating))
        or not math.isfinite(epochs)
        or epochs <= 0
    ):
        raise PrivacyConfigurationError(
            f"epochs must be a finite number > 0, got {epochs!r}; or pass steps= instead."
        )
    num_examples = check_num_examples(num_examples)
    batch_size = check_positive_int("batch_size", batch_size)
    decimal_epochs = fractions.Fraction(repr(float(epochs)))
    # Fixed-size epochs (shuffled, or one fixed order) skip the leftover examples.
    if sampling in ("shuffle", "fixed_order"):
        steps = math.floor(decimal_epochs * (num_examples // batch_size))
        if steps < 1:
            raise PrivacyConfigurationError(
                f"epochs={epochs} of {num_examples // batch_size} full batches per epoch "
                "is less than one step; raise epochs."
            )
        return steps
    if sampling not in ("poisson", "cyclic_poisson"):
        raise ValueError(
            "sampling must be 'poisson', 'cyclic_poisson', 'shuffle' or 'fixed_order', got "
            f"{sampling!r}.")
    return max(1, math.ceil(decimal_epochs * num_examples / batch_size))


@dataclasses.dataclass(frozen=True)
class Phase:
    """A run of identical logical steps.

    Args:
        steps: number of logical steps in the phase (>= 1).
        batch_size: the expected logical batch size B_t. Under Poisson
            sampling it is q_t * N; it is always the divisor of the noisy
            gradient sum (never the realised batch size).
        accumulation_steps: micro-batches per logical step, k_t. The static
            capacity of a step is k_t * micro_batch_size * num_replicas.
        noise_multiplier: sigma_t for this phase, or None to use the
            optimizer's own `noise_multiplier`.
    """

    steps: int
    batch_size: int
    accumulation_steps: int
    noise_multiplier: float | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Phase.{name} must be a positive integer, got {value!r}."
                )
        if self.noise_multiplier is not None:
            sigma = float(self.noise_multiplier)
            if not math.isfinite(sigma) or sigma < 0:
                raise ValueError(
                    "Phase.noise_multiplier must be a finite number >= 0 or None, "
                    f"got {self.noise_multiplier!r}."
                )


class BatchSizeSchedule:
    """Piecewise-constant logical batch sizes, e.g. a batch that grows.

    Args:
        phases: the phases in training order.
        num_examples: N, the number of privacy units (sequences) in the corpus.
        micro_batch_size: m, the static per-replica micro-batch size.
        num_replicas: R, replicas that each process one micro-batch per
            micro-step.

    Example:
    ```python
    schedule = BatchSizeSchedule.for_poisson(
        [(100, 1024), (400, 4096)], num_examples=100_000, micro_batch_size=256)
    schedule.sampling_rate(0)      # 0.01024
    schedule.phase_at(150)         # Phase(steps=400, batch_size=4096, ...)
    ```
    """

    def __init__(
        self,
        phases: Sequence[Phase],
        *,
        num_examples: int,
        micro_batch_size: int,
        num_replicas: int = 1,
    ):
        phases = tuple(phases)
        if not phases:
            raise ValueError("A BatchSizeSchedule needs at least one Phase.")
        for name, value in (
            ("num_examples", num_examples),
            ("micro_batch_size", micro_batch_size),
            ("num_replicas", num_replicas),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for index, phase in enumerate(phases):
            if not isinstance(phase, Phase):
                raise TypeError(f"phases[{index}] is {phase!r}, not a Phase.")
            check_batch_fits(phase.batch_size, num_examples, f"Phase {index} has ")
            capacity = step_capacity(phase.accumulation_steps, micro_batch_size, num_replicas)
            if capacity < phase.batch_size:
                raise ValueError(
                    f"Phase {index}: accumulation_steps * micro_batch_size * "
                    f"num_replicas = {capacity} is smaller than batch_size "
                    f"{phase.batch_size}. Raise accumulation_steps to at least "
                    f"{math.ceil(phase.batch_size / (micro_batch_size * num_replicas))}."
                )
        self._phases = phases
        self.num_examples = num_examples
        self.micro_batch_size = micro_batch_size
        self.num_replicas = num_replicas

    @classmethod
    def for_poisson(
        cls,
        steps_and_batch_sizes: Iterable[tuple[int, int]],
        *,
        num_examples: int,
        micro_batch_size: int,
        num_replicas: int = 1,
        truncation_probability: float = 1e-9,
        noise_multipliers: Sequence[float | None] | None = None,
    ) -> "BatchSizeSchedule":
        """Builds a schedule whose static capacity rarely truncates a Poisson step.

        For each phase, k_t is the smallest number of micro-batches whose
        capacity c satisfies P[Binomial(N, q_t) > c] <= truncation_probability.

        Args:
            steps_and_batch_sizes: (steps, expected batch size) per phase.
            num_examples: N.
            micro_batch_size: m.
            num_replicas: R.
            truncation_probability: per-step bound on the probability that a
                sampled step has more examples than fit.
            noise_multipliers: optional sigma_t per phase.

        Returns:
            A `BatchSizeSchedule`.
        """
        if not 0 < truncation_probability < 1:
            raise ValueError(
                "truncation_probability must be in (0, 1), got "
                f"{truncation_probability!r}."
            )
        pairs = list(steps_and_batch_sizes)
        sigmas = list(noise_multipliers) if noise_multipliers else [None] * len(pairs)
        if len(sigmas) != len(pairs):
            raise ValueError("noise_multipliers needs one entry per phase.")
        slots_per_micro_step = micro_batch_size * num_replicas
        phases = []
        for (steps, batch_size), sigma in zip(pairs, sigmas):
            q = min(1.0, sampling_rate_of(batch_size, num_examples))
            needed = int(stats.binom.isf(truncation_probability, num_examples, q))
            needed = max(needed, batch_size)
            accumulation_steps = max(1, math.ceil(needed / slots_per_micro_step))
            phases.append(Phase(steps, batch_size, accumulation_steps, sigma))
        return cls(
            phases,
            num_examples=num_examples,
            micro_batch_size=micro_batch_size,
            num_replicas=num_replicas,
        )

    @classmethod
    def constant(
        cls,
        steps: int,
        batch_size: int,
        *,
        num_examples: int,
        micro_batch_size: int,
        num_replicas: int = 1,
        truncation_probability: float = 1e-9,
    ) -> "BatchSizeSchedule":
        """A single-phase Poisson schedule; see `for_poisson`."""
        return cls.for_poisson(
            [(steps, batch_size)],
            num_examples=num_examples,
            micro_batch_size=micro_batch_size,
            num_replicas=num_replicas,
            truncation_probability=truncation_probability,
        )

    def extended(
        self,
        phases: Iterable[Phase | tuple[int, int]],
        *,
        truncation_probability: float = 1e-9,
    ) -> "BatchSizeSchedule":
        """This schedule followed by more phases, for the same N, micro-batch size and replicas.

        Args:
            phases: `Phase` objects, or (steps, expected batch size) pairs,
                whose accumulation steps are sized as `for_poisson` sizes them.
            truncation_probability: as in `for_poisson`, for the pairs.

        Returns:
            A `BatchSizeSchedule` whose first phases are this one's.

        Example:
        ```python
        longer = schedule.extended([(200, 4096)])
        longer.total_steps == schedule.total_steps + 200     # True
        ```
        """
        added = []
        for phase in phases:
            if not isinstance(phase, Phase):
                phase = BatchSizeSchedule.for_poisson(
                    [phase], num_examples=self.num_examples,
                    micro_batch_size=self.micro_batch_size, num_replicas=self.num_replicas,
                    truncation_probability=truncation_probability,
                ).phases[0]
            added.append(phase)
        if not added:
            raise ValueError("extended needs at least one phase to add.")
        return BatchSizeSchedule(
            self._phases + tuple(added), num_examples=self.num_examples,
            micro_batch_size=self.micro_batch_size, num_replicas=self.num_replicas,
        )

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self._phases

    @property
    def total_steps(self) -> int:
        """Logical steps over all phases."""
        return sum(phase.steps for phase in self._phases)

    @property
    def phase_ends(self) -> list[int]:
        """Cumulative logical step at which each phase ends (exclusive)."""
        ends, total = [], 0
        for phase in self._phases:
            total += phase.steps
            ends.append(total)
        return ends

    def capacity(self, phase: Phase) -> int:
        """Static example slots of one logical step of `phase`."""
        return step_capacity(phase.accumulation_steps, self.micro_batch_size, self.num_replicas)

    def phase_index(self, step: int) -> int:
        """Index of the phase that logical step `step` (0-based) belongs to.

        Steps past the end of the schedule stay in the last phase.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        for index, end in enumerate(self.phase_ends):
            if step < end:
                return index
        return len(self._phases) - 1

    def phase_at(self, step: int) -> Phase:
        return self._phases[self.phase_index(step)]

    def phase_tensors(self, step, noise_multiplier: float | None):
        """(k, B, sigma) of logical step `step` (a tensor), for the compiled step.

        Args:
            step: the logical step, an int64 scalar tensor.
            noise_multiplier: sigma of the phases that set none.

        Returns:
            (accumulation steps int64, batch size float32, noise multiplier
            float32), each a scalar tensor; steps past the end stay in the
            last phase, as `phase_at`.
        """
        import tensorflow as tf

        phases = self.phases
        ends = tf.constant(self.phase_ends[:-1], tf.int64)
        index = tf.searchsorted(ends, tf.reshape(step, [1]), side="right")[0]
        pick = lambda values, dtype: tf.gather(tf.constant(values, dtype), index)
        return (
            pick([p.accumulation_steps for p in phases], tf.int64),
            pick([float(p.batch_size) for p in phases], tf.float32),
            pick([noise_multiplier_of(p, noise_multiplier) for p in phases], tf.float32),
        )

    def sampling_rate(self, step: int) -> float:
        """q_t = B_t / N for logical step `step`."""
        return sampling_rate_of(self.phase_at(step).batch_size, self.num_examples)

    def truncation_probability(self, phase: Phase) -> float:
        """P[Binomial(N, q) > capacity] for one Poisson step of `phase`."""
        q = sampling_rate_of(phase.batch_size, self.num_examples)
        return float(stats.binom.sf(self.capacity(phase), self.num_examples, q))

    def examples_processed(self) -> int:
        """Expected number of examples over the whole schedule."""
        return sum(phase.steps * phase.batch_size for phase in self._phases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_examples": self.num_examples,
            "micro_batch_size": self.micro_batch_size,
            "num_replicas": self.num_replicas,
            "phases": [dataclasses.asdict(phase) for phase in self._phases],
        }

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "BatchSizeSchedule":
        try:
            phases = [Phase(**phase) for phase in config["phases"]]
            return cls(
                phases,
                num_examples=config["num_examples"],
                micro_batch_size=config["micro_batch_size"],
                num_replicas=config.get("num_replicas", 1),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(
                "A schedule needs num_examples, micro_batch_size and phases, each "
                "phase with steps, batch_size and accumulation_steps "
                f"(noise_multiplier optional): {error}"
            ) from error

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "BatchSizeSchedule":
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSizeSchedule) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        phases = ", ".join(
            f"{p.steps}x(B={p.batch_size}, k={p.accumulation_steps})" for p in self._phases
        )
        return (
            f"BatchSizeSchedule([{phases}], N={self.num_examples}, "
            f"m={self.micro_batch_size}, R={self.num_replicas})"
        )
