"""Where a private run's weights come from, and the privacy they already spent.

A ledger that begins empty says that the weights spent no privacy before
the first private step. That holds for a model's own initialisation and
for public pretrained weights; it does not hold for values an earlier DP
run trained, however they reached the model: a release loaded with
`keras.models.load_model` (before: fine-tuned to a reported epsilon 3.00
after a 5.36 release), `load_weights`, keras-hub `from_preset`,
`set_weights`, or the backbone of a release inside a new classifier.

Such values are recognised by their digests (`tf_megadp.run.provenance`):
every weights file Keras writes of them carries their DP ledger, which
Keras ignores and tf_megadp remembers when Keras reads the file in a
process that imported it. A private run whose ledger is empty (checked by
the ledger keeper before any step, `check_starting_weights`):

* composes the ledger of every DP run whose values its model holds, whole
  or in part, so that epsilon covers both (a warning says so, and the
  report's `initial_weights` names them); or, if the user states that this
  run's data share no example with those runs' data
  (`declare_disjoint_data`), composes nothing and reports the statement;
* refuses values set from outside after `make_private` (`set_weights`,
  `load_weights` of a file without a record) that no record describes,
  until `declare_public_weights` (trained on public data only) or
  `declare_disjoint_data` names them.

A private run whose ledger already counts steps refuses values of a DP run
whose ledger its own does not start with (the record of a release it never
composed), unless its start set that run aside (`declare_disjoint_data`):
where the start's weights came from is saved with the run's ledger, in its
`DPOptimizer` (`write_weights_origin`), so a resumed run that kept some of
a release's values (frozen layers, LoRA's base weights) still knows it
declared them.

`continue_from_release` composes a release from the report saved with it
(`PrivacyCallback.save_report`), for values that reached the model without
their file's record (NumPy arrays from another process); it checks that
the report describes these weights (`weights_fingerprint`) and that its
ledger is the one bound to them (`ledger_binding`): an edited or swapped
report is refused.

What it cannot see: weights loaded before `import tf_megadp` (no record
was read), and values that left Keras through NumPy into another process
without the report (docs/lifecycle.md, "What can still escape").
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any, NamedTuple

import keras
import numpy as np

from tf_megadp import _keras_compat
from tf_megadp.accounting import LedgerEntry, PrivacyLedger
from tf_megadp.accounting.events import UNACCOUNTED
from tf_megadp.accounting.report import check_report_format
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import (
    LEDGER_CAPACITY,
    DPOptimizer,
    ledger_owner,
    read_ledger,
    read_weights_origin,
    write_weights_origin,
)
from tf_megadp.run import provenance
from tf_megadp.run.provenance import Provenance

__all__ = ["check_starting_weights", "composable_ledger", "continue_from_release",
           "declare_disjoint_data", "declare_public_weights", "ledger_binding",
           "note_ledger_loaded", "note_starting_weights", "origin_report", "set_weights_guard",
           "weights_fingerprint"]

_ORIGIN = "_tf_megadp_weights_origin"
# The digest of a variable's value when its private run started (a plain
# attribute of the variable: Keras saving never writes it).
_START_DIGEST = "_tf_megadp_start_digest"


class _WeightsOrigin:
    """A private model's starting weights (a plain holder: Keras saving never writes it).

    Its run's `DPOptimizer` saves `declared` and the ledgers `set_aside`
    before the first step (`check_starting_weights`).
    """

    def __init__(self):
        self.fingerprint: str | None = None
        self.declared: dict[str, Any] | None = None
        # The records of the DP runs whose data the user declared disjoint.
        self.set_aside: list[Provenance] = []

    def saved(self) -> dict[str, Any]:
        """What the run's optimizer stores of it (`write_weights_origin`)."""
        return {"declared": self.declared,
                "set_aside": [record.to_dict() for record in self.set_aside]}


def _origin(model) -> _WeightsOrigin:
    origin = getattr(model, _ORIGIN, None)
    if origin is None:
        origin = _WeightsOrigin()
        setattr(model, _ORIGIN, origin)
    return origin


