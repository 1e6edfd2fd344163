"""From raw English text to masked-LM micro-batches for BERT.

The pipeline: read documents (text files, JSONL, or the offline default corpus
of Python docstrings), learn a WordPiece vocabulary, tokenize, pack the tokens
into rows of exactly L ids laid out as BERT expects (``[CLS] tokens... [SEP]``
then ``[PAD]``), and store the rows as memory-mapped shards with a manifest
(`tf_megadp.data.shards.write_token_shards`). The samplers draw rows from those
shards; `MaskedLMBatcher` turns each micro-batch of rows into the inputs of
`keras_hub.models.BertMaskedLM` with per-position sample weights.

Privacy unit: one packed row (sequence) is one training example, so the DP
guarantee protects any single sequence of L tokens. With the default
``packing="stream"`` a sequence may hold the end of one document and the start
of the next, and a long document spans several sequences: a document is then
protected only to the extent of group privacy over the sequences it touches.
``packing="document"`` never mixes documents in a sequence.
"""

from __future__ import annotations

import ast
import glob as glob_lib
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import sysconfig
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tf_megadp.files import write_bytes_atomically
from tf_megadp.jobs.bert.config import SEPARATORS
from tf_megadp.data.shards import MANIFEST_NAME, TokenShards, write_token_shards

__all__ = [
    "CorpusError",
    "SPECIAL_TOKENS",
    "default_corpus_documents",
    "read_documents",
    "write_synthetic_corpus",
    "learn_vocabulary",
    "read_vocabulary_file",
    "prepare_corpus",
    "load_vocabulary",
    "MaskedLMBatcher",
]

# BERT's special tokens, in the order keras-hub's WordPiece trainer reserves
# them: [PAD] must be id 0 because padding rows and padding positions are zeros.
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
_PAD, _CLS, _SEP, _UNK, _MASK = range(len(SPECIAL_TOKENS))
_DEFAULT_PACKAGES = ("stdlib", "numpy", "keras", "tensorflow")
# Folders whose docstrings are test scaffolding or duplicated tooling, not prose.
_SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_MIN_DOCSTRING_CHARACTERS = 40
_FORMAT_VERSION = 1
# Documents longer than this are counted and tokenized in pieces cut at
# whitespace (the words and tokens are the same: WordPiece never joins across
# whitespace), so a document of many megabytes is never one tensor element.
_TOKENIZE_PIECE_CHARACTERS = 1 << 16
# Progress lines report every this share of the work.
_PROGRESS_SHARE = 0.1

Progress = Callable[[str], None]


class CorpusError(ValueError):
    """The corpus or the text settings cannot produce a usable training set.

    The message names the file (and byte offset) or the setting to change.
    """


def _package_roots(packages: Sequence[str]) -> list[str]:
    roots = []
    for package in packages:
        if package == "stdlib":
            roots.append(sysconfig.get_paths()["stdlib"])
            continue
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(
                f"Package {package!r} is not installed; choose default-corpus "
                f"packages among the installed ones (e.g. {_DEFAULT_PACKAGES})."
            )
        roots.append(list(spec.submodule_search_locations)[0])
    return roots


def _docstrings(path: str) -> Iterator[str]:
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        # Some installed files are templates or target other Python versions.
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text and len(text) >= _MIN_DOCSTRING_CHARACTERS:
                yield text


def default_corpus_documents(
    max_characters: int = 2_000_000,
    packages: Sequence[str] = _DEFAULT_PACKAGES,
) -> list[str]:
    """English documents that every installation has: docstrings of installed Python code.

    Walks the Python standard library and the given installed packages in
    sorted order, extracts module, class and function docstrings with `ast`
    (without importing anything), drops short and duplicate ones, and stops
    at `max_characters` split evenly over the packages. Nothing is downloaded
    and no third-party text is stored in this repository.

    Args:
        max_characters: total size cap of the corpus.
        packages: ``"stdlib"`` and/or importable package names.

    Returns:
        A list of docstrings, deterministic for a given installation.
    """
    if max_characters < 1:
        raise CorpusError(f"max_characters must be >= 1, got {max_characters}.")
    roots = _package_roots(packages)
    budget = max_characters // len(roots)
    seen: set[bytes] = set()
    documents: list[str] = []
    for root in roots:
        used = 0
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if d not in _SKIPPED_FOLDERS)
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                for text in _docstrings(os.path.join(folder, name)):
                    key = hashlib.sha1(" ".join(text.split()).encode("utf-8")).digest()
                    if key in seen:
                        continue
                    seen.add(key)
                    documents.append(text)
                    used += len(text)
                    if used >= budget:
                        break
                if used >= budget:
                    break
            if used >= budget:
                break
    return documents


