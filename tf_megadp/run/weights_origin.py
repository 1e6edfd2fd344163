"""Where a private run's weights start from: declared, or the ledger refuses to begin empty.

A ledger that begins empty says that the weights spent no privacy before the
first private step. That holds for a model's own initialisation and for
weights the user loaded before `make_private` (public pretrained weights,
a keras-hub preset); it does not hold for a release of an earlier DP run
set into a fresh private model (`set_weights`, `load_weights` of an export,
an assignment): a run continued that way reported 2 of its 18 steps.

So each private model keeps the fingerprint of its *starting weights*: the
weights `make_private` saw (or, for a model built later, those it had
before the first `set_weights` / `load_weights` of a file without a ledger),
the weights a DP run's file loaded with its ledger, or the weights a
declaration named. A private run whose ledger is empty refuses to start
(`check_starting_weights`, called by the ledger keeper before any step)
when the weights are not the starting weights, or when they are those of
a release this process exported, until the user declares them:

* `declare_public_weights(model, source)`: they come from public data only
  (the report names the source);
* `continue_from_release(model, "privacy.json")`: they are the release
  that report describes (its `weights_fingerprint` must match); its ledger
  becomes the start of this run's, so epsilon composes both.

A release loaded in another process and made private before any weights are
set looks like public pretrained weights: only `continue_from_release`
composes it (docs/concepts.md, "What can still escape").
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import keras
import numpy as np

from tf_megadp import _keras_compat
from tf_megadp.accounting import PrivacyLedger
from tf_megadp.accounting.report import check_report_format
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.optimizer import DPOptimizer

__all__ = ["check_starting_weights", "continue_from_release", "declare_public_weights",
           "note_ledger_loaded", "note_release", "note_starting_weights", "origin_report",
           "set_weights_guard", "weights_fingerprint"]

_ORIGIN = "_tf_megadp_weights_origin"
# Fingerprints of the releases (with a ledger) this process exported, by path.
_RELEASES: dict[str, str] = {}


class _WeightsOrigin:
    """A private model's starting weights (a plain holder: Keras saving never writes it)."""

    def __init__(self):
        self.fingerprint: str | None = None
        self.declared: dict[str, Any] | None = None
        # Whether the starting weights themselves came from private steps
        # (a DP run's file with its ledger, or a continued release).
        self.spent_privacy = False


def _origin(model) -> _WeightsOrigin:
    origin = getattr(model, _ORIGIN, None)
    if origin is None:
        origin = _WeightsOrigin()
        setattr(model, _ORIGIN, origin)
    return origin


def weights_fingerprint(model: keras.Model) -> str:
    """A hex digest of the floating-point weights' values, dtypes and shapes, in order.

    Every weight of the model, trainable or not, so that freezing a layer
    changes nothing; integer state (random seed generators) is left out.
    Names are left out too, so a fresh copy of an architecture (whose layer
    names differ) holding the same weights has the same fingerprint.

    A layer with LoRA enabled (`enable_lora`) counts as the file Keras
    writes of it: its merged kernel W + s A B in place of W, A and B. So the
    fingerprint of a LoRA run is that of its released file (which a
    `continue_from_release` of that file checks), and enabling LoRA (B = 0)
    leaves the fingerprint of the weights it starts from unchanged.
    """
    digest = hashlib.blake2b(digest_size=16)
    for value in _saved_values(model):
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(value))
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _saved_values(model) -> list:
    """The float weights' values in order, each LoRA layer's factors merged as Keras saves it."""
    merged, factors = {}, set()
    for layer in _keras_compat.flatten_layers(model, include_self=False):
        if getattr(layer, "lora_enabled", False):
            # `kernel` is the merged value Keras's save_own_variables writes.
            merged[id(_keras_compat.lora_base_kernel(layer))] = layer.kernel
            factors.update((id(layer.lora_kernel_a), id(layer.lora_kernel_b)))
    return [merged.get(id(variable), variable) for variable in _float_weights(model)
            if id(variable) not in factors]


def _float_weights(model) -> list:
    return [variable for variable in model.weights
            if keras.backend.is_float_dtype(variable.dtype)]


def _built(model) -> bool:
    return bool(model.built and _float_weights(model))


def note_starting_weights(model: keras.Model) -> None:
    """Records the model's weights as its starting weights, once (`make_private`, a first set)."""
    origin = _origin(model)
    if origin.fingerprint is None and _built(model):
        origin.fingerprint = weights_fingerprint(model)


def note_ledger_loaded(model: keras.Model) -> None:
    """The weights just loaded came with their ledger (a DP run's file): they start it."""
    if _built(model):
        origin = _origin(model)
        origin.fingerprint = weights_fingerprint(model)
        origin.declared = None
        origin.spent_privacy = True


def set_weights_guard(model: keras.Model, original_set_weights):
    """`set_weights` that first records the weights it replaces as the starting weights."""

    def set_weights(weights):
        note_starting_weights(model)
        return original_set_weights(weights)

    set_weights.__doc__ = original_set_weights.__doc__
    return set_weights


def note_release(model: keras.Model, path: str) -> None:
    """`export_model` wrote `model` to `path`: remember its weights if they spent privacy.

    Weights that private steps left exactly as they started (a learning rate
    of 0), from a start that spent nothing, hold nothing of the data: another
    model of the same seed starts from them and is no continuation.
    """
    if not _steps_of_weights(model, build=False):
        return
    fingerprint = weights_fingerprint(model)
    origin = getattr(model, _ORIGIN, None)
    if origin is not None and origin.fingerprint == fingerprint and not origin.spent_privacy:
        return
    _RELEASES[fingerprint] = path


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


