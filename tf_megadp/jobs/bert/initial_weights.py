"""Where a pretraining run's weights start: `--init-from` a published model or a keras-hub preset.

`tf-megadp pretrain --init-from PATH` continues pretraining from PATH
instead of random weights. PATH is the `model.keras` a run of this job
published (its run folder beside it) or a local keras-hub preset directory
(`save_to_preset`; `from_preset` reads it, nothing is downloaded). The
model's shape and vocabulary come from PATH: shape flags that contradict it
are refused by name, and the vocabulary must be the public one PATH was
trained with (`configured`).

What PATH adds to this run's epsilon depends on where its weights come
from (`InitialWeights.origin`), decided from the files beside it:

* "public": a non-private run of this job on the public default corpus, or
  a keras-hub preset without a privacy.json (taken as public pretrained
  weights, like a published BERT preset). Nothing: no private data of this
  run reached them (`tf_megadp.declare_public_weights`).
* "release": the output of a private run (its report.json says private, or
  a privacy.json lies beside it). A DP release: its ledger (privacy.json)
  is composed into this run's epsilon (`tf_megadp.continue_from_release`),
  which holds whatever the overlap of the two corpora; a target epsilon
  bounds the composition.
* "disjoint": `--init-data-disjoint`, the user's statement that PATH's
  training data share no example with this corpus (public text does).
  Nothing is composed; the report records the statement. A non-private run
  on a user corpus, or a model.keras whose origin no file tells, needs it.

A run that resumes keeps the record of its start (the checkpoint holds
it): its ledger already holds a composed release's steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
import zipfile
from typing import Any, Collection

from tf_megadp.files import sha256_of_file
from tf_megadp.jobs.bert.config import MODEL_PRESETS, PretrainConfig, PretrainError
from tf_megadp.jobs.bert.run_files import (
    PRIVACY_REPORT_NAME,
    REPORT_NAME,
    VOCABULARY_NAME,
)

__all__ = ["ORIGINS", "InitialWeights", "configured", "declare", "load_into",
           "read_initial_weights", "token_order"]

ORIGINS = ("public", "release", "disjoint")
# What the files beside PATH say of its training.
_PRIVATE_RUN = "a private run of this job"
_DEFAULT_CORPUS = "a non-private run of this job on the public default corpus"
_USER_CORPUS = "a non-private run of this job on a user corpus"
_PRESET = "a keras-hub preset (no privacy.json beside it)"
_UNKNOWN = "unknown (no report.json or privacy.json beside it)"
# A keras-hub preset's tokenizer vocabulary (`save_to_preset` of a task with
# a preprocessor, or of a tokenizer).
_PRESET_VOCABULARY = os.path.join("assets", "tokenizer", "vocabulary.txt")
_SHAPE_FLAGS = {"model": "--model", "vocabulary_size": "--vocabulary-size",
                "sequence_length": "--sequence-length", "vocabulary": "--vocabulary"}


@dataclasses.dataclass(frozen=True)
class InitialWeights:
    """What `--init-from PATH` holds, read from its files (no TensorFlow).

    Attributes:
        path: PATH, absolute.
        kind: "model.keras" (a file) or "preset" (a keras-hub preset directory).
        sha256: the content hash (of the file, or of the directory's files
            and their names).
        architecture: (layers, hidden, heads, intermediate).
        vocabulary_size: V of its token table.
        max_sequence_length: rows of its position table.
        vocabulary: the vocabulary file it reads (None: none found).
        vocabulary_public: whether that vocabulary is public (None: no file says).
        trained: what the files beside it say of its training.
        privacy_report: the release's privacy.json, if any.
        release: of that report: steps, epsilon, delta and the ledger.
    """

    path: str
    kind: str
    sha256: str
    architecture: tuple[int, int, int, int]
    vocabulary_size: int
    max_sequence_length: int
    vocabulary: str | None
    vocabulary_public: bool | None
    trained: str
    privacy_report: str | None = None
    release: dict[str, Any] | None = None

    def preset_name(self) -> str:
        """The job's `--model` preset of this architecture.

        Raises:
            PretrainError: no preset has it.
        """
        for name, shape in MODEL_PRESETS.items():
            if tuple(shape) == tuple(self.architecture):
                return name
        raise PretrainError(
            f"--init-from {self.path}: its architecture (layers, hidden, heads, "
            f"intermediate) = {tuple(self.architecture)} is none of the job's --model presets "
            f"({', '.join(f'{n} {s}' for n, s in MODEL_PRESETS.items())}); start from a model "
            "of one of these shapes.")

    def origin(self, config: PretrainConfig) -> str:
        """"public", "release" or "disjoint" (module docstring), for a private run.

        Raises:
            PretrainError: a private run's release without its privacy.json,
                or weights trained without DP on text that may be this
                run's, and no `--init-data-disjoint`.
        """
        if self.trained == _PRIVATE_RUN:
            if config.init_data_disjoint:
                return "disjoint"
            if self.release is None:
                raise PretrainError(
                    f"--init-from {self.path} is the output of a private run, a DP release, "
                    f"but no {PRIVACY_REPORT_NAME} lies beside it: its ledger cannot be "
                    "composed into this run's epsilon. Put the release's "
                    f"{PRIVACY_REPORT_NAME} beside it, or pass --init-data-disjoint if its "
                    "training data share no example with this corpus.")
            return "release"
        if self.trained in (_DEFAULT_CORPUS, _PRESET):
            return "public"
        if config.init_data_disjoint:
            return "disjoint"
        raise PretrainError(
            f"--init-from {self.path}: trained by {self.trained}, without DP: its weights "
            "may hold this corpus's text verbatim, which no epsilon covers. Pass "
            "--init-data-disjoint if its training data share no example with this corpus "
            "(public text does), or start from a public model or a DP release with its "
            f"{PRIVACY_REPORT_NAME}.")

    def composed_ledger(self, config: PretrainConfig):
        """The release's `PrivacyLedger` this run's epsilon composes, or None."""
        from tf_megadp.accounting import PrivacyLedger

        if config.non_private or self.origin(config) != "release":
            return None
        return PrivacyLedger.from_list(self.release["ledger"])

    def report(self, config: PretrainConfig) -> dict[str, Any]:
        """report.json's "init": the weights, their origin and, in one line, their effect on epsilon."""
        origin = None if config.non_private else self.origin(config)
        if origin is None:
            effect = "none: this run is the non-private baseline"
        elif origin == "public":
            effect = f"adds nothing to epsilon: trained by {self.trained}, on public data only"
        elif origin == "release":
            effect = (f"its ledger ({self.release['steps']} logical steps, epsilon "
                      f"{self.release['epsilon']:.4g} at delta {self.release['delta']:.3g} "
                      "alone) is composed into this run's epsilon: a DP release trained further")
        else:
            effect = ("adds nothing to epsilon: the user states (--init-data-disjoint) that its "
                      f"training data ({self.trained}) share no example with this corpus")
        return {"path": self.path, "kind": self.kind, "sha256": self.sha256,
                "trained": self.trained, "origin": origin, "epsilon": effect,
                "data_disjoint_stated": bool(config.init_data_disjoint),
                "privacy_report": self.privacy_report,
                "release": ({k: v for k, v in self.release.items() if k != "ledger"}
                            if self.release else None),
                "vocabulary": self.vocabulary}

    def to_dict(self) -> dict[str, Any]:
        """JSON, for the run's checkpoint (a resumed run reports its start from it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "InitialWeights":
        return cls(**{**values, "architecture": tuple(values["architecture"])})


def read_initial_weights(path: str | os.PathLike) -> InitialWeights:
    """Reads what PATH is: its shape, vocabulary, content hash and origin files.

    Args:
        path: a `model.keras` of this job (its run folder beside it) or a
            keras-hub preset directory.

    Returns:
        The `InitialWeights`.

    Raises:
        PretrainError: PATH is missing, or not a BertMaskedLM or BertBackbone.

    Example:
    ```python
    init = read_initial_weights("runs/public/model.keras")
    init.preset_name(), init.vocabulary_size
    ```
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return _read_preset(path)
    if not os.path.isfile(path):
        raise PretrainError(f"--init-from {path}: no such file or preset directory.")
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, ValueError):
        raise PretrainError(
            f"--init-from {path}: not a Keras model file (.keras) nor a keras-hub preset "
            "directory.") from None
    if config.get("registered_name") != "keras_hub>BertMaskedLM":
        raise PretrainError(
            f"--init-from {path} holds a {config.get('class_name')}; the job continues a "
            "keras-hub BertMaskedLM (the model.keras of a `tf-megadp pretrain` run).")
    folder = os.path.dirname(path)
    return _with_provenance(path, "model.keras", sha256_of_file(path),
                            config["config"]["backbone"]["config"], folder,
                            _existing(os.path.join(folder, VOCABULARY_NAME)), None)


