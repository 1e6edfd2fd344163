"""What every noise mechanism provides, and the registry that finds one by its kind.

A noise mechanism is how a run's gradient noise is drawn: independent from
step to step (DP-SGD) or correlated across steps by a strategy C (matrix
factorization). Each mechanism is one module of this package and one
frozen dataclass, a subclass of `NoiseMechanism` registered with
`register_noise`, that owns everything the rest of the library asks of
it:

* its parameters and their serialization (`to_dict`, `from_dict`, and the
  one number a job's or the CLI's flag gives, `from_option`);
* its resolved strategy for a run (`resolve`: a `NoiseStrategy`, whose
  `stream` is the noise the optimizer adds, in streaming form);
* the samplings it has a privacy proof for (`check_sampling`, and
  `accounted_sampling`: the sampling a job trains it with);
* its ledger record (`NoiseStrategy.record`, read back by
  `read_noise_record`): one serialized description per noise segment,
  whatever the mechanism, so that the ledger's format never depends on it;
* its events (`fixed_order_event`; a banded mechanism its cyclic Poisson
  event), from its sensitivity.

The library asks for a mechanism by its kind (`noise_class`,
`mechanism_from_dict`) and never branches on one: a new mechanism is one
module here and one row of `tests/test_noise_mechanisms.py`'s table.

Conventions (`tf_megadp.accounting.matrix_factorization`): the noise of
logical step t is sigma * C_clip * (C^{-1} z)_t with z_t ~ N(0, I) fresh
per step and C a lower-triangular Toeplitz matrix scaled to unit L2 column
norm, so that sigma is the noise multiplier on that C.

The graph side (TensorFlow) is not imported here: `NoiseStrategy.stream`
is written on the operations a `StreamOps` gives it (the optimizer's noise
stage passes TensorFlow's; `tests/reference.py` passes NumPy's), so that
this package stays free of TensorFlow, as `tf-megadp epsilon` needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar, Protocol, Sequence

import dp_accounting
import numpy as np

from tf_megadp._validate import check_positive_int
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.accounting.events import FIXED_ORDER
from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "NoiseMechanism",
    "NoiseStrategy",
    "StreamOps",
    "default_noise",
    "fixed_order_participation",
    "mechanism_from_dict",
    "noise_class",
    "noise_kinds",
    "read_noise_record",
    "register_noise",
    "resolve_noise",
]


def fixed_order_participation(steps: int, steps_per_epoch: int) -> tuple[int, int, int]:
    """(n, s, k) of a fixed-order pass: n steps, s per epoch, k = ceil(n / s) epochs."""
    steps = check_positive_int("steps", steps)
    steps_per_epoch = check_positive_int("steps_per_epoch", steps_per_epoch)
    return steps, steps_per_epoch, -(-steps // steps_per_epoch)


class StreamOps(Protocol):
    """The operations a `NoiseStrategy.stream` is written on, for one variable at one step.

    The optimizer's noise stage gives TensorFlow's (`tf_megadp.optimizer.noise`),
    a test NumPy's. Tensors support +, -, * and / with each other and with
    Python floats.

    Attributes:
        draw: z_t, this step's standard normal draw for the variable.
        buffers: the strategy's `noise_buffers` model-sized buffers, zeroed
            when a noise segment opens; read with `read`, written with `write`.
        step: t, the logical step (an integer scalar tensor).
    """

    draw: Any
    buffers: Sequence[Any]
    step: Any

    def previous_draw(self, lag: int) -> Any:
        """z_(t - lag), drawn again from the secret stream; zeros before the segment's first step."""

    def read(self, buffer) -> Any:
        """The buffer's value."""

    def write(self, buffer, value) -> None:
        """Assigns `value` to `buffer`, after every read and write issued before it."""

    def weighted_sum(self, weights: Sequence[Any], buffers: Sequence[Any]) -> Any:
        """sum_i weights[i] * buffers[i]'s value, each read after the product before it.

        One or two model-sized temporaries at a time, never one per buffer.
        """

    def ring_weights(self, coefficients: Sequence[float]) -> list[Any]:
        """The weight of each slot of a ring of past outputs (`ring_write`), as scalars.

        The ring has len(coefficients) slots; step u wrote slot u mod slots,
        so slot s holds the output of the last step u < t with that slot,
        j = t - u steps ago, whose weight is coefficients[j - 1].
        """

    def ring_write(self, value) -> None:
        """Writes `value` into the ring slot of this step (t mod the number of buffers)."""


