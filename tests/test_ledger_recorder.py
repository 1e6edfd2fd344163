"""Specification of the ledger unit of a run: `LedgerRecorder` and the optimizer's ledger variables.

The compiled step appends each noisy update to the optimizer's buffer of
applied steps (`tf_megadp.optimizer.ledger`); the run's `LedgerRecorder`
(`tf_megadp.run.ledger_recorder`) takes them through its public protocol
and turns them into ledger entries with what only the data can tell. Here
the recorder is driven by hand, with steps applied by `train_on_batch`,
without `fit`, callbacks or a custom loop.
"""

import ast
import os
import warnings

import keras
import numpy as np
import pytest

import tf_megadp
from tf_megadp import PrivacyConfigurationError
from tf_megadp.accounting import LedgerEntry
from tf_megadp.accounting.events import UNACCOUNTED
from tf_megadp.data.sources import FIXED_SIZE_SAMPLING, DataSource
from tf_megadp.optimizer import read_ledger
from tf_megadp.run.ledger_recorder import LedgerRecorder

SIGMA = 1.5
ROWS = 4  # One micro-batch of 4 rows is one logical step.


@pytest.fixture
def model():
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=SIGMA, seed=1), loss="mse")
    return model


def _step(model):
    """One logical step outside fit: it reaches the buffer of applied steps only."""
    rng = np.random.default_rng(0)
    model.train_on_batch(rng.normal(size=(ROWS, 3)).astype("float32"),
                         rng.normal(size=(ROWS, 1)).astype("float32"))


def _applied(model, rows=ROWS):
    """What the compiled step does when it applies a noisy update (without tracing one)."""
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    optimizer.ledger_stage.record_applied_step(SIGMA, 1, float(rows), float(rows), 0.0, False)
    optimizer.iterations.assign_add(1)


def _recorder(model, num_examples):
    source = DataSource(sampling=FIXED_SIZE_SAMPLING, num_examples=num_examples,
                        num_examples_measured=True, description="test data")
    recorder = LedgerRecorder(source, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fixed-size batches: an estimate, it warns.
        recorder.begin()
    return recorder


def test_the_steps_a_compiled_step_applied_become_entries_with_the_data_size(model):
    recorder = _recorder(model, num_examples=16)
    _step(model)
    _step(model)
    optimizer = model.optimizer
    assert optimizer.pending_applied_steps == 2 and optimizer.unrecorded_steps == 2
    table = recorder.take_applied_steps()
    assert optimizer.pending_applied_steps == 0  # Taken: the buffer is empty.
    recorder.record_steps(table)
    # Identical consecutive steps share one entry.
    expected = [LedgerEntry(2, ROWS / 16, SIGMA, 0, FIXED_SIZE_SAMPLING)]
    assert list(read_ledger(optimizer)) == list(recorder.ledger) == expected
    assert optimizer.unrecorded_steps == 0
    assert tf_megadp.model_ledger(model).total_steps == 2


def test_steps_applied_before_a_run_begins_are_unaccounted(model):
    _applied(model)
    _applied(model)
    recorder = _recorder(model, num_examples=16)
    assert list(recorder.ledger) == [LedgerEntry.steps_only(2, UNACCOUNTED)]
    with pytest.raises(PrivacyConfigurationError, match="cannot be"):
        tf_megadp.model_ledger(model)


def test_a_step_of_more_rows_than_the_data_has_examples_is_refused(model):
    # An example would be twice in one noisy sum.
    recorder = _recorder(model, num_examples=ROWS - 1)
    _applied(model)
    with pytest.raises(PrivacyConfigurationError, match="entered one noisy sum twice"):
        recorder.record_steps(recorder.take_applied_steps())


def test_a_buffer_that_overflowed_is_refused_not_read_in_part(model):
    recorder = _recorder(model, num_examples=16)
    optimizer = model.optimizer
    optimizer.ledger_stage.applied_rows.assign(
        optimizer.ledger_stage.applied_steps.shape[0] + 1)
    with pytest.raises(PrivacyConfigurationError, match="differently configured logical steps"):
        recorder.take_applied_steps()


def test_unaccounted_steps_join_the_ledger_as_it_stands(model):
    recorder = _recorder(model, num_examples=16)
    _applied(model)
    recorder.record_steps(recorder.take_applied_steps())
    recorder.record_unaccounted(3)
    assert list(read_ledger(model.optimizer)) == [
        LedgerEntry(1, ROWS / 16, SIGMA, 0, FIXED_SIZE_SAMPLING),
        LedgerEntry.steps_only(3, UNACCOUNTED)]


# -- Who writes the ledger --------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LEDGER_VARIABLES = {"privacy_ledger", "privacy_ledger_length", "carried_steps", "applied_steps",
                     "applied_rows"}
