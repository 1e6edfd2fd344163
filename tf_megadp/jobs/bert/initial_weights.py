"""Where a pretraining run's weights start: `--init-from` a published model or a keras-hub preset.

`tf-megadp pretrain --init-from PATH` continues pretraining from PATH
instead of random weights. PATH is the `model.keras` a run of this job
published (its run folder beside it) or a local keras-hub preset directory
(`save_to_preset`; `from_preset` reads it, nothing is downloaded). The
model's shape and vocabulary come from PATH: shape flags that contradict it
are refused by name, and the vocabulary must be the public one PATH was
trained with (`configured`).

What PATH adds to this run's epsilon depends on where its weights come
from (`InitialWeights.origin`), decided from PATH's own weights file and
the files beside it, never from a missing file:

* "release": values a DP run trained. Their weights file carries the
  run's ledger (`tf_megadp.run.provenance`; a privacy.json beside it must
  state the same ledger), or, for a file without that record, a
  privacy.json lies beside it. The ledger is composed into this run's
  epsilon, which holds whatever the overlap of the two corpora; a target
  epsilon bounds the composition.
* "public": the report.json beside PATH says a non-private run of this job
  trained it on the public default corpus, or the user states it
  (`--init-public`, for a preset no file describes). Nothing is composed;
  the report says which of the two it was.
* "disjoint": `--init-data-disjoint`, the user's statement that PATH's
  training data share no example with this corpus (public text does).
  Nothing is composed; the report records the statement. A non-private run
  on a user corpus needs it.

A model whose origin no file tells (a preset or model.keras without a
record or a report beside it: a non-private model of the private corpus
saved with `save_to_preset`, or a release whose privacy.json was left
behind) is refused until `--init-public` or `--init-data-disjoint` states
where it comes from.

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
from tf_megadp.jobs.common.run_folder import (
    PRIVACY_REPORT_NAME,
    REPORT_NAME,
    VOCABULARY_NAME,
)

__all__ = ["BERT_TASK", "ORIGINS", "InitialWeights", "configured", "declare", "load_into",
           "read_initial_weights", "token_order"]

ORIGINS = ("public", "release", "disjoint")
# What PATH's files say of its training.
_PRIVATE_RUN = "a DP run (its weights file carries its ledger)"
_PRIVACY_REPORT_ONLY = "a DP run (a privacy.json lies beside it)"
_DEFAULT_CORPUS = ("a non-private run of this job on the public default corpus (its "
                   "report.json says so)")
_USER_CORPUS = "a non-private run of this job on a user corpus (its report.json says so)"
_UNKNOWN = "unknown: no ledger in its weights, no report.json or privacy.json beside it"
_PRIVATE_RUN_WITHOUT_LEDGER = ("a private run of this job (its report.json says so), whose "
                               "ledger neither its weights nor a privacy.json holds")
_RELEASES = (_PRIVATE_RUN, _PRIVACY_REPORT_ONLY)
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
        max_sequence_length: rows of its position table; for a model
            without one (Llama: rotary positions), the tokens its run
            trained on (the report.json beside it: model.context), None
            if no report says.
        vocabulary: the vocabulary file it reads (None: none found).
        vocabulary_public: whether that vocabulary is public (None: no file says).
        trained: what its files say of its training.
        privacy_report: the release's privacy.json, if any.
        release: the DP ledger its values spent (from its weights' record,
            else from the privacy.json): steps, the ledger, and epsilon and
            delta where a privacy.json states them.
        task: the registered keras-hub name PATH holds (a model.keras's
            task, a preset's backbone); None in a record written before it
            was kept.
    """

    path: str
    kind: str
    sha256: str
    architecture: tuple[int, int, int, int]
    vocabulary_size: int
    max_sequence_length: int | None
    vocabulary: str | None
    vocabulary_public: bool | None
    trained: str
    privacy_report: str | None = None
    release: dict[str, Any] | None = None
    task: str | None = None

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
            PretrainError: a private run's output without its ledger, weights
                trained without DP on text that may be this run's, weights
                of unknown origin, or `--init-public` for a DP release; each
                names the statement that would make the run honest.
        """
        if self.trained in _RELEASES or self.trained == _PRIVATE_RUN_WITHOUT_LEDGER:
            if config.init_public:
                raise PretrainError(
                    f"--init-public: --init-from {self.path} was trained by {self.trained}, "
                    "not on public data only. Drop --init-public (its ledger is then "
                    "composed), or pass --init-data-disjoint if its training data share no "
                    "example with this corpus.")
            if config.init_data_disjoint:
                return "disjoint"
            if self.release is None:
                raise PretrainError(
                    f"--init-from {self.path} is the output of a private run, a DP release, "
                    f"but neither its weights nor a {PRIVACY_REPORT_NAME} beside it hold its "
                    "ledger: it cannot be composed into this run's epsilon. Put the release's "
                    f"{PRIVACY_REPORT_NAME} beside it, or pass --init-data-disjoint if its "
                    "training data share no example with this corpus.")
            return "release"
        if config.init_data_disjoint:
            return "disjoint"
        if self.trained == _DEFAULT_CORPUS or config.init_public:
            return "public"
        if self.trained == _USER_CORPUS:
            raise PretrainError(
                f"--init-from {self.path}: trained by {self.trained}, without DP: its weights "
                "may hold this corpus's text verbatim, which no epsilon covers. Pass "
                "--init-data-disjoint if its training data share no example with this corpus "
                "(public text does), or start from a public model or a DP release.")
        raise PretrainError(
            f"--init-from {self.path}: where its weights come from is {self.trained}. It "
            "could be a model trained without DP on this corpus, or a DP release whose "
            f"{PRIVACY_REPORT_NAME} was left behind. State it: --init-public if it was trained "
            "on public data only, --init-data-disjoint if its training data share no example "
            f"with this corpus; or put the release's {PRIVACY_REPORT_NAME} beside it.")

    def composed_ledger(self, config: PretrainConfig):
        """The release's `PrivacyLedger` this run's epsilon composes, or None."""
        from tf_megadp.accounting import PrivacyLedger

        if config.non_private or self.origin(config) != "release":
            return None
        return PrivacyLedger.from_list(self.release["ledger"])

    def report(self, config: PretrainConfig) -> dict[str, Any]:
        """report.json's "init": the weights, their origin and, in one line, their effect on epsilon.

        Paths are named relative to nothing the machine holds: the init's
        file or folder name, and the files beside it by name.
        """
        origin = None if config.non_private else self.origin(config)
        declared = origin == "disjoint" or (origin == "public" and config.init_public)
        if origin is None:
            effect = "none: this run is the non-private baseline"
        elif origin == "public" and config.init_public:
            effect = ("adds nothing to epsilon: the user declares (--init-public) that it was "
                      "trained on public data only")
        elif origin == "public":
            effect = f"adds nothing to epsilon: trained by {self.trained}, on public data only"
        elif origin == "release":
            stated = (f", epsilon {self.release['epsilon']:.4g} at delta "
                      f"{self.release['delta']:.3g} alone" if self.release.get("epsilon")
                      is not None else "")
            effect = (f"its ledger ({self.release['steps']} logical steps{stated}) is composed "
                      "into this run's epsilon: a DP release trained further")
        else:
            effect = ("adds nothing to epsilon: the user states (--init-data-disjoint) that its "
                      f"training data ({self.trained}) share no example with this corpus")
        return {"path": os.path.basename(self.path), "kind": self.kind, "sha256": self.sha256,
                "trained": self.trained, "origin": origin, "epsilon": effect,
                "declared_by_user": declared,
                "data_disjoint_stated": bool(config.init_data_disjoint),
                "public_stated": bool(config.init_public),
                "privacy_report": (os.path.basename(self.privacy_report)
                                   if self.privacy_report else None),
                "release": ({k: v for k, v in self.release.items() if k != "ledger"}
                            if self.release else None),
                "vocabulary": os.path.basename(self.vocabulary) if self.vocabulary else None}

    def to_dict(self) -> dict[str, Any]:
        """JSON, for the run's checkpoint (a resumed run reports its start from it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "InitialWeights":
        return cls(**{**values, "architecture": tuple(values["architecture"])})