@dataclasses.dataclass(frozen=True)
class NoiseStrategy:
    """A mechanism resolved for one run: the exact unit-norm strategy the noise streams.

    A subclass per mechanism holds its numbers (all public: the strategy is
    no secret; the buffers' values are) and gives the optimizer its noise
    (`stream`), the accountant its sensitivity (`column`, `sensitivity`),
    the ledger its record (`record`) and the report its description
    (`describe`).
    """

    kind: ClassVar[str]

    @property
    def noise_buffers(self) -> int:
        """Model-sized buffers the noise keeps in memory, per replica."""
        raise NotImplementedError

    def mechanism(self) -> "NoiseMechanism":
        """The mechanism this strategy resolves (its parameters as given, for its proofs)."""
        raise NotImplementedError

    def numbers(self) -> tuple[float, ...]:
        """Every number that fixes the strategy (hashed into its record)."""
        raise NotImplementedError

    def column(self, num_steps: int) -> np.ndarray:
        """The first column of the unit-norm C over `num_steps` steps."""
        raise NotImplementedError

    def stream(self, ops: StreamOps):
        """(C^{-1} z)_t of the unit-norm C for one variable, updating the buffers (graph).

        Args:
            ops: the operations of this step and variable (`StreamOps`).

        Returns:
            A tensor of the draw's shape and dtype: times sigma C_clip, the noise.
        """
        raise NotImplementedError

    @property
    def strategy_hash(self) -> str:
        """12 hex digits of SHA-256 of the kind and every number: which strategy the noise streamed."""
        numbers = np.array(self.numbers(), np.float64)
        return hashlib.sha256(self.kind.encode() + numbers.tobytes()).hexdigest()[:12]

    def record(self) -> str:
        """The ledger record of a segment of this noise: the mechanism's parameters and the strategy's hash.

        Canonical JSON (sorted keys, no spaces), so that two segments of
        one strategy have equal records; `read_noise_record` reads it back.
        """
        mechanism = self.mechanism()
        fields = {"kind": self.kind, **mechanism.identity()}
        if mechanism.has_strategy:
            fields["strategy"] = self.strategy_hash
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def sensitivity(self, num_steps: int, *, steps_per_epoch: int) -> mf.Sensitivity:
        """sens of C x for a fixed-order pass of `num_steps` steps, s per epoch (exact or flagged)."""
        n, s, k = fixed_order_participation(num_steps, steps_per_epoch)
        return mf.minsep_sensitivity(self.column(n), n, min_separation=s, max_participations=k)

    def buffer_bytes(self, parameters: int, bytes_per_value: int = 4) -> int:
        """Memory of the noise buffers of one replica: buffers x parameters x bytes (float32: 4)."""
        return self.noise_buffers * check_positive_int("parameters", parameters) * int(
            bytes_per_value)

    def describe(self) -> dict[str, Any]:
        """The strategy as the privacy report states it: kind, record, buffers, hash and its numbers."""
        return {"kind": self.kind, **self.mechanism().identity(), "record": self.record(),
                "noise_buffers": self.noise_buffers, "strategy_hash": self.strategy_hash,
                **{field.name: _listed(getattr(self, field.name))
                   for field in dataclasses.fields(self)}}


