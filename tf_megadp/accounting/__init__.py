"""Privacy accounting: what a DP-SGD run spent, as (epsilon, delta).

Every logical step of DP-SGD is one subsampled Gaussian mechanism: each of the
N training examples joins the step's batch with probability q_t = B_t / N, the
clipped gradients are summed and Gaussian noise of standard deviation
sigma_t * C is added once. The guarantee covers one training example (one
sequence) under add/remove-one adjacency.

This module turns a run into `dp_accounting` events and asks an accountant for
epsilon at a given delta. A run is described by a `PrivacyLedger`: a list of
phases of identical logical steps (steps, q, sigma, truncation, sampling kind),
the same numbers the `DPOptimizer` stores in its `privacy_ledger` variable, so
a checkpoint carries what the run has spent.

Sampling kinds:

* ``"poisson"``: every example joins every step independently with
  probability q. If the sampler truncates a step at a static maximum batch
  (`max_batch_size > 0`), the step is a `TruncatedSubsampledGaussianDpEvent`.
  When truncation is rare, a coupling bound accounts it at the cost of the
  untruncated step (and works with RDP); otherwise dp_accounting's exact PLD
  of the truncated mechanism is used (see `_TruncationAwareAccountant`).
* ``"shuffle"``: fixed-size batches from a shuffled dataset. No accountant in
  dp_accounting covers them; they are reported *as if* Poisson-sampled, with a
  warning, because that understates the real privacy loss (Chua et al., 2024,
  "How Private are DP-SGD Implementations?"). The honest alternative is Poisson
  sampling.

Two accountants are available: ``"pld"`` (privacy loss distributions, the
default: essentially exact, 0.3-5 s per evaluation) and ``"rdp"`` (Renyi DP,
about 0.1 s, 6-135 % looser). See docs/privacy.md for the measurements.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import logging
import math
import os
import warnings
from typing import Any, Iterable, Iterator, Sequence

import dp_accounting
import numpy as np
from dp_accounting import mechanism_calibration, pld, rdp
from scipy import stats

from tf_megadp._validate import check_delta as _check_delta
from tf_megadp._validate import check_num_examples as _check_num_examples
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.files import write_json_atomically
from tf_megadp.steps import (
    BatchSizeSchedule,
    noise_multiplier_of,
    sampling_rate_of,
    steps_for_epochs,
)

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_ACCOUNTANT",
    "SAMPLING_KINDS",
    "LEDGER_COLUMNS",
    "LedgerEntry",
    "PrivacyLedger",
    "PrivacyAccountant",
    "ledger_from_schedule",
    "steps_for_epochs",
    "compute_epsilon",
    "calibrate_noise_multiplier",
]

ACCOUNTANTS = ("pld", "rdp")
DEFAULT_ACCOUNTANT = "pld"
# The position of a kind in this tuple is its code in the optimizer's ledger.
SAMPLING_KINDS = ("poisson", "shuffle")
LEDGER_COLUMNS = (
    "steps",
    "sampling_rate",
    "noise_multiplier",
    "max_batch_size",
    "sampling_kind",
)
REPORT_FORMAT = "tf_megadp.privacy_report/1"

# The accountants' own defaults: 1e-4 keeps PLD within 0.1 % of a 10x finer
# grid in every setting we measured (docs/privacy.md).
_PLD_DISCRETIZATION = 1e-4

_SHUFFLE_WARNING = (
    "Shuffled fixed-size batches are accounted as if they were Poisson-sampled. "
    "This UNDERSTATES the real privacy loss: shuffling does not give the "
    "amplification that the accountant assumes (Chua et al., 2024, 'How Private "
    "are DP-SGD Implementations?'). Report the epsilon as a Poisson-sampling "
    "estimate, or train with Poisson sampling (the tf_megadp Poisson sampler) to "
    "get a guarantee that matches the number."
)


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}."
        )
    return accountant


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """A run of identical logical steps, as the accountant sees them.

    Args:
        steps: number of logical steps (>= 0).
        sampling_rate: q = B / N, the probability that one example joins a
            step; in (0, 1].
        noise_multiplier: sigma, the noise standard deviation divided by the
            clipping norm; > 0.
        max_batch_size: the static maximum at which a Poisson step is
            truncated, or 0 for an untruncated Poisson step.
        sampling: ``"poisson"`` or ``"shuffle"``.
    """

    steps: int
    sampling_rate: float
    noise_multiplier: float
    max_batch_size: int = 0
    sampling: str = "poisson"

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(
            self.steps, (int, np.integer)
        ):
            raise ValueError(f"steps must be an integer, got {self.steps!r}.")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}.")
        q = float(self.sampling_rate)
        if not math.isfinite(q) or q <= 0.0:
            raise ValueError(
                f"sampling_rate must be in (0, 1], got {self.sampling_rate!r}."
            )
        if q > 1.0:
            raise ValueError(
                f"sampling_rate q = B / N = {q:g} is larger than 1: the batch size "
                "cannot exceed the number of examples. Check num_examples and "
                "batch_size."
            )
        sigma = float(self.noise_multiplier)
        if not math.isfinite(sigma) or sigma <= 0.0:
            raise ValueError(
                f"noise_multiplier must be a finite number > 0 for a private run, "
                f"got {self.noise_multiplier!r}. With noise_multiplier = 0 the run "
                "is not differentially private (epsilon is infinite)."
            )
        if (
            isinstance(self.max_batch_size, bool)
            or not isinstance(self.max_batch_size, (int, np.integer))
            or self.max_batch_size < 0
        ):
            raise ValueError(
                "max_batch_size must be an integer >= 0 (0 = no truncation), got "
                f"{self.max_batch_size!r}."
            )
        if self.sampling not in SAMPLING_KINDS:
            raise ValueError(
                f"sampling must be one of {SAMPLING_KINDS}, got {self.sampling!r}."
            )
        if self.sampling == "shuffle" and self.max_batch_size:
            raise ValueError(
                "max_batch_size only applies to Poisson sampling; shuffled batches "
                "have a fixed size. Pass max_batch_size=0."
            )
        # Normalise numpy scalars so that entries compare and serialise alike.
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "sampling_rate", q)
        object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "max_batch_size", int(self.max_batch_size))

    def same_mechanism(self, other: "LedgerEntry") -> bool:
        """Whether `other` describes steps identical to these (any count)."""
        return dataclasses.replace(self, steps=0) == dataclasses.replace(
            other, steps=0
        )

    def to_row(self) -> list[float]:
        """The entry as one row of the optimizer's `privacy_ledger` variable."""
        return [
            float(self.steps),
            self.sampling_rate,
            self.noise_multiplier,
            float(self.max_batch_size),
            float(SAMPLING_KINDS.index(self.sampling)),
        ]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "LedgerEntry":
        """Inverse of `to_row`."""
        if len(row) != len(LEDGER_COLUMNS):
            raise ValueError(
                f"A ledger row has {len(LEDGER_COLUMNS)} columns {LEDGER_COLUMNS}, "
                f"got {len(row)}."
            )
        steps, q, sigma, max_batch_size, kind = (float(value) for value in row)
        if kind not in range(len(SAMPLING_KINDS)):
            raise ValueError(f"Unknown sampling kind code {kind} in a ledger row.")
        return cls(
            steps=int(steps),
            sampling_rate=q,
            noise_multiplier=sigma,
            max_batch_size=int(max_batch_size),
            sampling=SAMPLING_KINDS[int(kind)],
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PrivacyLedger:
    """The logical steps a run has taken, as phases of identical steps.

    Consecutive identical steps are merged into one `LedgerEntry`, so a run
    that follows a `BatchSizeSchedule` has one entry per phase.

    Args:
        entries: the entries in training order.

    Example:
    ```python
    ledger = PrivacyLedger()
    ledger.record(100, sampling_rate=0.01, noise_multiplier=1.1)
    ledger.record(50, sampling_rate=0.01, noise_multiplier=1.1)
    len(ledger), ledger.total_steps     # (1, 150)
    ```
    """

    def __init__(self, entries: Iterable[LedgerEntry] = ()):
        self._entries: list[LedgerEntry] = []
        for entry in entries:
            self.append(entry)

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def total_steps(self) -> int:
        return sum(entry.steps for entry in self._entries)

    def append(self, entry: LedgerEntry) -> None:
        """Adds `entry`, merging it into the last entry if the steps match."""
        if not isinstance(entry, LedgerEntry):
            raise TypeError(f"Expected a LedgerEntry, got {entry!r}.")
        if entry.steps == 0:
            return
        if self._entries and self._entries[-1].same_mechanism(entry):
            last = self._entries[-1]
            self._entries[-1] = dataclasses.replace(
                last, steps=last.steps + entry.steps
            )
        else:
            self._entries.append(entry)

    def record(
        self,
        steps: int,
        *,
        sampling_rate: float,
        noise_multiplier: float,
        max_batch_size: int = 0,
        sampling: str = "poisson",
    ) -> None:
        """Records `steps` identical logical steps; see `LedgerEntry`."""
        self.append(
            LedgerEntry(steps, sampling_rate, noise_multiplier, max_batch_size, sampling)
        )

    def copy(self) -> "PrivacyLedger":
        return PrivacyLedger(self._entries)

    def to_rows(self) -> np.ndarray:
        """The ledger as a float64 array of shape (len(self), 5)."""
        return np.array(
            [entry.to_row() for entry in self._entries], dtype=np.float64
        ).reshape(len(self._entries), len(LEDGER_COLUMNS))

    @classmethod
    def from_rows(cls, rows: np.ndarray | Sequence[Sequence[float]]) -> "PrivacyLedger":
        """Inverse of `to_rows`; pass only the rows in use."""
        return cls(LedgerEntry.from_row(row) for row in np.asarray(rows, np.float64))

    def to_list(self) -> list[dict[str, Any]]:
        return [entry.to_dict() for entry in self._entries]

    @classmethod
    def from_list(cls, entries: Iterable[dict[str, Any]]) -> "PrivacyLedger":
        try:
            return cls(LedgerEntry(**entry) for entry in entries)
        except TypeError as error:
            raise ValueError(
                f"A ledger entry needs the fields {LEDGER_COLUMNS[:3]} and may have "
                f"max_batch_size and sampling: {error}"
            ) from error

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._entries!r})"


