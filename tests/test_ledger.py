"""Specification of tf_megadp.accounting.ledger: the privacy ledger as a value type.

A `LedgerEntry` is a run of identical logical steps; a `PrivacyLedger` is
the entries of a run in training order, identical consecutive steps merged.
Both round-trip through JSON (the optimizer's `privacy_ledger` variable,
checkpoints and reports: one format, whatever the noise mechanism, each
entry's noise one record its mechanism reads back), and refuse any number
or record that would make an epsilon computed from them a lie. No accountant, optimizer or callback is
involved here: the epsilon of a ledger is tests/test_accounting.py's.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from tf_megadp.accounting import LedgerEntry, PrivacyLedger, ledger_from_schedule
from tf_megadp.accounting.events import NOISELESS, UNACCOUNTED
from tf_megadp.accounting.ledger import DEFAULT_NOISE_RECORD
from tf_megadp.accounting.noise import BLT, BandMF
from tf_megadp.steps import BatchSizeSchedule, Phase

# Every kind a ledger stores, by name.
KINDS = ("poisson", "shuffle", "cyclic_poisson", "fixed_order", NOISELESS, UNACCOUNTED)
# The records of a BandMF of 4 bands and a BLT of 2 buffers, as their mechanisms write them.
BANDMF_RECORD = BandMF(4).resolve(16).record()
BLT_RECORD = BLT(2, buffer_decays=(0.9, 0.5), output_scales=(0.1, 0.2)).resolve(100).record()

# One entry of each segment kind, with every noise field set.
CYCLIC = dict(sampling="cyclic_poisson", noise=BANDMF_RECORD, cycle_length=4, cycle_position=1)
FIXED = dict(sampling="fixed_order", noise=BLT_RECORD, steps_per_epoch=25, participations=4,
             sensitivity=1.7)


def _stored(ledger):
    """`ledger` after the round trip of the optimizer's ledger variable (its JSON)."""
    return PrivacyLedger.from_json(ledger.to_json())


# -- One entry ---------------------------------------------------------------------


