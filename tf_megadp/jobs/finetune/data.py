"""The fine-tuning job's data: labelled JSONL or CSV, its labels and split, and the default task.

A labelled file holds one example per line (JSONL: an object; CSV: a row
under a header) with a text field and a label field (`text` and `label` by
default, both renamable). The labels are the distinct values of the
training file's label field, sorted, unless given; a test file may not
hold another. Without a test file, a stratified share of the training
file is held out (seeded by the run's public `--seed`: which examples are
held out is not secret, and they are not trained on).

The default task (no `--train`) is made from offline public text that
every installation has and that the public pretraining corpus leaves
out: which package a docstring comes from, among `DEFAULT_TASK_PACKAGES`
(scipy, scikit-learn, matplotlib, all three installed with tf_megadp).
Each example is a docstring's summary (its first paragraph, cut to
`max_characters` at a word) with every mention of a package's name
removed, so the model must tell the packages apart by what the text is
about (integrals and distributions, estimators and fitting, axes and
figures). The classes are balanced (majority class 1/3). A bag of words
does not solve it at once: TF-IDF with logistic regression reaches about
0.85 (docs/results.md, "Private fine-tuning").
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Any, Sequence

import numpy as np

from tf_megadp.jobs.common.errors import JobError

__all__ = ["DEFAULT_TASK_PACKAGES", "LabelledTask", "default_task", "read_labelled",
           "task_from_files"]

# The default task's packages: {package: the class's name}. None of them is
# in the public pretraining corpus.
DEFAULT_TASK_PACKAGES = {"scipy": "scipy", "sklearn": "scikit-learn",
                         "matplotlib": "matplotlib"}
# Words that name a package (or a common alias of one) in its docstrings.
_NAMES = re.compile(
    r"\S*(scipy|sklearn|scikit[-_ ]?learn|matplotlib|pyplot|mpl_toolkits|numpy)\S*"
    r"|\b(plt|mpl|np|sp)\b\.?\S*", re.IGNORECASE)
_MIN_CHARACTERS = 30


@dataclasses.dataclass(frozen=True)
class LabelledTask:
    """A labelled classification task: texts and class indices, train and test.

    Attributes:
        labels: the class names; class i is `labels[i]`.
        train_texts, train_labels: the training examples (the private data).
        test_texts, test_labels: the test examples (never trained on).
        description: where the examples come from, for the report.
    """

    labels: tuple[str, ...]
    train_texts: tuple[str, ...]
    train_labels: np.ndarray
    test_texts: tuple[str, ...]
    test_labels: np.ndarray
    description: str

    def majority_class_accuracy(self) -> float:
        """The test accuracy of always predicting the training split's most frequent class."""
        majority = int(np.bincount(self.train_labels, minlength=len(self.labels)).argmax())
        return float(np.mean(self.test_labels == majority))

    def report(self) -> dict[str, Any]:
        return {"description": self.description, "labels": list(self.labels),
                "train_examples": len(self.train_texts), "test_examples": len(self.test_texts),
                "train_class_counts": np.bincount(self.train_labels,
                                                  minlength=len(self.labels)).tolist(),
                "test_class_counts": np.bincount(self.test_labels,
                                                 minlength=len(self.labels)).tolist()}


def read_labelled(path: str | os.PathLike, text_field: str = "text",
                  label_field: str = "label",
                  field_flags: tuple[str, str] = ("--text-field", "--label-field")
                  ) -> tuple[list[str], list[str]]:
    """(texts, labels as strings) of a JSONL or CSV file (by its extension: .csv is CSV).

    Any two text fields of each record: the causal-LM job reads prompts and
    completions with it, `field_flags` naming its own flags in the messages.

    Raises:
        JobError: the file cannot be read, or a line lacks a field (named,
            with its line number).
    """
    path = os.fspath(path)
    texts, labels = [], []
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            if path.lower().endswith(".csv"):
                reader = csv.DictReader(handle)
                rows = ((number + 2, row) for number, row in enumerate(reader))
            else:
                rows = _jsonl_rows(handle, path)
            for number, row in rows:
                for field in (text_field, label_field):
                    if not isinstance(row, dict) or row.get(field) in (None, ""):
                        raise JobError(
                            f"{path}:{number}: no {field!r} field. Name the fields with "
                            f"{field_flags[0]} and {field_flags[1]} (JSONL: one object per "
                            "line; CSV: a header row).")
                texts.append(str(row[text_field]))
                labels.append(str(row[label_field]))
    except OSError as error:
        raise JobError(f"{path}: {error.strerror}.") from None
    except UnicodeDecodeError as error:
        raise JobError(f"{path}: not UTF-8 text (byte {error.start}).") from None
    if not texts:
        raise JobError(f"{path} holds no example.")
    return texts, labels


def _jsonl_rows(handle, path: str):
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError:
            raise JobError(f"{path}:{number}: not a JSON object (JSONL holds one per "
                           "line).") from None


