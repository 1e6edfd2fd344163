"""`CanaryCoordinates`: where the white-box audit's gradient canaries live in the model."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Sequence

import keras
import numpy as np

__all__ = ["CanaryCoordinates"]


@dataclasses.dataclass(frozen=True)
class CanaryCoordinates:
    """Where the canaries live: canary i is coordinate `flat_indices[i]` of variable `variables[i]`.

    Args:
        variable_paths: the `path` of the trainable variable of each canary.
        flat_indices: the index into that variable, flattened (row-major).

    Example:
    ```python
    kernel = model.layers[0].kernel                    # [features, units]
    rows = np.arange(8, 8 + 1000)                      # features the data never uses
    coords = CanaryCoordinates.on_rows(kernel, rows)   # column 0 of each row
    ```
    """

    variable_paths: tuple
    flat_indices: tuple

    def __post_init__(self):
        if len(self.variable_paths) != len(self.flat_indices) or not self.flat_indices:
            raise ValueError(
                "Need one variable path and one flat index per canary, and at least one "
                f"canary; got {len(self.variable_paths)} paths and {len(self.flat_indices)} "
                "indices."
            )
        pairs = set(zip(self.variable_paths, self.flat_indices))
        if len(pairs) != len(self.flat_indices):
            raise ValueError(
                "Two canaries share a coordinate: each canary needs its own, or their "
                "updates cannot be told apart."
            )

    def __len__(self) -> int:
        return len(self.flat_indices)

    @classmethod
    def on_rows(cls, variable, rows: Sequence[int] | np.ndarray, column: int = 0) -> "CanaryCoordinates":
        """One canary per row of a 2-D variable (e.g. a Dense kernel or an embedding), in `column`.

        Args:
            variable: a 2-D trainable variable [rows, columns].
            rows: the rows, one canary each.
            column: the column used in every row.

        Returns:
            The coordinates.
        """
        shape = tuple(variable.shape)
        if len(shape) != 2:
            raise ValueError(f"on_rows needs a 2-D variable, got shape {shape}.")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size == 0 or rows.min() < 0 or rows.max() >= shape[0] or not 0 <= column < shape[1]:
            raise ValueError(
                f"Rows must lie in [0, {shape[0]}) and column in [0, {shape[1]}), got rows "
                f"[{rows.min() if rows.size else '-'}, {rows.max() if rows.size else '-'}] "
                f"and column {column}."
            )
        flat = rows * shape[1] + int(column)
        return cls(tuple([variable.path] * rows.size), tuple(int(i) for i in flat))

    @classmethod
    def random(
        cls,
        model: keras.Model,
        num_canaries: int,
        *,
        variables: Sequence[Any] | None = None,
        seed: int | None = None,
    ) -> "CanaryCoordinates":
        """Distinct coordinates drawn uniformly from some trainable variables.

        The choice is public (the attacker may know it); `seed` only makes it
        reproducible. Coordinates that real gradients also move add their
        gradients to the canary's record and weaken the audit (never its
        validity): prefer rows the data cannot reach, e.g. embedding rows of
        tokens the tokenizer reserves, via `on_rows`. Never choose them by
        looking at gradients of the private data: the list would then tell
        which coordinates the data leaves untouched.

        Args:
            model: the built model.
            num_canaries: m.
            variables: the candidate variables (default: all trainable ones).
            seed: seed of the draw (None: OS entropy).

        Returns:
            The coordinates.
        """
        pool = list(variables) if variables is not None else list(model.trainable_variables)
        sizes = np.array([int(np.prod(v.shape)) for v in pool], dtype=np.int64)
        if num_canaries < 1 or num_canaries > sizes.sum():
            raise ValueError(
                f"Need 1 <= num_canaries <= {int(sizes.sum())} coordinates, got {num_canaries}."
            )
        rng = np.random.default_rng(secrets.randbits(64) if seed is None else seed)
        chosen = np.sort(rng.choice(int(sizes.sum()), size=num_canaries, replace=False))
        owner = np.searchsorted(np.cumsum(sizes), chosen, side="right")
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return cls(tuple(pool[o].path for o in owner),
                   tuple(int(c - offsets[o]) for c, o in zip(chosen, owner)))