@dataclasses.dataclass(frozen=True)
class NoiseMechanism:
    """The gradient noise of a run, as its user describes it (a frozen dataclass per mechanism).

    Subclasses set `kind` (the name in ledgers, reports, configs and the
    `--noise` flag), `option` (the name of the one number a flag gives,
    `from_option`; None when there is none) and `summary` (one line for
    `--help`), and implement `resolve`, `check_sampling` and
    `accounted_sampling`.
    """

    kind: ClassVar[str]
    option: ClassVar[str | None] = None
    summary: ClassVar[str] = ""
    # Whether its noise follows a strategy other than C = I (its record then
    # carries the strategy's hash).
    has_strategy: ClassVar[bool] = True
    # Whether it is the noise of a run that names none (`default_noise`): one
    # registered mechanism is.
    default: ClassVar[bool] = False
    # The parameters whose buffer memory a run's plan states (`tf-megadp plan`).
    plan_examples: ClassVar[tuple] = ()

    # -- Parameters and serialization ----------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The public description (`mechanism_from_dict` rebuilds it); no secret is in it."""
        return {"kind": self.kind, **{field.name: _listed(getattr(self, field.name))
                                      for field in dataclasses.fields(self)}}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "NoiseMechanism":
        """The mechanism of `to_dict`'s fields (without "kind")."""
        return cls(**{name: tuple(value) if isinstance(value, list) else value
                      for name, value in fields.items()})

    def identity(self) -> dict[str, Any]:
        """The parameters a ledger record keeps (`from_record` reads them back): its sizes, not its numbers."""
        return {}

    @classmethod
    def from_record(cls, fields: dict[str, Any]) -> "NoiseMechanism":
        """The mechanism of a ledger record's `identity` fields."""
        return cls(**fields)

    @classmethod
    def from_option(cls, value: float | None) -> "NoiseMechanism":
        """The mechanism of the one number a flag gives (`option`): `--noise KIND --bands P`.

        Raises:
            PrivacyConfigurationError: the mechanism takes no such number and
                one was given, or needs one and none was.
        """
        if value is not None:
            raise PrivacyConfigurationError(
                f"--noise {cls.kind} takes no parameter, got {value!r}.")
        return cls()

    @property
    def noise_buffers(self) -> int:
        """Model-sized buffers its noise keeps in memory, per replica (whatever the run)."""
        raise NotImplementedError

    # -- The run's strategy ------------------------------------------------------

    @property
    def needs_run_length(self) -> bool:
        """Whether its strategy depends on the run's steps (so a DPOptimizer needs a schedule)."""
        return True

    def resolve(self, num_steps: int | None, *, steps_per_epoch: int | None = None
                ) -> NoiseStrategy:
        """The exact strategy of a run of `num_steps` steps (s per epoch for a fixed order).

        None for a run of unknown length, only when `needs_run_length` is False.
        """
        raise NotImplementedError

    def sensitivity(self, steps: int, *, steps_per_epoch: int) -> mf.Sensitivity:
        """The sensitivity of C x for a fixed-order epoch pass of `steps` steps, s per epoch."""
        n, s, _ = fixed_order_participation(steps, steps_per_epoch)
        return self.resolve(n, steps_per_epoch=s).sensitivity(n, steps_per_epoch=s)

    # -- Proofs and events ---------------------------------------------------------

    def check_sampling(self, sampling: str, cycle_length: int = 1) -> None:
        """Refuses a sampling this noise has no privacy proof for, naming the fix.

        Args:
            sampling: the registered sampling kind of the steps.
            cycle_length: L of cyclic Poisson sampling (1 for Poisson without cycles).

        Raises:
            PrivacyConfigurationError: no theorem covers the pair.
        """
        raise NotImplementedError

    def accounted_sampling(self) -> dict[str, Any]:
        """The `RunDescription` fields of the sampling a job trains this noise with.

        `{}` (the run's own), `{"cycle_length": L}` (cyclic Poisson) or
        `{"sampling": "fixed_order"}`.
        """
        raise NotImplementedError

    @classmethod
    def expected_errors(cls, *, num_examples: int, batch_size: int, steps: int,
                        target_epsilon: float, delta: float,
                        phase_starts: Sequence[int] = ()) -> dict[Any, float]:
        """The expected error of the run for each candidate parameter (`--bands auto`).

        Args:
            num_examples, batch_size, steps: N, the (mean) expected batch B, T.
            target_epsilon, delta: the budget.
            phase_starts: the steps where a schedule's later phases start
                (a candidate whose sampling cannot follow them is left out).

        Returns:
            {parameter: the RMSE of the run's noisy prefix sums in units of
            C_clip at the target}, for a mechanism with an automatic choice.

        Raises:
            PrivacyConfigurationError: the mechanism has no automatic choice.
        """
        raise PrivacyConfigurationError(
            f"--noise {cls.kind} has no automatic choice of its {cls.option or 'parameters'}: "
            "give it.")

    def fixed_order_event(
        self, noise_multiplier: float, *, steps: int, steps_per_epoch: int
    ) -> dp_accounting.DpEvent:
        """The run's event for a fixed-order epoch pass: Gaussian(sigma / sens), no amplification."""
        self.check_sampling(FIXED_ORDER)
        return mf.fixed_order_event(
            noise_multiplier, self.sensitivity(steps, steps_per_epoch=steps_per_epoch))

    def label(self) -> str:
        """The mechanism in words, for logs and statements (its kind and its sizes)."""
        return f"{self.kind} noise"


_NOISES: dict[str, type[NoiseMechanism]] = {}