def ledger_from_schedule(
    schedule: BatchSizeSchedule,
    noise_multiplier: float | None = None,
    *,
    sampling: str = "poisson",
    steps: int | None = None,
) -> PrivacyLedger:
    """The ledger of a run that follows `schedule`.

    Poisson steps are truncated at the schedule's static capacity
    (`schedule.capacity(phase)`), as the tf_megadp Poisson sampler does.

    Args:
        schedule: the `BatchSizeSchedule`.
        noise_multiplier: sigma for phases that do not set their own.
        sampling: ``"poisson"`` or ``"shuffle"``.
        steps: number of logical steps to take; defaults to
            `schedule.total_steps`. Steps past the end stay in the last phase.

    Returns:
        A `PrivacyLedger` with one entry per phase.
    """
    if not isinstance(schedule, BatchSizeSchedule):
        raise TypeError(f"schedule must be a BatchSizeSchedule, got {schedule!r}.")
    total = schedule.total_steps if steps is None else steps
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}.")
    ledger = PrivacyLedger()
    remaining = total
    for index, phase in enumerate(schedule.phases):
        last = index == len(schedule.phases) - 1
        count = remaining if last else min(remaining, phase.steps)
        if count == 0:
            break
        sigma = noise_multiplier_of(phase, noise_multiplier)
        if sigma is None:
            raise ValueError(
                f"Phase {index} of the schedule sets no noise_multiplier; pass "
                "noise_multiplier for phases that do not set their own."
            )
        ledger.record(
            count,
            sampling_rate=sampling_rate_of(phase.batch_size, schedule.num_examples),
            noise_multiplier=sigma,
            max_batch_size=schedule.capacity(phase) if sampling == "poisson" else 0,
            sampling=sampling,
        )
        remaining -= count
    return ledger


