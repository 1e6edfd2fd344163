"""Term kinds of ghost clipping: what a per-example gradient is made of.

A ghost rule records, for each call of its layer, one term per trainable
variable: a compact description of every example's gradient of that variable
(never the [m, *shape] tensor itself, except for `Explicit`). Each kind knows

- `squared_norms`: ||g_i||^2 per example, from the compact form;
- `inner(other)`: <g_i, h_i> per example with a term of another kind (the
  cross terms of a variable recorded by several rules, e.g. a tied
  embedding), or `NotImplemented` when the other kind is the one to ask;
- `clipped_sum(factors, keep)`: sum_i c_i g_i, shaped like the variable;
- `dense()`: the per-example gradients [m, *shape] (what `inner` falls back
  to for a pair of kinds neither side knows, so that a new kind needs no
  edit of the existing ones);
- `merged(terms)`: one term of the same kind equal to the sum of several
  (a layer called twice).

All terms of one variable share a dtype: float64 for float64 variables,
float32 otherwise (`compute_dtype`), so bfloat16 models clip in float32.
"""

from __future__ import annotations

import abc

import tensorflow as tf

from tf_megadp.clipping_memory import outer_is_materialised

__all__ = ["Explicit", "Gather", "Outer", "Term", "compute_dtype",
           "squared_norm_of_sum"]


def compute_dtype(variable) -> tf.DType:
    """The dtype a variable's norms and clipped sums are computed in."""
    return tf.float64 if tf.as_dtype(variable.dtype) == tf.float64 else tf.float32


def _rows(tensor, keep):
    """Zeroes the examples that do not count (0 * NaN would be NaN)."""
    mask = tf.reshape(keep, [-1] + [1] * (tensor.shape.rank - 1))
    return tf.where(mask, tensor, tf.zeros_like(tensor))


def _squared_row_norms(per_example) -> tf.Tensor:
    """||row i||^2 of [m, ...] per-example values, shape [m].

    Reduced over one flattened axis: XLA on CPU ran the multi-axis
    reduction 1.5x slower (mini, m = 256: 14.5 against 9.6 ms per layer).
    """
    flat = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
    return tf.reduce_sum(tf.square(flat), axis=1)


def _with_dropped_rows_zeroed(keep, compute, *tensors):
    """compute(*tensors), the rows not kept zeroed first, but only when there are any.

    The rows not kept may be non-finite (0 * NaN is NaN), so they must be
    zeroed; zeroing is a pass over all m rows (and a copy of each tensor),
    and most micro-batches keep every row.
    """
    return tf.cond(tf.reduce_all(keep), lambda: compute(*tensors),
                   lambda: compute(*[_rows(tensor, keep) for tensor in tensors]))


def _weighted_row_sum(factors, per_example, keep) -> tf.Tensor:
    """sum_i factors_i row_i over the rows with keep_i, of [m, ...] values; shape [...].

    The sum is a product of a [2, m] matrix (factors and a zero row) with
    the [m, k] rows: XLA rewrites a vector-matrix product into a multiply
    and a column reduction, which on CPU ran 2.7x slower (mini, m = 256, a
    256 x 256 kernel: 11.3 against 4.2 ms).
    """
    flat = tf.reshape(per_example, [tf.shape(per_example)[0], -1])
    factors = tf.cast(factors, flat.dtype)
    weights = tf.stack([factors, tf.zeros_like(factors)])
    total = _with_dropped_rows_zeroed(keep, lambda rows: tf.matmul(weights, rows), flat)[0]
    return tf.reshape(total, tf.shape(per_example)[1:])