def register_noise(mechanism: type[NoiseMechanism]) -> type[NoiseMechanism]:
    """Adds a mechanism class to the registry (a class decorator).

    Raises:
        ValueError: another mechanism has its kind.
    """
    kind = mechanism.kind
    if kind in _NOISES and _NOISES[kind] is not mechanism:
        raise ValueError(f"Noise kind {kind!r} is registered already ({_NOISES[kind]!r}).")
    if mechanism.default and any(other.default and other is not mechanism
                                 for other in _NOISES.values()):
        raise ValueError(f"{kind!r} cannot be the default noise: another mechanism is.")
    _NOISES[kind] = mechanism
    return mechanism


def noise_kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order (the independent noise first)."""
    return tuple(_NOISES)


def noise_class(kind: str) -> type[NoiseMechanism]:
    """The registered mechanism class of `kind`; a ValueError naming the kinds otherwise."""
    try:
        return _NOISES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"noise must be one of {list(_NOISES)}, got kind {kind!r}.") from None


def default_noise() -> NoiseMechanism:
    """The noise of a run that names none (`noise=None`): the registered default, DP-SGD's."""
    return next(cls for cls in _NOISES.values() if cls.default)()


def mechanism_from_dict(config: dict[str, Any] | None) -> NoiseMechanism | None:
    """The mechanism of a `to_dict` (None stays None: the caller's default).

    Raises:
        ValueError: an unknown kind, or fields the mechanism does not take.
    """
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"A noise description is a mapping with a 'kind', got {config!r}.")
    fields = dict(config)
    cls = noise_class(fields.pop("kind", None))
    try:
        return cls.from_dict(fields)
    except TypeError as error:
        raise ValueError(f"{cls.kind} noise: {error}") from None


def resolve_noise(mechanism: NoiseMechanism | None, num_steps: int | None, *,
                  steps_per_epoch: int | None = None) -> NoiseStrategy:
    """The strategy of `mechanism` (None: `default_noise()`) for a run of `num_steps` steps.

    `num_steps=None` (a run of unknown length) only for a mechanism whose
    strategy does not depend on it (`needs_run_length` False).

    Raises:
        TypeError: `mechanism` is no registered mechanism.
    """
    if mechanism is None:
        mechanism = default_noise()
    if not isinstance(mechanism, NoiseMechanism) or type(mechanism) not in _NOISES.values():
        raise TypeError(f"noise must be one of the registered mechanisms {list(_NOISES)}, got "
                        f"{mechanism!r}.")
    if num_steps is None and mechanism.needs_run_length:
        raise PrivacyConfigurationError(
            f"{mechanism!r} is optimized for the run's steps: give the run's length.")
    return mechanism.resolve(num_steps, steps_per_epoch=steps_per_epoch)


def read_noise_record(record: str) -> tuple[NoiseMechanism, str | None]:
    """The mechanism a ledger record describes, and its strategy's hash (None: none).

    Args:
        record: a `NoiseStrategy.record` (JSON text).

    Returns:
        (the mechanism rebuilt from the record's parameters, the hash).

    Raises:
        ValueError: the record is not JSON, names no registered kind (a
            foreign record), or has fields its mechanism does not read back;
            each message names the record.
    """
    try:
        fields = json.loads(record)
    except (TypeError, ValueError):
        raise ValueError(f"A ledger noise record must be JSON text, got {record!r}.") from None
    if not isinstance(fields, dict) or fields.get("kind") not in _NOISES:
        raise ValueError(
            f"A ledger noise record names no registered noise ({list(_NOISES)}): {record!r}. "
            "It was not written by this tf_megadp, whose ledger it cannot account.")
    cls = _NOISES[fields.pop("kind")]
    strategy = fields.pop("strategy", None)
    if strategy is not None and not (isinstance(strategy, str) and len(strategy) == 12
                                     and all(c in "0123456789abcdef" for c in strategy)):
        raise ValueError(f"A ledger noise record's strategy hash must be 12 hex digits: "
                         f"{record!r}.")
    try:
        mechanism = cls.from_record(fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"The {cls.kind} ledger noise record {record!r} is malformed: "
                         f"{error}") from None
    if (strategy is None) == cls.has_strategy:
        raise ValueError(f"The {cls.kind} ledger noise record {record!r} "
                         f"{'lacks' if strategy is None else 'has'} a strategy hash.")
    return mechanism, strategy


def _listed(value):
    return list(value) if isinstance(value, tuple) else value