def _entry_event(entry: LedgerEntry, num_examples: int) -> dp_accounting.DpEvent:
    """The `dp_accounting` event of `entry`'s steps.

    Every sampling kind is matched explicitly: a kind added to
    `SAMPLING_KINDS` without an accounting rule here must not be accounted as
    Poisson by default, which could understate what it spends.

    Raises:
        PrivacyConfigurationError: `entry.sampling` has no accounting rule.
    """
    if entry.sampling == "poisson" and entry.max_batch_size:
        step = dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=num_examples,
            sampling_probability=entry.sampling_rate,
            truncated_batch_size=entry.max_batch_size,
            noise_multiplier=entry.noise_multiplier,
        )
    elif entry.sampling == "poisson" or entry.sampling == "shuffle":
        # "shuffle" is accounted as if Poisson, always with _SHUFFLE_WARNING.
        step = dp_accounting.PoissonSampledDpEvent(
            entry.sampling_rate, dp_accounting.GaussianDpEvent(entry.noise_multiplier)
        )
    else:
        raise PrivacyConfigurationError(
            f"No accounting rule for sampling kind {entry.sampling!r}: tf_megadp "
            "accounts only 'poisson' and 'shuffle' (as Poisson, with a warning). "
            "Draw the batches with tf_megadp.PoissonSampler, or record the steps "
            "with sampling='shuffle'."
        )
    return dp_accounting.SelfComposedDpEvent(step, entry.steps)


class _DropUnconvergedOrders(logging.Filter):
    """Drops dp_accounting's "_compute_log_a_frac failed to converge" records.

    The RDP accountant logs one such warning (through absl) for each
    fractional Renyi order whose series does not converge within 1000 terms,
    which happens at small noise multipliers and large sampling rates, i.e.
    exactly where a calibration's bracket search probes. That order is then
    excluded (its RDP is taken as infinite), which can only make the epsilon
    bound looser, never smaller: the reported epsilon stays an upper bound
    and the records say nothing a user must act on. Every other record
    (e.g. "Negative Renyi divergence", a real numerical problem) passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


@contextlib.contextmanager
def _quiet_unconverged_orders():
    """While active, the absl logger drops only the records `_DropUnconvergedOrders` names."""
    logger = logging.getLogger("absl")
    record_filter = _DropUnconvergedOrders()
    logger.addFilter(record_filter)
    try:
        yield
    finally:
        logger.removeFilter(record_filter)


# One step's PLD holds ~1-3 MB at the default grid; 16 cover every phase of
# a run (and its exact truncated steps) with room for a calibration's probes.
@functools.lru_cache(maxsize=16)
def _step_pld(event: dp_accounting.DpEvent) -> pld.privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD of one step `event`, built as dp_accounting's `PLDAccountant` builds it.

    Building it is most of an evaluation's cost (~0.8 s for a Poisson step,
    ~3 s for an exact truncated one); composing it over the steps is a few
    FFTs. A run asks for the same step at every log, every budget check and
    every probe of a budget search, so it is built once per process.
    """
    if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
        return pld.privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
            dataset_size=event.dataset_size,
            sampling_probability=event.sampling_probability,
            truncated_batch_size=event.truncated_batch_size,
            noise_multiplier=event.noise_multiplier,
            value_discretization_interval=_PLD_DISCRETIZATION,
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        )
    return pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=event.event.noise_multiplier,
        value_discretization_interval=_PLD_DISCRETIZATION,
        sampling_prob=event.sampling_probability,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


