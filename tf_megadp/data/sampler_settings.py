"""`SamplerSettings`: the keyword arguments every sampler takes, as one value with one resolver.

A sampler is built either over token shards with an explicit
`BatchSizeSchedule` (its constructor) or over arrays and records
(`from_arrays`, `from_records`), which may build the schedule from B, E and
m. Every one of these entry points, for every sampler, takes the same
keywords: they are the fields of `SamplerSettings`, spelled, documented and
checked here once, and `resolve_schedule` is the one place a schedule is
chosen or built from them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

from tf_megadp.steps import BatchSizeSchedule, check_batch_fits

__all__ = ["SamplerSettings"]

# The settings from which `resolve_schedule` builds a schedule when none is given.
_SCHEDULE_BUILDING = ("batch_size", "epochs", "micro_batch_size", "num_replicas",
                      "truncation_probability")
# Of those, the ones it cannot build a schedule without.
_REQUIRED_TO_BUILD = ("batch_size", "epochs", "micro_batch_size")


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """How a sampler draws a run: its schedule (given, or built from B, E and m) and its randomness.

    Args:
        schedule: an explicit `BatchSizeSchedule` shared with the optimizer
            and the accountant, instead of the five settings below.
        batch_size: the expected logical batch size B (q = B / N).
        epochs: passes over the data, E > 0 (may be fractional); a Poisson
            run has ceil(E * N / B) logical steps
            (`tf_megadp.steps.steps_for_epochs`).
        micro_batch_size: m, the static per-replica micro-batch size.
        num_replicas: R (default 1): each element is a global micro-batch
            of m * R rows.
        truncation_probability: Poisson only: per-step bound on
            P[b > capacity] used to size k (default 1e-9).
        seed: a non-negative int for reproducible, non-private draws (warns,
            and the report marks the run as seeded).
        shared_secret: an int of at least 2**32 drawn from OS entropy and
            shared between hosts that must draw the same steps; cannot be
            combined with `seed`. It is secret: the value's repr leaves it
            out, and no sampler keeps the value.
        start_step: first logical step to draw (`int(optimizer.iterations)`
            on resume).
        end_step: logical step to stop before; default the schedule's
            total.
        cycle_length: L (default 1: Poisson sampling). With L > 1 a Poisson
            sampler assigns every example (or unit) to one of L groups by its
            secret, and step t Poisson-samples group t mod L only, at
            q = B L / N, so the expected batch stays B (cyclic Poisson
            sampling, what `tf_megadp.BandMF` noise needs with
            L >= num_bands). Static shapes, padding and truncation as with
            L = 1.

    Raises:
        ValueError: `schedule` together with any of the five settings that
            build one.

    Example:
    ```python
    # Each builds SamplerSettings(batch_size=256, epochs=3, micro_batch_size=32):
    tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=256, epochs=3,
                                         micro_batch_size=32)
    tf_megadp.ShuffleSampler.from_records(records, batch_size=256, epochs=3,
                                          micro_batch_size=32)
    ```
    """

    schedule: BatchSizeSchedule | None = None
    batch_size: int | None = None
    epochs: float | None = None
    micro_batch_size: int | None = None
    num_replicas: int | None = None
    truncation_probability: float | None = None
    seed: int | None = None
    shared_secret: int | None = dataclasses.field(default=None, repr=False)
    start_step: int = 0
    end_step: int | None = None
    cycle_length: int | None = None

    def __post_init__(self):
        given = self.schedule_settings_given()
        if self.schedule is not None and given:
            raise ValueError(
                f"Pass either schedule= or batch_size/epochs/micro_batch_size, not "
                f"both (got schedule and {', '.join(given)})."
            )

    def schedule_settings_given(self) -> list[str]:
        """The names of the settings that build a schedule, among those given."""
        return [name for name in _SCHEDULE_BUILDING if getattr(self, name) is not None]

    @property
    def replicas(self) -> int:
        """R: `num_replicas`, 1 when not given."""
        return 1 if self.num_replicas is None else self.num_replicas

    def randomness(self) -> dict[str, Any]:
        """The settings a sampler's constructor takes beside its schedule, by name."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name != "schedule" and field.name not in _SCHEDULE_BUILDING}

    def resolve_schedule(
        self,
        num_examples: int,
        build: Callable[[int, "SamplerSettings"], BatchSizeSchedule],
        sampler: str = "The sampler",
    ) -> BatchSizeSchedule:
        """The run's schedule: the one given, or `build(num_examples, settings)`.

        Args:
            num_examples: N, measured from the data.
            build: the sampler kind's schedule from checked settings (e.g.
                Poisson steps truncated with `truncation_probability`).
            sampler: the sampler's name, for the error.

        Returns:
            The `BatchSizeSchedule`.

        Raises:
            TypeError: no schedule, and one of batch_size, epochs and
                micro_batch_size missing.
            ValueError: epochs or batch_size that no run can have, or B > N.
        """
        if self.schedule is not None:
            return self.schedule
        missing = [name for name in _REQUIRED_TO_BUILD if getattr(self, name) is None]
        if missing:
            raise TypeError(
                f"{sampler} needs batch_size, epochs and micro_batch_size to build its "
                f"schedule (missing: {', '.join(missing)}), or an explicit schedule=."
            )
        epochs, batch_size = self.epochs, self.batch_size
        if isinstance(epochs, bool) or not isinstance(epochs, numbers.Real) or not (
            0 < epochs < math.inf
        ):
            raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        check_batch_fits(batch_size, num_examples)
        return build(num_examples, dataclasses.replace(self, epochs=float(epochs)))
