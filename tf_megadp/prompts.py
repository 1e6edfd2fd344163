"""Prompt (infilling) classification with a masked language model: the label is a word at [MASK].

A classifier head on [CLS] is a new, untrained part: masked-LM pretraining
never trained it (nor, in BERT without next-sentence prediction, the pooler
below it), so DP noise must teach it everything from nothing. The seed
paper of DP fine-tuning (Li, Tramer, Liang, Hashimoto 2022) aligns the
fine-tuning objective with pretraining instead: each text is put into a
template with one [MASK] slot ("<text> It was [MASK]."), and the label is
a word predicted at [MASK] by the pretrained (tied) MLM head. Every weight
the loss reaches was trained to predict words; fine-tuning moves it, it
does not build it.

* `Verbalizer`: one word per label, each a single token of the model's
  vocabulary (checked: a word that the tokenizer splits, or does not know,
  is refused with the words it would accept).
* `PromptTemplate`: turns texts into the masked LM's inputs, the text
  truncated so that the template always fits, `mask_positions` at its
  [MASK].
* `PromptClassifier`: a Keras model around a keras-hub masked LM
  (`BertMaskedLM` and its kin) whose outputs are the MLM logits of the
  label words at [MASK]: a `[batch, classes]` tensor, trained with any
  classification loss (`SparseCategoricalCrossentropy(from_logits=True)`)
  and predicted by argmax. It is an ordinary Keras model: `make_private`,
  the `DPOptimizer` (ghost, auto or vectorized clipping), LoRA on its
  backbone, the samplers, callbacks, checkpoints, `save` and `load_model`
  all apply.

Nothing here imports keras-hub: the masked LM and its tokenizer are the
caller's.

Example:
```python
tokenizer = keras_hub.models.BertTokenizer(vocabulary="vocab.txt", lowercase=True)
verbalizer = tf_megadp.Verbalizer(["negative", "positive"], ["bad", "good"], tokenizer)
template = tf_megadp.PromptTemplate("{text} it was [MASK] .")
x = template.encode(texts, tokenizer, sequence_length=128)
model = tf_megadp.make_private(tf_megadp.PromptClassifier(masked_lm, verbalizer.token_ids))
model.compile(optimizer=tf_megadp.DPOptimizer(...),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
```
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np

__all__ = ["PromptClassifier", "PromptTemplate", "Verbalizer"]

TEXT_SLOT = "{text}"
MASK_SLOT = "[MASK]"


def _token_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer([text])
    ids = ids.to_list() if hasattr(ids, "to_list") else keras.ops.convert_to_numpy(ids).tolist()
    return [int(i) for i in ids[0]]


class Verbalizer:
    """One word per label, each a single token of the model's vocabulary.

    Args:
        labels: the class names, in the order of the class indices
            (`labels[i]` is class i).
        words: the word the model should predict at [MASK] for each label
            (`words[i]` for `labels[i]`); lower case for an uncased model.
        tokenizer: the masked LM's tokenizer (a keras-hub tokenizer:
            callable on a list of strings, with `token_to_id`).

    Raises:
        ValueError: labels and words differ in number, a word repeats, or
            a word is not one token of the vocabulary (the error names the
            word, its pieces, and the candidates that are single tokens).

    Example:
    ```python
    verbalizer = Verbalizer(["scipy", "sklearn"], ["integral", "estimator"], tokenizer)
    verbalizer.token_ids    # [812, 2040]
    ```
    """

    def __init__(self, labels: Sequence[Any], words: Sequence[str], tokenizer):
        labels, words = list(labels), [str(word) for word in words]
        if len(labels) != len(words) or len(labels) < 2:
            raise ValueError(
                f"A verbalizer needs one word per label, for at least 2 labels; got "
                f"{len(labels)} labels and {len(words)} words.")
        if len(set(words)) != len(words):
            raise ValueError(f"Each label needs its own word; {words} repeats one.")
        ids = []
        for label, word in zip(labels, words):
            pieces = _token_ids(tokenizer, word)
            if len(pieces) != 1 or _is_unknown(tokenizer, pieces[0]):
                names = [tokenizer.id_to_token(i) for i in pieces] if hasattr(
                    tokenizer, "id_to_token") else pieces
                raise ValueError(
                    f"The label word {word!r} (label {label!r}) is not one token of the "
                    f"model's vocabulary: the tokenizer reads it as {names}. The MLM head "
                    "predicts one token at [MASK]: choose a word that is a single token "
                    "(check tokenizer.token_to_id(word)), e.g. a shorter or more common "
                    "word of the same meaning.")
            ids.append(pieces[0])
        self.labels = labels
        self.words = words
        self.token_ids = ids

    def __repr__(self) -> str:
        return f"Verbalizer({dict(zip(self.labels, self.words))!r})"


def _is_unknown(tokenizer, token_id: int) -> bool:
    unknown = getattr(tokenizer, "oov_token", None)
    return unknown is not None and token_id == tokenizer.token_to_id(unknown)


class PromptTemplate:
    """A template with the text's slot `{text}` and one `[MASK]`: texts to masked-LM inputs.

    Args:
        template: e.g. ``"{text} it was [MASK] ."``; `{text}` once, `[MASK]`
            once, outside the text.

    Raises:
        ValueError: the template lacks a slot, or has one twice.
    """

    def __init__(self, template: str):
        if template.count(TEXT_SLOT) != 1 or template.count(MASK_SLOT) != 1:
            raise ValueError(
                f"A prompt template holds {TEXT_SLOT!r} once and {MASK_SLOT!r} once, e.g. "
                f"'{{text}} it was [MASK] .'; got {template!r}.")
        self.template = template

    def __repr__(self) -> str:
        return f"PromptTemplate({self.template!r})"

    def encode(self, texts: Sequence[str], tokenizer, sequence_length: int) -> dict[str, np.ndarray]:
        """The masked LM's inputs of `texts` in the template.

        Each row is ``[CLS] prefix text prompt [SEP]`` padded with [PAD]; the
        text is cut from its end so that the template always fits, and
        `mask_positions` holds the index of [MASK] (one per row).

        Args:
            texts: the texts.
            tokenizer: the masked LM's tokenizer (keras-hub: callable, with
                `cls_token_id`, `sep_token_id`, `pad_token_id`, `mask_token_id`).
            sequence_length: T, the rows' length.

        Returns:
            `token_ids`, `segment_ids`, `padding_mask` (int32 [N, T]) and
            `mask_positions` (int32 [N, 1]).

        Raises:
            ValueError: the template alone does not fit in T.
        """
        before_text, after_text = self.template.split(TEXT_SLOT)
        if MASK_SLOT in before_text:
            prefix_before, prefix_after = before_text.split(MASK_SLOT)
            prefix = (_pieces(tokenizer, prefix_before) + [tokenizer.mask_token_id]
                      + _pieces(tokenizer, prefix_after))
            suffix = _pieces(tokenizer, after_text)
        else:
            suffix_before, suffix_after = after_text.split(MASK_SLOT)
            prefix = _pieces(tokenizer, before_text)
            suffix = (_pieces(tokenizer, suffix_before) + [tokenizer.mask_token_id]
                      + _pieces(tokenizer, suffix_after))
        room = sequence_length - 2 - len(prefix) - len(suffix)
        if room < 1:
            raise ValueError(
                f"The template {self.template!r} takes {len(prefix) + len(suffix) + 2} of the "
                f"{sequence_length} tokens of a row: lengthen the sequences or shorten it.")
        rows = np.full((len(texts), sequence_length), tokenizer.pad_token_id, np.int32)
        mask = np.zeros((len(texts), sequence_length), np.int32)
        positions = np.zeros((len(texts), 1), np.int32)
        tokenized = tokenizer(list(texts))
        tokenized = tokenized.to_list() if hasattr(tokenized, "to_list") else list(tokenized)
        for row, pieces in enumerate(tokenized):
            ids = ([tokenizer.cls_token_id] + prefix + [int(i) for i in pieces][:room] + suffix
                   + [tokenizer.sep_token_id])
            rows[row, :len(ids)] = ids
            mask[row, :len(ids)] = 1
            positions[row, 0] = ids.index(tokenizer.mask_token_id)
        return {"token_ids": rows, "segment_ids": np.zeros_like(rows), "padding_mask": mask,
                "mask_positions": positions}


def _pieces(tokenizer, text: str) -> list[int]:
    return _token_ids(tokenizer, text) if text.strip() else []


@keras.saving.register_keras_serializable(package="tf_megadp")
class PromptClassifier(keras.Model):
    """A masked LM that classifies by the logits of the label words at [MASK].

    Args:
        masked_lm: a keras-hub masked LM (e.g. `BertMaskedLM`, built with
            `preprocessor=None`) taking `token_ids`, `segment_ids`,
            `padding_mask` and `mask_positions` (one position: the [MASK]
            of `PromptTemplate.encode`), returning [batch, 1, vocabulary]
            logits.
        label_token_ids: the label words' token ids, class by class
            (`Verbalizer.token_ids`).

    Returns (called on a batch): float logits [batch, classes].

    Example:
    ```python
    model = PromptClassifier(masked_lm, verbalizer.token_ids)
    model.compile(optimizer=..., loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    ```
    """

    def __init__(self, masked_lm: keras.Model, label_token_ids: Sequence[int], **kwargs):
        super().__init__(**kwargs)
        label_token_ids = [int(i) for i in label_token_ids]
        if len(label_token_ids) < 2 or len(set(label_token_ids)) != len(label_token_ids):
            raise ValueError(
                "PromptClassifier needs the distinct token ids of at least 2 label words "
                f"(Verbalizer.token_ids); got {label_token_ids}.")
        self.masked_lm = masked_lm
        self.label_token_ids = label_token_ids

    def call(self, inputs, training=None):
        logits = self.masked_lm(inputs, training=training)
        return keras.ops.take(logits[:, 0, :], self.label_token_ids, axis=-1)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(),
                "masked_lm": keras.saving.serialize_keras_object(self.masked_lm),
                "label_token_ids": list(self.label_token_ids)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PromptClassifier":
        config = dict(config)
        config["masked_lm"] = keras.saving.deserialize_keras_object(config["masked_lm"])
        return cls(**config)