def _read_preset(path: str) -> InitialWeights:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            backbone = json.load(handle)
    except (OSError, ValueError):
        raise PretrainError(
            f"--init-from {path}: not a keras-hub preset directory (no readable "
            "config.json).") from None
    if backbone.get("registered_name") != "keras_hub>BertBackbone":
        raise PretrainError(
            f"--init-from {path} is a preset of {backbone.get('class_name')}; the job "
            "continues a keras-hub BERT (BertBackbone).")
    vocabulary = (_existing(os.path.join(path, _PRESET_VOCABULARY))
                  or _existing(os.path.join(path, VOCABULARY_NAME)))
    lowercase = _preset_lowercase(path)
    return _with_provenance(path, "preset", _sha256_of_directory(path), backbone["config"],
                            path, vocabulary, lowercase)


def _with_provenance(path, kind, sha256, backbone, folder, vocabulary,
                     lowercase) -> InitialWeights:
    """The `InitialWeights` of a model whose provenance files lie in `folder`."""
    if lowercase is False:
        raise PretrainError(
            f"--init-from {path}: its tokenizer is cased (lowercase false), but the job "
            "lowercases text before its word pieces; start from an uncased model.")
    run = _json_or_none(os.path.join(folder, REPORT_NAME))
    privacy_report = _existing(os.path.join(folder, PRIVACY_REPORT_NAME))
    release = _release(privacy_report) if privacy_report else None
    if (run is not None and run.get("private")) or release is not None:
        trained = _PRIVATE_RUN
    elif run is not None:
        trained = _DEFAULT_CORPUS if not (run.get("config") or {}).get("corpus") else _USER_CORPUS
    else:
        trained = _PRESET if kind == "preset" else _UNKNOWN
    if run is not None:
        vocabulary_public = bool((run.get("vocabulary") or {}).get("public"))
    else:
        vocabulary_public = True if trained == _PRESET else None
    return InitialWeights(
        path=path, kind=kind, sha256=sha256,
        architecture=(backbone["num_layers"], backbone["hidden_dim"], backbone["num_heads"],
                      backbone["intermediate_dim"]),
        vocabulary_size=backbone["vocabulary_size"],
        max_sequence_length=backbone["max_sequence_length"],
        vocabulary=vocabulary, vocabulary_public=vocabulary_public, trained=trained,
        privacy_report=privacy_report, release=release)


