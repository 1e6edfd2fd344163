"""Input-space canaries for one-run audits: examples in the training data.

Each of m canary examples is included by a secret fair coin. Every canary
becomes a row of the training arrays; an excluded canary's row has sample
weight 0, which the DP step treats as padding (it contributes exactly
nothing), so N and the sampling rate the accountant is told do not depend
on the coins: the run is then exactly "the real data plus the included
canaries", sampled at the rate the accountant assumes. Because canaries go
through the whole private pipeline (the sampler's draws, per-example
gradients, clipping, accumulation, noise), they can catch bugs that
gradient canaries injected after clipping cannot, such as an example that
escapes the clip.

Scores:

* black-box (`finish` always): a function of the finished model only, by
  default the negated loss of each canary (the attack of
  `tf_megadp.audit.membership`), or any `score_fn(model, x, y)`; for masked
  LMs, `masked_lm_canary_scores` reuses the exposure machinery of
  `tf_megadp.audit.canaries`;
* white-box (`with_white_box`): when each canary moves one coordinate only
  (`dirac_canaries` on features the real data never uses), its record in
  every update, scored as in `tf_megadp.audit.white_box`.

Both views of the same canaries are two attacks on one set of coins; they
are scored together, each at half the level, so both bounds hold at the
stated confidence.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_megadp.audit.one_run import CanaryCoins, OneRunResult
from tf_megadp.audit.white_box import (
    CanaryClipping,
    CanaryCoordinates,
    WhiteBoxRecorder,
    WhiteBoxScoring,
    check_schedule,
)
from tf_megadp.clipping import ClippingStrategy
from tf_megadp.steps import BatchSizeSchedule

__all__ = ["InputCanaries", "dirac_canaries", "dirac_canary_signal", "example_losses", "masked_lm_canary_scores"]

ScoreFn = Callable[[keras.Model, Any, Any], np.ndarray]


def dirac_canary_signal(scale: float) -> float:
    """The `signal` of `dirac_canaries` on a linear output layer with a target above the predictions.

    One clipped presence's gradient is -C (scale e_j, 1) / sqrt(scale^2 + 1)
    on (kernel, bias): its component along the canary's kernel entry is
    -scale / sqrt(scale^2 + 1) in units of C (negative: the gradient points
    down, so descent moves the weight up).

    Args:
        scale: the canaries' input value.

    Returns:
        The signed signal.
    """
    return -float(scale) / math.sqrt(float(scale) ** 2 + 1.0)


def dirac_canaries(
    num_canaries: int,
    num_features: int,
    first_feature: int,
    *,
    scale: float = 3.0,
    target: float = 100.0,
    output_dim: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Canaries for a model on flat features: canary i is `scale` on feature first_feature + i.

    Put the canary features where the real data is always 0 (as reserved
    token ids are for an embedding): then only canary i moves the kernel row
    of its feature, and a target far above any prediction keeps its
    (squared-error) gradient above the clip throughout training. For a
    linear output layer, see `dirac_canary_signal` for the white-box signal.
    A moderate scale keeps an unclipped canary (a broken clip) from
    overshooting its target, so that it stands out in the black-box loss too.

    Args:
        num_canaries: m.
        num_features: the model's input width.
        first_feature: the first canary feature; features first_feature ..
            first_feature + m - 1 must exist.
        scale: the canary's input value.
        target: the regression target of every canary.
        output_dim: the width of the target.

    Returns:
        (x float32 [m, num_features], y float32 [m, output_dim]).

    Example:
    ```python
    x_canary, y_canary = dirac_canaries(1000, 8 + 1000, first_feature=8)
signal = dirac_canary_signal(3.0)   # -0.949
    ```
    """
    if num_canaries < 1 or first_feature < 0 or first_feature + num_canaries > num_features:
        raise ValueError(
            f"Canary features {first_feature} .. {first_feature + num_canaries - 1} do not fit "
            f"{num_features} input features."
        )
    x = np.zeros((num_canaries, num_features), np.float32)
    x[np.arange(num_canaries), first_feature + np.arange(num_canaries)] = scale
    y = np.full((num_canaries, output_dim), target, np.float32)
    return x, y


