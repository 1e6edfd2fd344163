"""Sampling kinds, the registry that turns a ledger entry into a `dp_accounting` event.

A ledger entry names how its steps drew their examples: its sampling kind.
Each kind is one `SamplingKind`, registered once by the sampler that draws
such steps (`tf_megadp.data.samplers`: "poisson" and "shuffle"), with the
event of one step, its code in the optimizer's ledger rows, whether its steps
may be truncated, and the warning its epsilon carries. A kind without an
event is refused by the accountant, never accounted as Poisson by default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import dp_accounting

from tf_megadp.errors import PrivacyConfigurationError

__all__ = [
    "SamplingKind",
    "entry_event",
    "register_sampling_kind",
    "sampling_kind",
    "sampling_kind_of_code",
    "sampling_kinds",
]


@dataclasses.dataclass(frozen=True)
class SamplingKind:
    """How one kind of step draws its examples, and how its steps are accounted.

    Args:
        name: the kind's name in ledgers, reports and `DataSource`s.
        code: its number in the optimizer's `privacy_ledger` rows; stored in
            checkpoints, so it never changes once released.
        step_event: the `dp_accounting` event of one step of a ledger entry
            of this kind, `step_event(entry, num_examples)`; None for a kind
            the accountant must refuse.
        truncates: whether its steps may be truncated at `max_batch_size`.
        warning: what the epsilon of such steps does not cover, raised once
            per accountant and published in the report; None if nothing.

    Example:
    ```python
    register_sampling_kind(SamplingKind("balls_in_bins", 2, step_event=None))
    ```
    """

    name: str
    code: int
    step_event: Callable[[Any, int], dp_accounting.DpEvent] | None
    truncates: bool = False
    warning: str | None = None


_KINDS: dict[str, SamplingKind] = {}


def register_sampling_kind(kind: SamplingKind) -> SamplingKind:
    """Adds `kind` to the kinds that ledgers record and the accountant reads.

    Raises:
        ValueError: another kind has its name or its code.
    """
    for other in _KINDS.values():
        if other.name == kind.name or other.code == kind.code:
            raise ValueError(
                f"Sampling kind {kind.name!r} (code {kind.code}) clashes with the "
                f"registered {other.name!r} (code {other.code}): each kind needs its "
                "own name and ledger code."
            )
    _KINDS[kind.name] = kind
    return kind


def sampling_kinds() -> tuple[str, ...]:
    """The registered kinds' names, by code."""
    return tuple(sorted(_KINDS, key=lambda name: _KINDS[name].code))


def sampling_kind(name: str) -> SamplingKind:
    """The registered kind `name`; a ValueError naming the kinds otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"sampling must be one of {sampling_kinds()}, got {name!r}."
        ) from None


def sampling_kind_of_code(code: float) -> SamplingKind:
    """The registered kind whose ledger code is `code`."""
    for kind in _KINDS.values():
        if kind.code == code:
            return kind
    raise ValueError(f"Unknown sampling kind code {code} in a ledger row.")


def entry_event(entry: Any, num_examples: int) -> dp_accounting.DpEvent:
    """The `dp_accounting` event of `entry`'s steps (`entry` a `LedgerEntry`, which imports this module).

    Every sampling kind brings its own event: a kind registered without one
    must not be accounted as Poisson by default, which could understate what
    it spends.

    Raises:
        PrivacyConfigurationError: `entry.sampling` has no accounting rule.
    """
    step_event = sampling_kind(entry.sampling).step_event
    if step_event is None:
        accounted = [name for name in sampling_kinds() if _KINDS[name].step_event]
        raise PrivacyConfigurationError(
            f"No accounting rule for sampling kind {entry.sampling!r}: tf_megadp "
            f"accounts only {accounted} ('shuffle' as Poisson, with a warning). "
            "Draw the batches with tf_megadp.PoissonSampler, or record the steps "
            "with sampling='shuffle'."
        )
    return dp_accounting.SelfComposedDpEvent(step_event(entry, num_examples), entry.steps)
