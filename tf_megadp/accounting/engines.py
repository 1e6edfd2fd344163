"""Accountant engines: the registry of `dp_accounting` accountants that compose a run's events.

An accountant is one `dp_accounting.PrivacyAccountant` class plus one
`register_accountant` line: ``"pld"`` (a PLD engine that builds each step's
privacy loss distribution once) and ``"rdp"`` (dp_accounting's RDP). The
truncation-aware accountant wraps the chosen engine and accounts rarely
truncated Poisson steps by a coupling bound. `epsilon` is the cached entry
point every accountant, callback and calibration goes through.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import math
from typing import Any, Callable

import dp_accounting
from dp_accounting import pld, rdp
from scipy import stats

from tf_megadp.accounting import mechanisms
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.accounting.events import ledger_event


__all__ = [
    "DEFAULT_ACCOUNTANT",
    "TruncationAwareAccountant",
    "accountant_names",
    "check_accountant",
    "epsilon",
    "pld_grid_points",
    "quiet_unconverged_orders",
    "register_accountant",
]

DEFAULT_ACCOUNTANT = "pld"

_ENGINES: dict[str, Callable[[], dp_accounting.PrivacyAccountant]] = {}


def register_accountant(name: str):
    """Decorator: registers a `dp_accounting.PrivacyAccountant` class (or factory) as `name`.

    Every `accountant=` argument of the library, the CLI and the BERT job
    accepts the registered names. The engine must account the events the
    sampling kinds make (`tf_megadp.accounting.events`) under add/remove-one
    adjacency, or refuse them (`supports` false); tests/test_accounting.py
    checks each registered engine against its reference row.

    Example:
    ```python
    @register_accountant("my_rdp")
    class MyRdp(dp_accounting.rdp.RdpAccountant):
        ...
    ```
    """

    def register(make_engine):
        if name in _ENGINES:
            raise ValueError(f"An accountant named {name!r} is already registered.")
        _ENGINES[name] = make_engine
        return make_engine

    return register


def accountant_names() -> tuple[str, ...]:
    """The registered accountants' names, in registration order."""
    return tuple(_ENGINES)


# The accountants' own defaults: 1e-4 keeps PLD within 0.1 % of a 10x finer
# grid in every setting we measured (docs/privacy.md).
_PLD_DISCRETIZATION = 1e-4


def check_accountant(accountant: str) -> str:
    if accountant not in _ENGINES:
        raise ValueError(
            f"accountant must be one of {accountant_names()}, got {accountant!r}."
        )
    return accountant


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
def quiet_unconverged_orders():
    """While active, the absl logger drops only the records `_DropUnconvergedOrders` names."""
    logger = logging.getLogger("absl")
    record_filter = _DropUnconvergedOrders()
    logger.addFilter(record_filter)
    try:
        yield
    finally:
        logger.removeFilter(record_filter)


# The largest one-step PLD the accountant builds (points of its privacy-loss
# grid): about sigma = 0.03 for a Poisson step, ~10 s and ~1 GB. A run of
# sigma 1e-3 (clipping without noise) asked dp_accounting for a 38 GiB grid.
PLD_GRID_LIMIT = 10_000_000


# One step's PLD holds ~1-3 MB at the default grid; 16 cover every phase of
# a run (and its exact truncated steps) with room for a calibration's probes.
@functools.lru_cache(maxsize=16)
def _step_pld(event: dp_accounting.DpEvent) -> pld.privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD of one step `event`, built as dp_accounting's `PLDAccountant` builds it.

    Building it is most of an evaluation's cost (~0.8 s for a Poisson step,
    ~3 s for an exact truncated one); composing it over the steps is a few
    FFTs. A run asks for the same step at every log, every budget check and
    every probe of a budget search, so it is built once per process.

    Raises:
        PrivacyConfigurationError: the step's grid exceeds `PLD_GRID_LIMIT`
            (a tiny noise multiplier); RDP accounts it at any sigma.
    """
    points = pld_grid_points(event)
    if points > PLD_GRID_LIMIT:
        raise PrivacyConfigurationError(
            f"The PLD accountant would build a privacy-loss grid of {points:,} points for one "
            f"step of this run (more than {PLD_GRID_LIMIT:,}: its noise multiplier is tiny, and "
            "time and memory grow as 1 / sigma^2). Account it with accountant='rdp' "
            "(--accountant rdp: a valid, looser bound, fast at any sigma), or raise the "
            "noise multiplier.")
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


@functools.lru_cache(maxsize=16)
def _gaussian_pld(standard_deviation: float
                  ) -> pld.privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD of an unsampled Gaussian, as dp_accounting's `PLDAccountant` builds it.

    `PLDAccountant` composes a `GaussianDpEvent` taken `count` times as one
    Gaussian of standard deviation sigma / sqrt(count) (Gaussians compose
    exactly); so does this one, for the same epsilon.
    """
    return pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=standard_deviation,
        value_discretization_interval=_PLD_DISCRETIZATION,
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
        return self._maybe_compose_step(
            mechanisms.as_single_gaussian(event), count, do_compose)

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


