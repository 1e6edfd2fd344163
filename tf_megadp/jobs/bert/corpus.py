"""The BERT job's documents: text files, JSONL, or the offline default corpus of Python docstrings."""

from __future__ import annotations

import ast
import collections
import glob as glob_lib
import hashlib
import importlib.util
import json
import os
import re
import sysconfig
from typing import Callable, Iterator, Sequence

import numpy as np

from tf_megadp.jobs.bert.config import SEPARATORS

__all__ = ["CLS_ID", "CorpusError", "DEFAULT_PACKAGES", "HELD_OUT_DISTRIBUTIONS",
           "HELD_OUT_PACKAGES", "MASK_ID", "PAD_ID", "SEP_ID",
           "SKIPPED_FOLDERS", "SPECIAL_TOKENS", "UNK_ID", "default_corpus_documents",
           "expand_sources", "file_docstrings", "package_roots", "read_documents",
           "root_docstrings", "write_synthetic_corpus"]

# BERT's special tokens, in the order keras-hub's WordPiece trainer reserves
# them: [PAD] must be id 0 because padding rows and padding positions are zeros.
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
# Their ids.
PAD_ID, CLS_ID, SEP_ID, UNK_ID, MASK_ID = range(len(SPECIAL_TOKENS))
DEFAULT_PACKAGES = ("stdlib", "numpy", "keras", "tensorflow")
# Packages whose docstrings never enter a public pretraining corpus: the
# fine-tuning task (issue 48) classifies them, so a public start must not have
# read them. Import names; HELD_OUT_DISTRIBUTIONS are the same projects as pip
# names them (their installed files are never read either,
# `tf_megadp.jobs.bert.public_text`).
HELD_OUT_PACKAGES = ("scipy", "sklearn", "matplotlib")
HELD_OUT_DISTRIBUTIONS = ("scipy", "scikit-learn", "matplotlib")
# Folders whose docstrings are test scaffolding or duplicated tooling, not prose.
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_MIN_DOCSTRING_CHARACTERS = 40

Progress = Callable[[str], None]


class CorpusError(ValueError):
    """The corpus or the text settings cannot produce a usable training set.

    The message names the file (and byte offset) or the setting to change.
    """


def package_roots(packages: Sequence[str]) -> list[str]:
    roots = []
    for package in packages:
        if package == "stdlib":
            roots.append(sysconfig.get_paths()["stdlib"])
            continue
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(
                f"Package {package!r} is not installed; choose default-corpus "
                f"packages among the installed ones (e.g. {DEFAULT_PACKAGES})."
            )
        roots.append(list(spec.submodule_search_locations)[0])
    return roots


def file_docstrings(path: str) -> Iterator[str]:
    """The docstrings of one Python file (nothing if it does not parse)."""
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
        # Some installed files are templates or target other Python versions.
        return
    for node in _statements_breadth_first(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)
            if text and len(text) >= _MIN_DOCSTRING_CHARACTERS:
                yield text


# Nodes that can hold statements; expressions never do (a lambda has no docstring).
_STATEMENT_HOLDERS = (ast.mod, ast.stmt, ast.excepthandler, ast.match_case)


def _statements_breadth_first(tree: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk`'s order, restricted to the nodes that can hold a docstring.

    Skipping expressions visits about a tenth of the nodes: learning the
    default vocabulary spent half its time walking them. The order of the
    definitions is `ast.walk`'s, so the corpus is unchanged.
    """
    queue = collections.deque([tree])
    while queue:
        node = queue.popleft()
        queue.extend(child for child in ast.iter_child_nodes(node)
                     if isinstance(child, _STATEMENT_HOLDERS))
        yield node


def default_corpus_documents(
    max_characters: int = 2_000_000,
    packages: Sequence[str] = DEFAULT_PACKAGES,
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
    roots = package_roots(packages)
    budget = max_characters // len(roots)
    seen: set[bytes] = set()
    documents: list[str] = []
    for root in roots:
        used = 0
        for text in root_docstrings(root):
            key = hashlib.sha1(" ".join(text.split()).encode("utf-8")).digest()
            if key in seen:
                continue
            seen.add(key)
            documents.append(text)
            used += len(text)
            if used >= budget:
                break
    return documents


def root_docstrings(root: str) -> Iterator[str]:
    """The docstrings (of at least 40 characters) of the Python files under `root`, in sorted order.

    Module, class and function docstrings, read with `ast` (nothing is
    imported), skipping `SKIPPED_FOLDERS`.

    Args:
        root: a folder (`package_roots` of a package).
    """
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield from file_docstrings(os.path.join(folder, name))


def expand_sources(sources: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
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
    unit_field: str | None = None,
) -> tuple[list[str], int] | tuple[list[str], int, list[str]]:
    """Documents from text files, JSONL files, or globs of them.

    Plain text: documents are separated by blank lines (``separator=
    "blank-line"``) or each line is one document (``"line"``). ``.jsonl``
    files: one JSON object per line, the document in `jsonl_field`.

    Args:
        sources: a path, a glob pattern, or a list of them.
        jsonl_field: the JSONL field that holds the text.
        unit_field: the JSONL field naming each document's privacy unit
            (its author, account, ...), for user-level privacy; every
            record must have it (a string or an integer), and every source
            must be JSONL.
        skip_undecodable: False raises `CorpusError` at the first byte that is
            not UTF-8 (naming file and byte offset); True drops the documents
            that contain such bytes and counts them.
        separator: how plain-text files are cut into documents, one of
            `SEPARATORS`.
        progress: called with one line per file read (size and documents).

    Returns:
        (documents, number of documents skipped for bad bytes), and with
        `unit_field` a third item: each document's unit id, as a string.
    """
    if separator not in SEPARATORS:
        raise CorpusError(
            f"separator must be one of {', '.join(SEPARATORS)}, got {separator!r}.")
    documents: list[str] = []
    units: list[str] = []
    skipped = 0
    for path in expand_sources(sources):
        jsonl = path.endswith(".jsonl")
        if unit_field is not None and not jsonl:
            raise CorpusError(
                f"{path} is not JSONL: a privacy unit ({unit_field!r}) can only be read "
                "from a field of .jsonl records. Convert the corpus to JSONL with a "
                f"{unit_field!r} field on every record.")
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
                if unit_field is not None:
                    unit = record.get(unit_field)
                    if isinstance(unit, bool) or not isinstance(unit, (str, int)):
                        raise CorpusError(
                            f"{path}: the line at byte {offset} has no string or integer "
                            f"field {unit_field!r} (its privacy unit); every record needs one.")
            if text.strip():
                documents.append(text.strip())
                if unit_field is not None:
                    units.append(str(unit))
        if progress:
            progress(f"  read {path}: {_megabytes(len(data))}, "
                     f"{len(documents) - before:,} documents")
    if not documents:
        raise CorpusError(f"No non-empty document in {sources!r}.")
    return (documents, skipped) if unit_field is None else (documents, skipped, units)


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