class Term(abc.ABC):
    """Example i's gradient of one variable of shape `shape`, in compact form.

    Args:
        shape: the variable's shape (a list of ints).
    """

    def __init__(self, shape):
        self.shape = list(shape)

    @property
    @abc.abstractmethod
    def dtype(self) -> tf.DType:
        """The dtype of the recorded tensors (float32 or float64)."""

    @abc.abstractmethod
    def squared_norms(self) -> tf.Tensor:
        """||g_i||^2, shape [m]."""

    @abc.abstractmethod
    def clipped_sum(self, factors: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
        """sum_i factors_i g_i over examples with `keep_i`, shaped like the variable."""

    @abc.abstractmethod
    def dense(self) -> tf.Tensor:
        """The per-example gradients, [m, *shape]."""

    @classmethod
    @abc.abstractmethod
    def merged(cls, terms: list) -> "Term":
        """One term of this kind whose gradient is the sum of `terms`' gradients."""

    def inner(self, other: "Term") -> tf.Tensor:
        """<g_i, h_i> per example for `other`'s h, or NotImplemented."""
        return NotImplemented


class Outer(Term):
    """Per-example gradient `left_i^T right_i`, reshaped to the variable.

    Two forms, chosen per layer from the static shapes:

    - materialised, when p d <= T (p + d): the per-example gradients
      [m, p, d] are built once (T p d per example, the cost of the ordinary
      weight gradient) and no larger than the records they come from. Both
      the norms and the clipped sum are read off them, so the clipped sum
      costs p d per example instead of a second T p d product.
    - Gram, otherwise: ||g_i||^2 = <A_i A_i^T, G_i G_i^T> (T^2 (p + d) per
      example, T^2 memory) and the clipped sum is one [p, m T] x [m T, d]
      product of the records.

    Args:
        left: [m, T, P] (a layer's inputs, or unfolded patches of them).
        right: [m, T, D] (the output gradient).
        shape: the variable's shape (P * D elements).
    """

    def __init__(self, left, right, shape):
        super().__init__(shape)
        self.left, self.right = left, right
        self._per_example = None

    @property
    def dtype(self):
        return self.left.dtype

    @property
    def materialised(self) -> bool:
        """Whether the per-example gradients are built (see the class docstring)."""
        return outer_is_materialised(self.left.shape[1], self.left.shape[2], self.right.shape[2])

    def _per_example_gradients(self) -> tf.Tensor:
        """[m, P, D], built once per term (norms and clipped sum share it)."""
        if self._per_example is None:
            self._per_example = tf.einsum("mtp,mtd->mpd", self.left, self.right)
        return self._per_example

    def squared_norms(self):
        if self.materialised:
            return _squared_row_norms(self._per_example_gradients())
        left_gram = tf.einsum("mtp,msp->mts", self.left, self.left)
        right_gram = tf.einsum("mtd,msd->mts", self.right, self.right)
        return tf.reduce_sum(left_gram * right_gram, axis=[1, 2])

    def clipped_sum(self, factors, keep):
        if self.materialised:
            return tf.reshape(_weighted_row_sum(factors, self._per_example_gradients(), keep),
                              self.shape)
        factors = tf.cast(factors, self.dtype)[:, None, None]

        def product(left, right):
            # One [p, m*T] x [m*T, d] product: XLA on CPU runs it about twice
            # as fast as the equivalent two-axis einsum "mtp,mtd->pd".
            return tf.matmul(tf.reshape(left * factors, [-1, left.shape[-1]]),
                             tf.reshape(right, [-1, right.shape[-1]]), transpose_a=True)

        total = _with_dropped_rows_zeroed(keep, product, self.left, self.right)
        return tf.reshape(total, self.shape)

    def dense(self):
        per_example = self._per_example_gradients()
        return tf.reshape(per_example, [tf.shape(per_example)[0]] + self.shape)

    @classmethod
    def merged(cls, terms):
        # Several calls: concatenating along the token axis sums the outer products.
        return cls(tf.concat([t.left for t in terms], 1),
                   tf.concat([t.right for t in terms], 1), terms[0].shape)

    def inner(self, other):
        if isinstance(other, Gather):
            # <left^T right, scatter(ids, values)> = sum_{s,t} left[s, ids_t] <right_s, values_t>
            left_at_ids = tf.gather(self.left, other.ids, axis=2, batch_dims=1)
            products = tf.einsum("msd,mtd->mst", self.right, other.values)
            return tf.reduce_sum(left_at_ids * products, axis=[1, 2])
        if isinstance(other, Explicit):
            matrix = tf.reshape(other.value, [tf.shape(other.value)[0], self.left.shape[2], -1])
            return tf.einsum("msp,mpd,msd->m", self.left, matrix, self.right)
        return NotImplemented


class Gather(Term):
    """Per-example gradient: `values_i[t]` added to row `ids_i[t]` of the variable.

    Args:
        ids: int32 [m, T] row indices.
        values: [m, T, D].
        shape: the variable's shape ([rows, D]).
    """

    def __init__(self, ids, values, shape):
        super().__init__(shape)
        self.ids, self.values = ids, values

    @property
    def dtype(self):
        return self.values.dtype

    def squared_norms(self):
        """Token-equality Gram sum_{s,t} [ids_s = ids_t] <v_s, v_t>: no [V, D] tensor."""
        same = tf.cast(self.ids[:, :, None] == self.ids[:, None, :], self.dtype)
        gram = tf.einsum("mtd,msd->mts", self.values, self.values)
        return tf.reduce_sum(same * gram, axis=[1, 2])

    def clipped_sum(self, factors, keep):
        values = _rows(self.values, keep) * tf.cast(factors, self.dtype)[:, None, None]
        total = tf.math.unsorted_segment_sum(
            tf.reshape(values, [-1, values.shape[-1]]), tf.reshape(self.ids, [-1]),
            self.shape[0])
        return tf.reshape(total, self.shape)

    def dense(self):
        m = tf.shape(self.ids)[0]
        rows = self.shape[0]
        # Example i's rows are offset by i * rows: one segment sum for all examples.
        offsets = tf.range(m, dtype=self.ids.dtype)[:, None] * rows
        total = tf.math.unsorted_segment_sum(
            tf.reshape(self.values, [-1, self.values.shape[-1]]),
            tf.reshape(self.ids + offsets, [-1]), m * rows)
        return tf.reshape(total, [m] + self.shape)

    @classmethod
    def merged(cls, terms):
        return cls(tf.concat([t.ids for t in terms], 1),
                   tf.concat([t.values for t in terms], 1), terms[0].shape)

    def inner(self, other):
        if isinstance(other, Explicit):
            matrix = tf.reshape(other.value, [tf.shape(other.value)[0], self.shape[0], -1])
            rows = tf.gather(matrix, self.ids, axis=1, batch_dims=1)
            return tf.reduce_sum(rows * self.values, axis=[1, 2])
        return NotImplemented


class Explicit(Term):
    """The per-example gradients themselves.

    Args:
        value: [m, *shape].
        shape: the variable's shape; by default `value`'s trailing axes.
    """

    def __init__(self, value, shape=None):
        super().__init__(value.shape[1:] if shape is None else shape)
        self.value = value

    @property
    def dtype(self):
        return self.value.dtype

    def squared_norms(self):
        return _squared_row_norms(self.value)

    def clipped_sum(self, factors, keep):
        return tf.reshape(_weighted_row_sum(factors, self.value, keep), self.shape)

    def dense(self):
        return tf.reshape(self.value, [tf.shape(self.value)[0]] + self.shape)

    @classmethod
    def merged(cls, terms):
        return cls(tf.add_n([t.dense() for t in terms]), terms[0].shape)

    def inner(self, other):
        # Other kinds know the cheaper form of their product with an explicit term.
        return _dense_inner(self, other) if isinstance(other, Explicit) else NotImplemented


def _dense_inner(a: Term, b: Term) -> tf.Tensor:
    a, b = a.dense(), b.dense()
    m = tf.shape(a)[0]
    return tf.reduce_sum(tf.reshape(a, [m, -1]) * tf.reshape(b, [m, -1]), axis=1)


def _inner(a: Term, b: Term) -> tf.Tensor:
    value = a.inner(b)
    if value is NotImplemented:
        value = b.inner(a)
    if value is NotImplemented:  # neither kind knows the other: through dense gradients
        value = _dense_inner(a, b)
    return value


def squared_norm_of_sum(terms: list) -> tf.Tensor:
    """||sum of the terms' gradients||^2 per example, cross terms included.

    Args:
        terms: the records of ONE variable, at most one per kind (`merged`).
    """
    parts = [term.squared_norms() for term in terms]
    for i, a in enumerate(terms):
        for b in terms[i + 1:]:
            parts.append(2.0 * _inner(a, b))
    return tf.add_n(parts)
