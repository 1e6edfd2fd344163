"""The privacy a weights file carries: the DP ledger of the values it holds.

Weights that a DP run trained have spent privacy; whoever trains them
further on the same data spends more on top. A separate report beside the
file is easy to lose (a keras-hub preset saved from the release, a copy
of model.keras alone), so the weights file itself says it: every Keras
weights file written of values a DP run trained (`tf_megadp.export_model`,
`model.save`, `save_weights`, `ModelCheckpoint`, a keras-hub
`save_to_preset`, also of a model that merely loaded such values) holds a
*provenance record* beside its variables, which Keras ignores on load:

* the ledger of the noisy steps those values received (`PrivacyLedger`),
* the digests of the values it covers (`value_digest` of each variable),
* `binding`, a digest of both, so that an edited ledger or digest list is
  refused on read (`ProvenanceError`).

A process that imports tf_megadp reads the record wherever Keras loads
weights and remembers the digests (`remember`); `tf_megadp.run.weights_origin`
then recognises those values in any model, whole or in part, however they
got there (`load_model`, `load_weights`, keras-hub `from_preset`,
`set_weights`, assignment), and a private run that starts on them composes
the record's ledger before its first step.

The binding detects edits and swaps; it is no signature: someone who means
to forge a record can recompute it, as they could edit any report. This
module needs neither TensorFlow nor Keras (the CLI reads records with h5py
alone); `value_digest` takes a NumPy array.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from typing import Any, Iterable

import numpy as np

from tf_megadp.accounting.ledger import PrivacyLedger

__all__ = ["PROVENANCE_FORMAT", "PROVENANCE_KEY", "Provenance", "ProvenanceError",
           "composed_ledger", "forget_all", "read_file_provenance", "read_provenance",
           "recognised", "remember", "remembers_any", "value_digest", "write_provenance"]

PROVENANCE_FORMAT = "tf_megadp.weights_provenance/1"
# The HDF5 dataset at the root of a Keras weights file that holds the records
# (JSON, as bytes). Keras reads only the groups of its layers' variables.
PROVENANCE_KEY = "tf_megadp_provenance"
# The digests of values a DP run trained, remembered by this process, each
# with every record that covers it and no other record continues.
_KNOWN: dict[str, list["Provenance"]] = {}


class ProvenanceError(ValueError):
    """A provenance record that is malformed, or whose binding does not hold (edited)."""


def value_digest(value: np.ndarray) -> str:
    """The hex digest of one variable's value: dtype, shape and every byte."""
    value = np.ascontiguousarray(value)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{value.dtype}{value.shape}".encode())
    digest.update(value.tobytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Provenance:
    """The noisy steps some weight values received: their ledger and the values' digests.

    Args:
        ledger: every logical step the values received, composed releases
            first.
        digests: `value_digest` of each variable value the ledger covers.
    """

    ledger: PrivacyLedger
    digests: frozenset[str]

    def __post_init__(self):
        if not isinstance(self.ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a PrivacyLedger, got {self.ledger!r}.")
        object.__setattr__(self, "digests", frozenset(self.digests))

    @property
    def binding(self) -> str:
        """A digest of the ledger and the digests together: any edit of either changes it."""
        return _binding(self.ledger.to_list(), sorted(self.digests))

    def restricted_to(self, digests: Iterable[str]) -> "Provenance":
        """The same ledger, covering only those of its values among `digests`."""
        return Provenance(self.ledger, self.digests & frozenset(digests))

    def to_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.to_list(), "digests": sorted(self.digests),
                "binding": self.binding}

    @classmethod
    def from_dict(cls, values: Any) -> "Provenance":
        """Inverse of `to_dict`.

        Raises:
            ProvenanceError: a field is missing or malformed, or the binding
                does not match the ledger and digests (the record was edited).
        """
        try:
            ledger = PrivacyLedger.from_list(values["ledger"])
            digests = [str(digest) for digest in values["digests"]]
            binding = values["binding"]
        except (KeyError, TypeError, ValueError) as error:
            raise ProvenanceError(f"a malformed provenance record ({error}).") from None
        provenance = cls(ledger, frozenset(digests))
        if binding != provenance.binding:
            raise ProvenanceError(
                "a provenance record whose ledger or digests were edited after it was "
                "written (its binding does not match them).")
        return provenance


def _binding(ledger: list[dict[str, Any]], digests: list[str]) -> str:
    canonical = json.dumps({"format": PROVENANCE_FORMAT, "ledger": ledger, "digests": digests},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def composed_ledger(records: Iterable[Provenance]) -> PrivacyLedger:
    """One ledger composing `records`: each one's entries, a record another one continues left out.

    A record whose ledger starts another's (an earlier checkpoint of the
    same run, a release that run continued) is already counted in it.
    """
    kept: list[PrivacyLedger] = []
    for ledger in sorted((record.ledger for record in records),
                         key=lambda ledger: -ledger.total_steps):
        if not any(longer.starts_with(ledger) for longer in kept):
            kept.append(ledger)
    return PrivacyLedger([entry for ledger in kept for entry in ledger])


# -- This process's memory of trained values -------------------------------------


def remember(records: Iterable[Provenance]) -> None:
    """Remembers every digest of `records` as values a DP run trained.

    One value may be covered by several records. A record another one
    continues (an earlier checkpoint of the same run) is counted in it and
    is dropped; records neither of which continues the other (a release,
    and a run that declared its data disjoint from the release's and kept
    some of its values untouched) are both kept: whoever trains the value
    on composes both.
    """
    for record in records:
        for digest in record.digests:
            known = _KNOWN.setdefault(digest, [])
            if any(other.ledger.starts_with(record.ledger) for other in known):
                continue
            known[:] = [other for other in known if not record.ledger.starts_with(other.ledger)]
            known.append(record)


def recognised(digests: Iterable[str]) -> list[Provenance]:
    """The remembered records of any of `digests`, each restricted to those it covers."""
    digests = set(digests)
    found: dict[str, Provenance] = {}
    for digest in digests:
        for record in _KNOWN.get(digest, ()):
            found[record.binding] = record
    return [record.restricted_to(digests) for record in found.values()]


def remembers_any() -> bool:
    """Whether this process has met any value a DP run trained."""
    return bool(_KNOWN)


def forget_all() -> None:
    """Forgets every remembered record (what a new process knows; for tests)."""
    _KNOWN.clear()


# -- Records in Keras weights files ----------------------------------------------


def write_provenance(h5_file, records: Iterable[Provenance]) -> None:
    """Writes `records` into an open, writable HDF5 weights file (replacing any)."""
    payload = {"format": PROVENANCE_FORMAT,
               "records": [record.to_dict() for record in records]}
    data = np.frombuffer(json.dumps(payload, sort_keys=True).encode("utf-8"), np.uint8)
    if PROVENANCE_KEY in h5_file:
        del h5_file[PROVENANCE_KEY]
    h5_file.create_dataset(PROVENANCE_KEY, data=data)


def read_provenance(h5_file) -> list[Provenance]:
    """The records of an open HDF5 weights file ([] when it carries none).

    Raises:
        ProvenanceError: a record is malformed or was edited.
    """
    if PROVENANCE_KEY not in h5_file:
        return []
    try:
        payload = json.loads(bytes(np.asarray(h5_file[PROVENANCE_KEY], np.uint8)))
    except (TypeError, ValueError) as error:
        raise ProvenanceError(f"an unreadable provenance record ({error}).") from None
    if not isinstance(payload, dict) or payload.get("format") != PROVENANCE_FORMAT:
        raise ProvenanceError(
            f"a provenance record of format {payload.get('format') if isinstance(payload, dict) else None!r}, "
            f"expected {PROVENANCE_FORMAT!r}.")
    records = payload.get("records")
    if not isinstance(records, list):
        raise ProvenanceError("a provenance record without its list of records.")
    return [Provenance.from_dict(record) for record in records]


def read_file_provenance(path: str | os.PathLike) -> list[Provenance] | None:
    """The records of a Keras weights file on disk, without TensorFlow.

    Args:
        path: a `.keras` model file, a `.weights.h5` file, or a keras-hub
            preset directory (its `model.weights.h5`).

    Returns:
        The records ([] when the file carries none), or None when `path`
        holds no Keras HDF5 weights.

    Raises:
        ProvenanceError: a record is malformed or was edited.
    """
    import h5py

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "model.weights.h5")
    try:
        if path.endswith(".keras"):
            with zipfile.ZipFile(path) as archive:
                data = archive.read("model.weights.h5")
            with h5py.File(io.BytesIO(data), "r") as handle:
                return read_provenance(handle)
        with h5py.File(path, "r") as handle:
            return read_provenance(handle)
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
