"""The data of a pretraining run: corpus shards, vocabulary, held-out split and canaries."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from tf_megadp.files import atomic_write
from tf_megadp.jobs.bert.config import (
    PretrainConfig,
    PretrainError,
)
from tf_megadp.jobs.bert.run_files import (
    CANARIES_NAME,
    CANARY_ALPHABET,
    CANARY_CONTEXT,
    CANARY_REPETITIONS,
    CANARY_SECRET_LENGTH,
    TRAINING_CORPUS_VOCABULARY,
)
from tf_megadp.jobs.common.run_folder import VOCABULARY_NAME

def _default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tf_megadp", "corpora")


def _default_corpus_sources() -> list:
    """What the default corpus (docstrings of installed packages) depends on."""
    import importlib.metadata
    import platform

    return [("python", platform.python_version())] + [
        (name, importlib.metadata.version(name)) for name in ("tensorflow", "keras", "numpy")]


def _public_sources(config: PretrainConfig) -> tuple[str, ...] | None:
    """The sources of the run's offline default corpus (None: the docstrings, as always)."""
    if config.public_sources is None:
        return None
    from tf_megadp.jobs.bert.public_text import parse_public_sources

    return parse_public_sources(config.public_sources)


def public_corpus_sources(config: PretrainConfig) -> list:
    """What a default corpus of `config.public_sources` depends on: package versions, files."""
    from tf_megadp.jobs.bert.public_text import sources_fingerprint

    return _default_corpus_sources() + [list(pair) for pair in
                                        sources_fingerprint(_public_sources(config))]


def _vocabulary_plan(config: PretrainConfig) -> dict[str, Any]:
    """Where the run's vocabulary comes from, as JSON (part of the corpus cache key).

    Only the vocabulary learned from a user corpus depends on private text;
    the default is the public offline default corpus.
    """
    if config.vocabulary:
        from tf_megadp.files import sha256_of_file

        path = os.path.abspath(config.vocabulary)
        return {"kind": "file", "path": path, "sha256": sha256_of_file(path)}
    if config.corpus and config.vocabulary_from_training_corpus:
        return {"kind": "training corpus"}
    if config.public_sources is not None:
        return {"kind": "default corpus", "max_characters": config.max_characters,
                "public_sources": list(_public_sources(config)),
                "sources": public_corpus_sources(config), "size": config.vocabulary_size}
    return {"kind": "default corpus", "max_characters": config.max_characters,
            "sources": _default_corpus_sources(), "size": config.vocabulary_size}


def vocabulary_report(config: PretrainConfig) -> dict[str, Any]:
    """The report's account of where the published vocabulary came from.

    Args:
        config: the run's settings.

    Returns:
        {"source": ..., "public": bool, "file": "vocab.txt"}; "public" is
        False only for a vocabulary learned from a user corpus, which
        epsilon does not cover.

    Example:
    ```python
    vocabulary_report(PretrainConfig())["source"]
    # 'public: the offline default corpus (docstrings of installed packages)'
    ```
    """
    from tf_megadp.files import publishable_path

    plan = _vocabulary_plan(config)
    # Named as report.json names files: no path of this machine.
    folder = config.output_dir or "."
    if plan["kind"] == "file" and config.init_from:
        source, public = (f"public: the vocabulary {publishable_path(config.vocabulary, folder)} "
                          "of the initial weights "
                          f"{publishable_path(config.init_from, folder)}"), True
    elif plan["kind"] == "file":
        source, public = (f"public: the file {publishable_path(config.vocabulary, folder)} "
                          "(named public by the user)"), True
    elif plan["kind"] == "training corpus":
        source, public = TRAINING_CORPUS_VOCABULARY, False
    elif config.public_sources is not None:
        from tf_megadp.jobs.bert.corpus import HELD_OUT_PACKAGES

        source = ("public: the offline default corpus of sources "
                  f"{', '.join(_public_sources(config))} (docstrings of "
                  f"{', '.join(HELD_OUT_PACKAGES)} held out)")
        public = True
    else:
        source = "public: the offline default corpus (docstrings of installed packages)"
        public = True
    return {"source": source, "public": public, "file": VOCABULARY_NAME}