class _StepAccountant(dp_accounting.PrivacyAccountant):
    """A dp_accounting accountant that composes a run step by step.

    dp_accounting hands `_maybe_compose` a tree of composed and self-composed
    events; both tf_megadp accountants walk it the same way (composed events
    in order, self-composed ones multiplying the count) and differ only in
    what they do with each step, `_maybe_compose_step`.
    """

    def __init__(self):
        super().__init__(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, dp_accounting.ComposedDpEvent):
            for inner in event.events:
                error = self._maybe_compose(inner, count, do_compose)
                if error is not None:
                    return error
            return None
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            return self._maybe_compose(event.event, count * event.count, do_compose)
        return self._maybe_compose_step(event, count, do_compose)

    @abc.abstractmethod
    def _maybe_compose_step(
        self, event: dp_accounting.DpEvent, count: int, do_compose: bool
    ) -> dp_accounting.PrivacyAccountant.CompositionErrorDetails | None:
        """Checks one step `event`, and with `do_compose` composes it `count` times.

        Args:
            event: a DpEvent that is neither composed nor self-composed.
            count: how many times the step is taken.
            do_compose: whether to update the accountant's state.

        Returns:
            None if the step can be accounted, else why not.
        """


class _CachedPLDAccountant(_StepAccountant):
    """dp_accounting's PLD accounting of DP-SGD steps, with each step's PLD built once.

    The same operations as `pld.PLDAccountant` in the same order (identity,
    then for each event `compose(step_pld.self_compose(count))`), so the
    epsilon is the same number; only `_step_pld` is cached. It accounts the
    events `_entry_event` makes, with positive rates, sizes and noise;
    anything else is refused rather than accounted some other way.
    """

    def __init__(self):
        super().__init__()
        self._pld = pld.privacy_loss_distribution.identity(
            value_discretization_interval=_PLD_DISCRETIZATION)

    def _maybe_compose_step(self, event, count, do_compose):
        if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
            valid = (event.dataset_size > 0 and event.truncated_batch_size > 0
                     and event.sampling_probability > 0 and event.noise_multiplier > 0)
        elif isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
                event.event, dp_accounting.GaussianDpEvent):
            valid = event.sampling_probability > 0 and event.event.noise_multiplier > 0
        else:
            valid = False
        if not valid:
            return self.CompositionErrorDetails(
                event, "tf_megadp's PLD accountant accounts only Poisson-sampled and "
                "truncated Gaussian steps with positive rate and noise")
        if do_compose and count > 0:
            self._pld = self._pld.compose(_step_pld(event).self_compose(count))
        return None

    def get_epsilon(self, target_delta: float) -> float:
        return self._pld.get_epsilon_for_delta(target_delta)


def _engine(accountant: str) -> dp_accounting.PrivacyAccountant:
    if accountant == "pld":
        return _CachedPLDAccountant()
    return rdp.RdpAccountant()