# The tasks a job continues (the registered names its `model.keras` may
# hold) and the command whose run folder holds one. Presets are BERT's alone.
BERT_TASK = (("keras_hub>BertMaskedLM",), "tf-megadp pretrain")
# How a backbone's config names its query heads: BERT and GPT-2 `num_heads`,
# Llama `num_query_heads` (its `num_key_value_heads` may be fewer).
_HEADS_KEYS = ("num_heads", "num_query_heads")


def read_initial_weights(path: str | os.PathLike,
                         tasks: tuple[tuple[str, ...], str] = BERT_TASK) -> InitialWeights:
    """Reads what PATH is: its shape, vocabulary, content hash and origin files.

    Args:
        path: a `model.keras` of this job (its run folder beside it) or a
            keras-hub preset directory (BERT only).
        tasks: (the registered names of the keras-hub tasks the job
            continues, the command whose runs write them); the causal-LM job
            passes GPT-2's and Llama's. Their backbones name their shape as
            BERT's does (num_layers, hidden_dim, num_heads or
            num_query_heads, intermediate_dim, vocabulary_size, and
            max_sequence_length where they have a position table).

    Returns:
        The `InitialWeights`.

    Raises:
        PretrainError: PATH is missing, holds none of `tasks` (BERT: nor a
            BertBackbone preset), or a Llama whose key/value heads or tied
            head are not those the job builds.

    Example:
    ```python
    init = read_initial_weights("runs/public/model.keras")
    init.preset_name(), init.vocabulary_size
    ```
    """
    path = os.path.abspath(os.fspath(path))
    registered_names, command = tasks
    if os.path.isdir(path) and tasks == BERT_TASK:
        return _read_preset(path)
    if os.path.isdir(path):
        raise PretrainError(
            f"--init-from {path} is a folder; start from the model.keras of a `{command}` run.")
    if not os.path.isfile(path):
        raise PretrainError(f"--init-from {path}: no such file or preset directory.")
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, ValueError):
        raise PretrainError(
            f"--init-from {path}: not a Keras model file (.keras) nor a keras-hub preset "
            "directory.") from None
    if config.get("registered_name") not in registered_names:
        names = " or ".join(name.split(">")[-1] for name in registered_names)
        raise PretrainError(
            f"--init-from {path} holds a {config.get('class_name')}; the job continues a "
            f"keras-hub {names} (the model.keras of a `{command}` run).")
    folder = os.path.dirname(path)
    return _with_provenance(path, "model.keras", sha256_of_file(path),
                            config["config"]["backbone"]["config"], folder,
                            _existing(os.path.join(folder, VOCABULARY_NAME)), None,
                            config["registered_name"])


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
                            path, vocabulary, lowercase, backbone["registered_name"])


