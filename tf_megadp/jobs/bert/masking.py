"""`MaskedLMBatcher`: a micro-batch of token rows as `keras_hub.models.BertMaskedLM` inputs."""

from __future__ import annotations

import math
from typing import Any

from tf_megadp.data.shards import TokenShards
from tf_megadp.jobs.bert.corpus import CLS_ID, MASK_ID, PAD_ID, SEP_ID

__all__ = ["MaskedLMBatcher"]


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
        if vocabulary_size <= MASK_ID:
            raise ValueError(
                f"vocabulary_size must exceed the special token ids (> {MASK_ID}), "
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
        selectable = (tf.not_equal(rows, PAD_ID) & tf.not_equal(rows, CLS_ID)
                      & tf.not_equal(rows, SEP_ID))
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

        shown = tf.where(draw < self.mask_token_rate, MASK_ID,
                         tf.where(draw < self.mask_token_rate + self.random_token_rate,
                                  random_tokens, mask_ids))
        # Each row's valid positions are distinct: one one-hot sum places them.
        placed = tf.one_hot(positions, length, dtype=tf.int32) * tf.cast(valid, tf.int32)[..., None]
        is_selected = tf.reduce_sum(placed, axis=1) > 0
        token_ids = tf.where(is_selected, tf.reduce_sum(placed * shown[..., None], axis=1), rows)

        real = tf.not_equal(rows, PAD_ID)
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
