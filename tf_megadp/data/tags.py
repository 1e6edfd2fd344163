"""Micro-batch tags: the secret mark by which a `PrivateStep` knows a micro-batch is its sampler's.

A custom loop feeds `PrivateStep` itself, so the step cannot see where a
micro-batch came from: the same rows fed again and again, or other data fed
after `begin(sampler)`, would be accounted with the sampler's N and
sampling rate. A sampler's tagged dataset (`as_dataset(..., tagged=True)`)
therefore gives every micro-batch, as `(batch, tag)`, one tag per row (the
same for every row, so that it splits over replicas with the rows): a keyed
pseudo-random function of (logical step, micro-step within it), keyed by a
key drawn from the sampler's secret (its own stream). The step
recomputes the tags of the position it is at in the graph and admits the
micro-batch only when they agree, so it accounts only micro-batches that
the sampler produced, in its order, each once.

The key never leaves memory (a `Secret`; the tags ride along the elements
as data, never as constants of a graph), so a tag cannot be forged from
files or logs, and it says nothing about the data: it depends on the
position alone. A map that transforms the rows keeps it by passing it on:
`dataset.map(lambda batch, tag: (transform(batch), tag))`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_megadp.secret import Secret

__all__ = ["TAG_DTYPE", "attach_tag_key", "micro_batch_tags", "micro_step_tag", "tag_key_of"]

TAG_DTYPE = tf.int64
# A plain attribute of the dataset object: no graph holds the key.
_KEY_ATTRIBUTE = "_tf_megadp_tag_key"


def micro_batch_tags(key, step, micro_step, rows: int) -> tf.Tensor:
    """The tags of the `rows` rows of micro-step `micro_step` of logical step `step`.

    Args:
        key: int64 [2], the sampler's tag key.
        step: the logical step (int64 scalar).
        micro_step: the micro-batch's index within its logical step.
        rows: the rows of one global micro-batch (m * R).

    Returns:
        int64 [rows], `micro_step_tag` on every row.
    """
    return tf.fill([rows], micro_step_tag(key, step, micro_step))


def micro_step_tag(key, step, micro_step) -> tf.Tensor:
    """The tag every row of micro-step `micro_step` of logical step `step` carries (int64).

    Two Philox fold-ins and one draw: a keyed function TensorFlow computes
    alike on every device, cheap enough to check on every micro-batch.
    (A fold-in's result holds the folded value itself, so the draw from the
    second seed is what depends on both.)
    """
    seed = tf.random.experimental.stateless_fold_in(
        tf.cast(key, tf.int64), tf.cast(step, tf.int64), alg="philox")
    seed = tf.random.experimental.stateless_fold_in(
        seed, tf.cast(micro_step, tf.int64), alg="philox")
    return tf.random.stateless_uniform([], seed=seed, minval=None, maxval=None,
                                       dtype=TAG_DTYPE, alg="philox")


def attach_tag_key(data: Any, key: Secret) -> Any:
    """Marks `data` (a sampler's tagged dataset, or its distributed form) with the tag key."""
    if not isinstance(key, Secret):
        raise TypeError("The tag key must be held in a tf_megadp Secret.")
    setattr(data, _KEY_ATTRIBUTE, key)
    return data


def tag_key_of(data: Any) -> Secret | None:
    """The tag key of a sampler's tagged dataset (None for any other data)."""
    return getattr(data, _KEY_ATTRIBUTE, None)