# What writes them, outside Keras's own loading: the optimizer's ledger module's
# functions and methods (a call on a recorder is the recorder's protocol,
# which calls them in its own module).
_LEDGER_WRITERS = {"write_ledger", "take_applied_steps", "start_ledger"}


def _writers():
    """(modules that assign a ledger variable, modules that call a ledger writer)."""
    assigning, calling = set(), set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tf_megadp")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if not isinstance(node, ast.Call):
                    continue
                function = node.func
                called = getattr(function, "attr", getattr(function, "id", None))
                if called in ("assign", "assign_add", "assign_sub") and getattr(
                        function.value, "attr", None) in _LEDGER_VARIABLES:
                    assigning.add(module)
                receiver = getattr(function, "value", None)
                on_recorder = getattr(receiver, "attr", getattr(receiver, "id", "")).endswith(
                    "recorder")
                if called in _LEDGER_WRITERS and not on_recorder:
                    calling.add(module)
    return assigning, calling


def test_the_ledger_variables_are_written_in_the_optimizers_ledger_module_only():
    assigning, calling = _writers()
    assert assigning == {"tf_megadp.optimizer.ledger"}
    # Besides that module (and the DPOptimizer, whose public methods hand
    # over to its ledger stage), only the run's recorder records steps, and a
    # release's continuation starts a ledger.
    assert calling == {"tf_megadp.optimizer.dp_optimizer", "tf_megadp.run.ledger_recorder",
                       "tf_megadp.run.weights_origin"}


# -- Correlated noise (issue 39) ----------------------------------------------------------

_SCHEDULE = tf_megadp.BatchSizeSchedule([tf_megadp.Phase(8, 4, 1)], num_examples=64,
                                        micro_batch_size=4)


@pytest.mark.parametrize("noise, sampling, cycle, message", [
    (tf_megadp.BandMF(4), "poisson", 1, "Poisson sampling without cycles under BandMF.*"
                                        "cycle_length >= 4"),
    (tf_megadp.BandMF(4), "cyclic_poisson", 2, "cycle_length = 2 is smaller than num_bands = 4"),
    (tf_megadp.BLT(2), "cyclic_poisson", 4, "BLT.*no privacy proof under Poisson.*fixed-order"),
    (tf_megadp.BandMF(4), "shuffle", 1, "no privacy proof with 'shuffle' batches.*"
                                        "FixedOrderSampler"),
])
def test_a_fit_refuses_correlated_noise_its_sampling_has_no_proof_for(noise, sampling, cycle,
                                                                     message):
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=SIGMA,
        schedule=_SCHEDULE, noise=noise), loss="mse")
    source = DataSource(sampling=sampling, num_examples=64, num_examples_measured=True,
                        description="test data",
                        schedule=_SCHEDULE if sampling != "shuffle" else None,
                        cycle_length=cycle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PrivacyConfigurationError, match=message):
            LedgerRecorder(source, model=model).begin()
    # Nothing ran: the refusal comes before any step.
    assert model.optimizer.iterations.numpy() == 0


def test_a_new_sampler_opens_a_new_noise_segment_and_its_own_continues_it():
    keras.utils.set_random_seed(0)
    model = tf_megadp.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=SIGMA,
        schedule=_SCHEDULE, noise=tf_megadp.BandMF(4)), loss="mse")
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    state = optimizer.noise_stage.state
    # As after a step of a segment drawing assignment "a" (the next step is 3).
    state.segment_generation.assign(0)
    state.segment_next_step.assign(3)
    optimizer.continue_noise_segment("a")
    assert not optimizer.noise_segment_continues(3)  # No data was known: a new one.
    state.segment_generation.assign(0)
    optimizer.continue_noise_segment("a")
    assert optimizer.noise_segment_continues(3)      # The same sampler's continuation.
    optimizer.continue_noise_segment("b")
    assert not optimizer.noise_segment_continues(3)  # Another sampler's groups.
    state.segment_generation.assign(0)
    optimizer.continue_noise_segment(None)           # Data no sampler drew.
    assert not optimizer.noise_segment_continues(3)
