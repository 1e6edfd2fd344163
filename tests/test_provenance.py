"""Specification of `tf_megadp.run.provenance`: the DP ledger a weights file carries."""

import io
import json

import h5py
import numpy as np
import pytest

from tf_megadp.accounting import PrivacyLedger
from tf_megadp.run import provenance
from tf_megadp.run.provenance import Provenance, ProvenanceError


def ledger(*phases):
    result = PrivacyLedger()
    for steps, q in phases:
        result.record(steps, sampling_rate=q, noise_multiplier=1.0)
    return result


@pytest.fixture(autouse=True)
def a_new_process():
    provenance.forget_all()
    yield
    provenance.forget_all()


def test_a_value_digest_changes_with_any_bit_dtype_or_shape():
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    digest = provenance.value_digest(value)
    assert provenance.value_digest(value.copy()) == digest
    flipped = value.copy()
    flipped.view(np.uint32)[0, 0] ^= 1  # the lowest bit of one number
    assert provenance.value_digest(flipped) != digest
    assert provenance.value_digest(value.reshape(3, 2)) != digest
    assert provenance.value_digest(value.astype(np.float64)) != digest


def test_a_record_round_trips_and_refuses_an_edit_of_its_ledger_or_digests():
    record = Provenance(ledger((20, 0.25)), frozenset({"a" * 32, "b" * 32}))
    assert Provenance.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    fewer_steps = record.to_dict()
    fewer_steps["ledger"][0]["steps"] = 5  # a smaller epsilon, claimed
    with pytest.raises(ProvenanceError, match="edited"):
        Provenance.from_dict(fewer_steps)
    other_values = record.to_dict()
    other_values["digests"] = ["c" * 32]  # the ledger moved onto other weights
    with pytest.raises(ProvenanceError, match="edited"):
        Provenance.from_dict(other_values)
    with pytest.raises(ProvenanceError, match="malformed"):
        Provenance.from_dict({"ledger": [], "binding": record.binding})


def test_records_in_an_hdf5_file_round_trip_and_a_file_without_one_has_none():
    records = [Provenance(ledger((20, 0.25)), frozenset({"a" * 32})),
               Provenance(ledger((3, 0.5)), frozenset({"b" * 32}))]
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as handle:
        handle.create_group("vars")
        assert provenance.read_provenance(handle) == []
        provenance.write_provenance(handle, records)
        provenance.write_provenance(handle, records)  # replaces, never appends
    with h5py.File(buffer, "r") as handle:
        assert provenance.read_provenance(handle) == records


def test_a_record_of_another_format_is_refused():
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as handle:
        payload = json.dumps({"format": "other/9", "records": []}).encode()
        handle.create_dataset(provenance.PROVENANCE_KEY, data=np.frombuffer(payload, np.uint8))
        with pytest.raises(ProvenanceError, match="expected 'tf_megadp.weights_provenance/1'"):
            provenance.read_provenance(handle)


def test_remembered_values_are_recognised_by_digest_each_record_restricted_to_them():
    release = Provenance(ledger((20, 0.25)), frozenset({"a" * 32, "b" * 32}))
    provenance.remember([release])
    assert provenance.remembers_any()
    assert provenance.recognised(["c" * 32]) == []
    found = provenance.recognised(["b" * 32, "c" * 32])
    assert found == [Provenance(release.ledger, frozenset({"b" * 32}))]
    # A later record of the same value that continues the first replaces it.
    continued = Provenance(ledger((20, 0.25), (5, 0.5)), frozenset({"b" * 32}))
    provenance.remember([continued])
    assert provenance.recognised(["b" * 32])[0].ledger == continued.ledger
    assert provenance.recognised(["a" * 32])[0].ledger == release.ledger


def test_composition_counts_a_record_that_another_continues_once():
    release = ledger((20, 0.25))
    continued = ledger((20, 0.25), (5, 0.5))
    unrelated = ledger((7, 0.1))
    records = [Provenance(release, frozenset({"a"})), Provenance(continued, frozenset({"b"})),
               Provenance(unrelated, frozenset({"c"}))]
    composed = provenance.composed_ledger(records)
    assert composed.total_steps == 25 + 7
    assert composed.starts_with(continued)
    assert provenance.composed_ledger([records[0], records[0]]) == release


def test_a_ledger_starts_with_its_earlier_steps_even_inside_a_merged_entry():
    assert ledger((20, 0.25), (5, 0.5)).starts_with(ledger((20, 0.25)))
    assert ledger((25, 0.25)).starts_with(ledger((20, 0.25)))  # merged on append
    assert ledger((25, 0.25)).starts_with(PrivacyLedger())
    assert not ledger((20, 0.25)).starts_with(ledger((25, 0.25)))
    assert not ledger((20, 0.25), (5, 0.5)).starts_with(ledger((20, 0.25), (6, 0.5)))
    assert not ledger((20, 0.5)).starts_with(ledger((20, 0.25)))
    assert not ledger((10, 0.25), (5, 0.5)).starts_with(ledger((5, 0.25), (5, 0.5)))


def test_a_file_on_disk_is_read_without_tensorflow(tmp_path):
    record = Provenance(ledger((2, 0.5)), frozenset({"a" * 32}))
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as handle:
        provenance.write_provenance(handle, [record])
    assert provenance.read_file_provenance(path) == [record]
    assert provenance.read_file_provenance(tmp_path) == [record]  # a preset folder
    assert provenance.read_file_provenance(tmp_path / "missing.weights.h5") is None
