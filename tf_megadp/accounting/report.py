"""The publishable privacy report of a run: what it spent, how it was accounted, with what."""

from __future__ import annotations

import math
from typing import Any

from tf_megadp._version import __version__
from tf_megadp.accounting.events import sampling_kind

__all__ = ["REPORT_FORMAT", "check_report_format", "privacy_report"]

REPORT_FORMAT = "tf_megadp.privacy_report/1"


def privacy_report(accountant: Any, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of a `PrivacyAccountant`'s run (which imports this module); see its `report`."""
    kinds = sorted({entry.sampling for entry in accountant.ledger})
    truncated = any(entry.max_batch_size for entry in accountant.ledger)
    # Correlated noise is accounted by segment (cyclic Poisson rounds or a
    # fixed-order Gaussian): the report names the segments it composed.
    segments = sum(1 for entry in accountant.ledger if entry.segment_start)
    accounted_as = "truncated_poisson" if truncated else "poisson"
    if any(sampling_kind(kind).segment_event is not None for kind in kinds):
        accounted_as = f"noise segments ({segments}): " + ", ".join(
            kind for kind in kinds if sampling_kind(kind).segment_event is not None)
    warnings_ = [sampling_kind(kind).warning for kind in kinds if sampling_kind(kind).warning]
    # Steps without noise: the accountant refuses them, and the report states
    # what they spent, an infinite epsilon.
    noiseless = accountant.ledger.infinite_epsilon_steps
    if noiseless:
        warnings_.append(f"{noiseless} logical steps had no noise: the run is NOT "
                         "differentially private.")
    if accountant.delta > 1.0 / accountant.num_examples:
        warnings_.append(f"delta = {accountant.delta:g} is larger than 1/N.")
    return {
        "format": REPORT_FORMAT,
        # One spelling everywhere (data reports, the job's report.json):
        # "example", or the name of a user-level unit (PrivacyUnitSampler).
        "privacy_unit": "example",
        "neighbouring_relation": "add_or_remove_one",
        "accountant": accountant.accountant,
        "epsilon": math.inf if noiseless else accountant.epsilon(),
        "delta": accountant.delta,
        "num_examples": accountant.num_examples,
        "steps": accountant.steps,
        "sampling": {
            "kinds": kinds,
            "truncated": truncated,
            "accounted_as": accounted_as,
        },
        "ledger": accountant.ledger.to_list(),
        "settings": dict(settings or {}),
        "warnings": warnings_,
        "versions": {
            "tf_megadp": __version__,
            "dp_accounting": _dp_accounting_version(),
        },
    }


def check_report_format(report: dict[str, Any]) -> None:
    """Raises a ValueError unless `report` is a tf_megadp privacy report."""
    if report.get("format") != REPORT_FORMAT:
        raise ValueError(
            f"Not a tf_megadp privacy report (format {report.get('format')!r}, "
            f"expected {REPORT_FORMAT!r})."
        )


def _dp_accounting_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:
        return "unknown"