class _TruncationAwareAccountant(_StepAccountant):
    """A PLD or RDP accountant that accounts truncated Poisson steps cheaply.

    dp_accounting's exact PLD for `TruncatedSubsampledGaussianDpEvent` costs
    ~5 s per phase (RDP has none). When truncation is rare (the tf_megadp
    sampler sizes steps so that it almost never happens), a coupling bound is
    as tight and costs nothing extra: run the truncated and the untruncated
    Poisson mechanism on the same draws; their outputs differ only if some
    step truncates, which over the run has probability at most
    m = sum_t P[Binomial(N + 1, q_t) > c_t] on either neighbouring dataset.
    Hence delta_truncated(eps) <= delta_poisson(eps) + (1 + e^eps) * m.

    `get_epsilon(delta)` takes eps_hi = eps_poisson(delta / 2) and, if the
    slack s = (1 + e^eps_hi) * m is at most delta / 2, returns
    eps_poisson(delta - s) (<= eps_hi, so the bound holds at the returned
    epsilon). Otherwise it composes the exact truncated events with PLD. As
    s >= 2m, a run with 2m > delta / 2 goes to the exact events at once,
    without composing the untruncated ones it would not use.

    Args:
        accountant: ``"pld"`` or ``"rdp"``, the engine for everything else.
    """

    def __init__(self, accountant: str):
        super().__init__()
        self._kind = accountant
        # (event, count) of the untruncated run, in composition order; the
        # engine is composed on first use (`_untruncated`).
        self._steps: list[tuple[dp_accounting.DpEvent, int]] = []
        self._poisson: dp_accounting.PrivacyAccountant | None = None
        self._truncation_mass = 0.0

    def _maybe_compose_step(self, event, count, do_compose):
        if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
            if do_compose:
                self._truncation_mass += count * float(
                    stats.binom.sf(
                        event.truncated_batch_size,
                        event.dataset_size + 1,
                        event.sampling_probability,
                    )
                )
                event = dp_accounting.PoissonSampledDpEvent(
                    event.sampling_probability,
                    dp_accounting.GaussianDpEvent(event.noise_multiplier),
                )
        elif not _engine(self._kind).supports(event):
            return self.CompositionErrorDetails(event, f"{self._kind} cannot account it")
        if do_compose:
            self._steps.append((event, count))
            self._poisson = None
        return None

    def _untruncated(self) -> dp_accounting.PrivacyAccountant:
        """The engine composed with the run's steps, truncated ones as Poisson."""
        if self._poisson is None:
            self._poisson = _engine(self._kind)
            for event, count in self._steps:
                self._poisson.compose(event, count)
        return self._poisson

    def get_epsilon(self, target_delta: float) -> float:
        if self._truncation_mass == 0.0:
            return self._untruncated().get_epsilon(target_delta)
        if 2.0 * self._truncation_mass <= target_delta / 2:
            upper = self._untruncated().get_epsilon(target_delta / 2)
            if upper < 700:  # Beyond, e^eps overflows and the bound is useless anyway.
                slack = (1.0 + math.exp(upper)) * self._truncation_mass
                if slack <= target_delta / 2:
                    return self._untruncated().get_epsilon(target_delta - slack)
        if self._kind == "rdp":
            raise ValueError(
                "Truncation is too likely for the coupling bound (per-run "
                f"truncation probability {self._truncation_mass:.3g} against delta "
                f"{target_delta:g}), and the RDP accountant has no exact event for "
                "truncated Poisson sampling. Use accountant='pld', or raise the "
                "static capacity (accumulation steps) so that truncation is rarer."
            )
        return _engine("pld").compose(self.ledger).get_epsilon(target_delta)


@functools.lru_cache(maxsize=256)
def _epsilon(
    entries: tuple[LedgerEntry, ...], num_examples: int, delta: float, accountant: str
) -> float:
    # Cached: callbacks ask for the same ledger at every epoch end and log step.
    if not entries:
        return 0.0
    event = dp_accounting.ComposedDpEvent(
        [_entry_event(entry, num_examples) for entry in entries]
    )
    with _quiet_unconverged_orders():
        return float(_TruncationAwareAccountant(accountant).compose(event).get_epsilon(delta))