def _with_provenance(path, kind, sha256, backbone, folder, vocabulary,
                     lowercase, task) -> InitialWeights:
    """The `InitialWeights` of a model: its weights' record, and the files in `folder`."""
    if lowercase is False:
        raise PretrainError(
            f"--init-from {path}: its tokenizer is cased (lowercase false), but the job "
            "lowercases text before its word pieces; start from an uncased model.")
    run = _json_or_none(os.path.join(folder, REPORT_NAME))
    privacy_report = _existing(os.path.join(folder, PRIVACY_REPORT_NAME))
    stated = _release(privacy_report) if privacy_report else None
    carried = _carried_ledger(path)
    if carried is not None:
        trained = _PRIVATE_RUN
        if stated is not None and stated["ledger"] != carried.to_list():
            raise PretrainError(
                f"--init-from {path}: the {PRIVACY_REPORT_NAME} beside it states a ledger of "
                f"{stated['steps']} logical steps, but its weights carry one of "
                f"{carried.total_steps}: the report was edited or belongs to another run. "
                f"Put the release's own {PRIVACY_REPORT_NAME} beside it, or remove it (the "
                "weights' ledger is the one composed).")
        release = {"steps": carried.total_steps, "ledger": carried.to_list(),
                   "epsilon": stated["epsilon"] if stated else None,
                   "delta": stated["delta"] if stated else None}
    elif stated is not None:
        trained, release = _PRIVACY_REPORT_ONLY, stated
    elif run is not None and run.get("private"):
        trained, release = _PRIVATE_RUN_WITHOUT_LEDGER, None
    elif run is not None:
        trained = _DEFAULT_CORPUS if not (run.get("config") or {}).get("corpus") else _USER_CORPUS
        release = None
    else:
        trained, release = _UNKNOWN, None
    if run is not None:
        vocabulary_public = bool((run.get("vocabulary") or {}).get("public"))
    else:
        vocabulary_public = True if kind == "preset" else None
    heads = next(backbone[key] for key in _HEADS_KEYS if key in backbone)
    _check_attention_and_head(path, backbone, heads)
    if "max_sequence_length" in backbone:
        context = backbone["max_sequence_length"]
    else:
        # No position table (rotary positions): the tokens its run trained on.
        context = ((run or {}).get("model") or {}).get("context")
    return InitialWeights(
        path=path, kind=kind, sha256=sha256,
        architecture=(backbone["num_layers"], backbone["hidden_dim"], heads,
                      backbone["intermediate_dim"]),
        vocabulary_size=backbone["vocabulary_size"], max_sequence_length=context,
        vocabulary=vocabulary, vocabulary_public=vocabulary_public, trained=trained,
        privacy_report=privacy_report, release=release, task=task)