def task_from_files(train: str, test: str | None, *, text_field: str = "text",
                    label_field: str = "label", labels: Sequence[str] | None = None,
                    test_fraction: float = 0.2, seed: int = 0) -> LabelledTask:
    """The task of labelled files: `train`, and `test` or a held-out share of `train`.

    Args:
        train, test: the files (`read_labelled`); test None: hold out
            `test_fraction` of train, stratified by label, seeded by `seed`.
        text_field, label_field: the fields.
        labels: the class names in order (None: the training labels, sorted).
        test_fraction: the share held out without a test file.
        seed: the public seed of the held-out split.

    Raises:
        JobError: fewer than 2 classes, a label outside `labels`, or a split
            that leaves a class without a training or test example.
    """
    texts, raw = read_labelled(train, text_field, label_field)
    names = tuple(labels) if labels else tuple(sorted(set(raw)))
    if len(names) < 2:
        raise JobError(f"{train}: the task needs at least 2 labels, found {list(names)}.")
    train_labels = _indices(raw, names, train)
    if test is not None:
        test_texts, test_raw = read_labelled(test, text_field, label_field)
        test_labels = _indices(test_raw, names, test)
        return LabelledTask(names, tuple(texts), train_labels, tuple(test_texts), test_labels,
                            f"{os.path.basename(train)} and {os.path.basename(test)}")
    keep, held = _stratified_split(train_labels, test_fraction, seed)
    for split, name in ((keep, "training"), (held, "test")):
        missing = set(range(len(names))) - set(train_labels[split].tolist())
        if missing:
            raise JobError(
                f"{train}: the {name} split has no example of {[names[i] for i in missing]}: "
                "pass --test FILE, or more examples of each label.")
    return LabelledTask(
        names, tuple(texts[i] for i in keep), train_labels[keep],
        tuple(texts[i] for i in held), train_labels[held],
        f"{os.path.basename(train)}, {test_fraction:g} held out as the test split")


def _indices(raw: Sequence[str], names: Sequence[str], path) -> np.ndarray:
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(raw) - set(index))
    if unknown:
        raise JobError(f"{path}: labels {unknown[:5]} are not among the task's {list(names)} "
                       "(--labels).")
    return np.array([index[label] for label in raw], np.int32)


def _stratified_split(labels: np.ndarray, fraction: float,
                      seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keep, held = [], []
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        count = int(round(len(rows) * fraction))
        held += rows[:count].tolist()
        keep += rows[count:].tolist()
    return np.array(sorted(keep)), np.array(sorted(held))


@functools.lru_cache(maxsize=None)
def _summaries(package: str, max_characters: int) -> tuple[str, ...]:
    """The anonymised first paragraphs of a package's docstrings, in file order.

    Parsed once per process (seconds per package): a study runs the
    default task dozens of times.
    """
    from tf_megadp.jobs.bert.corpus import package_roots, root_docstrings

    return tuple(_anonymised(text.strip().split("\n\n")[0], max_characters)
                 for text in root_docstrings(package_roots([package])[0]))


def default_task(*, per_class: int = 2_500, test_fraction: float = 0.2,
                 max_characters: int = 200, seed: int = 0) -> LabelledTask:
    """Which package a docstring comes from (`DEFAULT_TASK_PACKAGES`), balanced.

    Args:
        per_class: examples of each class (train and test together); fewer
            if a package has fewer distinct docstrings.
        test_fraction: the share of each class held out for the test split.
        max_characters: each summary is cut to its first this many
            characters (at a word).
        seed: which docstrings are drawn and held out (public).

    Returns:
        The task; deterministic for an installation and a seed.
    """
    rng = np.random.default_rng(seed)
    seen: set[bytes] = set()
    by_class = []
    for package in DEFAULT_TASK_PACKAGES:
        texts = []
        for cleaned in _summaries(package, max_characters):
            key = hashlib.sha1(cleaned.encode("utf-8")).digest()
            if len(cleaned) < _MIN_CHARACTERS or key in seen:
                continue
            seen.add(key)
            texts.append(cleaned)
        by_class.append([texts[i] for i in sorted(rng.permutation(len(texts))[:per_class])])
    count = min(len(texts) for texts in by_class)
    texts = [text for texts_of in by_class for text in texts_of[:count]]
    labels = np.repeat(np.arange(len(by_class), dtype=np.int32), count)
    keep, held = _stratified_split(labels, test_fraction, seed)
    names = tuple(DEFAULT_TASK_PACKAGES.values())
    return LabelledTask(
        names, tuple(texts[i] for i in keep), labels[keep], tuple(texts[i] for i in held),
        labels[held],
        f"which package a docstring comes from ({', '.join(names)}; the summaries of {count} "
        f"docstrings each, names removed, cut to {max_characters} characters; "
        f"{test_fraction:g} held out)")


def _anonymised(text: str, max_characters: int) -> str:
    """`text` without any name of a package, on one line, cut at a word near `max_characters`."""
    words = " ".join(_NAMES.sub(" ", text).split())
    if len(words) <= max_characters:
        return words
    return words[:max_characters].rsplit(" ", 1)[0]