def _release(report_path: str) -> dict[str, Any]:
    from tf_megadp.accounting.report import check_report_format

    report = _json_or_none(report_path)
    try:
        if not isinstance(report, dict):
            raise ValueError("not a JSON object")
        check_report_format(report)
    except ValueError as error:
        raise PretrainError(f"--init-from: {report_path}: {error}") from None
    return {"steps": report["steps"], "epsilon": report["epsilon"], "delta": report["delta"],
            "weights_fingerprint": report.get("weights_fingerprint"),
            "ledger": report["ledger"]}


def configured(config: PretrainConfig, init: InitialWeights | None = None,
               given: Collection[str] | None = None) -> PretrainConfig:
    """`config` with the shape and vocabulary of `config.init_from`, after every refusal.

    The model preset, V and the position table come from the init; the
    sequence length too unless given (it may be shorter than the init's
    table); the vocabulary is the init's file. Idempotent.

    Args:
        config: the run's settings, with `init_from`.
        init: `read_initial_weights(config.init_from)` if already read.
        given: fields the user set even where they equal the defaults (the
            flags given); a field that differs from `PretrainConfig()`'s
            default counts as given anyway.

    Returns:
        The configuration the run trains.

    Raises:
        PretrainError: a given shape flag contradicts the init (named), a
            vocabulary learned from the training corpus (here or in the
            init's run), a vocabulary other than the init's, or an origin
            `InitialWeights.origin` refuses.
    """
    init = init or read_initial_weights(config.init_from)
    defaults = PretrainConfig()
    given = set(given or ()) | {name for name in _SHAPE_FLAGS
                                if getattr(config, name) != getattr(defaults, name)}
    preset = init.preset_name()
    wanted = {"model": preset, "vocabulary_size": init.vocabulary_size}
    for name, value in wanted.items():
        if name in given and getattr(config, name) != value:
            raise PretrainError(
                f"{_SHAPE_FLAGS[name]} {getattr(config, name)} contradicts --init-from "
                f"{init.path}, whose model has {name.replace('_', ' ')} {value}: drop "
                f"{_SHAPE_FLAGS[name]} (the shape comes from the init).")
    sequence_length = (config.sequence_length if "sequence_length" in given
                       else init.max_sequence_length)
    if sequence_length > init.max_sequence_length:
        raise PretrainError(
            f"--sequence-length {sequence_length} exceeds the {init.max_sequence_length} "
            f"positions of --init-from {init.path}: drop --sequence-length or lower it.")
    vocabulary = _vocabulary_of(config, init, "vocabulary" in given)
    resolved = dataclasses.replace(
        config, model=preset, vocabulary_size=init.vocabulary_size,
        sequence_length=sequence_length, max_sequence_length=init.max_sequence_length,
        vocabulary=vocabulary)
    if not resolved.non_private:
        init.origin(resolved)  # Refuses before the corpus is read.
    return resolved