@register_accountant("pld")
class _CachedPLDAccountant(_StepAccountant):
    """dp_accounting's PLD accounting of DP-SGD steps, with each step's PLD built once.

    The same operations as `pld.PLDAccountant` in the same order (identity,
    then for each event `compose(step_pld.self_compose(count))`), so the
    epsilon is the same number; only `_step_pld` is cached. It accounts the
    events `events.ledger_event` makes, with positive rates, sizes and noise:
    Poisson-sampled and truncated Gaussian steps, and the unsampled Gaussian
    of a fixed-order noise segment (composed as `PLDAccountant` composes a
    `GaussianDpEvent`); anything else is refused rather than accounted some
    other way.
    """

    def __init__(self):
        super().__init__()
        self._pld = pld.privacy_loss_distribution.identity(
            value_discretization_interval=_PLD_DISCRETIZATION)

    def _maybe_compose_step(self, event, count, do_compose):
        if isinstance(event, dp_accounting.GaussianDpEvent):
            if not event.noise_multiplier > 0:
                return self.CompositionErrorDetails(
                    event, "tf_megadp's PLD accountant accounts only Gaussians with noise")
            if do_compose and count > 0:
                self._pld = self._pld.compose(
                    _gaussian_pld(event.noise_multiplier / math.sqrt(count)))
            return None
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
                "truncated Gaussian steps with positive rate and noise, and Gaussians")
        if do_compose and count > 0:
            self._pld = self._pld.compose(_step_pld(event).self_compose(count))
        return None

    def get_epsilon(self, target_delta: float) -> float:
        return self._pld.get_epsilon_for_delta(target_delta)


register_accountant("rdp")(rdp.RdpAccountant)


_REMOVE = pld.privacy_loss_mechanism.AdjacencyType.REMOVE


def _truncated_ranges(event: dp_accounting.TruncatedSubsampledGaussianDpEvent):
    """(sigma, rate, adjacency) of the Gaussians whose mixture is the exact truncated PLD.

    As `pld.from_truncated_subsampled_gaussian_mechanism` builds it: the
    Poisson step, mixed (when truncation can happen) with a replace-one
    Gaussian of sigma / 2 at the sampling rate conditioned on truncation.
    """
    ranges = [(event.noise_multiplier, event.sampling_probability, _REMOVE)]
    n, rate, size = event.dataset_size, event.sampling_probability, event.truncated_batch_size
    truncation = float(stats.binom.sf(size - 1, n - 1, rate))
    if truncation > 0:
        conditional = float(stats.binom.sf(size, n, rate)) * size / truncation / n
        ranges.append((event.noise_multiplier / 2, conditional,
                       pld.privacy_loss_mechanism.AdjacencyType.REPLACE))
    return ranges