class PrivacyAccountant:
    """Tracks a run's ledger and reports its (epsilon, delta).

    Args:
        num_examples: N, the number of privacy units (training examples or
            sequences) in the dataset.
        delta: the target delta, in (0, 1); a warning is raised if it is above
            1/N.
        accountant: ``"pld"`` (default, tightest) or ``"rdp"``.
        ledger: the steps already taken (e.g. restored from a checkpoint).

    Example:
    ```python
    accountant = PrivacyAccountant(num_examples=60_000, delta=1e-5)
    accountant.record(1000, sampling_rate=256 / 60_000, noise_multiplier=1.1)
    accountant.epsilon()      # 0.599 (PLD)
    ```
    """

    def __init__(
        self,
        num_examples: int,
        delta: float,
        *,
        accountant: str = DEFAULT_ACCOUNTANT,
        ledger: PrivacyLedger | None = None,
    ):
        self.num_examples = _check_num_examples(num_examples)
        self.delta = _check_delta(delta, self.num_examples)
        self.accountant = _check_accountant(accountant)
        self.ledger = ledger.copy() if ledger is not None else PrivacyLedger()
        self._warned_shuffle = False
        self._warn_if_shuffled(self.ledger)

    @classmethod
    def for_run(
        cls,
        delta: float,
        *,
        schedule: BatchSizeSchedule | None = None,
        num_examples: int | None = None,
        batch_size: int | None = None,
        steps: int | None = None,
        noise_multiplier: float | None = None,
        sampling: str = "poisson",
        max_batch_size: int | None = None,
        accountant: str = DEFAULT_ACCOUNTANT,
        epochs: float | None = None,
    ) -> "PrivacyAccountant":
        """The accountant of a whole planned run; arguments as in `compute_epsilon`."""
        num_examples, ledger = _run_ledger(
            schedule=schedule,
            num_examples=num_examples,
            batch_size=batch_size,
            steps=steps,
            noise_multiplier=noise_multiplier,
            sampling=sampling,
            max_batch_size=max_batch_size,
            epochs=epochs,
        )
        return cls(num_examples, delta, accountant=accountant, ledger=ledger)

    def _warn_if_shuffled(self, ledger: PrivacyLedger) -> None:
        if not self._warned_shuffle and any(e.sampling == "shuffle" for e in ledger):
            self._warned_shuffle = True
            warnings.warn(_SHUFFLE_WARNING, UserWarning, stacklevel=3)

    def _check_entry(self, entry: LedgerEntry) -> None:
        if entry.max_batch_size > self.num_examples:
            raise ValueError(
                f"max_batch_size {entry.max_batch_size} exceeds num_examples "
                f"{self.num_examples}."
            )

    def record(
        self,
        steps: int,
        *,
        sampling_rate: float,
        noise_multiplier: float,
        max_batch_size: int = 0,
        sampling: str = "poisson",
    ) -> None:
        """Records `steps` identical logical steps; see `LedgerEntry`."""
        entry = LedgerEntry(
            steps, sampling_rate, noise_multiplier, max_batch_size, sampling
        )
        self._check_entry(entry)
        self.ledger.append(entry)
        self._warn_if_shuffled(self.ledger)

    @property
    def steps(self) -> int:
        return self.ledger.total_steps

    def dp_event(self) -> dp_accounting.DpEvent:
        """The run as one `dp_accounting` event (composed per ledger entry)."""
        return dp_accounting.ComposedDpEvent(
            [_entry_event(entry, self.num_examples) for entry in self.ledger]
        )

    def epsilon(self, ledger: PrivacyLedger | None = None) -> float:
        """Epsilon at `self.delta` of the ledger (or of `ledger` if given)."""
        ledger = self.ledger if ledger is None else ledger
        for entry in ledger:
            self._check_entry(entry)
        return _epsilon(ledger.entries, self.num_examples, self.delta, self.accountant)

    def steps_within_budget(
        self,
        target_epsilon: float,
        entry: LedgerEntry,
        *,
        limit: int | None = None,
    ) -> int:
        """How many more steps like `entry` fit in `target_epsilon`.

        Returns the largest n such that the ledger followed by n steps like
        `entry` (its own `steps` is ignored) has epsilon <= `target_epsilon`,
        capped at `limit` (without a limit, below 2**24). The answer never
        overstates what fits. Epsilon grows with the number of
        steps, so an exponential then binary search needs O(log n)
        evaluations; when all `limit` steps fit (e.g. the rest of a schedule
        phase), one evaluation says so.

        Args:
            target_epsilon: the budget, > 0.
            entry: the step to repeat.
            limit: the most steps worth asking about.

        Returns:
            n, an int in [0, limit].
        """
        if not target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}.")

        def fits(count: int) -> bool:
            ledger = self.ledger.copy()
            ledger.append(dataclasses.replace(entry, steps=count))
            return self.epsilon(ledger) <= target_epsilon

        if limit is not None and fits(limit):
            return limit
        limit = 2**24 if limit is None else limit
        if limit < 1 or not fits(1):
            return 0
        low, high = 1, 2
        while high < limit and fits(high):
            low, high = high, high * 2
        # fits(low), and min(high, limit) is taken not to fit: that is known,
        # except at the default cap, where it only makes the answer smaller.
        return self._bisect(fits, low, min(high, limit))

    @staticmethod
    def _bisect(fits, low: int, high: int) -> int:
        # Invariant: fits(low) and not fits(high).
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def report(self, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """A publishable description of what the run spent.

        Args:
            settings: training settings to publish alongside (e.g. the clipping
                norm); must be JSON-serialisable.

        Returns:
            A dict with the privacy unit, adjacency, accountant, epsilon,
            delta, N, steps, the sampling assumption, the ledger and warnings.
        """
        kinds = sorted({entry.sampling for entry in self.ledger})
        truncated = any(entry.max_batch_size for entry in self.ledger)
        warnings_ = []
        if "shuffle" in kinds:
            warnings_.append(_SHUFFLE_WARNING)
        if self.delta > 1.0 / self.num_examples:
            warnings_.append(f"delta = {self.delta:g} is larger than 1/N.")
        return {
            "format": REPORT_FORMAT,
            "privacy_unit": "one training example (sequence)",
            "neighbouring_relation": "add_or_remove_one",
            "accountant": self.accountant,
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "num_examples": self.num_examples,
            "steps": self.steps,
            "sampling": {
                "kinds": kinds,
                "truncated": truncated,
                "accounted_as": "truncated_poisson" if truncated else "poisson",
            },
            "ledger": self.ledger.to_list(),
            "settings": dict(settings or {}),
            "warnings": warnings_,
            "versions": {
                "tf_megadp": _package_version(),
                "dp_accounting": _dp_accounting_version(),
            },
        }

    def save_report(self, path: str | os.PathLike, settings: dict[str, Any] | None = None) -> None:
        """Writes `report(settings)` as JSON to `path`, atomically."""
        write_json_atomically(path, self.report(settings))

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> "PrivacyAccountant":
        """Rebuilds the accountant of a `report()` (e.g. to re-check epsilon)."""
        if report.get("format") != REPORT_FORMAT:
            raise ValueError(
                f"Not a tf_megadp privacy report (format {report.get('format')!r}, "
                f"expected {REPORT_FORMAT!r})."
            )
        return cls(
            report["num_examples"],
            report["delta"],
            accountant=report["accountant"],
            ledger=PrivacyLedger.from_list(report["ledger"]),
        )


def _package_version() -> str:
    from tf_megadp import __version__  # The package imports this module.

    return __version__


def _dp_accounting_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:
        return "unknown"


def _run_ledger(
    *,
    schedule: BatchSizeSchedule | None,
    num_examples: int | None,
    batch_size: int | None,
    steps: int | None,
    noise_multiplier: float | None,
    sampling: str,
    max_batch_size: int | None,
    epochs: float | None = None,
) -> tuple[int, PrivacyLedger]:
    """(N, ledger) from either a schedule or plain constant-batch settings."""
    if sampling not in SAMPLING_KINDS:
        raise ValueError(f"sampling must be one of {SAMPLING_KINDS}, got {sampling!r}.")
    if epochs is not None:
        if schedule is not None:
            raise PrivacyConfigurationError(
                "epochs= describes a constant-batch run, but a BatchSizeSchedule "
                "sets the steps of each phase itself: drop epochs (pass steps= to "
                "stop early) or describe the run by num_examples, batch_size and "
                "epochs without a schedule."
            )
        if steps is not None:
            raise PrivacyConfigurationError(
                f"Pass steps or epochs, not both (got steps={steps!r}, "
                f"epochs={epochs!r}): one of them fixes the number of logical steps."
            )
    if schedule is not None:
        if batch_size is not None or max_batch_size is not None:
            raise ValueError(
                "Pass either a schedule or batch_size/max_batch_size, not both: the "
                "schedule sets the batch size and the truncation of every phase."
            )
        if num_examples is not None and num_examples != schedule.num_examples:
            raise ValueError(
                f"num_examples {num_examples} differs from the schedule's "
                f"num_examples {schedule.num_examples}."
            )
        return schedule.num_examples, ledger_from_schedule(
            schedule, noise_multiplier, sampling=sampling, steps=steps
        )
    missing = [
        name
        for name, value in (
            ("num_examples", num_examples),
            ("batch_size", batch_size),
            ("steps (or epochs)", steps if epochs is None else epochs),
            ("noise_multiplier", noise_multiplier),
        )
        if value is None
    ]
    if missing:
        raise ValueError(
            f"Without a schedule, pass {', '.join(missing)} (or pass a "
            "BatchSizeSchedule)."
        )
    num_examples = _check_num_examples(num_examples)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size {batch_size} is larger than num_examples {num_examples}: "
            "the sampling rate q = B / N would exceed 1."
        )
    if epochs is not None:
        steps = steps_for_epochs(epochs, num_examples=num_examples, batch_size=batch_size,
                                 sampling=sampling)
    ledger = PrivacyLedger()
    ledger.record(
        steps,
        sampling_rate=sampling_rate_of(batch_size, num_examples),
        noise_multiplier=noise_multiplier,
        max_batch_size=max_batch_size or 0,
        sampling=sampling,
    )
    return num_examples, ledger