def example_losses(model: keras.Model, x, y, *, batch_size: int = 256) -> np.ndarray:
    """Per-example values of the model's compiled loss (mean over non-batch axes).

    Args:
        model: a compiled model whose `loss` is a name, a function or a
            `keras.losses.Loss` (a dict of losses is not supported).
        x, y: the examples.
        batch_size: examples per model call.

    Returns:
        float64 [n].
    """
    loss = model.loss
    if isinstance(loss, keras.losses.Loss):
        function = loss.call
    elif isinstance(loss, str) or callable(loss):
        function = keras.losses.get(loss)
    else:
        raise ValueError(
            f"Per-example losses need a single compiled loss, got {loss!r}; pass score_fn=."
        )
    total = len(tf.nest.flatten(x)[0])
    values = []
    for start in range(0, total, batch_size):
        part = tf.nest.map_structure(lambda a: a[start:start + batch_size], x)
        target = tf.nest.map_structure(lambda a: a[start:start + batch_size], y)
        value = keras.ops.convert_to_numpy(function(target, model(part, training=False)))
        values.append(value.reshape(value.shape[0], -1).mean(axis=1))
    return np.concatenate(values).astype(np.float64)


def _negated_loss(model, x, y) -> np.ndarray:
    return -example_losses(model, x, y)


def masked_lm_canary_scores(
    canaries: Sequence[Any],
    *,
    mask_token_id: int,
    pad_token_id: int = 0,
    num_candidates: int | None = None,
    batch_size: int = 256,
) -> ScoreFn:
    """A black-box `score_fn` for secret-sharer canaries of a masked LM: their exposure.

    Reuses `MaskedLMScorer.secret_score_fn` (pseudo-log-likelihood of the
    secret's slots) and `canary_exposure` (the secret's rank among the
    candidates): a memorized canary has high exposure.

    Args:
        canaries: the `tf_megadp.audit.Canary` objects, one per coin, in order
            (their `repetitions` is ignored: the coin decides inclusion).
        mask_token_id, pad_token_id, batch_size: as in `MaskedLMScorer`.
        num_candidates: sampled candidates per canary (None enumerates).

    Returns:
        A function `(model, x, y) -> exposures [m]` (x and y are ignored).
    """
    from tf_megadp.audit.canaries import canary_exposure
    from tf_megadp.audit.scoring import MaskedLMScorer

    canaries = list(canaries)

    def score(model, x=None, y=None):
        scorer = MaskedLMScorer(model, mask_token_id=mask_token_id, pad_token_id=pad_token_id,
                                batch_size=batch_size)
        functions = {}
        values = []
        for index, canary in enumerate(canaries):
            slots = canary.format.secret_positions
            if slots not in functions:
                functions[slots] = scorer.secret_score_fn(slots)
            values.append(canary_exposure(canary, functions[slots], num_candidates=num_candidates,
                                          extrapolate=False, seed=index)["exposure"])
        return np.asarray(values)

    return score


def _rows(structure) -> int:
    leaves = tf.nest.flatten(structure)
    if not leaves:
        raise ValueError("Empty inputs.")
    return int(np.asarray(leaves[0]).shape[0])


