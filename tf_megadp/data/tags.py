"""Micro-batch tags: the secret mark by which a `PrivateStep` knows a micro-batch is its sampler's.

A custom loop feeds `PrivateStep` itself, so the step cannot see where a
micro-batch came from: the same rows fed again and again, other data fed
after `begin(sampler)`, or the sampler's rows changed on the way (a map
that sets every row of a micro-batch to its largest one moved the
un-noised clipped sum by 7 C) would be accounted with the sampler's N and
sampling rate. A sampler's tagged dataset (`as_dataset(..., tagged=True)`)
therefore gives every micro-batch, as `(batch, tag)`, one tag per row: a
keyed hash of the row itself (every tensor of the element, after the
sampler's `map_fn`), its index in the global micro-batch, the logical step
and the micro-step within it. The step recomputes the tags of the rows it
is given, at the place in the run it is at, and admits the micro-batch
only when every one agrees: it accounts only rows the sampler produced,
unchanged, in its order, each once, at their own index (a transform of
the rows, a row copied with its tag over another, or the rows of another
step all fail).

The hash is a Wegman-Carter MAC over 64-bit words (wrapping arithmetic,
the same in TensorFlow, XLA and on every device): each row's words are
weighted by secret 64-bit weights and summed, and a secret pad for the
row's index is added; weights and pads are drawn with Philox from the key,
the logical step and the micro-step, so each is used for one micro-batch
only. A changed row passes with probability at most 2^-32 (a change of
the sign bit of a float32 alone) and usually 2^-64. The key never leaves
memory (a `Secret`; the tags ride along the elements as data, never as
constants of a graph), so a tag cannot be forged from files or logs.

Per-micro-batch processing therefore belongs in the sampler's `map_fn`,
which the sampler checks for mixing (`tf_megadp.data.map_independence`)
before it tags the rows, exactly as `fit` requires; a map applied to the
tagged dataset is refused by the step.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.secret import Secret

__all__ = ["TAG_DTYPE", "attach_tag_key", "row_tags", "tag_key_of"]

TAG_DTYPE = tf.int64
# A plain attribute of the dataset object: no graph holds the key.
_KEY_ATTRIBUTE = "_tf_megadp_tag_key"
# The 64-bit words of each dtype a micro-batch may hold (bit patterns, exactly).
_WORDS = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32,
          tf.float64: tf.int64}


def row_tags(key, step, micro_step, element: Any, first_row, total_rows) -> tf.Tensor:
    """The tags of the rows of `element`, rows `first_row ...` of a global micro-batch.

    Args:
        key: int64 [2], the sampler's tag key.
        step: the logical step (int64 scalar).
        micro_step: the micro-batch's index within its logical step.
        element: the rows (a tensor or a nest of tensors sharing their
            leading axis): the whole global micro-batch in the sampler's
            pipeline, one replica's share in the step.
        first_row: the index of `element`'s first row in the global
            micro-batch (the replica's offset; 0 in the pipeline).
        total_rows: the rows of the global micro-batch (m * R): an int, or
            a scalar tensor where the shapes are known only at run time.

    Returns:
        int64 [rows of `element`].

    Raises:
        PrivacyConfigurationError: a tensor holds strings (tag the rows the
            model reads: tokenize in the sampler's `map_fn`).
    """
    words = _row_words(element)
    seed = tf.random.experimental.stateless_fold_in(
        tf.cast(key, tf.int64), tf.cast(step, tf.int64), alg="philox")
    seed = tf.random.experimental.stateless_fold_in(
        seed, tf.cast(micro_step, tf.int64), alg="philox")
    width = words.shape[1] if words.shape[1] is not None else tf.shape(words)[1]
    weights = tf.random.stateless_uniform(
        [width], seed=seed, minval=None, maxval=None, dtype=TAG_DTYPE, alg="philox")
    pad_seed = tf.random.experimental.stateless_fold_in(seed, -1, alg="philox")
    pads = tf.random.stateless_uniform(
        [total_rows], seed=pad_seed, minval=None, maxval=None, dtype=TAG_DTYPE, alg="philox")
    rows = tf.shape(words)[0]
    pads = tf.slice(pads, [tf.cast(first_row, tf.int32)], [rows])
    return tf.reduce_sum(words * weights[tf.newaxis, :], axis=1) + pads


def _row_words(element: Any) -> tf.Tensor:
    """int64 [rows, D]: every number of each row, as the 64-bit word of its exact bits."""
    parts = []
    for tensor in tf.nest.flatten(element):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype == tf.string:
            raise PrivacyConfigurationError(
                "A tagged micro-batch holds strings: the tags bind the rows the model "
                "reads. Turn text into tensors in the sampler's map_fn.")
        if tensor.shape.rank == 0:
            raise PrivacyConfigurationError(
                "A tagged micro-batch holds a scalar: every tensor of a micro-batch has "
                "one row per example, and the tags bind each row.")
        if tensor.dtype in _WORDS:
            tensor = tf.bitcast(tensor, _WORDS[tensor.dtype])
        # Static where the shapes are (XLA needs them), else read at run time.
        rows = tensor.shape[0] if tensor.shape[0] is not None else tf.shape(tensor)[0]
        parts.append(tf.reshape(tf.cast(tensor, TAG_DTYPE), [rows, -1]))
    return tf.concat(parts, axis=1)


def attach_tag_key(data: Any, key: Secret) -> Any:
    """Marks `data` (a sampler's tagged dataset, or its distributed form) with the tag key."""
    if not isinstance(key, Secret):
        raise TypeError("The tag key must be held in a tf_megadp Secret.")
    setattr(data, _KEY_ATTRIBUTE, key)
    return data


def tag_key_of(data: Any) -> Secret | None:
    """The tag key of a sampler's tagged dataset (None for any other data)."""
    return getattr(data, _KEY_ATTRIBUTE, None)