def _expand_sources(sources: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    paths: list[str] = []
    for source in sources:
        source = os.fspath(source)
        if glob_lib.has_magic(source):
            matches = sorted(glob_lib.glob(source, recursive=True))
            if not matches:
                raise CorpusError(f"The pattern {source!r} matches no file.")
            paths.extend(matches)
        elif os.path.isdir(source):
            raise CorpusError(
                f"{source} is a folder; pass its files or a glob such as '{source}/*.txt'."
            )
        else:
            paths.append(source)
    for path in paths:
        if not os.path.isfile(path):
            raise CorpusError(f"Corpus file {path} does not exist.")
        if os.path.getsize(path) == 0:
            raise CorpusError(f"Corpus file {path} is empty.")
    return paths


# A line break (LF or CRLF) ends a JSONL record or a line document; a run of
# blank lines ends a paragraph.
_LINE_SEPARATOR = re.compile(rb"\r?\n")
_PARAGRAPH_SEPARATOR = re.compile(rb"(?:\r?\n[ \t]*){2,}")


def _split_units(data: bytes, by_line: bool) -> list[tuple[int, bytes]]:
    """(byte offset, bytes) of each document: lines, or blank-line paragraphs."""
    separator = _LINE_SEPARATOR if by_line else _PARAGRAPH_SEPARATOR
    units, start = [], 0
    for match in separator.finditer(data):
        units.append((start, data[start : match.start()]))
        start = match.end()
    units.append((start, data[start:]))
    return units


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def read_documents(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    jsonl_field: str = "text",
    skip_undecodable: bool = False,
    separator: str = "blank-line",
    progress: Progress | None = None,
) -> tuple[list[str], int]:
    """Documents from text files, JSONL files, or globs of them.

    Plain text: documents are separated by blank lines (``separator=
    "blank-line"``) or each line is one document (``"line"``). ``.jsonl``
    files: one JSON object per line, the document in `jsonl_field`.

    Args:
        sources: a path, a glob pattern, or a list of them.
        jsonl_field: the JSONL field that holds the text.
        skip_undecodable: False raises `CorpusError` at the first byte that is
            not UTF-8 (naming file and byte offset); True drops the documents
            that contain such bytes and counts them.
        separator: how plain-text files are cut into documents, one of
            `SEPARATORS`.
        progress: called with one line per file read (size and documents).

    Returns:
        (documents, number of documents skipped for bad bytes).
    """
    if separator not in SEPARATORS:
        raise CorpusError(
            f"separator must be one of {', '.join(SEPARATORS)}, got {separator!r}.")
    documents: list[str] = []
    skipped = 0
    for path in _expand_sources(sources):
        jsonl = path.endswith(".jsonl")
        with open(path, "rb") as handle:
            data = handle.read()
        before = len(documents)
        for offset, raw in _split_units(data, jsonl or separator == "line"):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                if skip_undecodable:
                    skipped += 1
                    continue
                raise CorpusError(
                    f"{path}: byte {offset + error.start} is not valid UTF-8 "
                    f"({raw[error.start:error.start + 4]!r}). Fix the file, or pass "
                    "skip_undecodable=True to drop such documents."
                ) from None
            if jsonl:
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as error:
                    raise CorpusError(
                        f"{path}: the line at byte {offset} is not JSON ({error.msg})."
                    ) from None
                if not isinstance(record, dict) or not isinstance(record.get(jsonl_field), str):
                    raise CorpusError(
                        f"{path}: the line at byte {offset} has no string field "
                        f"{jsonl_field!r}; set jsonl_field to the field holding the text."
                    )
                text = record[jsonl_field]
            if text.strip():
                documents.append(text.strip())
        if progress:
            progress(f"  read {path}: {_megabytes(len(data))}, "
                     f"{len(documents) - before:,} documents")
    if not documents:
        raise CorpusError(f"No non-empty document in {sources!r}.")
    return documents, skipped


def write_synthetic_corpus(
    path: str | os.PathLike,
    size_bytes: int,
    *,
    separator: str = "blank-line",
    seed: int = 0,
) -> int:
    """Writes generated English-like text: a corpus of a chosen size, no third-party text.

    Words are made of random syllables and drawn with Zipf-like frequencies,
    sentences of 5-20 words, documents of 1-8 sentences, so that a WordPiece
    vocabulary has frequent words and rare ones to split, as in real text.
    For exercising the pipeline at scale (tests, benchmarks); a model learns
    only the word statistics from it.

    Args:
        path: the file to write (UTF-8).
        size_bytes: stop once the file holds at least this many bytes.
        separator: documents separated by a blank line or one per line
            (`SEPARATORS`).
        seed: the generator's seed; the same seed writes the same file.

    Returns:
        The number of documents written.
    """
    if separator not in SEPARATORS:
        raise CorpusError(
            f"separator must be one of {', '.join(SEPARATORS)}, got {separator!r}.")
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lexicon = sorted({"".join(rng.choice(syllables, size=int(rng.integers(1, 4))))
                      for _ in range(20_000)})
    rng.shuffle(lexicon)
    frequencies = 1.0 / np.arange(1, len(lexicon) + 1) ** 1.1
    frequencies /= frequencies.sum()
    gap = "\n" if separator == "line" else "\n\n"
    written = documents = 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < size_bytes:
            # Draw words in blocks: one call per document keeps this fast.
            counts = rng.integers(5, 21, size=int(rng.integers(1, 9)))
            words = rng.choice(len(lexicon), size=int(counts.sum()), p=frequencies)
            sentences, start = [], 0
            for count in counts:
                sentence = " ".join(lexicon[w] for w in words[start:start + count])
                sentences.append(sentence[0].upper() + sentence[1:] + ".")
                start += count
            document = " ".join(sentences) + gap
            handle.write(document)
            written += len(document.encode("utf-8"))
            documents += 1
    return documents


# Documents (or pieces) per batch when counting words and tokenizing: small
# enough for progress lines at every tenth of a corpus of a few thousand.
_TEXT_BATCH = 256


def _words_dataset(documents: Sequence[str], lowercase: bool, batch_size: int):
    import tensorflow as tf
    from tf_megadp._keras_compat import keras_hub_pretokenize

    return (
        tf.data.Dataset.from_tensor_slices(list(documents))
        .batch(batch_size)
        .map(lambda text: keras_hub_pretokenize(text, lowercase))
    )


def _pieces(document: str, limit: int) -> list[str]:
    """`document` cut at whitespace into pieces of at most `limit` characters.

    A word longer than `limit` (no whitespace in it) is cut where it must be.
    """
    pieces, start = [], 0
    while len(document) - start > limit:
        cut = max(document.rfind(" ", start, start + limit), document.rfind("\n", start, start + limit))
        cut = cut if cut > start else start + limit
        pieces.append(document[start:cut])
        start = cut
    pieces.append(document[start:])
    return pieces


def _as_pieces(documents: Sequence[str], limit: int) -> tuple[list[str], list[int]]:
    """Every document as `_pieces`, and the index of the document of each piece."""
    pieces: list[str] = []
    owners: list[int] = []
    for index, document in enumerate(documents):
        cut = _pieces(document, limit)
        pieces.extend(cut)
        owners.extend([index] * len(cut))
    return pieces, owners


def _documents_done(owners: list[int], pieces_done: int) -> int:
    """How many documents are complete once the first `pieces_done` pieces are."""
    if pieces_done == len(owners):
        return owners[-1] + 1 if owners else 0
    return owners[pieces_done]


class _Reporter:
    """Progress lines at every `_PROGRESS_SHARE` of a known total, with elapsed time."""

    def __init__(self, progress: Progress | None, what: str, total: int):
        self.progress, self.what, self.total = progress, what, max(total, 1)
        self.started = time.time()
        self.next_share = _PROGRESS_SHARE

    def update(self, done: int, detail: str = "") -> None:
        share = done / self.total
        if self.progress is None or (share < self.next_share and done < self.total):
            return
        while self.next_share <= share:
            self.next_share += _PROGRESS_SHARE
        self.progress(f"  {self.what}: {share:4.0%} ({done:,} / {self.total:,} documents"
                      f"{', ' + detail if detail else ''}; {time.time() - self.started:.0f} s)")


def learn_vocabulary(
    documents: Sequence[str],
    vocabulary_size: int,
    *,
    lowercase: bool = True,
    max_word_types: int | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Learns a WordPiece vocabulary with tensorflow-text's learner.

    Args:
        documents: the texts.
        vocabulary_size: the maximum size V, special tokens included.
        lowercase: lowercase before splitting (an "uncased" BERT vocabulary).
        max_word_types: learn from at most this many of the most frequent
            distinct words (rarer words are spelled with word pieces anyway);
            default 2 * V.
        progress: called with a line at every tenth of the documents
            counted, and when the learner starts and ends.

    Returns:
        The vocabulary: `SPECIAL_TOKENS` first ([PAD] = 0), then single
        characters, then word pieces by frequency.
    """
    import collections

    from tensorflow_text.tools.wordpiece_vocab import wordpiece_tokenizer_learner_lib as learner

    minimum = len(SPECIAL_TOKENS) + 1
    if isinstance(vocabulary_size, bool) or not isinstance(vocabulary_size, int) or vocabulary_size < minimum:
        raise CorpusError(
            f"vocabulary_size must be an integer >= {minimum}, got {vocabulary_size!r}."
        )
    # The learner's own count_words, batch by batch, so that a large corpus
    # reports how far the count is.
    counts: collections.Counter = collections.Counter()
    pieces, owners = _as_pieces(documents, _TOKENIZE_PIECE_CHARACTERS)
    reporter = _Reporter(progress, "counting words", len(documents))
    done = 0
    for words in _words_dataset(pieces, lowercase, _TEXT_BATCH):
        counts.update(words.flat_values.numpy())
        done = min(done + _TEXT_BATCH, len(pieces))
        reporter.update(_documents_done(owners, done), f"{len(counts):,} distinct words")
    counts = collections.Counter({word.decode("utf-8"): count for word, count in counts.items()})
    if progress:
        progress(f"  learning a WordPiece vocabulary of {vocabulary_size} from the "
                 f"{min(len(counts), max_word_types or 2 * vocabulary_size):,} most frequent "
                 f"of {len(counts):,} distinct words...")
    started = time.time()
    # Settings chosen for speed on a CPU: the learner is pure Python and its
    # cost grows with distinct words, piece length and refinement rounds;
    # these keep a default-corpus vocabulary to about a minute.
    vocabulary = learner.learn(
        counts,
        vocabulary_size,
        list(SPECIAL_TOKENS),
        lower_thresh=2,
        max_token_length=16,
        num_iterations=2,
        slack_ratio=0.1,
        max_input_tokens=max_word_types or 2 * vocabulary_size,
    )
    if progress:
        progress(f"  vocabulary learned in {time.time() - started:.0f} s")
    # The learner orders special tokens, characters, then pieces by frequency;
    # cutting the tail drops the rarest pieces.
    return vocabulary[:vocabulary_size]


def read_vocabulary_file(path: str | os.PathLike) -> list[str]:
    """A WordPiece vocabulary file (one token per line), in tf_megadp's id order.

    tf_megadp's masking and padding use ids 0-4 for `SPECIAL_TOKENS`. A
    file that holds all five elsewhere (the public BERT `vocab.txt` has
    [PAD] at 0 and [UNK] [CLS] [SEP] [MASK] at 100-103) is reordered: the
    special tokens first, then every other token in file order. A model
    trained from scratch may number its tokens freely; the run publishes the
    reordered vocabulary with it.

    Args:
        path: the file, UTF-8, one token per line.

    Returns:
        The tokens: `SPECIAL_TOKENS`, then the others, without duplicates or
        empty lines.

    Raises:
        CorpusError: the file cannot be read or lacks a special token.

    Example:
    ```python
    vocabulary = read_vocabulary_file("bert-base-uncased/vocab.txt")
    vocabulary[:5]    # ['[PAD]', '[CLS]', '[SEP]', '[UNK]', '[MASK]']
    ```
    """
    try:
        with open(path, encoding="utf-8") as handle:
            # Lines, not whitespace-split words: a token never holds a line
            # break, and the file's own order is kept.
            tokens = [line.rstrip("\r\n") for line in handle]
    except OSError as error:
        raise CorpusError(f"Cannot read vocabulary file {path}: {error.strerror}.") from None
    except UnicodeDecodeError as error:
        raise CorpusError(f"Vocabulary file {path} is not UTF-8 ({error.reason}).") from None
    tokens = [token for token in tokens if token.strip()]
    missing = [token for token in SPECIAL_TOKENS if token not in tokens]
    if missing:
        raise CorpusError(
            f"Vocabulary file {path} lacks the special tokens {missing}; a BERT "
            f"vocabulary needs all of {list(SPECIAL_TOKENS)} (add them as lines)."
        )
    ordered = list(SPECIAL_TOKENS)
    seen = set(ordered)
    for token in tokens:
        if token not in seen:
            seen.add(token)
            ordered.append(token)
    return ordered


def _tokenize(documents: Sequence[str], vocabulary: list[str], lowercase: bool,
              progress: Progress | None = None,
              piece_characters: int = _TOKENIZE_PIECE_CHARACTERS) -> list[np.ndarray]:
    """Token ids of each document, tokenized in batches of pieces of whole words."""
    import keras_hub
    import tensorflow as tf

    tokenizer = keras_hub.tokenizers.WordPieceTokenizer(
        vocabulary=vocabulary, lowercase=lowercase, oov_token=SPECIAL_TOKENS[_UNK]
    )
    pieces, owners = _as_pieces(documents, piece_characters)
    dataset = tf.data.Dataset.from_tensor_slices(pieces).batch(_TEXT_BATCH).map(tokenizer.tokenize)
    per_piece: list[np.ndarray] = []
    reporter = _Reporter(progress, "tokenizing", len(documents))
    total = 0
    for batch in dataset:
        values = batch.flat_values.numpy().astype(np.int32)
        splits = batch.row_splits.numpy()
        per_piece.extend(np.split(values, splits[1:-1]))
        total += len(values)
        reporter.update(_documents_done(owners, len(per_piece)), f"{total:,} tokens")
    if len(pieces) == len(documents):
        return per_piece
    tokens: list[list[np.ndarray]] = [[] for _ in documents]
    for owner, ids in zip(owners, per_piece):
        tokens[owner].append(ids)
    return [np.concatenate(parts) for parts in tokens]


def _pack(
    tokens: list[np.ndarray], sequence_length: int, packing: str, min_tokens: int
) -> np.ndarray:
    """Rows of [CLS] body [SEP] [PAD]..., body up to L - 2 tokens."""
    body = sequence_length - 2
    if packing == "stream":
        pieces = [np.concatenate(tokens)] if tokens else []
    else:
        pieces = tokens
    bodies: list[np.ndarray] = []
    for piece in pieces:
        for start in range(0, len(piece), body):
            chunk = piece[start : start + body]
            if len(chunk) >= min_tokens:
                bodies.append(chunk)
    rows = np.zeros((len(bodies), sequence_length), np.int32)
    for row, chunk in zip(rows, bodies):
        row[0] = _CLS
        row[1 : 1 + len(chunk)] = chunk
        row[1 + len(chunk)] = _SEP
    return rows


def _inputs_checksum(
    sources: str | os.PathLike | Sequence[str | os.PathLike] | None,
    max_characters: int,
    settings: dict[str, Any],
) -> str:
    """A digest of what determines the shards, computed without tokenizing.

    User files are hashed by content. The default corpus is hashed by the
    name, size and modification time of every source file it may read (plus
    the Python version and the size cap): installing or upgrading a package
    changes it, and a rebuild is needed only then.
    """
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))

    def feed(*parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)

    if sources is None:
        feed("default", sys.version, max_characters)
        for root in _package_roots(_DEFAULT_PACKAGES):
            for folder, subfolders, files in os.walk(root):
                subfolders[:] = sorted(d for d in subfolders if d not in _SKIPPED_FOLDERS)
                for name in sorted(files):
                    if name.endswith(".py"):
                        info = os.stat(os.path.join(folder, name))
                        feed(os.path.relpath(os.path.join(folder, name), root), info.st_size, info.st_mtime_ns)
    else:
        for path in _expand_sources(sources):
            with open(path, "rb") as handle:
                feed("file", path.endswith(".jsonl"), handle.read())
    return digest.hexdigest()


def prepare_corpus(
    output_dir: str | os.PathLike,
    sources: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    sequence_length: int = 128,
    vocabulary_size: int = 8192,
    lowercase: bool = True,
    packing: str = "stream",
    min_tokens: int = 16,
    max_characters: int = 2_000_000,
    max_sequences: int | None = None,
    jsonl_field: str = "text",
    skip_undecodable: bool = False,
    max_unknown_fraction: float = 0.05,
    rows_per_shard: int = 1 << 20,
    vocabulary: str | os.PathLike | Sequence[str] | None = None,
    separator: str = "blank-line",
    progress: Progress | None = None,
) -> TokenShards:
    """Builds (or reuses) the token shards of a corpus for masked-LM pretraining.

    Args:
        output_dir: folder for `manifest.json`, `vocab.txt` and the shards.
        sources: text/JSONL files or globs; None uses
            `default_corpus_documents(max_characters)`.
        sequence_length: L, tokens per row including [CLS] and [SEP]; use it
            as the BertBackbone's `max_sequence_length`.
        vocabulary_size: maximum WordPiece vocabulary size; the manifest's
            `vocabulary_size` (possibly smaller on a small corpus) is what the
            BertBackbone must use.
        lowercase: uncased vocabulary and tokenization.
        packing: ``"stream"`` fills every row, letting documents share rows;
            ``"document"`` starts every document on a new row.
        min_tokens: rows with fewer real tokens are dropped (the last piece
            of a stream or a document).
        max_characters: size cap of the default corpus (ignored with sources).
        max_sequences: keep only the first this-many rows.
        jsonl_field: text field of ``.jsonl`` files.
        skip_undecodable: drop documents with non-UTF-8 bytes instead of raising.
        max_unknown_fraction: raise if more [UNK] tokens than this (the
            vocabulary is too small for the text).
        rows_per_shard: rows per shard file.
        vocabulary: a WordPiece vocabulary (list of tokens starting with
            `SPECIAL_TOKENS`, or the path of a `vocab.txt`, read with
            `read_vocabulary_file`), e.g. one learned from public text, to use
            instead of learning one from this corpus. Learning it from a
            private corpus puts the corpus's frequent words, names and
            identifiers into the vocabulary verbatim, outside the DP
            guarantee: pass a public vocabulary for private text.
        separator: how plain-text `sources` are cut into documents
            ("blank-line" or "line", see `read_documents`).
        progress: called with progress lines (files read, words counted,
            the vocabulary learned, documents tokenized, sequences written),
            e.g. `print`; None is silent.

    Returns:
        The `TokenShards`. If `output_dir` already holds shards built from the
        same documents and settings (same checksum), they are reused.

    Example:
    ```python
    shards = prepare_corpus("runs/corpus", max_characters=1_000_000)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=shards.vocabulary_size, max_sequence_length=shards.sequence_length,
        num_layers=2, num_heads=2, hidden_dim=128, intermediate_dim=512)
    ```
    """
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < 8:
        raise CorpusError(
            f"sequence_length must be an integer >= 8 ([CLS], [SEP] and at least 6 "
            f"tokens), got {sequence_length!r}."
        )
    if packing not in ("stream", "document"):
        raise CorpusError(f"packing must be 'stream' or 'document', got {packing!r}.")
    if not 1 <= min_tokens <= sequence_length - 2:
        raise CorpusError(
            f"min_tokens must be in [1, sequence_length - 2 = {sequence_length - 2}], "
            f"got {min_tokens}."
        )
    given_vocabulary = vocabulary is not None
    if vocabulary is not None:
        if isinstance(vocabulary, (str, os.PathLike)):
            vocabulary = read_vocabulary_file(vocabulary)
        vocabulary = [token for token in vocabulary if token]
        if tuple(vocabulary[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise CorpusError(
                f"A given vocabulary must start with {list(SPECIAL_TOKENS)} in this "
                f"order; it starts with {vocabulary[: len(SPECIAL_TOKENS)]}."
            )
    settings = {
        "format": _FORMAT_VERSION,
        "given_vocabulary": vocabulary,
        "sequence_length": sequence_length,
        "vocabulary_size": vocabulary_size,
        "lowercase": lowercase,
        "packing": packing,
        "min_tokens": min_tokens,
        "max_sequences": max_sequences,
        "max_unknown_fraction": max_unknown_fraction,
        "rows_per_shard": rows_per_shard,
        "jsonl_field": jsonl_field,
        "skip_undecodable": skip_undecodable,
    }
    if sources is not None:
        # Only files have separators; the default corpus's key stays as it was.
        if separator not in SEPARATORS:
            raise CorpusError(
                f"separator must be one of {', '.join(SEPARATORS)}, got {separator!r}.")
        settings["separator"] = separator
    checksum = _inputs_checksum(sources, max_characters, settings)
    output_dir = os.fspath(output_dir)
    manifest_path = os.path.join(output_dir, MANIFEST_NAME)
    if os.path.isfile(manifest_path):
        with open(manifest_path, encoding="utf-8") as handle:
            previous = json.load(handle)
        if previous.get("checksum") == checksum:
            shards = TokenShards(output_dir)
            if progress:
                progress(f"  reusing the prepared shards in {output_dir}: "
                         f"N = {len(shards):,} sequences of {sequence_length} tokens")
            return shards

    started = time.time()
    if sources is None:
        documents, skipped = default_corpus_documents(max_characters), 0
        description = f"default corpus: docstrings of {', '.join(_DEFAULT_PACKAGES)}"
    else:
        documents, skipped = read_documents(
            sources, jsonl_field=jsonl_field, skip_undecodable=skip_undecodable,
            separator=separator, progress=progress,
        )
        description = f"{len(_expand_sources(sources))} file(s)"
    if progress:
        progress(f"  {len(documents):,} documents, "
                 f"{sum(len(d) for d in documents):,} characters"
                 + (f" ({skipped:,} skipped: not UTF-8)" if skipped else ""))

    if vocabulary is None:
        vocabulary = learn_vocabulary(documents, vocabulary_size, lowercase=lowercase,
                                      progress=progress)
    tokens = _tokenize(documents, vocabulary, lowercase, progress)
    total = sum(len(t) for t in tokens)
    unknown = sum(int(np.count_nonzero(t == _UNK)) for t in tokens)
    if total == 0:
        raise CorpusError("The corpus has no tokens.")
    if unknown / total > max_unknown_fraction:
        fix = (
            "the given vocabulary does not cover this text's characters: use a public "
            "vocabulary that does (or raise max_unknown_fraction)"
            if given_vocabulary
            else f"the vocabulary of {len(vocabulary)} is too small for this text. "
            "Raise vocabulary_size"
        )
        raise CorpusError(
            f"{unknown / total:.1%} of the tokens are [UNK] (limit "
            f"{max_unknown_fraction:.1%}): {fix}."
        )
    rows = _pack(tokens, sequence_length, packing, min_tokens)
    if max_sequences is not None:
        rows = rows[:max_sequences]
    if len(rows) == 0:
        raise CorpusError(
            f"No sequence has {min_tokens} tokens or more ({total} tokens in all): "
            "use a larger corpus or a smaller min_tokens."
        )
    os.makedirs(output_dir, exist_ok=True)
    write_bytes_atomically(
        os.path.join(output_dir, "vocab.txt"),
        "".join(token + "\n" for token in vocabulary).encode("utf-8"),
    )
    write_token_shards(
        output_dir,
        [rows],
        sequence_length=sequence_length,
        vocabulary_size=len(vocabulary),
        checksum=checksum,
        rows_per_shard=rows_per_shard,
        metadata={
            "vocabulary_file": "vocab.txt",
            **({"separator": separator} if sources is not None else {}),
            "special_tokens": {name: index for index, name in enumerate(SPECIAL_TOKENS)},
            "lowercase": lowercase,
            "packing": packing,
            "privacy_unit": f"one sequence of {sequence_length} tokens",
            "source": description,
            "num_documents": len(documents),
            "documents_skipped": skipped,
            "num_tokens": total,
            "unknown_fraction": unknown / total,
        },
    )
    if progress:
        progress(f"  wrote N = {len(rows):,} sequences of {sequence_length} tokens "
                 f"({total:,} tokens, {unknown / total:.2%} [UNK]) to {output_dir} "
                 f"in {time.time() - started:.0f} s")
    return TokenShards(output_dir)


def load_vocabulary(shards: TokenShards) -> list[str]:
    """The vocabulary stored next to shards built by `prepare_corpus`."""
    path = os.path.join(shards.directory, shards.manifest["vocabulary_file"])
    with open(path, encoding="utf-8") as handle:
        return handle.read().split("\n")[:-1]


class MaskedLMBatcher:
    """Turns a micro-batch of token rows into `BertMaskedLM` training inputs.

    Use it as the `map_fn` of a sampler's `as_dataset`. It selects
    `mask_rate` of each row's real tokens (never [PAD], [CLS], [SEP]; at most
    `max_predictions`) uniformly at random, replaces 80 % of them by [MASK],
    10 % by a random token, and leaves 10 % unchanged: BERT's masking, as
    `keras_hub.layers.MaskedLMMaskGenerator` does it.

    Its randomness is the sampler's: `as_dataset` passes every micro-batch
    the secret key of its logical step (`key`, drawn from the sampler's OS
    entropy, the same for every micro-batch of the step). Each row's draws
    are keyed by that key and the row's own content (its 64-bit
    fingerprint), never by its position: an example gets the same masks
    wherever the draw places it, so adding or removing one example changes
    no other example's masks, and the clipped sum moves by at most C.
    Every draw is stateless, so the masks do not depend on thread timing
    or on the order the pipeline runs the calls. A seeded sampler (tests
    only, marked not for release) makes the masks reproducible.

    Args:
        vocabulary_size: V of the model.
        sequence_length: L of the rows.
        mask_rate: fraction of real tokens to predict.
        max_predictions: P, the static number of predicted positions per row,
            in [1, L]; default ceil(mask_rate * L).
        mask_token_rate: share of selected tokens replaced by [MASK].
        random_token_rate: share replaced by a random token.

    Call arguments:
        rows: int32 [M, L] token ids ([PAD] = 0).
        weights: float32 [M], 0 for padding examples.
        key: int64 [2], the key of the logical step (a sampler's `as_dataset`
            passes it). Equal rows masked with the same key get the same
            masks; a fixed evaluation set uses a fixed, public key.

    Returns:
        `(x, y, sample_weight)`: x = {"token_ids", "segment_ids",
        "padding_mask", "mask_positions"}, y = mask_ids int32 [M, P],
        sample_weight = float32 [M, P] (1 for a predicted position of a real
        example, 0 otherwise; all zeros for padding examples).
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        *,
        mask_rate: float = 0.15,
        max_predictions: int | None = None,
        mask_token_rate: float = 0.8,
        random_token_rate: float = 0.1,
    ):
        if not 0 < mask_rate < 1:
            raise ValueError(f"mask_rate must be in (0, 1), got {mask_rate}.")
        if vocabulary_size <= _MASK:
            raise ValueError(
                f"vocabulary_size must exceed the special token ids (> {_MASK}), "
                f"got {vocabulary_size}."
            )
        if not (0 <= mask_token_rate and 0 <= random_token_rate
                and mask_token_rate + random_token_rate <= 1):
            raise ValueError(
                "mask_token_rate and random_token_rate must be non-negative with a sum "
                f"of at most 1, got {mask_token_rate} and {random_token_rate}.")
        max_predictions = max_predictions or math.ceil(mask_rate * sequence_length)
        if not 1 <= max_predictions <= sequence_length:
            raise ValueError(
                f"max_predictions must be in [1, sequence_length={sequence_length}], "
                f"got {max_predictions}.")
        self.vocabulary_size = vocabulary_size
        self.sequence_length = sequence_length
        self.mask_rate = mask_rate
        self.max_predictions = max_predictions
        self.mask_token_rate = mask_token_rate
        self.random_token_rate = random_token_rate

    @classmethod
    def from_shards(cls, shards: TokenShards, **kwargs: Any) -> "MaskedLMBatcher":
        """A batcher with V and L read from the shards' manifest."""
        return cls(shards.vocabulary_size, shards.sequence_length, **kwargs)

    def _draws(self, rows, key):
        """Per row: selection scores [L], replacement draws [P], random tokens [P].

        Row i's draws come from `key` folded with the fingerprint of row i's
        tokens: a function of the example, not of where it sits.
        """
        import tensorflow as tf

        length, predictions = self.sequence_length, self.max_predictions
        fingerprints = tf.bitcast(tf.fingerprint(rows), tf.int64)
        key = tf.cast(key, tf.int64)

        def one_row(fingerprint):
            seed = tf.random.experimental.stateless_fold_in(key, fingerprint)
            selection, replacement, token = tf.unstack(
                tf.random.experimental.stateless_split(seed, 3))
            return (tf.random.stateless_uniform([length], selection),
                    tf.random.stateless_uniform([predictions], replacement),
                    tf.random.stateless_uniform([predictions], token, minval=0,
                                                maxval=self.vocabulary_size, dtype=tf.int32))

        return tf.map_fn(one_row, fingerprints,
                         fn_output_signature=(tf.float32, tf.float32, tf.int32))

    def __call__(self, rows, weights, *, key):
        import tensorflow as tf

        rows = tf.convert_to_tensor(rows, tf.int32)
        length, predictions = self.sequence_length, self.max_predictions
        uniform, draw, random_tokens = self._draws(rows, key)
        selectable = (tf.not_equal(rows, _PAD) & tf.not_equal(rows, _CLS)
                      & tf.not_equal(rows, _SEP))
        count = tf.reduce_sum(tf.cast(selectable, tf.int32), axis=1)
        chosen = tf.minimum(
            tf.cast(tf.math.ceil(tf.cast(count, tf.float32) * self.mask_rate), tf.int32),
            predictions)
        # The `chosen` selectable positions of lowest score: a uniform subset
        # (scores of unselectable positions, 2, rank after every real one).
        scores = tf.where(selectable, uniform, 2.0)
        _, ranked = tf.math.top_k(-scores, k=predictions)
        valid = tf.range(predictions)[None, :] < chosen[:, None]
        # Positions ascending, the padding slots (position 0, weight 0) last.
        positions = tf.sort(tf.where(valid, ranked, length), axis=1)
        positions = tf.where(valid, positions, 0)
        mask_ids = tf.where(valid, tf.gather(rows, positions, batch_dims=1), 0)

        shown = tf.where(draw < self.mask_token_rate, _MASK,
                         tf.where(draw < self.mask_token_rate + self.random_token_rate,
                                  random_tokens, mask_ids))
        # Each row's valid positions are distinct: one one-hot sum places them.
        placed = tf.one_hot(positions, length, dtype=tf.int32) * tf.cast(valid, tf.int32)[..., None]
        is_selected = tf.reduce_sum(placed, axis=1) > 0
        token_ids = tf.where(is_selected, tf.reduce_sum(placed * shown[..., None], axis=1), rows)

        real = tf.not_equal(rows, _PAD)
        # A padding example has no real token; letting it attend to position 0
        # keeps its (zero-weight) loss finite, so 0 * loss stays 0, not NaN.
        is_padding = tf.equal(weights, 0.0)
        first = tf.range(length) == 0
        padding_mask = tf.logical_or(real, tf.logical_and(first[None, :], is_padding[:, None]))
        x = {
            "token_ids": token_ids,
            "segment_ids": tf.zeros_like(rows, tf.int32),
            # int32, BertBackbone's own input dtype: under a tf.distribute
            # strategy Keras averages the first batch across replicas to
            # build the model, which no all-reduce can do for bool.
            "padding_mask": tf.cast(padding_mask, tf.int32),
            "mask_positions": positions,
        }
        sample_weight = tf.cast(valid, tf.float32) * tf.cast(weights, tf.float32)[:, None]
        return x, mask_ids, sample_weight
