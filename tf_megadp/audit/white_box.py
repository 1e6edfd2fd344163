"""White-box one-run audits of the DP step: canaries read from every model update.

The white-box attacker of the DP-SGD analysis sees every released
iterate theta_0, theta_1, ..., theta_T (the analysis covers them all).
A canary here is tied to one coordinate of one trainable variable; at the
start of every logical step the audit records the canaries' coordinates,
so the update of step t along canary i is o_{t,i} = -(theta_{t+1} -
theta_t)[k_i] (minus: gradient descent moves against the gradient).

Two kinds of canary use this:

* **gradient canaries** (`GradientCanaryAudit`): each included canary is a
  synthetic example whose clipped gradient is C times the unit vector of
  its coordinate (a Dirac direction), the worst case the DP-SGD analysis
  allows for one example. Like a real example it joins each logical step
  with the sampler's rate q_t, independently, once per step, and it enters
  the step's clipped sum before the optimizer adds noise. This audits
  everything downstream of the clipped sum (accumulation, noise, divisor,
  the sampling rate and step count the accountant was told), for any
  model. It does not see bugs upstream of it (per-example gradients,
  clipping, the sampler's draws): for those, put canaries into the data
  (`tf_megadp.audit.input_canaries`).
* **input canaries with white-box scoring**: examples in the training data
  whose gradient reaches one coordinate only (e.g. a Dirac input on a
  feature the real data never uses, read from that feature's kernel row),
  scored from the same records.

The score of a canary is the log-likelihood ratio of "included" against
"excluded" under the claimed mechanism, summed over steps:

    score_i = sum_t log(1 - q_t + q_t exp(mu_t z_{t,i} - mu_t^2 / 2)),

where z_{t,i} is o_{t,i} centred by the step's median over canaries and
divided by the step's robust noise scale s_t (1.4826 * MAD over canaries:
in a step, all but about q_t / 2 of the canaries hold noise only), and
mu_t = shift_t / s_t is the expected shift of one presence in noise units.
With plain SGD (no momentum, weight decay or EMA) the shift of one presence
is known, lr_t * C * signal / B_t, so mu_t is measured: a run whose noise is
smaller than claimed shows a larger mu_t. Otherwise mu_t = signal / sigma_t
(the claim). Any score is valid (the bound only needs the score to be a
function of what training released); this one is the most powerful test of
presence when the claim is true.

Nothing the audit records is secret: the coordinates are chosen in the
open and the records are the released iterates. The secrets (the coins,
and for gradient canaries the key of their per-step sampling) live in an
in-memory object that no Keras or TensorFlow checkpoint can see; the coins
are revealed only when the audit is scored, the sampling key never.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.audit.one_run import CanaryCoins, OneRunResult
from tf_megadp.clipping import ClippingStrategy, get_clipping_strategy
from tf_megadp.audit.canary_coordinates import CanaryCoordinates
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.steps import BatchSizeSchedule

# 1 / Phi^-1(3/4): the MAD of a normal sample times this estimates its SD.
_MAD_TO_SD = 1.482602218505602

__all__ = [
    "CanaryClipping",
    "CanaryCoordinates",
    "GradientCanaryAudit",
    "WhiteBoxRecorder",
    "WhiteBoxScoring",
    "check_schedule",
    "white_box_scores",
]


@dataclasses.dataclass
class _InMemory:
    """Audit state that must never reach a file (a plain object: no checkpoint walks it).

    `values` and `recorded` are released iterates (not secret, but large);
    `included` and `key` are the secrets.
    """

    values: Any = None
    recorded: Any = None
    included: Any = None
    key: Any = None
    last_injected: Any = None


def _check_single_replica():
    if tf.distribute.get_strategy().num_replicas_in_sync > 1:
        raise PrivacyConfigurationError(
            "Canary audits run on one replica only: every replica would inject the same "
            "gradient canary, so it would enter the noisy sum once per replica (a "
            "sensitivity of R * C the accountant does not know). Audit on one device."
        )


def _resolve(model: keras.Model, coordinates: CanaryCoordinates):
    """(variables, per-variable index arrays, canary ids per variable) for `coordinates`."""
    by_path = {v.path: (position, v) for position, v in enumerate(model.trainable_variables)}
    groups: dict[int, tuple[list, list]] = {}
    for canary, (path, flat) in enumerate(zip(coordinates.variable_paths, coordinates.flat_indices)):
        if path not in by_path:
            raise ValueError(
                f"Canary {canary} names variable {path!r}, which is not a trainable "
                f"variable of {model.name} (its variables: {sorted(by_path)[:5]} ...)."
            )
        position, variable = by_path[path]
        size = int(np.prod(variable.shape))
        if not 0 <= flat < size:
            raise ValueError(
                f"Canary {canary}: flat index {flat} outside variable {path!r} of {size} entries."
            )
        groups.setdefault(position, ([], []))
        groups[position][0].append(int(flat))
        groups[position][1].append(canary)
    return [(position, np.array(flat, np.int64), np.array(ids, np.int64))
            for position, (flat, ids) in sorted(groups.items())]


class WhiteBoxRecorder:
    """Records the canaries' coordinates at the start of every logical step (in the graph).

    Created by the audits; `CanaryClipping` calls it from inside the private
    train step, so it works with any `steps_per_execution` and costs one
    gather of m numbers per micro-batch.

    Args:
        model: the model (built).
        coordinates: the canaries' coordinates.
        num_steps: logical steps to record (rows of the buffer); later steps
            are neither recorded nor injected.
    """

    def __init__(self, model: keras.Model, coordinates: CanaryCoordinates, num_steps: int):
        if not model.built:
            raise ValueError("Build the model (call it once or model.build) before auditing it.")
        self.model = model
        self.coordinates = coordinates
        self.num_steps = int(num_steps)
        self.num_canaries = len(coordinates)
        self.groups = _resolve(model, coordinates)
        # Canary order of the concatenated per-variable gathers.
        order = np.concatenate([ids for _, _, ids in self.groups])
        self._inverse = np.argsort(order)
        # One spare row takes the writes of steps past the plan, so that
        # recording never reads the buffer (a read would copy all of it).
        self._memory = _InMemory(
            values=tf.Variable(tf.zeros([self.num_steps + 1, self.num_canaries], tf.float32),
                               trainable=False, name="canary_records"),
            recorded=tf.Variable(tf.zeros([self.num_steps + 1], tf.bool), trainable=False,
                                 name="canary_recorded"),
        )

    def current_values(self, variables=None) -> tf.Tensor:
        """The canaries' coordinates now, float32 [m], in canary order."""
        variables = variables if variables is not None else self.model.trainable_variables
        parts = [tf.gather(tf.reshape(tf.cast(variables[position], tf.float32), [-1]), flat)
                 for position, flat, _ in self.groups]
        return tf.gather(tf.concat(parts, axis=0), self._inverse)

    def record(self, step) -> None:
        """Writes the current coordinates into row `step` (graph-safe; no-op past the plan)."""
        memory = self._memory
        row = tf.minimum(tf.cast(step, tf.int64), self.num_steps)
        memory.values.scatter_nd_update([[row]], [self.current_values()])
        memory.recorded.scatter_nd_update([[row]], [True])

    def observations(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-step updates along the canaries, o[t] = -(theta_{t+1} - theta_t).

        Returns:
            (observations float64 [T, m], observed bool [T]): rows of steps
            whose start and end were both seen (the end of the last applied
            step is the model's current value); other rows are zero and
            marked unobserved.
        """
        values = self._memory.values.numpy()[: self.num_steps].astype(np.float64)
        recorded = self._memory.recorded.numpy()[: self.num_steps]
        done = int(self.model.optimizer.iterations.numpy())
        final = self.current_values().numpy().astype(np.float64)
        steps = min(done, self.num_steps)
        observations = np.zeros((self.num_steps, self.num_canaries))
        observed = np.zeros(self.num_steps, bool)
        for t in range(steps):
            if not recorded[t]:
                continue
            if t + 1 < steps and recorded[t + 1]:
                end = values[t + 1]
            elif t + 1 == done:
                end = final
            else:
                continue
            observations[t] = -(end - values[t])
            observed[t] = True
        return observations, observed


def white_box_scores(
    observations: np.ndarray,
    sampling_rates: Sequence[float] | np.ndarray,
    *,
    shift: Sequence[float] | np.ndarray | None = None,
    noise_multipliers: Sequence[float] | np.ndarray | None = None,
    signal: float = 1.0,
    observed: Sequence[bool] | np.ndarray | None = None,
) -> np.ndarray:
    """Presence log-likelihood-ratio scores of canaries from their per-step updates.

    Args:
        observations: float [T, m], the update of each step along each canary
            (positive when the canary's gradient was applied).
        sampling_rates: q_t per step [T].
        shift: the update one presence causes, per step [T] (lr_t * C / B_t
            for plain SGD); None to use the claimed noise instead.
        noise_multipliers: sigma_t per step [T], used when `shift` is None.
        signal: the component along the coordinate of one clipped
            presence's gradient, in units of C: 1 for gradient canaries,
            negative for a canary whose gradient points down its coordinate
            (e.g. -0.95 for `dirac_canaries` with scale 3).
        observed: bool [T]; unobserved steps contribute nothing.

    Returns:
        float64 [m], higher = "looks included".

    Example:
    ```python
    scores = white_box_scores(obs, np.full(len(obs), 0.01), noise_multipliers=np.full(len(obs), 1.0))
    ```
    """
    observations = np.asarray(observations, dtype=np.float64)
    if observations.ndim != 2 or observations.shape[1] < 2:
        raise ValueError(f"`observations` must be [steps, canaries >= 2], got {observations.shape}.")
    if not signal:
        raise ValueError("`signal` must be non-zero: a canary must move its coordinate.")
    # Orient every record so that a presence moves it up.
    observations = observations * math.copysign(1.0, signal)
    signal = abs(float(signal))
    steps = observations.shape[0]
    rates = np.broadcast_to(np.asarray(sampling_rates, np.float64), (steps,))
    if np.any(rates < 0) or np.any(rates > 1):
        raise ValueError("Sampling rates must lie in [0, 1].")
    keep = np.ones(steps, bool) if observed is None else np.asarray(observed, bool)
    centre = np.median(observations, axis=1, keepdims=True)
    spread = _MAD_TO_SD * np.median(np.abs(observations - centre), axis=1, keepdims=True)
    if shift is not None:
        shift = np.broadcast_to(np.abs(np.asarray(shift, np.float64)) * signal, (steps,))[:, None]
        # Noise-free steps (sigma = 0) have no spread: a floor far below one
        # presence keeps the ratio finite and still decisive.
        spread = np.maximum(spread, 1e-9 * np.maximum(shift, 1e-30))
        mu = shift / spread
    else:
        if noise_multipliers is None:
            raise ValueError("Give `shift` (plain SGD) or `noise_multipliers` (the claim).")
        sigma = np.broadcast_to(np.asarray(noise_multipliers, np.float64), (steps,))[:, None]
        spread = np.maximum(spread, 1e-30)
        mu = signal / np.maximum(sigma, 1e-9)
    z = (observations - centre) / spread
    with np.errstate(divide="ignore"):
        absent = np.log1p(-rates)[:, None]
        present = np.log(rates)[:, None] + mu * z - 0.5 * mu * mu
    ratio = np.logaddexp(absent, present)
    ratio[~keep | (rates == 0)] = 0.0
    return ratio.sum(axis=0)


def _is_plain_sgd(optimizer) -> bool:
    return (
        type(optimizer) is keras.optimizers.SGD
        and float(optimizer.momentum) == 0.0
        and not optimizer.nesterov
        and not optimizer.weight_decay
        and not optimizer.use_ema
        and optimizer.clipnorm is None
        and optimizer.clipvalue is None
        and optimizer.global_clipnorm is None
    )


def _learning_rate_at(optimizer, step: int) -> float:
    rate = _keras_compat.optimizer_learning_rate(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or callable(rate):
        return float(keras.ops.convert_to_numpy(rate(step)))
    return float(keras.ops.convert_to_numpy(rate))


class CanaryClipping(ClippingStrategy):
    """A clipping strategy that records (and, for gradient canaries, injects) canaries.

    Wraps the strategy the run would use; the clipped sum it returns is the
    base strategy's plus, in the first micro-batch of each logical step, C
    times the unit vector of every included canary that the step samples.
    Pass it as `DPOptimizer(clipping=...)`; get it from
    `GradientCanaryAudit.clipping` or `InputCanaries.clipping`.

    Args:
        base: the wrapped strategy (a name or a `ClippingStrategy`).
        recorder: the audit's `WhiteBoxRecorder`.
        injector: the gradient canaries' injection, or None (record only).
    """

    name = "canary"

    def __init__(self, base: str | ClippingStrategy, recorder: WhiteBoxRecorder, injector=None):
        self.base = get_clipping_strategy(base) if isinstance(base, str) else base
        if not isinstance(self.base, ClippingStrategy):
            raise TypeError(f"`base` must be a strategy name or a ClippingStrategy, got {base!r}.")
        self.recorder = recorder
        self.injector = injector

    def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip):
        _check_single_replica()
        if model is not self.recorder.model:
            raise ValueError("This CanaryClipping audits another model.")
        batch = self.base.clip_and_sum(model, x, y, sample_weight, l2_norm_clip)
        step = tf.cast(model.optimizer.iterations, tf.int64)
        # Recorded before the optimizer applies this step's update (program
        # order inside the train step): theta_t, the start of step t.
        self.recorder.record(step)
        if self.injector is None:
            return batch
        return batch._replace(
            gradient_sum=self.injector.inject(model, batch.gradient_sum, step, l2_norm_clip))


class _Injector:
    """Adds the sampled gradient canaries of a step to its clipped sum, once per step."""

    def __init__(self, recorder: WhiteBoxRecorder, rates: np.ndarray, included: np.ndarray,
                 key: Sequence[int]):
        self.recorder = recorder
        self.rates = tf.constant(rates, tf.float32)
        memory = recorder._memory
        memory.included = tf.Variable(included, trainable=False, name="canary_included")
        memory.key = tf.Variable(np.asarray(key, np.int64), trainable=False, name="canary_key")
        memory.last_injected = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                           name="canary_last_step")

    def inject(self, model, gradient_sum, step, l2_norm_clip):
        memory = self.recorder._memory
        steps = self.recorder.num_steps
        due = tf.logical_and(step < steps, step > memory.last_injected.value())
        memory.last_injected.assign(tf.where(due, step, memory.last_injected.value()))
        rate = tf.gather(self.rates, tf.minimum(step, steps - 1))
        # The step's draw depends only on (key, step): secret, independent
        # across steps and canaries, like the sampler's draw of an example.
        uniform = tf.random.stateless_uniform(
            [self.recorder.num_canaries],
            seed=tf.random.experimental.stateless_fold_in(memory.key.value(), step),
        )
        present = tf.logical_and(memory.included.value(), uniform < rate)
        present = tf.logical_and(present, due)
        amount = tf.cast(present, tf.float32) * tf.cast(l2_norm_clip, tf.float32)
        gradient_sum = list(gradient_sum)
        for position, flat, ids in self.recorder.groups:
            gradient = gradient_sum[position]
            variable = model.trainable_variables[position]
            if gradient is None:
                raise PrivacyConfigurationError(
                    f"Gradient canaries are placed on {variable.path!r}, which the loss does "
                    "not reach: the DP step neither noises nor updates it, so canaries there "
                    "would be released without noise. Place them on a variable the loss reaches."
                )
            if isinstance(gradient, tf.IndexedSlices):  # e.g. an embedding's rows
                gradient = tf.convert_to_tensor(gradient)
            flat_gradient = tf.reshape(gradient, [-1])
            flat_gradient = tf.tensor_scatter_nd_add(
                flat_gradient, flat[:, None], tf.cast(tf.gather(amount, ids), gradient.dtype))
            gradient_sum[position] = tf.reshape(flat_gradient, tf.shape(gradient))
        return gradient_sum


def _schedule_rates(schedule: BatchSizeSchedule) -> np.ndarray:
    return np.array([schedule.sampling_rate(t) for t in range(schedule.total_steps)], np.float64)


def check_schedule(schedule) -> BatchSizeSchedule:
    """`schedule`, refused (TypeError) unless it is the run's `BatchSizeSchedule`."""
    if not isinstance(schedule, BatchSizeSchedule):
        raise TypeError(
            "The audit needs the run's BatchSizeSchedule (sampler.schedule of a tf_megadp "
            f"PoissonSampler): its q_t and B_t define the canaries' sampling. Got {schedule!r}."
        )
    return schedule


class WhiteBoxScoring:
    """Turns a recorder's observations into scores, using what the optimizer tells."""

    def __init__(self, recorder: WhiteBoxRecorder, schedule: BatchSizeSchedule, signal: float):
        self.recorder = recorder
        self.schedule = schedule
        self.signal = float(signal)

    def scores(self) -> tuple[np.ndarray, dict]:
        from tf_megadp.optimizer import DPOptimizer

        model = self.recorder.model
        optimizer = model.optimizer
        if not isinstance(optimizer, DPOptimizer):
            raise PrivacyConfigurationError(
                "The audited model is not compiled with a DPOptimizer: there is no DP step to audit."
            )
        if optimizer.adaptive_clipping is not None:
            raise PrivacyConfigurationError(
                "The white-box audit scores each step's update against lr * C / B and the "
                "gradient noise sigma * C, but this DPOptimizer clips adaptively (C moves "
                "every step, the gradient's noise is raised for the count): audit a run "
                "with a fixed C (adaptive_clipping=None).")
        if optimizer.schedule is not None and optimizer.schedule != self.schedule:
            raise PrivacyConfigurationError(
                "The DPOptimizer runs another schedule than the audit was planned for: the "
                "canaries' sampling rate would not be the examples'. Build both from sampler.schedule."
            )
        observations, observed = self.recorder.observations()
        steps = self.recorder.num_steps
        rates = _schedule_rates(self.schedule)[:steps]
        sigma = np.array([optimizer.noise_multiplier_at(t) for t in range(steps)])
        details = {"observed_steps": int(observed.sum()), "planned_steps": steps}
        shift = None
        divisor = None
        if optimizer.schedule is not None:
            divisor = np.array([float(self.schedule.phase_at(t).batch_size) for t in range(steps)])
        elif optimizer.normalize_by is not None:
            divisor = np.full(steps, float(optimizer.normalize_by))
        if divisor is not None and _is_plain_sgd(optimizer.inner_optimizer):
            learning_rate = np.array([_learning_rate_at(optimizer.inner_optimizer, t)
                                      for t in range(steps)])
            shift = learning_rate * optimizer.l2_norm_clip / divisor
            details["noise_scale"] = "measured (plain SGD: one presence moves lr * C / B)"
        else:
            details["noise_scale"] = ("claimed sigma (the inner optimizer is not plain SGD, or the "
                                     "divisor is not known)")
        scores = white_box_scores(observations, rates, shift=shift, noise_multipliers=sigma,
                                  signal=self.signal, observed=observed)
        return scores, details


class GradientCanaryAudit:
    """One-run white-box audit of the DP step with Dirac gradient canaries.

    Build it for the compiled-to-be model and the run's Poisson schedule,
    compile the `DPOptimizer` with `clipping=audit.clipping(...)`, train,
    then `audit.score()`. Each of the m canaries is included by a secret
    fair coin; an included canary joins each logical step with the step's
    sampling rate q_t and then adds C times its coordinate's unit vector to
    the clipped sum. The accountant's epsilon for the run therefore covers
    every canary exactly as it covers a real example, and the bound is set
    against it.

    Args:
        model: the model to be trained (built).
        schedule: the run's `BatchSizeSchedule` (`sampler.schedule`).
        coordinates: a `CanaryCoordinates`, or an int m to draw m random
            coordinates over all trainable variables.
        delta: the delta of the claim the bound is set against (the run's
            delta); the bound needs delta far below 1 / m.
        confidence: the bound's confidence.
        guesses: the (k_in, k_out) rules (default `one_run.default_guesses`).
        seed: None (OS entropy) or an int that makes coins and sampling
            reproducible: for tests only (warns), the bound then certifies
            nothing against whoever knows the seed.

    Example:
    ```python
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=10, epochs=5,
                                                   micro_batch_size=48)
    audit = tf_megadp.audit.GradientCanaryAudit(
        model, sampler.schedule, CanaryCoordinates.on_rows(kernel, range(8, 2008)), delta=1e-6)
    model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.SGD(0.5), 1.0, 0.8,
                  schedule=sampler.schedule, clipping=audit.clipping()), loss="mse")
    model.fit(sampler.as_dataset())
    audit.score().epsilon_lower_bound
    ```
    """

    kind = "white-box gradient canaries"

    def __init__(
        self,
        model: keras.Model,
        schedule: BatchSizeSchedule,
        coordinates: CanaryCoordinates | int,
        *,
        delta: float,
        confidence: float = 0.95,
        guesses: Sequence[tuple[int, int]] | None = None,
        seed: int | None = None,
    ):
        self.schedule = check_schedule(schedule)
        if isinstance(coordinates, int):
            coordinates = CanaryCoordinates.random(model, coordinates, seed=seed)
        self.coordinates = coordinates
        self.delta = float(delta)
        self.confidence = float(confidence)
        self.guesses = guesses
        self.coins = CanaryCoins(len(coordinates), seed=seed)
        self.recorder = WhiteBoxRecorder(model, coordinates, schedule.total_steps)
        key = ([secrets.randbits(63), secrets.randbits(63)] if seed is None
               else [seed + 1, 7919])
        self._injector = _Injector(self.recorder, _schedule_rates(schedule),
                                   self.coins._included(), key)
        self._scoring = WhiteBoxScoring(self.recorder, schedule, signal=1.0)
        self._strategy = None
        self.details: dict = {}

    def clipping(self, base: str | ClippingStrategy = "vectorized") -> CanaryClipping:
        """The strategy to compile the `DPOptimizer` with (one per audit).

        Args:
            base: the clipping strategy the run would use otherwise.

        Returns:
            A `CanaryClipping` wrapping `base`.
        """
        if self._strategy is not None:
            raise ValueError("This audit's clipping strategy was already made; reuse it.")
        self._strategy = CanaryClipping(base, self.recorder, self._injector)
        return self._strategy

    def scores(self) -> np.ndarray:
        """The canaries' scores from the recorded updates (the coins stay secret)."""
        scores, self.details = self._scoring.scores()
        return scores

    def score(self) -> OneRunResult:
        """Scores the canaries and returns the lower bound (once per audit)."""
        return self.coins.score(self.scores(), delta=self.delta, confidence=self.confidence,
                                guesses=self.guesses, kind=self.kind)

    def finish(self, model: keras.Model | None = None) -> dict[str, OneRunResult]:
        """`{"white_box": score()}`, the `AuditCallback(one_run=...)` protocol."""
        return {"white_box": self.score()}
