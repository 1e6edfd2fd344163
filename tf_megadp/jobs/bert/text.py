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

import hashlib
import json
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from tf_megadp.data.shards import MANIFEST_NAME, TokenShards, write_token_shards
from tf_megadp.files import write_bytes_atomically
from tf_megadp.jobs.bert.config import SEPARATORS
from tf_megadp.jobs.bert.corpus import (
    CLS_ID,
    DEFAULT_PACKAGES,
    SEP_ID,
    SKIPPED_FOLDERS,
    SPECIAL_TOKENS,
    UNK_ID,
    CorpusError,
    Progress,
    default_corpus_documents,
    expand_sources,
    package_roots,
    read_documents,
    write_synthetic_corpus,
)
from tf_megadp.jobs.bert.masking import MaskedLMBatcher
from tf_megadp.jobs.bert.units import save_unit_ids

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

_FORMAT_VERSION = 1
# Documents longer than this are counted and tokenized in pieces cut at
# whitespace (the words and tokens are the same: WordPiece never joins across
# whitespace), so a document of many megabytes is never one tensor element.
_TOKENIZE_PIECE_CHARACTERS = 1 << 16
# Progress lines report every this share of the work.
_PROGRESS_SHARE = 0.1



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
        vocabulary=vocabulary, lowercase=lowercase, oov_token=SPECIAL_TOKENS[UNK_ID]
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
        row[0] = CLS_ID
        row[1 : 1 + len(chunk)] = chunk
        row[1 + len(chunk)] = SEP_ID
    return rows


def _pack_by_unit(tokens: list[np.ndarray], units: Sequence[str], sequence_length: int,
                  packing: str, min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows as `_pack` makes them, no row shared by two units; and each row's unit.

    Returns:
        (rows [n, L], unit index [n] int64 into the sorted distinct unit ids).
    """
    names, index = np.unique(np.asarray(units, dtype=str), return_inverse=True)
    by_unit: list[list[np.ndarray]] = [[] for _ in names]
    for unit, ids in zip(index, tokens):
        by_unit[unit].append(ids)
    blocks = [_pack(parts, sequence_length, packing, min_tokens) for parts in by_unit]
    rows = (np.concatenate(blocks) if blocks
            else np.zeros((0, sequence_length), np.int32))
    row_units = np.repeat(np.arange(len(blocks), dtype=np.int64), [len(b) for b in blocks])
    return rows, row_units


def _inputs_checksum(
    sources: str | os.PathLike | Sequence[str | os.PathLike] | None,
    max_characters: int,
    settings: dict[str, Any],
) -> str:
    """A digest of what determines the shards, computed without tokenizing.

    User files are hashed by content. The default corpus is hashed by the
    name, size and modification time of every source file it may read (plus
    the Python version and the size cap): installing or upgrading a package
    changes it, and a rebuild is needed only then. A public corpus of
    several sources is hashed by their `sources_fingerprint` (the same
    for its files).
    """
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))

    def feed(*parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)

    if sources is None and settings.get("public_sources"):
        from tf_megadp.jobs.bert.public_text import sources_fingerprint

        feed("public", sys.version, max_characters,
             json.dumps(sources_fingerprint(settings["public_sources"])))
    elif sources is None:
        feed("default", sys.version, max_characters)
        for root in package_roots(DEFAULT_PACKAGES):
            for folder, subfolders, files in os.walk(root):
                subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
                for name in sorted(files):
                    if name.endswith(".py"):
                        info = os.stat(os.path.join(folder, name))
                        feed(os.path.relpath(os.path.join(folder, name), root), info.st_size, info.st_mtime_ns)
    else:
        for path in expand_sources(sources):
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
    unit_field: str | None = None,
    public_sources: Sequence[str] | None = None,
    text_cache_dir: str | os.PathLike | None = None,
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
        unit_field: user-level privacy: the JSONL field naming each
            document's privacy unit (`read_documents`). No row then holds
            text of two units (the documents of each unit are packed
            together, `packing` within the unit), and each row's unit index
            is saved next to the shards (`units.load_unit_ids`).
        public_sources: without `sources`, read the public corpus of these
            sources (`tf_megadp.jobs.bert.public_text.PUBLIC_SOURCES`,
            held-out packages excluded) instead of the default docstrings;
            the manifest records the characters taken from each.
        text_cache_dir: where the public sources' text is cached (None:
            read every time).

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
    if unit_field is not None:
        if sources is None:
            raise CorpusError(
                f"A privacy unit ({unit_field!r}) is read from JSONL records: pass the "
                "corpus files; the default corpus has no units.")
        settings["unit_field"] = unit_field
    if public_sources is not None and sources is None:
        from tf_megadp.jobs.bert.public_text import parse_public_sources

        public_sources = parse_public_sources(public_sources)
        # Only a public corpus has sources; the default corpus's key stays as it was.
        settings["public_sources"] = list(public_sources)
    else:
        public_sources = None
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
    source_sizes: dict[str, dict[str, int]] = {}
    if public_sources is not None:
        from tf_megadp.jobs.bert.public_text import public_corpus_documents

        documents, skipped = public_corpus_documents(
            public_sources, max_characters, progress=progress, sizes=source_sizes,
            cache_dir=None if text_cache_dir is None else os.fspath(text_cache_dir)), 0
        description = f"public corpus: {', '.join(public_sources)}"
    elif sources is None:
        documents, skipped = default_corpus_documents(max_characters), 0
        description = f"default corpus: docstrings of {', '.join(DEFAULT_PACKAGES)}"
    else:
        documents, skipped, *units = read_documents(
            sources, jsonl_field=jsonl_field, skip_undecodable=skip_undecodable,
            separator=separator, progress=progress, unit_field=unit_field,
        )
        description = f"{len(expand_sources(sources))} file(s)"
    if progress:
        progress(f"  {len(documents):,} documents, "
                 f"{sum(len(d) for d in documents):,} characters"
                 + (f" ({skipped:,} skipped: not UTF-8)" if skipped else ""))

    if vocabulary is None:
        vocabulary = learn_vocabulary(documents, vocabulary_size, lowercase=lowercase,
                                      progress=progress)
    tokens = _tokenize(documents, vocabulary, lowercase, progress)
    total = sum(len(t) for t in tokens)
    unknown = sum(int(np.count_nonzero(t == UNK_ID)) for t in tokens)
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
    unit_metadata: dict[str, Any] = {}
    if unit_field is None:
        rows = _pack(tokens, sequence_length, packing, min_tokens)
    else:
        rows, row_units = _pack_by_unit(tokens, units[0], sequence_length, packing, min_tokens)
    if max_sequences is not None:
        rows = rows[:max_sequences]
    if unit_field is not None:
        unit_metadata = {
            **save_unit_ids(output_dir, row_units[:len(rows)]),
            "privacy_unit": f"one {unit_field}: every sequence of the same {unit_field!r}",
            "unit_field": unit_field,
        }
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
            **unit_metadata,
            "source": description,
            **({"public_sources": source_sizes} if public_sources is not None else {}),
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
