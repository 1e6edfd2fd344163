"""The privacy units of a prepared corpus: each row's unit index, saved beside its shards.

User-level privacy (`--privacy-unit FIELD`) samples units, not rows, so the
job must know which rows belong together. Unit indices number the distinct
ids (never the ids themselves, which may be names or account numbers).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tf_megadp.data.shards import TokenShards
from tf_megadp.files import atomic_write, sha256_of_file
from tf_megadp.jobs.bert.corpus import CorpusError

__all__ = ["UNITS_FILE", "describe_population", "load_unit_ids", "save_unit_ids"]

UNITS_FILE = "units.npy"


def describe_population(privacy_unit: str | None, population: int, sequences: int) -> str:
    """N as the guarantee counts it, for the job's banners and summary.

    With a privacy unit, N (what epsilon protects, what the sampling rates
    divide by) is the number of units; the sequences they write are a
    separate, labelled figure.

    Args:
        privacy_unit: the JSONL field naming each unit, or None (one sequence).
        population: N, the privacy units of the training split.
        sequences: the training split's sequences.

    Example:
        >>> describe_population("author", 1189, 33503)
        "N = 1,189 privacy units ('author'; 33,503 training sequences)"
    """
    if privacy_unit:
        return (f"N = {population:,} privacy units ({privacy_unit!r}; "
                f"{sequences:,} training sequences)")
    return f"N = {population:,} training sequences (the privacy unit)"


def save_unit_ids(directory: str | os.PathLike, unit_ids: np.ndarray) -> dict[str, Any]:
    """Writes each row's privacy-unit index next to shards; returns the manifest fields.

    Unit indices number the distinct ids (never the ids themselves, which
    may be names or account numbers): the file says which rows belong
    together, nothing about who wrote them. Write it before the shards'
    manifest, which marks the folder complete.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, UNITS_FILE)
    atomic_write(path, lambda temporary: np.save(temporary, np.asarray(unit_ids, np.int64)))
    return {"units_file": UNITS_FILE, "units_sha256": sha256_of_file(path),
            "num_units": int(np.unique(unit_ids).size)}


def load_unit_ids(shards: TokenShards) -> np.ndarray:
    """Each row's privacy-unit index, saved by `prepare_corpus(unit_field=...)`.

    Raises:
        CorpusError: the shards hold no units, or the file does not match the manifest.
    """
    name = shards.manifest.get("units_file")
    if name is None:
        raise CorpusError(
            f"The shards in {shards.directory} carry no privacy units: prepare the corpus "
            "with a unit field (--privacy-unit FIELD).")
    path = os.path.join(shards.directory, name)
    if not os.path.isfile(path) or sha256_of_file(path) != shards.manifest.get("units_sha256"):
        raise CorpusError(f"{path} is missing or does not match its manifest: rebuild the corpus.")
    units = np.load(path, allow_pickle=False)
    if units.shape != (len(shards),):
        raise CorpusError(f"{path} holds {units.shape[0]} units for {len(shards)} rows.")
    return units
