"""When ghost clipping builds a layer's per-example gradient: a memory rule, in plain arithmetic.

The rule lives apart from `tf_megadp.clipping`, which imports TensorFlow,
because the run planner (`tf_megadp.jobs.bert.plan`, behind `tf-megadp
plan`) applies the same rule without TensorFlow.
"""

from __future__ import annotations

__all__ = ["outer_is_materialised"]


def outer_is_materialised(tokens: int | None, p: int, d: int) -> bool:
    """Whether an `Outer` record of T tokens, p inputs, d outputs builds its per-example gradient.

    True when p d <= T (p + d): the [p, d] gradient is no larger than the
    records it comes from. An unknown token count gets the Gram form, whose
    memory does not grow with the layer's width.

    Args:
        tokens: T, tokens per example (None when unknown).
        p: the layer's input width.
        d: its output width.

    Returns:
        True for the explicit [p, d] gradient, False for the Gram form.

    Example:
    ```python
    outer_is_materialised(128, 768, 3072)  # False: the Gram form is smaller
    ```
    """
    return tokens is not None and p * d <= tokens * (p + d)