class InputCanaries:
    """m canary examples, each put into the training data by a secret fair coin.

    Args:
        x: the canaries' inputs (an array or a nest of arrays, m rows).
        y: their targets (m rows).
        delta: the delta of the claim the bounds are set against.
        confidence: the joint confidence of the reported bounds.
        guesses: the (k_in, k_out) rules (default `one_run.default_guesses`).
        score_fn: black-box score `(model, x, y) -> [m]`, higher = "looks
            included"; default: the negated per-example loss.
        seed: None (OS entropy) or an int for reproducible coins and row
            positions (tests only; warns).

    Example:
    ```python
    x_c, y_c = tf_megadp.audit.dirac_canaries(1000, 1008, first_feature=8)
    canaries = tf_megadp.audit.InputCanaries(x_c, y_c, delta=1e-6)
    x_all, y_all, w_all = canaries.training_arrays(x_real, y_real)
    sampler = tf_megadp.PoissonSampler.from_arrays(x_all, y_all, w_all, batch_size=15,
                                                   epochs=5, micro_batch_size=48)
    ...  # compile with a DPOptimizer on sampler.schedule, fit(sampler.as_dataset())
    canaries.finish(model)["black_box"].epsilon_lower_bound
    ```
    """

    kind = "input canaries, "

    def __init__(
        self,
        x,
        y,
        *,
        delta: float,
        confidence: float = 0.95,
        guesses: Sequence[tuple[int, int]] | None = None,
        score_fn: ScoreFn | None = None,
        seed: int | None = None,
    ):
        self.x, self.y = x, y
        self.num_canaries = _rows(x)
        if _rows(y) != self.num_canaries:
            raise ValueError(f"x has {self.num_canaries} canaries but y has {_rows(y)}.")
        self.delta = float(delta)
        self.confidence = float(confidence)
        self.guesses = guesses
        self.score_fn = score_fn or _negated_loss
        self.coins = CanaryCoins(self.num_canaries, seed=seed)
        self._seed = seed
        self.rows: np.ndarray | None = None
        self._white_box: WhiteBoxScoring | None = None
        self.recorder: WhiteBoxRecorder | None = None
        self.details: dict = {}

    def training_arrays(self, x, y, sample_weight=None):
        """The training data with every canary as a row, excluded ones with weight 0.

        The canary rows go to uniformly random positions (public: where a
        canary sits says nothing about its coin). Their positions are kept
        in `rows`.

        Args:
            x: the real inputs (array or nest of arrays, N rows).
            y: the real targets.
            sample_weight: the real examples' weights, per example [N] or per
                token [N, ...]; None means all ones.

        Returns:
            (x, y, sample_weight) with N + m rows.
        """
        if self.rows is not None:
            raise ValueError("training_arrays was already called: one training set per audit.")
        n = _rows(x)
        m = self.num_canaries
        rng = np.random.default_rng(secrets.randbits(64) if self._seed is None else self._seed + 3)
        rows = np.sort(rng.choice(n + m, size=m, replace=False))
        is_canary = np.zeros(n + m, bool)
        is_canary[rows] = True

        def merge(real, canary):
            real, canary = np.asarray(real), np.asarray(canary)
            if real.shape[1:] != canary.shape[1:]:
                raise ValueError(
                    f"Canary rows have shape {canary.shape[1:]} but the data has {real.shape[1:]}.")
            merged = np.empty((n + m, *real.shape[1:]), np.result_type(real, canary))
            merged[~is_canary] = real
            merged[is_canary] = canary
            return merged

        x_all = tf.nest.map_structure(merge, x, self.x)
        y_all = tf.nest.map_structure(merge, y, self.y)
        if sample_weight is None:
            sample_weight = np.ones(n, np.float32)
        sample_weight = np.asarray(sample_weight, np.float32)
        included = self.coins._included().astype(np.float32)
        canary_weight = np.broadcast_to(
            included.reshape((m,) + (1,) * (sample_weight.ndim - 1)), (m, *sample_weight.shape[1:]))
        self.rows = rows
        return x_all, y_all, merge(sample_weight, canary_weight)

    def with_white_box(
        self,
        model: keras.Model,
        schedule: BatchSizeSchedule,
        coordinates: CanaryCoordinates,
        *,
        signal: float = 1.0,
    ) -> "InputCanaries":
        """Also scores each canary from the updates of its own coordinate.

        Args:
            model: the model to be trained (built).
            schedule: the run's schedule (`sampler.schedule`).
            coordinates: canary i's coordinate (e.g. `CanaryCoordinates.on_rows`
                of the first kernel at the canary features).
            signal: the fraction of C one clipped presence moves it (see
                `dirac_canaries`).

        Returns:
            self; then compile with `clipping=self.clipping(...)`.
        """
        if len(coordinates) != self.num_canaries:
            raise ValueError(f"{len(coordinates)} coordinates for {self.num_canaries} canaries.")
        schedule = check_schedule(schedule)
        self.recorder = WhiteBoxRecorder(model, coordinates, schedule.total_steps)
        self._white_box = WhiteBoxScoring(self.recorder, schedule, signal)
        return self

    def clipping(self, base: str | ClippingStrategy = "vectorized") -> CanaryClipping:
        """The recording strategy for `DPOptimizer(clipping=...)` (after `with_white_box`)."""
        if self.recorder is None:
            raise ValueError("Call with_white_box(...) first: black-box audits need no strategy.")
        return CanaryClipping(base, self.recorder, injector=None)

    def black_box_scores(self, model: keras.Model) -> np.ndarray:
        """The black-box scores of the finished model (the coins stay secret)."""
        scores = np.asarray(self.score_fn(model, self.x, self.y), dtype=np.float64).reshape(-1)
        if scores.size != self.num_canaries:
            raise ValueError(f"score_fn gave {scores.size} scores for {self.num_canaries} canaries.")
        # A diverged model may give non-finite losses; they rank as "least included".
        return np.where(np.isfinite(scores), scores, -1e300)

    def finish(self, model: keras.Model) -> dict[str, OneRunResult]:
        """Scores every attack once: {"black_box": ..., and "white_box": ... if recorded}."""
        if self.rows is None:
            raise ValueError("training_arrays was never called: the canaries were not trained on.")
        attacks = {"black_box": self.black_box_scores(model)}
        if self._white_box is not None:
            attacks["white_box"], self.details = self._white_box.scores()
        return self.coins.score_attacks(attacks, delta=self.delta, confidence=self.confidence,
                                        guesses=self.guesses, kind=self.kind)