def _vocabulary_of(config: PretrainConfig, init: InitialWeights, given: bool) -> str:
    """The vocabulary file the continued run reads: the init's (or the user's, if it has none)."""
    from tf_megadp.jobs.bert import text

    if config.vocabulary_from_training_corpus:
        raise PretrainError(
            "--vocabulary-from-training-corpus with --init-from: the model reads the "
            "vocabulary it was trained with, and one built from the private corpus would "
            "publish its words outside epsilon. Drop --vocabulary-from-training-corpus.")
    if init.vocabulary_public is False:
        raise PretrainError(
            f"--init-from {init.path} reads a vocabulary learned from its own training "
            "corpus (its report.json: vocabulary.public false), NOT private: continuing it "
            "publishes that vocabulary again. Start from a model pretrained with a public "
            "vocabulary (without --vocabulary-from-training-corpus).")
    vocabulary = init.vocabulary
    if vocabulary is None:
        if not (given and config.vocabulary):
            raise PretrainError(
                f"--init-from {init.path} has no vocabulary beside it ({VOCABULARY_NAME} or "
                f"{_PRESET_VOCABULARY}): pass --vocabulary FILE, the public vocabulary it was "
                "trained with.")
        vocabulary = os.path.abspath(config.vocabulary)
    elif given and config.vocabulary and _file_digest(config.vocabulary) != _file_digest(
            vocabulary):
        raise PretrainError(
            f"--vocabulary {config.vocabulary} is not the vocabulary of --init-from "
            f"{init.path} ({vocabulary}), whose token table the model reads: drop "
            "--vocabulary.")
    try:
        tokens = text.read_vocabulary_file(vocabulary)
        lines = _vocabulary_lines(vocabulary)
    except text.CorpusError as error:
        raise PretrainError(f"--init-from {init.path}: {error}") from None
    if len(tokens) != init.vocabulary_size or len(lines) != init.vocabulary_size:
        raise PretrainError(
            f"The vocabulary {vocabulary} holds {len(lines)} tokens ({len(tokens)} distinct) "
            f"but --init-from {init.path} has a token table of {init.vocabulary_size}: pass "
            "--vocabulary FILE, the vocabulary it was trained with.")
    return vocabulary