def _saved_variables(layer) -> list[tuple[Any, Any]]:
    """(variable, value) of every float weight in order, each LoRA layer's merged as Keras saves it.

    A layer with LoRA enabled counts as the file Keras writes of it: its
    merged kernel W + s A B in place of W, A and B (under the variable W).
    So enabling LoRA (B = 0) leaves the digests of the weights it starts
    from unchanged, and a LoRA run's values are those of its released file.
    """
    merged, factors = {}, set()
    for sublayer in _keras_compat.flatten_layers(layer, include_self=False):
        if getattr(sublayer, "lora_enabled", False):
            # `kernel` is the merged value Keras's save_own_variables writes.
            merged[id(_keras_compat.lora_base_kernel(sublayer))] = sublayer.kernel
            factors.update((id(sublayer.lora_kernel_a), id(sublayer.lora_kernel_b)))
    return [(variable, merged.get(id(variable), variable)) for variable in _float_weights(layer)
            if id(variable) not in factors]


class _Digest(NamedTuple):
    """A weight's `provenance.value_digest`, and whether it can tell a trained model.

    Every fresh model holds constant values (zero biases, unit scales); a
    value a DP run trained holds noise. Only distinctive values (more than
    one number, not all equal) are recorded and recognised, so that a new
    model never looks like a release by its constants.
    """

    variable: Any
    digest: str
    distinctive: bool


def _digests(layer) -> list[_Digest]:
    """The `_Digest` of every float weight's saved value, in order."""
    digests = []
    for variable, value in _saved_variables(layer):
        value = keras.ops.convert_to_numpy(value)
        digests.append(_Digest(variable, provenance.value_digest(value),
                               bool(value.size > 1 and np.ptp(value) > 0)))
    return digests