class _GridSize(_StepAccountant):
    """Not an accountant: walks a run's steps as the PLD accountant does and sizes their PLDs.

    `points` is the largest number of privacy-loss values one step's PLD
    holds at tf_megadp's grid, read off dp_accounting's own bounds of the
    loss (`connect_dots_bounds`) without building anything.
    """

    def __init__(self, truncated_as_poisson: bool):
        super().__init__()
        self._truncated_as_poisson = truncated_as_poisson
        self.points = 0

    def _maybe_compose_step(self, event, count, do_compose):
        if isinstance(event, dp_accounting.GaussianDpEvent):
            # Composed as one Gaussian of sigma / sqrt(count), unsampled.
            ranges = [(event.noise_multiplier / math.sqrt(max(count, 1)), 1.0, _REMOVE)]
        elif isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
                event.event, dp_accounting.GaussianDpEvent):
            ranges = [(event.event.noise_multiplier, event.sampling_probability, _REMOVE)]
        elif isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
            ranges = _truncated_ranges(event)[:1 if self._truncated_as_poisson else None]
        else:
            return None  # Not a PLD step: the accountant refuses it, at no cost.
        if do_compose and all(sigma > 0 and 0 < rate <= 1 for sigma, rate, _ in ranges):
            bounds = [pld.privacy_loss_mechanism.GaussianPrivacyLoss(
                sigma, sampling_prob=rate, adjacency_type=adjacency).connect_dots_bounds()
                for sigma, rate, adjacency in ranges]
            width = (max(float(b.epsilon_upper) for b in bounds)
                     - min(float(b.epsilon_lower) for b in bounds))
            self.points = max(self.points, math.ceil(width / _PLD_DISCRETIZATION))
        return None

    def get_epsilon(self, target_delta: float) -> float:
        raise NotImplementedError("_GridSize sizes PLDs; it accounts nothing.")


def pld_grid_points(event: dp_accounting.DpEvent, *, truncated_as_poisson: bool = False) -> int:
    """The points of the largest one-step PLD that accounting `event` with ``"pld"`` builds.

    What one PLD evaluation costs grows with it: the PLD of a Poisson step
    of noise multiplier sigma spans privacy losses up to about
    1 / (2 sigma^2) + 10 / sigma, on a grid of `_PLD_DISCRETIZATION`.
    Measured on the shared 2-core machine (q = 0.064): 75,635 points at
    sigma = 1 (0.4 s to build), 1,447,722 at sigma = 0.1 (7.9 s to build,
    4.1 s more to compose 20 steps and read epsilon). Read off
    dp_accounting's own bounds of the loss (`connect_dots_bounds`, under a
    millisecond) without building anything.

    Args:
        event: a run's DpEvent (`RunDescription.dp_event`, `events.ledger_event`).
        truncated_as_poisson: size a truncated Poisson step as the Poisson
            step that `TruncationAwareAccountant`'s coupling bound composes
            when truncation is rare (every tf_megadp sampler's case), not as
            the exact truncated PLD (a mixture with a Gaussian of sigma / 2:
            3.5x wider at sigma = 0.3, N = 1000, q = 0.064, 100 rows) that
            it builds otherwise.

    Returns:
        The number of points (0 for an event with no PLD step).
    """
    sizer = _GridSize(truncated_as_poisson)
    sizer.compose(event)
    return sizer.points


def _engine(accountant: str) -> dp_accounting.PrivacyAccountant:
    return _ENGINES[check_accountant(accountant)]()


class TruncationAwareAccountant(_StepAccountant):
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
        exact = _engine(self._kind)
        if not exact.supports(self.ledger):
            raise ValueError(
                "Truncation is too likely for the coupling bound (per-run "
                f"truncation probability {self._truncation_mass:.3g} against delta "
                f"{target_delta:g}), and the {self._kind.upper()} accountant has no exact "
                "event for truncated Poisson sampling. Use accountant='pld', or raise the "
                "static capacity (accumulation steps) so that truncation is rarer."
            )
        return exact.compose(self.ledger).get_epsilon(target_delta)


@functools.lru_cache(maxsize=256)
def epsilon(
    entries: tuple[Any, ...], num_examples: int, delta: float, accountant: str
) -> float:
    """epsilon at `delta` of a ledger's entries (`LedgerEntry`s, hashable) over N examples.

    Args:
        entries: the ledger's entries (typed loosely: the ledger module
            imports the noise mechanisms, whose band search uses this module).
        num_examples: N.
        delta: delta.
        accountant: a registered accountant's name.

    Returns:
        epsilon (0 for no entry).
    """
    # Cached: callbacks ask for the same ledger at every epoch end and log step.
    if not entries:
        return 0.0
    event = ledger_event(entries, num_examples)
    with quiet_unconverged_orders():
        return float(TruncationAwareAccountant(accountant).compose(event).get_epsilon(delta))