def test_an_entry_holds_plain_python_numbers_whatever_it_was_given():
    entry = LedgerEntry(np.int64(5), np.float32(0.25), np.float64(1.5), np.int32(40),
                        count_noise_multiplier=np.float32(8.0))
    assert entry == LedgerEntry(5, 0.25, 1.5, 40, "poisson", 8.0)
    assert [type(value) for value in dataclasses.astuple(entry)] == [
        int, float, float, int, str, float, str, int, int, int, int, float, bool]
    # Hashable and equal by value: the accountant caches epsilon by entries.
    assert hash(entry) == hash(LedgerEntry(5, 0.25, 1.5, 40, "poisson", 8.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.steps = 6


@pytest.mark.parametrize("steps, message", [
    (-1, "steps must be >= 0"),
    (1.0, "steps must be an integer"),
    (True, "steps must be an integer"),
])
def test_steps_are_a_count(steps, message):
    with pytest.raises(ValueError, match=message):
        LedgerEntry(steps, 0.1, 1.0)


@pytest.mark.parametrize("numbers, message", [
    (dict(sampling_rate=0.0), r"sampling_rate must be in \(0, 1\]"),
    (dict(sampling_rate=float("nan")), r"sampling_rate must be in \(0, 1\]"),
    (dict(sampling_rate=1.5), "cannot exceed the number of examples"),
    (dict(noise_multiplier=0.0), "not differentially private"),
    (dict(noise_multiplier=float("inf")), "noise_multiplier must be a finite number > 0"),
    (dict(noise_multiplier=-1.0), "noise_multiplier must be a finite number > 0"),
    (dict(max_batch_size=-1), "max_batch_size must be an integer >= 0"),
    (dict(max_batch_size=2.5), "max_batch_size must be an integer >= 0"),
    (dict(sampling="shuffle", max_batch_size=30), "max_batch_size only applies to Poisson"),
    (dict(count_noise_multiplier=-0.5), "count_noise_multiplier must be a finite number >= 0"),
    (dict(count_noise_multiplier=float("nan")), "count_noise_multiplier must be a finite"),
    (dict(sampling="balls_in_bins"), "sampling must be one of"),
])
def test_an_entry_refuses_a_step_no_accountant_could_bound(numbers, message):
    fields = dict(steps=10, sampling_rate=0.1, noise_multiplier=1.0)
    fields.update(numbers)
    with pytest.raises(ValueError, match=message):
        LedgerEntry(**fields)


def test_a_full_batch_and_a_truncated_poisson_step_are_valid():
    assert LedgerEntry(1, 1.0, 0.5).sampling_rate == 1.0
    assert LedgerEntry(1, 0.1, 0.5, max_batch_size=7).max_batch_size == 7


@pytest.mark.parametrize("kind", [NOISELESS, UNACCOUNTED])
def test_a_steps_only_kind_records_a_count_and_nothing_else(kind):
    entry = LedgerEntry.steps_only(4, kind)
    assert dataclasses.astuple(entry) == (
        4, 0.0, 0.0, 0, kind, 0.0, DEFAULT_NOISE_RECORD, 0, 0, 0, 0, 0.0, False)
    # Any other number would be invented: the steps had no known mechanism.
    for numbers in ((0.1, 0.0, 0, kind), (0.0, 1.0, 0, kind), (0.0, 0.0, 5, kind)):
        with pytest.raises(ValueError, match="records a count of steps only"):
            LedgerEntry(4, *numbers)
    with pytest.raises(ValueError, match="records a count of steps only"):
        LedgerEntry(4, 0.0, 0.0, 0, kind, count_noise_multiplier=2.0)


def test_the_gradient_and_count_pair_is_one_gaussian():
    # (sigma^-2 + count^-2)^-1/2, written out; without a count, sigma itself.
    assert LedgerEntry(1, 0.1, 1.2, count_noise_multiplier=5.0).equivalent_noise_multiplier == (
        pytest.approx(1 / math.sqrt(1 / 1.2**2 + 1 / 5.0**2), rel=1e-15))
    assert LedgerEntry(1, 0.1, 1.2).equivalent_noise_multiplier == 1.2


def test_same_mechanism_ignores_the_count_of_steps_only():
    entry = LedgerEntry(3, 0.1, 1.0, 20)
    assert entry.same_mechanism(LedgerEntry(99, 0.1, 1.0, 20))
    for other in (LedgerEntry(3, 0.2, 1.0, 20), LedgerEntry(3, 0.1, 1.1, 20),
                  LedgerEntry(3, 0.1, 1.0, 21), LedgerEntry(3, 0.1, 1.0, 20, "poisson", 4.0),
                  LedgerEntry(3, 0.1, 1.0, 0, "shuffle")):
        assert not entry.same_mechanism(other)


# -- Rows (checkpoints) and JSON (reports) ----------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_stored_by_its_name(kind):
    segment = {"cyclic_poisson": CYCLIC, "fixed_order": FIXED}.get(kind, {"sampling": kind})
    entry = (LedgerEntry.steps_only(2, kind) if kind in (NOISELESS, UNACCOUNTED)
             else LedgerEntry(2, 0.5, 1.0, segment_start=kind in ("cyclic_poisson", "fixed_order"),
                              **segment))
    [stored] = json.loads(PrivacyLedger([entry]).to_json())
    assert stored["sampling"] == kind
    assert _stored(PrivacyLedger([entry])).entries == (entry,)


@pytest.mark.parametrize("fields", [CYCLIC, FIXED], ids=["cyclic", "fixed_order"])
def test_a_segment_entry_keeps_its_mechanisms_record(fields):
    entry = LedgerEntry(9, 0.1, 1.3, segment_start=True, **fields)
    [stored] = json.loads(PrivacyLedger([entry]).to_json())
    # The record, as its mechanism wrote it: kind, parameters, the strategy's hash.
    record = json.loads(stored["noise"])
    assert record["kind"] == entry.mechanism.kind and len(record["strategy"]) == 12
    assert stored["segment_start"] is True
    assert _stored(PrivacyLedger([entry])).entries == (entry,)


@pytest.mark.parametrize("fields, message", [
    (dict(CYCLIC, cycle_length=2), "cycle_length = 2 is smaller than num_bands = 4"),
    (dict(CYCLIC, cycle_position=4), "0 <= cycle_position < L"),
    (dict(CYCLIC, noise=BLT_RECORD), "BLT.*no privacy proof under Poisson"),
    (dict(CYCLIC, steps_per_epoch=3), "no fixed-order participation"),
    (dict(FIXED, sensitivity=0.0), "sensitivity > 0"),
    (dict(FIXED, participations=0), "participations >= 1"),
    (dict(FIXED, cycle_length=4), "has no cycle"),
    (dict(sampling="poisson", noise=BANDMF_RECORD),
     "Poisson sampling without cycles under BandMF"),
    (dict(sampling="shuffle", noise=BANDMF_RECORD), "no privacy proof with"),
    (dict(sampling="poisson", cycle_length=4), "accounted step by step"),
    (dict(sampling="poisson", segment_start=True), "accounted step by step"),
    (dict(noise='{"kind":"independent","strategy":"0123456789ab"}'), "has a strategy hash"),
    (dict(noise='{"kind":"bandmf","num_bands":4}'), "lacks a strategy hash"),
    (dict(noise='{"kind":"laplace"}'), "names no registered noise"),
    (dict(noise='{"kind":"bandmf","num_bands":0,"strategy":"0123456789ab"}'),
     "bandmf ledger noise record .* is malformed"),
    (dict(noise="bandmf"), "must be JSON text"),
])
def test_an_entry_refuses_noise_its_sampling_has_no_proof_for(fields, message):
    with pytest.raises(ValueError, match=message):
        LedgerEntry(5, 0.1, 1.0, **fields)


def test_an_entry_that_opens_a_segment_is_never_merged():
    ledger = PrivacyLedger()
    ledger.append(LedgerEntry(3, 0.1, 1.0, segment_start=True, **CYCLIC))
    # The next steps of the segment merge, whatever their group...
    ledger.append(LedgerEntry(2, 0.1, 1.0, **dict(CYCLIC, cycle_position=0)))
    assert [(e.steps, e.cycle_position, e.segment_start) for e in ledger] == [(5, 1, True)]
    # ...a new segment of the same mechanism does not.
    ledger.append(LedgerEntry(4, 0.1, 1.0, segment_start=True, **CYCLIC))
    assert [(e.steps, e.segment_start) for e in ledger] == [(5, True), (4, True)]


def test_the_stored_json_lists_the_fields():
    entry = LedgerEntry(7, 0.004, 0.9, 5_000, "poisson", 6.4)
    assert json.loads(PrivacyLedger([entry]).to_json()) == [{
        "steps": 7, "sampling_rate": 0.004, "noise_multiplier": 0.9,
        "max_batch_size": 5_000, "sampling": "poisson", "count_noise_multiplier": 6.4,
        "noise": DEFAULT_NOISE_RECORD, "cycle_length": 0, "cycle_position": 0,
        "steps_per_epoch": 0, "participations": 0, "sensitivity": 0.0, "segment_start": False}]
    assert json.loads(DEFAULT_NOISE_RECORD) == {"kind": "independent"}


@pytest.mark.parametrize("text, message", [
    ("[{", "must be JSON text"),
    ('{"steps": 7}', "JSON list of entries"),
    ('[{"steps": 7, "sampling_rate": 0.004, "noise_multiplier": 0.9, "sampling": "bins"}]',
     "sampling must be one of"),
    ('[{"steps": 7, "sampling_rate": 0.004, "noise_multiplier": 0.9, '
     '"noise": "{\\"kind\\": \\"laplace\\"}"}]', "names no registered noise"),
])
def test_a_stored_ledger_that_is_malformed_or_foreign_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        PrivacyLedger.from_json(text)


def test_a_ledger_round_trips_through_json():
    ledger = PrivacyLedger([
        LedgerEntry(5, 0.001, 1.1),
        LedgerEntry(7, 0.004, 0.9, max_batch_size=5_000),
        LedgerEntry(2, 0.004, 0.9, sampling="shuffle"),
        LedgerEntry(3, 0.004, 1.2, count_noise_multiplier=6.4),
        LedgerEntry.steps_only(1, NOISELESS),
        LedgerEntry.steps_only(4, UNACCOUNTED),
        LedgerEntry(3, 0.02, 1.1, segment_start=True, **CYCLIC),
        LedgerEntry(6, 0.004, 2.0, segment_start=True, **FIXED),
    ])
    assert _stored(ledger) == ledger
    assert PrivacyLedger.from_list(json.loads(json.dumps(ledger.to_list()))) == ledger
    assert _stored(PrivacyLedger()) == PrivacyLedger()


def test_json_without_the_required_fields_is_refused_naming_them():
    with pytest.raises(ValueError, match="needs the fields"):
        PrivacyLedger.from_list([{"steps": 3, "sampling_rate": 0.1}])
    with pytest.raises(ValueError, match="needs the fields"):
        PrivacyLedger.from_list([{"steps": 3, "sampling_rate": 0.1, "noise_multiplier": 1.0,
                                  "delta": 1e-5}])


# -- The ledger -------------------------------------------------------------------------


def test_identical_consecutive_steps_merge_and_nothing_else_does():
    ledger = PrivacyLedger()
    ledger.record(3, sampling_rate=0.01, noise_multiplier=1.0)
    ledger.record(4, sampling_rate=0.01, noise_multiplier=1.0)
    ledger.record(2, sampling_rate=0.02, noise_multiplier=1.0)
    ledger.record(1, sampling_rate=0.01, noise_multiplier=1.0)
    ledger.record(0, sampling_rate=0.5, noise_multiplier=9.0)  # no step: no entry
    ledger.record(2, sampling_rate=0.01, noise_multiplier=1.0, count_noise_multiplier=3.0)
    assert [(e.steps, e.sampling_rate, e.count_noise_multiplier) for e in ledger] == [
        (7, 0.01, 0.0), (2, 0.02, 0.0), (1, 0.01, 0.0), (2, 0.01, 3.0)]
    assert len(ledger) == 4 and ledger.total_steps == 12
    # The constructor merges as append does.
    assert PrivacyLedger(ledger.entries + ledger.entries[-1:]).entries[-1].steps == 4


def test_record_takes_an_entrys_fields_by_name_only():
    ledger = PrivacyLedger()
    with pytest.raises(TypeError):
        ledger.record(3, 0.01, 1.0)
    with pytest.raises(TypeError):
        ledger.record(3, sampling_rate=0.01)
    with pytest.raises(TypeError, match="Expected a LedgerEntry"):
        ledger.append((3, 0.01, 1.0))
    assert ledger == PrivacyLedger()


def test_a_copy_is_independent_and_entries_cannot_be_changed_through_the_ledger():
    ledger = PrivacyLedger([LedgerEntry(3, 0.1, 1.0)])
    copy = ledger.copy()
    copy.record(2, sampling_rate=0.2, noise_multiplier=1.0)
    assert ledger.total_steps == 3 and copy.total_steps == 5
    assert isinstance(ledger.entries, tuple)
    assert ledger != copy and ledger != ledger.entries
    assert repr(ledger) == "PrivacyLedger([LedgerEntry(steps=3, sampling_rate=0.1, " \
        "noise_multiplier=1.0, max_batch_size=0, sampling='poisson', " \
        "count_noise_multiplier=0.0, noise='{\"kind\":\"independent\"}', " \
        "cycle_length=0, cycle_position=0, steps_per_epoch=0, participations=0, " \
        "sensitivity=0.0, segment_start=False)])"


def test_steps_without_noise_and_steps_on_unknown_data_are_counted_apart():
    ledger = PrivacyLedger([LedgerEntry(3, 0.1, 1.0), LedgerEntry.steps_only(2, NOISELESS)])
    # Every step the weights received is in total_steps; noiseless steps make
    # epsilon infinite, which a report can state.
    assert (ledger.total_steps, ledger.infinite_epsilon_steps) == (5, 2)
    assert ledger.unreportable_steps() is None
    ledger.append(LedgerEntry.steps_only(4, UNACCOUNTED))
    ledger.append(LedgerEntry(1, 0.1, 1.0))
    ledger.append(LedgerEntry.steps_only(1, UNACCOUNTED))
    # Steps on unknown data make any epsilon a lie: every report refuses.
    assert ledger.unreportable_steps() == (UNACCOUNTED, 5)
    assert (ledger.total_steps, ledger.infinite_epsilon_steps) == (11, 2)


# -- A schedule's ledger ------------------------------------------------------------------


@pytest.fixture
def schedule():
    return BatchSizeSchedule(
        [Phase(10, 100, 2), Phase(5, 400, 7, noise_multiplier=2.0), Phase(3, 200, 4)],
        num_examples=10_000, micro_batch_size=64)


def test_a_schedules_ledger_has_one_entry_per_phase_truncated_at_its_capacity(schedule):
    ledger = ledger_from_schedule(schedule, noise_multiplier=1.1)
    assert ledger.entries == (
        LedgerEntry(10, 100 / 10_000, 1.1, 2 * 64),
        LedgerEntry(5, 400 / 10_000, 2.0, 7 * 64),  # the phase's own sigma
        LedgerEntry(3, 200 / 10_000, 1.1, 4 * 64),
    )
    # Fixed-size batches are not truncated.
    assert [e.max_batch_size for e in ledger_from_schedule(
        schedule, noise_multiplier=1.1, sampling="shuffle")] == [0, 0, 0]


def test_a_schedules_ledger_stops_early_or_runs_on_in_the_last_phase(schedule):
    assert [e.steps for e in ledger_from_schedule(schedule, 1.1, steps=12)] == [10, 2]
    assert [e.steps for e in ledger_from_schedule(schedule, 1.1, steps=25)] == [10, 5, 10]
    assert ledger_from_schedule(schedule, 1.1, steps=0) == PrivacyLedger()


def test_a_schedules_ledger_needs_a_sigma_for_each_phase_it_reaches(schedule):
    with pytest.raises(ValueError, match="Phase 0 of the schedule sets no noise_multiplier"):
        ledger_from_schedule(schedule)
    only_second = BatchSizeSchedule([Phase(5, 400, 7, noise_multiplier=2.0), Phase(3, 200, 4)],
                                    num_examples=10_000, micro_batch_size=64)
    assert ledger_from_schedule(only_second, steps=5).total_steps == 5
    with pytest.raises(ValueError, match="Phase 1"):
        ledger_from_schedule(only_second, steps=6)
    with pytest.raises(TypeError, match="BatchSizeSchedule"):
        ledger_from_schedule([(10, 100)], 1.0)
    for steps in (-1, 2.0, True):
        with pytest.raises(ValueError, match="steps must be an integer >= 0"):
            ledger_from_schedule(schedule, 1.0, steps=steps)