def _corpus_key(config: PretrainConfig) -> str:
    """Identifies a prepared corpus: its sources (with sizes and times) and settings."""
    import hashlib

    if config.corpus:
        from tf_megadp.jobs.bert import text

        try:
            files = text.expand_sources(config.corpus)
        except text.CorpusError as error:
            raise PretrainError(str(error)) from None
        sources = [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files]
    elif config.public_sources is not None:
        sources = public_corpus_sources(config)
    else:
        sources = _default_corpus_sources()
    key = json.dumps({
        "sources": sources, "L": config.sequence_length, "V": config.vocabulary_size,
        "chars": None if config.corpus else config.max_characters,
        "heldout": config.heldout_fraction, "seed": config.seed,
        "vocabulary": _vocabulary_plan(config),
        # Only files have separators; the default corpus's key stays as it was.
        **({"separator": config.document_separator} if config.corpus else {}),
        **({"privacy_unit": config.privacy_unit} if config.privacy_unit else {}),
    }, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _public_vocabulary(config: PretrainConfig, log=None):
    """The vocabulary to tokenize with: a token list, or None to learn it on the corpus.

    A vocabulary learned from the default corpus is cached by what it
    depends on (installed packages, size, character cap), so runs on any
    corpus reuse it.
    """
    import hashlib

    from tf_megadp.jobs.bert import text
    from tf_megadp.files import write_bytes_atomically

    plan = _vocabulary_plan(config)
    if plan["kind"] == "training corpus":
        return None
    try:
        if plan["kind"] == "file":
            return text.read_vocabulary_file(config.vocabulary)
        key = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
        path = os.path.join(config.cache_dir or _default_cache_dir(), f"vocabulary-{key}",
                            VOCABULARY_NAME)
        if not os.path.isfile(path):
            if log:
                log("  learning the public vocabulary from the offline default corpus...")
            if config.public_sources is not None:
                from tf_megadp.jobs.bert.public_text import public_corpus_documents

                documents = public_corpus_documents(
                    _public_sources(config), config.max_characters, progress=log,
                    cache_dir=config.cache_dir or _default_cache_dir())
            else:
                documents = text.default_corpus_documents(config.max_characters)
            vocabulary = text.learn_vocabulary(documents, config.vocabulary_size, progress=log)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_bytes_atomically(path, "".join(t + "\n" for t in vocabulary).encode("utf-8"))
        return text.read_vocabulary_file(path)
    except text.CorpusError as error:
        raise PretrainError(str(error)) from None


def prepare_data(config: PretrainConfig, log=None):
    """Tokenizes `config.corpus` once into the cache and splits it; reused across runs.

    The cache folder is keyed by everything that changes the tokens (corpus,
    sequence length, vocabulary size, seed, held-out fraction), so a run and
    its later audit find the same split.

    Args:
        config: the run's settings.
        log: called with progress lines (files read, words counted,
            documents tokenized, sequences written), e.g. `print`; None is
            silent.

    The vocabulary is public by default: learned from the offline default
    corpus (also for a user corpus), or the file `config.vocabulary`. Only
    `config.vocabulary_from_training_corpus` learns it from the user's
    corpus (see `vocabulary_report`).

    Returns:
        (all, train, heldout): `TokenShards` of the whole corpus and of its
        two disjoint splits.

    Raises:
        PretrainError: the corpus cannot be read or is too small.

    Example:
    ```python
    corpus, train, heldout = prepare_data(PretrainConfig(corpus=["notes.txt"]))
    len(train), train.vocabulary_size
    ```
    """
    from tf_megadp import data
    from tf_megadp.jobs.bert import text, units as unit_files

    folder = os.path.join(config.cache_dir or _default_cache_dir(), _corpus_key(config))
    try:
        return tuple(data.TokenShards(os.path.join(folder, name))
                     for name in ("all", "train", "heldout"))
    except (FileNotFoundError, ValueError):
        pass  # Not prepared yet (or damaged): build it.
    vocabulary = _public_vocabulary(config, log)
    try:
        corpus = text.prepare_corpus(
            os.path.join(folder, "all"),
            config.corpus,
            sequence_length=config.sequence_length,
            vocabulary_size=config.vocabulary_size,
            max_characters=config.max_characters,
            # Short leftovers (stream ends) waste a row; keep rows at least half full.
            min_tokens=max(1, min(16, config.sequence_length // 2)),
            vocabulary=vocabulary,
            separator=config.document_separator,
            progress=log,
            unit_field=config.privacy_unit,
            public_sources=None if config.corpus else _public_sources(config),
            text_cache_dir=config.cache_dir or _default_cache_dir(),
        )
        units = unit_files.load_unit_ids(corpus) if config.privacy_unit else None
    except text.CorpusError as error:
        raise PretrainError(str(error)) from None
    total = len(corpus)
    heldout = max(1, int(round(total * config.heldout_fraction)))
    if total - heldout < 2:
        raise PretrainError(f"The corpus has only {total} sequences; it needs at least 3.")
    split_checksum = f"{corpus.manifest['checksum']}-heldout{heldout}-seed{config.seed}"
    splits = {}
    order = np.random.default_rng(config.seed).permutation(total)
    # The held-out split is written last: its manifest marks the whole folder complete.
    for name, indices in (("train", np.sort(order[heldout:])), ("heldout", np.sort(order[:heldout]))):
        directory = os.path.join(folder, name)
        rows = (corpus.read(indices[i:i + 65536]) for i in range(0, len(indices), 65536))
        # Each split keeps its rows' units (written before its manifest).
        unit_metadata = ({} if units is None
                         else unit_files.save_unit_ids(directory, units[indices]))
        data.write_token_shards(
            directory, rows, sequence_length=corpus.sequence_length,
            vocabulary_size=corpus.vocabulary_size, checksum=split_checksum,
            # Relative to the split's folder, as the corpus's own is: a
            # relative --cache-dir (or a moved cache) still finds it.
            metadata={"vocabulary_file": os.path.join(os.pardir, "all", "vocab.txt"),
                      **unit_metadata},
        )
        splits[name] = data.TokenShards(directory)
    return corpus, splits["train"], splits["heldout"]


def canary_split(config: PretrainConfig, train):
    """The training split with `config.canaries` canaries per repetition count inserted.

    Returns:
        (shards, canaries, canary_index): canary_index gives, for each row,
        the index of the canary it holds or -1.
    """
    from tf_megadp import data
    from tf_megadp.jobs.bert import text
    from tf_megadp.audit import canaries as canary_lib

    folder = os.path.join(os.path.dirname(train.directory), f"train-canaries{config.canaries}")
    try:
        shards = data.TokenShards(folder)
        return (shards, canary_lib.load_canaries(os.path.join(folder, CANARIES_NAME)),
                np.load(os.path.join(folder, "canary_index.npy")))
    except (FileNotFoundError, ValueError):
        pass  # Not prepared yet (or damaged): build it.
    canaries = _make_canaries(text.load_vocabulary(train), config.canaries, config.seed)
    rows, canary_index = canary_lib.insert_canaries(
        train.read(np.arange(len(train))), canaries, seed=config.seed)
    # Shard files and the canary list first: the manifest, written last, marks the folder complete.
    os.makedirs(folder, exist_ok=True)
    canary_lib.save_canaries(os.path.join(folder, CANARIES_NAME), canaries)
    atomic_write(os.path.join(folder, "canary_index.npy"),
                 lambda temporary: np.save(temporary, canary_index))
    data.write_token_shards(
        folder, [rows], sequence_length=train.sequence_length,
        vocabulary_size=train.vocabulary_size,
        checksum=f"{train.manifest['checksum']}-canaries{config.canaries}-seed{config.seed}",
        metadata={"vocabulary_file": train.manifest["vocabulary_file"]})
    return data.TokenShards(folder), canaries, canary_index


def _make_canaries(vocabulary: list[str], per_repetition: int, seed: int) -> list:
    """Canaries "[CLS] the key of W1 W2 is D D D [SEP]", tokenized like the corpus.

    Each canary has its own random name W1 W2 (two whole-word tokens of the
    vocabulary), so its secret is tied to a context only it has, as in the
    secret sharer; with one shared context a model could at most learn the
    digits' overall frequencies there.
    """
    import keras_hub

    from tf_megadp.audit.canaries import Canary, CanaryFormat

    ids = {token: index for index, token in enumerate(vocabulary)}
    missing = [digit for digit in CANARY_ALPHABET if digit not in ids]
    if missing:
        raise PretrainError(
            f"Cannot make canaries: the vocabulary lacks the digit tokens {missing}; "
            "use a corpus with digits or pass --canaries 0."
        )
    names = [index for token, index in ids.items() if token.isalpha() and len(token) >= 3]
    plan = [r for r in CANARY_REPETITIONS for _ in range(per_repetition)] + [0] * per_repetition
    if len(names) ** 2 < 2 * len(plan):
        raise PretrainError(
            f"Cannot make {len(plan)} canaries: the vocabulary has only {len(names)} whole "
            "words to name them; lower --canaries."
        )
    tokenizer = keras_hub.tokenizers.WordPieceTokenizer(vocabulary=vocabulary, lowercase=True,
                                                        oov_token="[UNK]")
    prefix, infix = (
        [int(t) for t in np.asarray(tokenizer.tokenize(text))] for text in CANARY_CONTEXT)
    alphabet = [ids[digit] for digit in CANARY_ALPHABET]
    rng = np.random.default_rng(seed)
    canaries, used = [], set()
    for repetitions in plan:
        name = tuple(int(t) for t in rng.choice(names, size=2))
        while name in used:
            name = tuple(int(t) for t in rng.choice(names, size=2))
        used.add(name)
        template = [ids["[CLS]"], *prefix, *name, *infix,
                    *([None] * CANARY_SECRET_LENGTH), ids["[SEP]"]]
        canary_format = CanaryFormat(template, alphabet)
        secret = tuple(int(t) for t in canary_format.sample_secrets(rng, 1)[0])
        canaries.append(Canary(canary_format, secret, repetitions))
    return canaries