def _fingerprint_of(digests: list[_Digest]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for entry in digests:
        digest.update(entry.digest.encode())
    return digest.hexdigest()


def weights_fingerprint(model: keras.Model) -> str:
    """A hex digest of the floating-point weights' values, dtypes and shapes, in order.

    Every weight of the model, trainable or not, so that freezing a layer
    changes nothing; integer state (random seed generators) is left out.
    Names are left out too, so a fresh copy of an architecture (whose layer
    names differ) holding the same weights has the same fingerprint. A LoRA
    layer counts as its merged kernel, as Keras saves it.
    """
    return _fingerprint_of(_digests(model))


def ledger_binding(fingerprint: str, ledger: PrivacyLedger) -> str:
    """The digest that binds a ledger to the weights of `fingerprint` (a report's `ledger_binding`)."""
    canonical = json.dumps({"weights_fingerprint": fingerprint, "ledger": ledger.to_list()},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def _float_weights(layer) -> list:
    return [variable for variable in layer.weights
            if keras.backend.is_float_dtype(variable.dtype)]


def _built(model) -> bool:
    return bool(model.built and _float_weights(model))


def _mark_start(digests: list[_Digest]) -> None:
    for entry in digests:
        setattr(entry.variable, _START_DIGEST, entry.digest)


def note_starting_weights(model: keras.Model) -> None:
    """Records the model's weights as its starting weights, once (`make_private`, a first set)."""
    origin = _origin(model)
    if origin.fingerprint is None and _built(model):
        digests = _digests(model)
        origin.fingerprint = _fingerprint_of(digests)
        _mark_start(digests)


def note_ledger_loaded(model: keras.Model) -> None:
    """The weights just loaded came with their ledger (a DP run's file): they start it."""
    if _built(model):
        digests = _digests(model)
        origin = _origin(model)
        origin.fingerprint = _fingerprint_of(digests)
        origin.declared = None
        origin.set_aside = []
        _mark_start(digests)


def set_weights_guard(model: keras.Model, original_set_weights):
    """`set_weights` that first records the weights it replaces as the starting weights."""

    def set_weights(weights):
        note_starting_weights(model)
        return original_set_weights(weights)

    set_weights.__doc__ = original_set_weights.__doc__
    return set_weights


# -- The records a weights file carries ----------------------------------------------


def provenance_of(layer) -> list[Provenance]:
    """The provenance records a weights file of `layer`'s values carries now.

    The ledger of the `DPOptimizer` that trained the values, if it took
    steps, covering every value it changed (or that it started from a DP
    run's values); and the records of DP runs whose values `layer` holds
    and that ledger does not already continue (a release loaded, saved on
    as a preset). Each record is remembered by this process.

    Raises:
        PrivacyConfigurationError: two DPOptimizers each trained part of
            the values.
    """
    if not isinstance(layer, keras.layers.Layer) or not layer.built:
        return []
    owner = ledger_owner(layer.trainable_variables)
    trained_by_owner = isinstance(owner, DPOptimizer) and owner.built and (
        owner.logical_steps_applied > 0 or owner.logical_steps_recorded > 0)
    if not trained_by_owner and not provenance.remembers_any():
        return []  # Nothing in this process was trained privately: skip the hashing.
    digests = _digests(layer)
    records = []
    owner_ledger = None
    if trained_by_owner:
        owner_ledger = read_ledger(owner)
        # Steps applied but not recorded (a custom loop before its record)
        # are in the values: they join as steps no epsilon may leave out.
        owner_ledger.append(LedgerEntry.steps_only(max(0, owner.unrecorded_steps), UNACCOUNTED))
        trained = set()
        for entry in digests:
            start = getattr(entry.variable, _START_DIGEST, None)
            if entry.distinctive and (start is None or entry.digest != start
                                      or provenance.recognised([start])):
                trained.add(entry.digest)
        records.append(Provenance(owner_ledger, frozenset(trained)))
    for record in _recognised(digests):
        if owner_ledger is None or not owner_ledger.starts_with(record.ledger):
            records.append(record)
    records = [record for record in records if record.digests]
    provenance.remember(records)
    return records


def _write_provenance(saveable, h5_file) -> None:
    records = provenance_of(saveable)
    if not records:
        return
    if h5_file is None:
        raise PrivacyConfigurationError(
            "These weights were trained by a DP run, and the file Keras is writing (the npz "
            "weights format) cannot carry their privacy ledger: a run continued from it "
            "would leave those steps out of epsilon. Save in Keras's default h5 format.")
    provenance.write_provenance(h5_file, records)


def _read_provenance(saveable, h5_file) -> None:
    if h5_file is None:
        return
    try:
        records = provenance.read_provenance(h5_file)
    except provenance.ProvenanceError as error:
        raise PrivacyConfigurationError(
            f"This weights file holds {error} Its values were trained by a DP run whose "
            "privacy ledger can no longer be trusted: load the file as its DP run wrote "
            "it.") from None
    provenance.remember(records)


_keras_compat.observe_weights_files(on_save=_write_provenance, on_load=_read_provenance)


# -- Before the first private step ----------------------------------------------------


def _steps_of_weights(model, build: bool = True) -> int:
    """The logical steps the weights' ledger holds or their optimizers applied.

    With `build`, the model's `DPOptimizer` is built first if it is not:
    building takes over the ledger of an earlier optimizer of the same
    weights (an unbuilt one counts 0 otherwise).
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        return 0
    if not optimizer.built:
        if not (build and _built(model)):
            return 0
        optimizer.build(model.trainable_variables)
    return max(optimizer.logical_steps_applied, optimizer.logical_steps_recorded)


def _recognised(digests: list[_Digest]) -> list[Provenance]:
    return provenance.recognised(entry.digest for entry in digests if entry.distinctive)


def _declared_disjoint(origin: _WeightsOrigin, fingerprint: str) -> bool:
    return (origin.declared is not None and origin.declared["origin"] == "disjoint"
            and origin.fingerprint == fingerprint)


def composable_ledger(model: keras.Model) -> PrivacyLedger | None:
    """The ledger a private run of `model` would compose before its first step, or None.

    The DP runs whose values the model holds, unless the user declared this
    run's data disjoint from theirs (`make_private_with_epsilon` calibrates
    with it).
    """
    if not _built(model):
        return None
    digests = _digests(model)
    records = _recognised(digests)
    if not records or _declared_disjoint(_origin(model), _fingerprint_of(digests)):
        return None
    return provenance.composed_ledger(records)


def check_starting_weights(model: keras.Model) -> None:
    """Composes, or refuses, what a private run's weights spent before its first step.

    Called before the first private step of every run (the ledger keeper's
    `begin`). A run's first step saves where its weights came from in its
    `DPOptimizer`; a resumed run reads it back.

    Raises:
        PrivacyConfigurationError: the ledger is empty but the weights were
            set from outside after `make_private` and neither a record nor
            a declaration names them; or the ledger counts steps but the
            weights hold values of a DP run it does not continue and its
            start did not set aside.
    """
    if not _built(model):
        return
    digests = _digests(model)
    fingerprint = _fingerprint_of(digests)
    records = _recognised(digests)
    origin = _origin(model)
    if _steps_of_weights(model):
        owner = ledger_owner(model.trainable_variables) or model.optimizer
        ledger = read_ledger(owner)
        saved = read_weights_origin(owner) or {}
        set_aside = _saved_set_aside(saved)
        foreign = [record for record in records if not ledger.starts_with(record.ledger)
                   and not any(_sets_aside(aside, record) for aside in set_aside)]
        if foreign:
            raise PrivacyConfigurationError(
                f"This model holds values of a DP run ({_describe(foreign)}) whose privacy "
                f"ledger this run's ({ledger.total_steps} logical steps) does not start "
                "with: its epsilon would leave those steps out. Train those values in a "
                "fresh private run (a new DPOptimizer composes their ledger), or declare "
                "this run's data disjoint from theirs in a fresh run "
                "(tf_megadp.declare_disjoint_data).")
        if origin.declared is None and saved.get("declared") is not None:
            origin.declared, origin.set_aside = saved["declared"], set_aside
        return
    if _declared_disjoint(origin, fingerprint):
        _save(model, origin)
        return
    if records:
        ledger = provenance.composed_ledger(records)
        model.optimizer.start_ledger(ledger)
        origin.fingerprint = fingerprint
        origin.declared = {"origin": "release", "steps": ledger.total_steps,
                           "records": [record.binding for record in records],
                           "weights_fingerprint": fingerprint}
        origin.set_aside = []
        _mark_start(digests)
        _save(model, origin)
        warnings.warn(
            f"This model holds values a DP run trained ({_describe(records)}): their "
            f"privacy ledger of {ledger.total_steps} logical steps starts this run's, so "
            "epsilon covers both. If this run's data share no example with that run's, "
            "say so before fit: tf_megadp.declare_disjoint_data(model, statement='...').",
            UserWarning, stacklevel=4)
        return
    if origin.declared is not None and origin.fingerprint == fingerprint:
        _save(model, origin)
        return
    if origin.fingerprint is not None and origin.fingerprint != fingerprint:
        raise PrivacyConfigurationError(
            "The weights of this private model were set from outside a private run "
            "(set_weights, load_weights of a file without a privacy ledger, or an "
            "assignment) after make_private, no privacy record describes them, and its "
            "ledger is empty: if they came from an earlier DP run, epsilon would leave "
            "that run out. Declare where they come from before fit: "
            "tf_megadp.declare_public_weights(model, source='...') for weights trained on "
            "public data only, tf_megadp.declare_disjoint_data(model, statement='...') for "
            "weights trained on data that share no example with this run's, or "
            "tf_megadp.continue_from_release(model, 'privacy.json') for a release of a DP "
            "run (its ledger is composed with this run's). Weights loaded before "
            "make_private need no declaration.")
    origin.fingerprint = fingerprint


def _saved_set_aside(saved: dict[str, Any]) -> list[Provenance]:
    try:
        return [Provenance.from_dict(record) for record in saved.get("set_aside", ())]
    except provenance.ProvenanceError as error:
        raise PrivacyConfigurationError(
            f"The run's saved declaration holds {error} Its start can no longer be trusted: "
            "restore the checkpoint as the run wrote it.") from None


def _sets_aside(aside: Provenance, record: Provenance) -> bool:
    """Whether a declaration that set `aside` aside covers `record`: the same run's values.

    The same ledger (or its beginning: an earlier state of that run) is not
    enough, since two runs of the same settings keep equal ledgers: the
    values must be among those the declaration named.
    """
    return aside.ledger.starts_with(record.ledger) and record.digests <= aside.digests


def _save(model, origin: _WeightsOrigin) -> None:
    """Saves the start's origin with the run's ledger, in the `DPOptimizer` about to step."""
    write_weights_origin(model.optimizer, origin.saved())


def _describe(records: list[Provenance]) -> str:
    steps = " + ".join(str(record.ledger.total_steps) for record in records)
    values = sum(len(record.digests) for record in records)
    return f"{steps} logical steps, over {values} of its weight variables"


def declare_public_weights(model: keras.Model, source: str) -> None:
    """Declares that `model`'s current weights were trained on public data only.

    A private run whose ledger is empty refuses weights set from outside it
    (`set_weights`, `load_weights` of a file without a ledger) after
    `make_private`; this declaration accepts them: the run's epsilon then
    covers its own steps only, which is right only if no private data
    reached these weights. The report says that the user declared it
    (`report["initial_weights"]`, with the source).

    Args:
        model: the built model, holding the public weights.
        source: what they are, for the report (a preset name, a URL).

    Raises:
        PrivacyConfigurationError: the weights already carry a privacy
            ledger, or hold values a DP run trained (their file's record
            says so: use `declare_disjoint_data` if this run's data share
            no example with that run's).

    Example:
    ```python
    model = tf_megadp.make_private(build_model())
    model.load_weights("public_pretrained.weights.h5")
    tf_megadp.declare_public_weights(model, source="pretrained on Wikipedia")
    ```
    """
    _declare(model, "public", source, "source")


def declare_disjoint_data(model: keras.Model, statement: str) -> None:
    """States that this run's data share no example with the data `model`'s weights were trained on.

    Weights trained by an earlier DP run (or without DP on other private
    data) spent that data's privacy, not this run's: with this statement a
    private run composes nothing before its first step, and its epsilon
    covers its own data only. The report records the statement as the
    user's (`report["initial_weights"]`), with the DP runs it set aside.

    Args:
        model: the built model, holding the weights.
        statement: what the weights were trained on and why it is
            disjoint from this run's data, for the report.

    Raises:
        PrivacyConfigurationError: the weights already carry a privacy
            ledger that counts steps (train on without a statement).

    Example:
    ```python
    model = tf_megadp.make_private(keras.models.load_model("release/model.keras"))
    tf_megadp.declare_disjoint_data(
        model, statement="pretrained with DP on the 2024 archive; fine-tuned on 2025 mail")
    ```
    """
    _declare(model, "disjoint", statement, "statement")


def _declare(model, origin_name: str, text: str, field: str) -> None:
    name = "declare_public_weights" if origin_name == "public" else "declare_disjoint_data"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name} needs {field}=, what the weights were trained on (a "
                         "preset name, a URL, a corpus), for the privacy report.")
    _check_fresh_ledger(model, name)
    digests = _digests(model)
    records = _recognised(digests)
    if origin_name == "public" and records:
        raise PrivacyConfigurationError(
            f"These weights hold values a DP run trained ({_describe(records)}; their file "
            "carries its privacy ledger), not public weights. A private run composes that "
            "ledger by itself; if this run's data share no example with that run's, say so "
            "instead: tf_megadp.declare_disjoint_data(model, statement='...').")
    declared = {"origin": origin_name, "declared_by": "user", field: text,
                "weights_fingerprint": _fingerprint_of(digests)}
    if records:
        declared["dp_runs_set_aside"] = [
            {"steps": record.ledger.total_steps, "binding": record.binding} for record in records]
    origin = _origin(model)
    origin.fingerprint, origin.declared = declared["weights_fingerprint"], declared
    origin.set_aside = records
    size = len(json.dumps(origin.saved(), sort_keys=True).encode("utf-8"))
    if size > LEDGER_CAPACITY:
        origin.fingerprint = origin.declared = None
        origin.set_aside = []
        raise ValueError(
            f"{name}: the declaration takes {size} bytes, and the run saves at most "
            f"{LEDGER_CAPACITY} of it with its ledger: shorten {field}=.")
    _mark_start(digests)


def continue_from_release(model: keras.Model, report_path: str | os.PathLike) -> PrivacyLedger:
    """Continues a release of a DP run from its report: its ledger starts this run's.

    A private run composes by itself the ledger of values whose file it
    loaded in this process (the file carries it). For values that arrived
    otherwise (arrays from another process), this reads the release's
    privacy report (`PrivacyCallback.save_report`), checks that it
    describes exactly the model's weights (`weights_fingerprint`) and that
    its ledger is the one bound to them (`ledger_binding`), and writes that
    ledger into the model's `DPOptimizer`, as if it had taken those steps.

    Args:
        model: the private model holding the release's weights, compiled
            with a `DPOptimizer` that has taken no step.
        report_path: the release's privacy report (JSON).

    Returns:
        The ledger taken over.

    Raises:
        PrivacyConfigurationError: the report describes other weights, its
            ledger was edited (the binding does not hold) or is not the one
            the weights' own record carries, the model's weights already
            carry a ledger, or the model is not compiled with a
            `DPOptimizer`.

    Example:
    ```python
    model = tf_megadp.make_private(build_model())
    model.compile(optimizer=tf_megadp.DPOptimizer(...), loss=...)
    model.set_weights(arrays_of_the_release)
    tf_megadp.continue_from_release(model, "release.privacy.json")
    model.fit(...)  # its epsilon covers the release's steps and these
    ```
    """
    report_path = os.fspath(report_path)
    with open(report_path, encoding="utf-8") as handle:
        report = json.load(handle)
    check_report_format(report)
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        raise PrivacyConfigurationError(
            "continue_from_release writes the release's ledger into the model's "
            f"DPOptimizer, but the model is compiled with {optimizer!r}. Compile it with a "
            "tf_megadp.DPOptimizer first.")
    _check_fresh_ledger(model, "continue_from_release")
    digests = _digests(model)
    fingerprint = _fingerprint_of(digests)
    described = report.get("weights_fingerprint")
    if described != fingerprint:
        raise PrivacyConfigurationError(
            f"{report_path} describes weights of fingerprint {described} but this model "
            f"holds {fingerprint}: it is the report of other weights. Pass the report "
            "written when these weights were exported (PrivacyCallback.save_report right "
            "after export_model), or continue the run from its training checkpoint.")
    ledger = PrivacyLedger.from_list(report["ledger"])
    if report.get("ledger_binding") != ledger_binding(fingerprint, ledger):
        raise PrivacyConfigurationError(
            f"{report_path}: its ledger is not the one bound to these weights (its "
            "ledger_binding does not match its ledger and weights_fingerprint): the report "
            "was edited, or put together from two reports. Pass the report as the DP run "
            "wrote it.")
    records = _recognised(digests)
    if records and provenance.composed_ledger(records) != ledger:
        raise PrivacyConfigurationError(
            f"{report_path} states a ledger of {ledger.total_steps} logical steps, but these "
            f"weights' own record says {_describe(records)}: the report belongs to another "
            "run. A private run composes the weights' record by itself: drop "
            "continue_from_release.")
    optimizer.start_ledger(ledger)
    provenance.remember([Provenance(ledger, frozenset(
        entry.digest for entry in digests if entry.distinctive))])
    origin = _origin(model)
    origin.fingerprint = fingerprint
    origin.declared = {"origin": "release", "report": os.path.basename(report_path),
                       "steps": ledger.total_steps, "epsilon": report.get("epsilon"),
                       "delta": report.get("delta"), "weights_fingerprint": fingerprint}
    origin.set_aside = []
    _mark_start(digests)
    return ledger


def _check_fresh_ledger(model, name: str) -> None:
    if not _built(model):
        raise ValueError(f"{name} names the model's current weights: build the model "
                         "(and set its weights) first.")
    steps = _steps_of_weights(model)
    if steps:
        raise PrivacyConfigurationError(
            f"{name}: these weights already carry a privacy ledger of {steps} logical "
            "steps, which goes on counting; a declaration only names the start of an "
            "empty ledger. Train on without it.")


def origin_report(model: keras.Model) -> dict[str, Any] | None:
    """What the report says of the weights' start: a declaration, or None."""
    origin = getattr(model, _ORIGIN, None)
    return None if origin is None or origin.declared is None else dict(origin.declared)
