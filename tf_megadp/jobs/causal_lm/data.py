"""The causal-LM job's data: packed rows or prompt/completion pairs as next-token examples.

The rows are the masked-LM job's packed sequences (`tf_megadp.jobs.bert.
prepare.prepare_data`, one cache for both jobs): `[CLS]` then the text's
tokens, `[SEP]` and padding, L ids each. Row r gives one example: the
model reads r[:-1] and predicts r[1:]. Only the text's tokens are
targets: a special token is predictable from its position alone (every
full row ends with `[SEP]` at the same place), so scoring it would
inflate the accuracy beyond what the unigram baseline can match.

A fine-tuning run reads prompt/completion pairs instead, one row each,
and only the completion's tokens are targets (`completion_examples`).
Either way the baseline is the unigram of the training targets, and the
held-out scores are next-token accuracy and perplexity on the targets.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tf_megadp.jobs.common.errors import JobError

__all__ = ["FIRST_TEXT_TOKEN", "UnigramBaseline", "completion_examples", "corpus_settings",
           "corpus_splits", "read_pairs", "heldout_scores", "next_token_examples",
           "unigram_baseline"]

# Ids below this are the special tokens ([PAD], [CLS], [SEP], [UNK], [MASK]).
FIRST_TEXT_TOKEN = 5


def corpus_settings(config):
    """The masked-LM job's settings of the same corpus: what `prepare_data` and the report read.

    Args:
        config: the run's `CausalLMConfig`.

    Returns:
        A `tf_megadp.jobs.bert.config.PretrainConfig` with the run's corpus,
        vocabulary size, sequence length, held-out share, seed and privacy
        unit (whose field `prepare_data` reads into each row's unit).
    """
    from tf_megadp.jobs.bert.config import PretrainConfig

    return PretrainConfig(
        corpus=list(config.corpus) if config.corpus else None,
        document_separator=config.document_separator, max_characters=config.max_characters,
        vocabulary_size=config.vocabulary_size, sequence_length=config.sequence_length,
        heldout_fraction=config.heldout_fraction, seed=config.seed, cache_dir=config.cache_dir,
        privacy_unit=config.privacy_unit, examples_per_unit=config.examples_per_unit)


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


def unigram_baseline(train_y: np.ndarray, train_w: np.ndarray, heldout_y: np.ndarray,
                     heldout_w: np.ndarray, vocabulary_size: int) -> UnigramBaseline:
    """The unigram baseline of the held-out targets, from the training targets' counts.

    Args:
        train_y, train_w: the training targets and their weights (only
            targets of weight > 0 are counted).
        heldout_y, heldout_w: the held-out targets and weights.
        vocabulary_size: V; the perplexity's frequencies are add-one
            smoothed over all V tokens.
    """
    counts = np.bincount(np.asarray(train_y).ravel(),
                         weights=(np.asarray(train_w).ravel() > 0).astype(np.float64),
                         minlength=vocabulary_size)
    token = int(np.argmax(counts))
    probabilities = (counts + 1.0) / (counts.sum() + vocabulary_size)
    weight = float(np.sum(heldout_w))
    accuracy = float(np.sum((heldout_y == token) * heldout_w) / weight)
    cross_entropy = -float(np.sum(np.log(probabilities[heldout_y]) * heldout_w) / weight)
    return UnigramBaseline(accuracy, math.exp(cross_entropy), token)


def read_pairs(config) -> tuple[tuple[list[str], list[str]], tuple[list[str], list[str]]]:
    """((train prompts, completions), (test prompts, completions)) of a fine-tuning run.

    Without `config.test`, `config.test_fraction` of the training pairs is
    held out, drawn with the public `config.seed`.

    Raises:
        JobError: a file cannot be read, a record lacks a field, or too
            few pairs remain for either split.
    """
    from tf_megadp.jobs.finetune.data import read_labelled

    flags = ("--prompt-field", "--completion-field")
    prompts, completions = read_labelled(config.train, config.prompt_field,
                                         config.completion_field, flags)
    if config.test:
        return (prompts, completions), read_labelled(config.test, config.prompt_field,
                                                     config.completion_field, flags)
    held = max(1, int(round(len(prompts) * config.test_fraction)))
    if len(prompts) - held < 2:
        raise JobError(f"--train {config.train} holds {len(prompts)} pairs: too few to hold "
                       f"{held} out; pass more, or --test FILE.")
    order = np.random.default_rng(config.seed).permutation(len(prompts))
    pick = lambda rows: ([prompts[i] for i in rows], [completions[i] for i in rows])  # noqa: E731
    return pick(np.sort(order[held:])), pick(np.sort(order[:held]))


def completion_examples(prompts: list[str], completions: list[str], tokenizer,
                        sequence_length: int) -> tuple[dict[str, np.ndarray], np.ndarray,
                                                       np.ndarray]:
    """(x, y, sample_weight) of prompt/completion pairs: the loss on the completion only.

    Each pair is one row `[CLS] prompt completion [SEP]`, padded to L; a row
    too long loses the start of its prompt first (the end, next to the
    completion, is kept), then the end of its completion. The targets of
    weight 1 are the completion's tokens and the [SEP] that ends it.

    Args:
        prompts, completions: the pairs' texts.
        tokenizer: a `keras_hub.models.BertTokenizer` of the start's vocabulary.
        sequence_length: L.
    """
    def ids(texts):
        pieces = tokenizer(list(texts))
        return [list(p) for p in (pieces.to_list() if hasattr(pieces, "to_list") else pieces)]

    rows = np.zeros((len(prompts), sequence_length), np.int32)
    completion_start = np.zeros(len(prompts), np.int64)
    room = sequence_length - 2  # [CLS] and [SEP]
    for row, (prompt, completion) in enumerate(zip(ids(prompts), ids(completions))):
        completion = completion[:room - 1]  # at least one prompt token stays
        prompt = prompt[len(prompt) - min(len(prompt), room - len(completion)):]
        tokens = [tokenizer.cls_token_id] + prompt + completion + [tokenizer.sep_token_id]
        rows[row, :len(tokens)] = tokens
        completion_start[row] = 1 + len(prompt)
    x, y, _ = next_token_examples(rows)
    # Target t is token t + 1 of the row: a completion token or its [SEP].
    positions = np.arange(1, sequence_length)[None, :]
    ends = (rows != 0).sum(axis=1)[:, None]
    weights = (positions >= completion_start[:, None]) & (positions < ends)
    return x, y, weights.astype(np.float32)


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
