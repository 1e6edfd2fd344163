"""Asking a masked language model how likely tokens are.

The audit needs two numbers from a model: the per-sequence loss of training
and held-out sequences (membership inference), and the likelihood of a
candidate secret in a canary's slots (exposure). Both come from one compiled
function: run the model on masked inputs and gather the log-probabilities of
the target tokens at the masked positions.

The model contract is the one of `keras_hub.models.BertMaskedLM` with
`preprocessor=None`: inputs {"token_ids", "segment_ids", "padding_mask",
"mask_positions"}, output logits [batch, num_masked, vocabulary].
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["MaskedLMScorer"]


def _to_numpy(value):
    if isinstance(value, dict):
        return {key: _to_numpy(item) for key, item in value.items()}
    return np.asarray(value)


def _num_rows(value) -> int:
    if isinstance(value, dict):
        value = next(iter(value.values()))
    return value.shape[0]


def _take_rows(value, index: np.ndarray):
    if isinstance(value, dict):
        return {key: item[index] for key, item in value.items()}
    return value[index]


class MaskedLMScorer:
    """Log-likelihoods and losses from a masked LM, in fixed-size batches.

    Args:
        model: a Keras masked LM with the `BertMaskedLM` input/output contract.
        mask_token_id: the id that replaces a masked token in `token_ids`
            (the same id training used).
        pad_token_id: padding id; positions holding it get padding_mask 0.
        batch_size: sequences per model call. Calls are padded to this size so
            that the compiled function is traced once.
        from_logits: whether the model outputs logits (True for
            `BertMaskedLM`) or probabilities.

    Example:
    ```python
    scorer = MaskedLMScorer(masked_lm, mask_token_id=4)
    score_fn = scorer.secret_score_fn(canary_format.secret_positions)
    canary_exposure(canary, score_fn)
    losses = scorer.example_losses(member_batches)
    ```
    """

    def __init__(
        self,
        model,
        *,
        mask_token_id: int,
        pad_token_id: int = 0,
        batch_size: int = 256,
        from_logits: bool = True,
    ):
        if int(mask_token_id) == int(pad_token_id):
            raise ValueError(
                f"mask_token_id and pad_token_id must differ, both are {mask_token_id}."
            )
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
        self.model = model
        self.mask_token_id = int(mask_token_id)
        self.pad_token_id = int(pad_token_id)
        self.batch_size = int(batch_size)
        self.from_logits = bool(from_logits)
        self._target_log_probs = tf.function(
            self._target_log_probs_eager, reduce_retracing=True
        )
        self._position_log_probs = tf.function(
            self._position_log_probs_eager, reduce_retracing=True
        )

    def _log_softmax(self, outputs):
        outputs = tf.cast(outputs, tf.float32)
        if self.from_logits:
            return tf.nn.log_softmax(outputs, axis=-1)
        return tf.math.log(outputs)

    def _position_log_probs_eager(self, inputs):
        return self._log_softmax(self.model(inputs, training=False))

    def _target_log_probs_eager(self, inputs, targets):
        outputs = tf.cast(self.model(inputs, training=False), tf.float32)
        # Gather on device: only [batch, num_masked] numbers come back, and no
        # second vocabulary-sized tensor is built.
        picked = tf.gather(outputs, targets, batch_dims=2)
        if self.from_logits:
            return picked - tf.reduce_logsumexp(outputs, axis=-1)
        return tf.math.log(picked)

    def _inputs(self, token_ids: np.ndarray, mask_positions: np.ndarray) -> dict:
        """Model inputs; the masked tokens must already be in `token_ids`."""
        return {
            "token_ids": token_ids.astype(np.int32),
            "segment_ids": np.zeros_like(token_ids, dtype=np.int32),
            "padding_mask": (token_ids != self.pad_token_id).astype(np.int32),
            "mask_positions": mask_positions.astype(np.int32),
        }

    def _batched(self, fn: Callable, arrays: Sequence[dict | np.ndarray]) -> np.ndarray:
        """Applies `fn` to fixed-size row slices of `arrays`, concatenating results.

        The last slice is padded by repeating the last row, so every call has the
        same shape; the padded rows' results are dropped.
        """
        total = _num_rows(arrays[0])
        size = min(self.batch_size, total)
        outputs = []
        for start in range(0, total, size):
            index = np.minimum(np.arange(start, start + size), total - 1)
            result = np.asarray(fn(*[_take_rows(a, index) for a in arrays]))
            outputs.append(result[: total - start])
        return np.concatenate(outputs, axis=0)

    def masked_token_log_probs(
        self, token_ids: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """log p(original token | sequence with `positions` masked), per position.

        Args:
            token_ids: int [n, length] sequences.
            positions: int [n, P] positions to mask and score in each sequence.

        Returns:
            float64 [n, P] log-probabilities of the original tokens.
        """
        token_ids = np.asarray(token_ids)
        positions = np.asarray(positions)
        targets = np.take_along_axis(token_ids, positions, axis=1)
        masked = token_ids.copy()
        np.put_along_axis(masked, positions, self.mask_token_id, axis=1)
        inputs = self._inputs(masked, positions)
        values = self._batched(
            lambda x, t: self._target_log_probs(x, tf.constant(t, tf.int32)),
            [inputs, targets],
        )
        return values.astype(np.float64)

    def secret_score_fn(
        self, secret_positions: Sequence[int], *, mode: str = "pseudo"
    ) -> Callable[[np.ndarray], np.ndarray]:
        """A canary score function: log-likelihood of the tokens in the slots.

        Args:
            secret_positions: the canary format's secret slot positions.
            mode: "pseudo" scores slot j with only slot j masked and the other
                slots holding the candidate's tokens, and sums over j (the
                pseudo-log-likelihood of Salazar et al. 2020; one model call per
                slot and candidate). "joint" masks all slots at once and sums
                the log-probabilities of the candidate's tokens; the masked
                input is the same for every candidate, so the model runs once
                per distinct context and scoring many candidates is cheap. It
                ignores how the slots depend on each other: when several
                canaries share a template, the per-slot predictions mix their
                secrets and exposure is understated. Report "pseudo".

        Returns:
            A function int [n, length] -> float64 [n] for `canary_exposure`.
        """
        slots = np.asarray(list(secret_positions), dtype=np.int64)
        if slots.size == 0:
            raise ValueError("`secret_positions` must name at least one position.")
        if mode == "pseudo":
            return lambda sequences: self._pseudo_score(np.asarray(sequences), slots)
        if mode == "joint":
            return lambda sequences: self._joint_score(np.asarray(sequences), slots)
        raise ValueError(f"`mode` must be 'pseudo' or 'joint', got {mode!r}.")

    def _pseudo_score(self, sequences: np.ndarray, slots: np.ndarray) -> np.ndarray:
        n, s = sequences.shape[0], slots.size
        # Row i * s + j scores slot j of sequence i.
        repeated = np.repeat(sequences, s, axis=0)
        positions = np.tile(slots, n)[:, None]
        log_probs = self.masked_token_log_probs(repeated, positions)
        return log_probs.reshape(n, s).sum(axis=1)

    def _joint_score(self, sequences: np.ndarray, slots: np.ndarray) -> np.ndarray:
        masked = sequences.copy()
        masked[:, slots] = self.mask_token_id
        contexts, which = np.unique(masked, axis=0, return_inverse=True)
        positions = np.tile(slots, (contexts.shape[0], 1))
        tables = self._batched(
            self._position_log_probs, [self._inputs(contexts, positions)]
        ).astype(np.float64)
        which = which.reshape(-1)
        picked = tables[which[:, None], np.arange(slots.size)[None, :], sequences[:, slots]]
        return picked.sum(axis=1)

    def example_losses(self, batches: Iterable) -> np.ndarray:
        """Per-sequence masked-LM loss over batches of the training data contract.

        Args:
            batches: an iterable of `(x, y)` or `(x, y, sample_weight)` with
                x the model inputs, y the masked token ids [m, P] and
                sample_weight the mask weights [m, P] (e.g. a tf.data.Dataset).

        Returns:
            float64 [num_sequences]: for each sequence with positive total
            weight, the weighted mean cross-entropy over its masked positions.
            Sequences with zero weight (padding of Poisson batches) are
            dropped.
        """
        losses = []
        for batch in batches:
            if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
                raise ValueError(
                    "Each batch must be (x, y) or (x, y, sample_weight), got "
                    f"{type(batch).__name__}."
                )
            x, y = _to_numpy(batch[0]), np.asarray(batch[1])
            weight = np.asarray(batch[2], np.float64) if len(batch) == 3 else np.ones(y.shape)
            if weight.shape != y.shape:
                raise ValueError(
                    f"sample_weight shape {weight.shape} must equal y shape {y.shape}."
                )
            log_probs = self._batched(
                lambda inputs, t: self._target_log_probs(inputs, tf.constant(t, tf.int32)),
                [x, y],
            ).astype(np.float64)
            total = weight.sum(axis=1)
            keep = total > 0
            losses.append(-(log_probs * weight).sum(axis=1)[keep] / total[keep])
        if not losses:
            raise ValueError("`batches` is empty: nothing to compute losses on.")
        return np.concatenate(losses)