def compute_epsilon(
    *,
    delta: float,
    schedule: BatchSizeSchedule | None = None,
    num_examples: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    noise_multiplier: float | None = None,
    sampling: str = "poisson",
    max_batch_size: int | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    epochs: float | None = None,
) -> float:
    """Epsilon of a DP-SGD run at `delta`.

    Describe the run either by a `BatchSizeSchedule` (plus `noise_multiplier`
    for phases that do not set their own; Poisson steps are truncated at each
    phase's capacity) or by constant `num_examples`, `batch_size`, `steps` (or
    `epochs`) and `noise_multiplier` (optionally truncated at
    `max_batch_size`).

    Args:
        delta: target delta in (0, 1).
        schedule: a `BatchSizeSchedule`.
        num_examples: N.
        batch_size: expected logical batch size B (q = B / N).
        steps: logical steps; with a schedule, defaults to its total.
        noise_multiplier: sigma.
        sampling: ``"poisson"`` or ``"shuffle"`` (reported as Poisson, with a
            warning).
        max_batch_size: truncation of untruncated-schedule Poisson steps.
        accountant: ``"pld"`` or ``"rdp"``.
        epochs: instead of `steps` (not with a schedule): passes over the
            data; as many steps as the sampler of `sampling` draws, see
            `tf_megadp.steps.steps_for_epochs`.

    Returns:
        epsilon (a float; 0.0 for zero steps).

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule.

    Example:
    ```python
    compute_epsilon(num_examples=60_000, batch_size=256, steps=10_000,
                    noise_multiplier=1.1, delta=1e-5)     # 1.978
    compute_epsilon(num_examples=60_000, batch_size=256, epochs=3,
                    noise_multiplier=1.1, delta=1e-5)     # 704 steps
    ```
    """
    return PrivacyAccountant.for_run(
        delta,
        schedule=schedule,
        num_examples=num_examples,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=noise_multiplier,
        sampling=sampling,
        max_batch_size=max_batch_size,
        accountant=accountant,
        epochs=epochs,
    ).epsilon()


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    *,
    schedule: BatchSizeSchedule | None = None,
    num_examples: int | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    sampling: str = "poisson",
    max_batch_size: int | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    epochs: float | None = None,
) -> float:
    """The smallest noise multiplier whose run meets (target_epsilon, target_delta).

    The inverse of `compute_epsilon`: `compute_epsilon(noise_multiplier=s, ...)`
    is at most `target_epsilon` (and within 1 % of it) for the returned s.
    With a schedule, phases that set their own noise multiplier keep it and
    the others share the calibrated one.

    Args:
        target_epsilon: the budget, > 0.
        target_delta: delta in (0, 1).
        schedule, num_examples, batch_size, steps, sampling, max_batch_size,
        accountant, epochs: as in `compute_epsilon`.

    Returns:
        sigma, a float.

    Raises:
        PrivacyConfigurationError: both `steps` and `epochs`, or `epochs`
            with a schedule.

    Example:
    ```python
    sigma = calibrate_noise_multiplier(
        3.0, 1e-5, num_examples=60_000, batch_size=256, steps=10_000)  # 0.886
    sigma = calibrate_noise_multiplier(
        3.0, 1e-5, num_examples=60_000, batch_size=256, epochs=40)
    ```
    """
    if epochs is not None:
        # Resolved once, so the search below and its RDP seed see plain steps.
        steps = _run_ledger(
            schedule=schedule, num_examples=num_examples, batch_size=batch_size,
            steps=steps, noise_multiplier=1.0, sampling=sampling,
            max_batch_size=max_batch_size, epochs=epochs,
        )[1].total_steps
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
        raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}.")
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}.")
    if schedule is not None and all(
        phase.noise_multiplier is not None for phase in schedule.phases
    ):
        raise ValueError(
            "Every phase of the schedule sets its own noise_multiplier: there is "
            "nothing to calibrate. Set noise_multiplier=None on the phases to "
            "calibrate."
        )

    def ledger_for(sigma: float) -> PrivacyLedger:
        return _run_ledger(
            schedule=schedule,
            num_examples=num_examples,
            batch_size=batch_size,
            steps=steps,
            noise_multiplier=sigma,
            sampling=sampling,
            max_batch_size=max_batch_size,
        )[1]

    first = ledger_for(1.0)  # Validates the settings before any search.
    if first.total_steps == 0:
        raise ValueError("There are no steps to calibrate (steps = 0).")
    accountant_ = PrivacyAccountant(
        schedule.num_examples if schedule is not None else num_examples,
        target_delta,
        accountant=accountant,
        ledger=first,
    )

    def epsilon(sigma: float) -> float:
        return accountant_.epsilon(ledger_for(sigma))

    # Bracket the root ourselves: epsilon is infinite at sigma = 0, where
    # dp_accounting's default bracket search would start. For PLD, start from
    # the RDP solution: RDP is looser, so its sigma is close above PLD's, and
    # RDP evaluations are ~20x cheaper than PLD ones.
    high = 1.0
    if accountant == "pld":
        try:
            high = calibrate_noise_multiplier(
                target_epsilon,
                target_delta,
                schedule=schedule,
                num_examples=num_examples,
                batch_size=batch_size,
                steps=steps,
                sampling=sampling,
                max_batch_size=max_batch_size,
                accountant="rdp",
            )
        except ValueError:
            pass  # RDP cannot account this run (frequent truncation): start at 1.
    while epsilon(high) > target_epsilon:
        high *= 2.0
        if high > 1e6:
            raise ValueError(
                f"No noise multiplier up to 1e6 reaches epsilon {target_epsilon}: "
                "the phases with their own noise_multiplier already exceed it."
            )
    # The RDP seed is usually within 10 % above the PLD answer: a narrow
    # bracket saves PLD evaluations (about 1 s each).
    shrink = 0.9 if accountant == "pld" else 0.5
    low = high * shrink
    while epsilon(low) <= target_epsilon:
        high, low = low, low * shrink
        if low < 1e-6:
            return high

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.ComposedDpEvent(
            [
                _entry_event(entry, accountant_.num_examples)
                for entry in ledger_for(sigma)
            ]
        )

    # The search composes events itself (outside `_epsilon`): keep its
    # unconverged-order records quiet too.
    with _quiet_unconverged_orders():
        return float(
            mechanism_calibration.calibrate_dp_mechanism(
                make_fresh_accountant=lambda: _TruncationAwareAccountant(accountant),
                make_event_from_param=make_event,
                target_epsilon=target_epsilon,
                target_delta=accountant_.delta,
                bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
                tol=low * 1e-3,
            )
        )