def token_order(vocabulary: str) -> list[int] | None:
    """Row of the init's token table for each id of the job's vocabulary, or None if the same.

    The job numbers its special tokens 0-4 (`text.read_vocabulary_file`);
    a public BERT vocabulary numbers them elsewhere, and its table's rows
    follow the file.
    """
    from tf_megadp.jobs.bert import text

    lines = _vocabulary_lines(vocabulary)
    row = {token: index for index, token in enumerate(lines)}
    order = [row[token] for token in text.read_vocabulary_file(vocabulary)]
    return None if order == list(range(len(order))) else order


def load_into(model, init: InitialWeights) -> None:
    """Sets the init's weights into the job's freshly built `model` (before LoRA, before make_private).

    The token table and the MLM output bias are reordered to the job's
    token ids when the init's vocabulary numbers them otherwise
    (`token_order`).
    """
    import keras
    import keras_hub

    from tf_megadp import _keras_compat

    if init.kind == "model.keras":
        with warnings.catch_warnings():
            # keras-hub compiles its tasks when built: the release holds no
            # optimizer state, which Keras says for the default one.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            model.load_weights(init.path)
    elif os.path.isfile(os.path.join(init.path, "task.json")):
        model.set_weights(keras_hub.models.BertMaskedLM.from_preset(
            init.path, preprocessor=None).get_weights())
    else:  # A backbone preset: the MLM head keeps its (public, seeded) initialisation.
        model.backbone.set_weights(keras_hub.models.Backbone.from_preset(init.path).get_weights())
    order = token_order(init.vocabulary)
    if order is not None:
        for variable in (model.backbone.token_embedding.embeddings,
                         _keras_compat.keras_hub_bias(model.masked_lm_head)):
            variable.assign(keras.ops.take(variable, order, axis=0))


def declare(model, init: InitialWeights, config: PretrainConfig) -> None:
    """Declares the init's weights to the private model: composes a release's ledger, or names the source.

    Called after `make_private`, before the first step of a new run.

    Raises:
        PretrainError: the release's privacy.json changed since the run was
            planned (its ledger is not the one sigma was calibrated with).
    """
    import tf_megadp

    origin = init.origin(config)
    if origin == "release":
        ledger = tf_megadp.continue_from_release(model, init.privacy_report)
        if ledger.to_list() != init.composed_ledger(config).to_list():
            raise PretrainError(
                f"{init.privacy_report} changed since the run was planned: plan it again.")
        return
    # By name: the source goes into privacy.json, which is published.
    tf_megadp.declare_public_weights(
        model, source=f"{os.path.basename(init.path)} (sha256 {init.sha256}): "
        f"{init.report(config)['epsilon']}")


def _vocabulary_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\r\n") for line in handle if line.strip()]


def _preset_lowercase(path: str) -> bool | None:
    tokenizer = _json_or_none(os.path.join(path, "tokenizer.json"))
    if tokenizer is None:
        return None
    return (tokenizer.get("config") or {}).get("lowercase")


def _json_or_none(path: str):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _existing(path: str) -> str | None:
    return path if os.path.isfile(path) else None


def _file_digest(path: str) -> str:
    return sha256_of_file(os.path.abspath(path))


def _sha256_of_directory(path: str) -> str:
    """sha256 over the directory's files: each one's relative name and content hash, sorted."""
    digest = hashlib.sha256()
    for folder, subfolders, files in os.walk(path):
        subfolders.sort()
        for name in sorted(files):
            full = os.path.join(folder, name)
            digest.update(os.path.relpath(full, path).encode())
            digest.update(sha256_of_file(full).encode())
    return digest.hexdigest()
