"""The causal-LM job's data: packed rows as next-token examples, the unigram baseline, the scores.

The rows are the masked-LM job's packed sequences (`tf_megadp.jobs.bert.
prepare.prepare_data`, one cache for both jobs): `[CLS]` then the text's
tokens, `[SEP]` and padding, L ids each. Row r gives one example: the
model reads r[:-1] and predicts r[1:]. Only the text's tokens are
targets: a special token is predictable from its position alone (every
full row ends with `[SEP]` at the same place), so scoring it would
inflate the accuracy beyond what the unigram baseline can match.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

__all__ = ["FIRST_TEXT_TOKEN", "UnigramBaseline", "corpus_settings", "corpus_splits", "heldout_scores", "next_token_examples",
           "unigram_baseline"]

# Ids below this are the special tokens ([PAD], [CLS], [SEP], [UNK], [MASK]).
FIRST_TEXT_TOKEN = 5


def corpus_settings(config):
    """The masked-LM job's settings of the same corpus: what `prepare_data` and the report read.

    Args:
        config: the run's `CausalLMConfig`.

    Returns:
        A `tf_megadp.jobs.bert.config.PretrainConfig` with the run's corpus,
        vocabulary size, sequence length, held-out share and seed.
    """
    from tf_megadp.jobs.bert.config import PretrainConfig

    return PretrainConfig(
        corpus=list(config.corpus) if config.corpus else None,
        document_separator=config.document_separator, max_characters=config.max_characters,
        vocabulary_size=config.vocabulary_size, sequence_length=config.sequence_length,
        heldout_fraction=config.heldout_fraction, seed=config.seed, cache_dir=config.cache_dir)


def corpus_splits(config, log=None):
    """(all, train, held-out) `TokenShards` of the run's corpus, prepared once and cached.

    Args:
        config: the run's `CausalLMConfig`.
        log: progress lines (None: silent).

    Raises:
        JobError: the corpus cannot be read or is too small.
    """
    from tf_megadp.jobs.bert.prepare import prepare_data

    # Its errors are `JobError`s (`PretrainError` is that class).
    return prepare_data(corpus_settings(config), log)


def next_token_examples(rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(x, y, sample_weight) of packed rows: read r[:-1], predict r[1:], text tokens weighted 1.

    Args:
        rows: int [n, L] packed rows ([PAD] = 0 after the text).

    Returns:
        x {"token_ids", "padding_mask"} [n, L - 1], the targets [n, L - 1]
        and their weights (1 where the target is a text token, else 0).
    """
    rows = np.asarray(rows, np.int32)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    x = {"token_ids": inputs, "padding_mask": (inputs != 0).astype(np.int32)}
    return x, targets, (targets >= FIRST_TEXT_TOKEN).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class UnigramBaseline:
    """What a model that ignores the context scores on the held-out targets.

    Attributes:
        accuracy: always predicting the training split's most frequent target.
        perplexity: the training split's target frequencies (add-one
            smoothed over the text tokens) as the prediction.
        token: the most frequent target's id.
    """

    accuracy: float
    perplexity: float
    token: int


def unigram_baseline(train, heldout_y: np.ndarray, heldout_w: np.ndarray,
                     vocabulary_size: int) -> UnigramBaseline:
    """The unigram baseline of the held-out targets, from the training split's counts.

    Args:
        train: the training `TokenShards`.
        heldout_y, heldout_w: the held-out targets and weights (`next_token_examples`).
        vocabulary_size: V.
    """
    counts = np.zeros(vocabulary_size, np.int64)
    for start in range(0, len(train), 65536):
        rows = train.read(np.arange(start, min(start + 65536, len(train))))
        counts += np.bincount(rows[:, 1:].ravel(), minlength=vocabulary_size)
    counts[:FIRST_TEXT_TOKEN] = 0
    token = int(np.argmax(counts))
    probabilities = (counts + 1.0) / (counts.sum() + vocabulary_size - FIRST_TEXT_TOKEN)
    weight = float(np.sum(heldout_w))
    accuracy = float(np.sum((heldout_y == token) * heldout_w) / weight)
    cross_entropy = -float(np.sum(np.log(probabilities[heldout_y]) * heldout_w) / weight)
    return UnigramBaseline(accuracy, math.exp(cross_entropy), token)


def heldout_scores(model, x: dict[str, np.ndarray], y: np.ndarray, sample_weight: np.ndarray,
                   batch_size: int) -> dict[str, Any]:
    """Next-token accuracy and perplexity on the held-out targets of weight 1.

    Perplexity is exp of the mean cross-entropy per target token (not
    Keras's loss, which divides by every position, padding included).

    Returns:
        {"heldout_accuracy", "heldout_perplexity"}.
    """
    import keras

    correct = cross_entropy = weight = 0.0
    for start in range(0, len(y), batch_size):
        rows = slice(start, start + batch_size)
        logits = keras.ops.convert_to_numpy(
            model({name: value[rows] for name, value in x.items()}, training=False))
        logits = logits.astype(np.float64)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        log_normaliser = np.log(np.exp(shifted).sum(axis=-1))
        target_logit = np.take_along_axis(shifted, y[rows][..., None], axis=-1)[..., 0]
        w = sample_weight[rows]
        cross_entropy += float(np.sum((log_normaliser - target_logit) * w))
        correct += float(np.sum((np.argmax(logits, axis=-1) == y[rows]) * w))
        weight += float(np.sum(w))
    return {"heldout_accuracy": correct / weight,
            "heldout_perplexity": math.exp(cross_entropy / weight)}