def check_starting_weights(model: keras.Model) -> None:
    """Refuses a private run whose empty ledger would claim weights set from outside.

    Called before the first private step of every run (the ledger keeper's
    `begin`); a run whose weights' ledger holds steps is not checked here
    (changes between its fits are marked in its report instead).

    Raises:
        PrivacyConfigurationError: the ledger is empty but the weights are
            not the model's starting weights, or are a release this process
            exported, and no declaration names them.
    """
    if _steps_of_weights(model) or not _built(model):
        return
    origin = _origin(model)
    fingerprint = weights_fingerprint(model)
    release = _RELEASES.get(fingerprint)
    if origin.declared is not None and origin.fingerprint == fingerprint:
        return
    if release is not None:
        raise PrivacyConfigurationError(
            f"This model holds the weights of the release {release}, exported by a DP run "
            "of this process, but its privacy ledger is empty: a fit would report only "
            "its own steps. To train further on the same private data, compose the "
            "release's ledger first: tf_megadp.continue_from_release(model, "
            "'privacy.json') with the report written when it was exported "
            "(PrivacyCallback.save_report). Or continue the run itself from its training "
            "checkpoint (keras.models.load_model / tf_megadp.restore_training_state).")
    if origin.fingerprint is not None and origin.fingerprint != fingerprint:
        raise PrivacyConfigurationError(
            "The trainable weights of this private model were set from outside a private "
            "run (set_weights, load_weights of a file without a privacy ledger, or an "
            "assignment) after make_private, and its privacy ledger is empty: if they "
            "came from an earlier DP run, epsilon would leave that run out. Declare where "
            "they come from before fit: tf_megadp.declare_public_weights(model, "
            "source='...') for weights trained on public data only, or "
            "tf_megadp.continue_from_release(model, 'privacy.json') for a release of a "
            "DP run (its ledger is composed with this run's). Weights loaded before "
            "make_private need no declaration.")
    origin.fingerprint = fingerprint


def declare_public_weights(model: keras.Model, source: str) -> None:
    """Declares that `model`'s current weights were trained on public data only.

    A private run whose ledger is empty refuses weights set from outside it
    (`set_weights`, `load_weights` of a file without a ledger) after
    `make_private`; this declaration accepts them: the run's epsilon then
    covers its own steps only, which is right only if no private data
    reached these weights. The report names the source
    (`report["initial_weights"]`).

    Args:
        model: the built model, holding the public weights.
        source: what they are, for the report (a preset name, a URL).

    Raises:
        PrivacyConfigurationError: the weights already carry a privacy
            ledger, or are a release this process exported (use
            `continue_from_release`).

    Example:
    ```python
    model = tf_megadp.make_private(build_model())
    model.load_weights("public_pretrained.weights.h5")
    tf_megadp.declare_public_weights(model, source="pretrained on Wikipedia")
    ```
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError("declare_public_weights needs source=, what the weights are "
                         "(a preset name, a URL), for the privacy report.")
    _check_fresh_ledger(model, "declare_public_weights")
    fingerprint = weights_fingerprint(model)
    if fingerprint in _RELEASES:
        raise PrivacyConfigurationError(
            f"These weights are the release {_RELEASES[fingerprint]} of a DP run of this "
            "process, not public weights. Compose its ledger: "
            "tf_megadp.continue_from_release(model, 'privacy.json').")
    origin = _origin(model)
    origin.fingerprint = fingerprint
    origin.spent_privacy = False
    origin.declared = {"origin": "public", "source": source, "weights_fingerprint": fingerprint}


def continue_from_release(model: keras.Model, report_path: str | os.PathLike) -> PrivacyLedger:
    """Continues a release of a DP run: its ledger starts this run's, so epsilon composes both.

    An exported model (`export_model`) holds no optimizer and no ledger; a
    private fit on its weights would report its own steps only. This reads
    the release's privacy report (`PrivacyCallback.save_report` /
    `report_path`, written when the weights were exported), checks that it
    describes exactly the model's weights (`weights_fingerprint`), and
    writes its ledger into the model's `DPOptimizer`, as if that optimizer
    had taken the release's steps.

    Args:
        model: the private model holding the release's weights, compiled
            with a `DPOptimizer` that has taken no step.
        report_path: the release's privacy report (JSON).

    Returns:
        The ledger taken over.

    Raises:
        PrivacyConfigurationError: the report describes other weights, the
            model's weights already carry a ledger, or the model is not
            compiled with a `DPOptimizer`.

    Example:
    ```python
    model = tf_megadp.make_private(keras.models.load_model("release.keras"))
    model.compile(optimizer=tf_megadp.DPOptimizer(...), loss=...)
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
    fingerprint = weights_fingerprint(model)
    described = report.get("weights_fingerprint")
    if described != fingerprint:
        raise PrivacyConfigurationError(
            f"{report_path} describes weights of fingerprint {described} but this model "
            f"holds {fingerprint}: it is the report of other weights (or of a release "
            "before reports named their weights). Pass the report written when these "
            "weights were exported (PrivacyCallback.save_report right after "
            "export_model), or continue the run from its training checkpoint.")
    ledger = PrivacyLedger.from_list(report["ledger"])
    optimizer.start_ledger(ledger)
    origin = _origin(model)
    origin.fingerprint = fingerprint
    origin.spent_privacy = True
    origin.declared = {"origin": "release", "report": report_path,
                       "steps": ledger.total_steps, "epsilon": report.get("epsilon"),
                       "delta": report.get("delta"), "weights_fingerprint": fingerprint}
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