def _check_attention_and_head(path: str, backbone: dict[str, Any], heads: int) -> None:
    """Refuses a backbone the jobs cannot rebuild: grouped-query attention, a tied Llama head.

    The jobs build as many key/value heads as query heads, and Llama with
    an untied head; weights of another layout would not load.
    """
    key_value_heads = backbone.get("num_key_value_heads", heads)
    if key_value_heads != heads:
        raise PretrainError(
            f"--init-from {path}: its attention has {key_value_heads} key/value heads for "
            f"{heads} query heads (grouped-query attention); the job builds as many of each. "
            "Start from a model of the job's.")
    if backbone.get("tie_word_embeddings"):
        raise PretrainError(
            f"--init-from {path}: its output head is tied to its token embedding "
            "(tie_word_embeddings); the job builds Llama with an untied head. Start from a "
            "model of the job's.")


def _carried_ledger(path: str):
    """The DP ledger PATH's weights carry (their record), or None (read with h5py alone)."""
    from tf_megadp.run import provenance

    try:
        records = provenance.read_file_provenance(path)
    except provenance.ProvenanceError as error:
        raise PretrainError(
            f"--init-from {path}: its weights file holds {error} Start from the file as its "
            "DP run wrote it.") from None
    return provenance.composed_ledger(records) if records else None


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
    # Installs the observer that reads a weights file's privacy ledger as
    # Keras loads it; under the `tf-megadp` launcher, which imports the
    # library on first use, nothing may have imported it yet, and a DP
    # release loaded without it is not recognised (its run then refuses to
    # start: its ledger would not be composed).
    from tf_megadp.run import weights_origin  # noqa: F401

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
    """Declares the init's weights to the private model: its composed ledger, or the statement.

    Called after `make_private`, before the first step of a new run. A
    release's values, loaded from its file, are composed by the private run
    itself (their record); one whose file carries no record is composed
    from its privacy.json (`tf_megadp.continue_from_release`, which checks
    that the report is bound to these weights).

    Raises:
        PretrainError: the ledger the run would compose is not the one the
            run was planned with (the files changed since).
    """
    import tf_megadp
    from tf_megadp.run import weights_origin

    origin = init.origin(config)
    if origin == "release":
        planned = init.composed_ledger(config)
        if init.trained == _PRIVACY_REPORT_ONLY:
            composed = tf_megadp.continue_from_release(model, init.privacy_report)
        else:
            composed = weights_origin.composable_ledger(model)
        if composed is None or composed.to_list() != planned.to_list():
            raise PretrainError(
                f"--init-from {init.path}: the ledger its weights would compose is not the "
                "one this run was planned with (its files changed since): plan it again.")
        return
    # By name: the statement goes into privacy.json, which is published.
    effect = init.report(config)["epsilon"]
    if origin == "disjoint":
        tf_megadp.declare_disjoint_data(
            model, statement=f"{os.path.basename(init.path)} (sha256 {init.sha256}): {effect}")
    else:
        tf_megadp.declare_public_weights(
            model, source=f"{os.path.basename(init.path)} (sha256 {init.sha256}): {effect}")


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
