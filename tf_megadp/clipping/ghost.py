"""Ghost clipping: per-example gradient norms without per-example gradients.

The model runs ONCE on the whole micro-batch, with every layer intercepted by
a rule of `tf_megadp.clipping.ghost_rules`. One backward pass of the summed
per-example losses gives each layer's output gradients; from those and the
recorded layer inputs, each example's squared gradient norm is assembled
variable by variable (Gram forms, no per-example gradient of a large matrix
is ever built), the clip factors c_i follow, and the clipped sum of each
variable is formed directly as sum_i c_i * (per-example gradient) from the
same records ("book-keeping": no second backward pass).

For a variable with several records (a layer called twice, or the tied
input/output embedding of a masked LM), the per-example gradient is the sum
of the records and its squared norm includes every cross term.
"""

from __future__ import annotations

import contextlib
import secrets
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_megadp import _keras_compat
from tf_megadp.clipping import base, independence, loss_rules, units
from tf_megadp.clipping.verdicts import FitVerdicts
from tf_megadp.clipping.ghost_rules import plan_rules
from tf_megadp.clipping.rules import ReadCheckingScope, Recorder
from tf_megadp.clipping.terms import squared_norm_of_sum
from tf_megadp.errors import GhostClippingUnsupportedError

__all__ = ["GhostClipping", "gradient_records"]


class GhostClipping(base.ClippingStrategy):
    """Clips per-example gradients using ghost norms and book-keeping.

    Args:
        fallback: "small" (the `clipping="ghost"` strategy): layers without a
            ghost-norm rule are accepted only if they are small normalization
            layers, whose per-example gradients are materialised; anything else
            raises. "any" (`clipping="auto"`): every layer without a rule gets
            exact per-example gradients for its own variables only.
        jit_compile: compile the step with XLA (default True).
        recheck_probability: after a signature's first check, each call
            runs the forward check again with this probability, decided by a
            secret in-memory key (so that data, crafted or not, cannot time
            mixing to the steps that are not checked).

    Example:
    ```python
    strategy = GhostClipping()
    batch = strategy.clip_and_sum(model, x, y, sample_weight, l2_norm_clip=1.0)
    batch.norms  # equal to VectorizedClipping's per-example norms
    ```
    """

    name = "ghost"

    def __init__(self, fallback: str = "small", jit_compile: bool = True,
                 recheck_probability: float = independence.RECHECK_PROBABILITY):
        if fallback not in ("small", "any"):
            raise ValueError(f"fallback must be 'small' or 'any', got {fallback!r}.")
        if not 0.0 <= recheck_probability <= 1.0:
            raise ValueError(
                f"recheck_probability must be in [0, 1], got {recheck_probability!r}.")
        self.fallback = fallback
        self.jit_compile = jit_compile
        self.recheck_probability = float(recheck_probability)
        self._functions = weakref.WeakKeyDictionary()
        self._checked = weakref.WeakKeyDictionary()
        self._fits = weakref.WeakKeyDictionary()

    def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip,
                     automatic_stability=None, examples_per_unit=1, loss_scale=None):
        """See `ClippingStrategy.clip_and_sum`.

        Raises:
            PrivacyConfigurationError: the model has a layer ghost clipping
                cannot attribute to examples, or its batched pass mixes
                examples: checked on the first call of every traced input
                signature (again after `reset_checks`: a private `fit` on
                other data, model or state, `begin_fit`), forward and
                backward, before that call releases anything, and on secret
                random calls after that, forward only
                (`_CheckedSignatures`). Called eagerly, the
                error is raised here. Inside a traced step (`fit`), a failed
                check zeroes the micro-batch's contribution, returns its code
                in `ClippedBatch.mixing`, and asserts; XLA drops assertions,
                so a step compiled whole with XLA must read `mixing` itself
                (`independence.mixing_error`).
        """
        function = self._functions.get(model)
        if function is None:
            rules = plan_rules(model, self.fallback)
            _check_no_regularizers(model)
            if self.jit_compile:
                base.refuse_layers_without_xla(model)

            def clip_and_sum(x, y, sample_weight, l2_norm_clip, automatic_stability, mixing,
                             examples_per_unit=1, loss_scale=None):
                return _clip_and_sum(model, rules, x, y, sample_weight, l2_norm_clip,
                                     automatic_stability, mixing=mixing,
                                     examples_per_unit=examples_per_unit,
                                     loss_scale=loss_scale)

            def check(x):
                return _independence_code(model, rules, x, vectorize=self.jit_compile)

            def check_gradients(x, y, sample_weight, rows_seed, loss_scale=None):
                return _gradient_norm_code(model, rules, x, y, sample_weight, rows_seed,
                                           loss_scale)

            # Compiled as the step is: some layers run only under XLA on a CPU
            # (a channels_first convolution). autograph=False: the passes build
            # their graphs with explicit tf.cond and need no conversion, which
            # cost ~6 s of CPU in every new process (451 functions of a pico
            # BERT's pass).
            function = tuple(
                tf.function(f, jit_compile=self.jit_compile, autograph=False)
                for f in (clip_and_sum, check, check_gradients))
            self._functions[model] = function
            self._checked[model] = _CheckedSignatures(self.recheck_probability)
        units.check_unit_layout(tf.nest.flatten(x)[0].shape[0], examples_per_unit)
        step, check, check_gradients = function
        checked = self._checked[model]
        slot = checked.slot((x, y, sample_weight, automatic_stability))
        first, again, rows_seed = checked.due(slot)
        ok = lambda: tf.constant(independence.MIXING_OK, tf.int32)  # noqa: E731

        def full_check():
            code = check(x)
            return tf.cond(tf.equal(code, independence.MIXING_OK),
                           lambda: check_gradients(x, y, sample_weight, rows_seed,
                                                   loss_scale),
                           lambda: code)

        # The checks are their own compiled functions, run before the step
        # and finished when the step starts: their per-example passes never
        # hold memory beside the step's records (0.8 GB at BERT-mini, m = 256).
        mixing = tf.cond(first, full_check, lambda: tf.cond(again, lambda: check(x), ok))
        batch = step(x, y, sample_weight, _as_float64(l2_norm_clip), automatic_stability, mixing,
                     examples_per_unit, loss_scale)
        checked.record(slot, batch.mixing)
        if tf.executing_eagerly():
            if int(batch.mixing) != independence.MIXING_OK:
                code = self.locate_mixing(model, x, y, sample_weight)
                if code == independence.MIXING_OK:  # e.g. randomness that differs per call
                    code = int(batch.mixing)
                raise independence.mixing_error(model, code, self.name)
        else:
            # Outside the XLA function, where assertions still run, unless the
            # caller's own step is compiled with XLA too.
            tf.debugging.Assert(
                tf.equal(batch.mixing, independence.MIXING_OK),
                [independence.ASSERTION_MARKER, batch.mixing])
        return batch


    def reset_checks(self, model) -> None:
        """Makes the next call of every signature of `model` check again, forward and backward.

        `begin_fit` calls it unless nothing that can change mixing changed
        since the last fit; a `PrivateStep.begin` calls it always.
        """
        checked = self._checked.get(model)
        if checked is not None:
            checked.reset()
        if model in self._fits:
            self._fits[model].forget()

    def begin_fit(self, model, data: bytes | None) -> bool:
        """At a private fit's start: keeps the last fit's verdicts, or resets them.

        Kept only when the last fit of `model` returned and its layers, the
        variables its traced passes read and the data (`data`:
        `fit_inputs.data_identity`) did not change since (`verdicts`).

        Returns:
            Whether the verdicts were kept.
        """
        kept = self._fits.setdefault(model, FitVerdicts()).begin(
            model, self._functions.get(model, ()), data)
        if not kept:
            self.reset_checks(model)
        return kept

    def end_fit(self, model) -> None:
        """A private fit returned: records what its verdicts stand for."""
        if model in self._fits:
            self._fits[model].end(model, self._functions.get(model, ()))

    def locate_mixing(self, model, x, y=None, sample_weight=None) -> int:
        """Runs the full independence check on one batch (eagerly, no XLA).

        Every tapped tensor is compared, not only the model's outputs, so the
        code names the first layer whose output (or input) differs between
        the micro-batch and an example run alone. Called after a failed
        check; `independence.mixing_error(model, code)` words it.

        Returns:
            `independence.MIXING_OK` (-1) or the code of the first difference.
        """
        rules = plan_rules(model, self.fallback)

        @tf.function
        def locate(x):
            return _independence_code(model, rules, x, locate=True, vectorize=False)

        return int(locate(x))


def _as_float64(value) -> tf.Tensor:
    """C in float64 (a float64 model clips at C, not at C rounded to float32).

    `tf.cast` of a Python float would first make it a float32 tensor.
    """
    if isinstance(value, (int, float, np.floating, np.integer)):
        return tf.constant(value, tf.float64)
    return tf.cast(value, tf.float64)


class _CheckedSignatures:
    """When one model's step runs the independence checks.

    Whether a model mixes examples is mostly a property of its traced
    computation, so the full check (forward, then the per-example gradient
    norms against each example's own backward pass) runs on the first call
    of each traced signature, and again on the first call after `reset`
    (a private `fit` whose data, model or state changed: `verdicts`). A
    model can also mix only on some data (a threshold, capacity-limited
    routing), which a first call with ordinary data does not show; so
    every later call also runs the forward check with probability
    `probability`, decided by Philox draws from a secret key held in memory
    (drawn from OS entropy): neither the data nor anyone who reads the code
    can tell which calls are checked. Fail
    closed: the flag of a signature is set only by a call whose check
    passed, in the same step that released its clipped sum, and a call
    whose check failed has already zeroed its micro-batch.

    A slot is one flag. Called eagerly, a slot belongs to an input signature
    (shapes, dtypes, automatic clipping's gamma), which is what makes the
    `tf.function` retrace. Called while a caller's step is traced (`fit`),
    every call site gets its own slot at trace time, so a retraced step, a
    new shape or each replica of a distributed step starts unchecked. Past
    `CAPACITY` slots, every call is checked.

    Args:
        probability: the chance of a forward check on each later call.
    """

    CAPACITY = 1024

    def __init__(self, probability: float):
        # Plain resource variables, created outside any trace or
        # distribution strategy: bookkeeping of this strategy, not model
        # state, and never saved (the key must not be).
        with tf.init_scope():
            self.passed = _keras_compat.plain_resource_variable(
                tf.zeros([self.CAPACITY], tf.int32), trainable=False,
                name="independence_checked")
            self._key = _keras_compat.plain_resource_variable(
                [secrets.randbits(63), secrets.randbits(63)], dtype=tf.int64,
                trainable=False, name="independence_recheck_key")
            self._calls = _keras_compat.plain_resource_variable(
                tf.constant(0, tf.int64), trainable=False, name="independence_calls")
        self.probability = probability
        self._eager_slots = {}
        self._used = 0

    def __repr__(self) -> str:
        return f"<independence checks: {self._used} slots, recheck p={self.probability:g}>"

    def slot(self, inputs) -> int:
        """The flag index for this call, or -1 (always check)."""
        if tf.executing_eagerly():
            signature = tuple(
                (tuple(leaf.shape), str(leaf.dtype)) if hasattr(leaf, "shape") else repr(leaf)
                for leaf in tf.nest.flatten(inputs))
            if signature not in self._eager_slots:
                self._eager_slots[signature] = self._new_slot()
            return self._eager_slots[signature]
        return self._new_slot()

    def _new_slot(self) -> int:
        slot = self._used if self._used < self.CAPACITY else -1
        self._used += 1
        return slot

    def due(self, slot: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """What this call checks.

        Returns:
            (the full check is due, a forward recheck is drawn: bool tensors;
            the secret seed that picks the examples of the backward check).
        """
        first = tf.constant(True) if slot < 0 else tf.equal(self.passed[slot], 0)
        count = self._calls.assign_add(1, read_value=True)
        draw_seed, rows_seed = tf.unstack(tf.random.experimental.stateless_split(
            tf.random.experimental.stateless_fold_in(self._key, count), 2))
        return first, tf.random.stateless_uniform([], seed=draw_seed) < self.probability, rows_seed

    def record(self, slot: int, mixing) -> None:
        """Sets the slot's flag to whether this call's check passed (or was skipped)."""
        if slot >= 0:
            self.passed.scatter_nd_update(
                [[slot]], [tf.cast(tf.equal(mixing, independence.MIXING_OK), tf.int32)])

    def reset(self) -> None:
        """Every slot checks again, fully, on its next call."""
        self.passed.assign(tf.zeros_like(self.passed))


def _check_no_regularizers(model):
    # A weight regularizer's gradient reaches the variables directly, not
    # through any layer output, so no rule would see it.
    regularized = [v.path for v in model.trainable_variables if v.regularizer is not None]
    regularized += [layer.name for layer in _keras_compat.flatten_layers(model)
                    if getattr(layer, "activity_regularizer", None) is not None]
    if regularized:
        raise GhostClippingUnsupportedError(
            f"Ghost clipping does not support regularizers ({regularized}). "
            "Use weight decay on the inner optimizer, or clipping='vectorized'."
        )


def _forward(model, rules, x, y, sample_weight, apply_seed_updates=True, loss_scale=None):
    """The recorded forward pass.

    Args:
        apply_seed_updates: advance the dropout seeds (the step does; a
            check, which must leave no trace, does not).
        loss_scale: None, or the fixed loss scale of float16 compute: the
            backward pass carries each example's scaled loss, and every
            gradient it gives the rules (output gradients, per-example
            gradients of fallback layers) is unscaled in float32 before a
            rule reads it, so the records, Gram forms and norms are those of
            the unscaled gradients.

    Returns:
        (records, batch axes ok, losses, y_pred).
    """
    leading = tf.nest.flatten(x)[0]
    batch_size = tf.shape(leading)[0]
    # The values every forward pass of this step reads, taken once, up front.
    values = [(v, tf.convert_to_tensor(v.value)) for v in model.trainable_variables]
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        recorder = Recorder(tape, batch_size, model.trainable_variables,
                            static_batch_size=leading.shape[0])
        scope = ReadCheckingScope(recorder, state_mapping=values)
        with contextlib.ExitStack() as stack:
            for rule in rules:
                stack.enter_context(rule.installed(recorder))
            with scope:
                if _keras_compat.call_has_training_arg(model):
                    y_pred = model(x, training=True)
                else:
                    y_pred = model(x)
        if scope.losses:
            raise GhostClippingUnsupportedError(
                "The model adds losses with add_loss(); ghost clipping cannot "
                "attribute them to examples. Use clipping='vectorized'."
            )
        if apply_seed_updates:
            _keep_only_seed_updates(model, scope)
    # Each example's loss gradient with respect to its own predictions comes
    # from a per-example pass; one backward pass of the model then carries
    # all of them. (Differentiating through `vectorized_map` instead makes
    # XLA treat inputs and weights as compile-time constants: a recompilation
    # at every step.)
    losses, loss_gradients = _per_example_losses(model, x, y, y_pred, sample_weight, loss_scale)
    gradients = tape.gradient(
        tf.nest.flatten(y_pred), recorder.watched, output_gradients=loss_gradients
    )
    records = recorder.terms([base.unscaled_gradient(g, loss_scale) for g in gradients])
    if recorder.violations:
        raise GhostClippingUnsupportedError(
            f"Trainable variables {sorted(set(recorder.violations))} are read "
            "outside the layer that owns them (e.g. a custom layer using "
            "another layer's weights directly); ghost clipping would miss "
            "that use. Use clipping='vectorized'."
        )
    return records, recorder.batch_axes_consistent(), losses, y_pred


def _independence_code(model, rules, x, locate=False, vectorize=True) -> tf.Tensor:
    """The independence check of the batched forward pass (`independence`).

    Its own batched forward pass, every layer tapped, then the per-example
    pass compared with it. Both run in a `StatelessScope`: the dropout seeds
    the check draws from are not advanced, so the training step that
    follows draws exactly the masks it would have drawn without the check.
    The batched pass is the same computation as the step's recorded one
    (the rules only read tensors and split activations off), so whether it
    treats examples independently is the step's answer too. `vectorize`:
    see `independence.check_independence`.

    Returns:
        int32 scalar: `independence.MIXING_OK` or the code of the difference.
    """
    leading = tf.nest.flatten(x)[0]
    trainable = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    states = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    mapping = list(zip(model.trainable_variables, trainable))
    mapping += list(zip(model.non_trainable_variables, states))
    taps = independence.LayerTaps(model, None, leading.shape[0])
    with base.example_axis_guards(model), base.secret_seed_draws(model):
        with taps.installed(), keras.StatelessScope(state_mapping=mapping):
            if _keras_compat.call_has_training_arg(model):
                model(x, training=True)
            else:
                model(x)
        return independence.check_independence(
            model, taps, x, trainable, states, tf.shape(leading)[0],
            rule_layers={id(rule.layer) for rule in rules}, locate=locate, vectorize=vectorize)


def _gradient_norm_code(model, rules, x, y, sample_weight, rows_seed,
                        loss_scale=None) -> tf.Tensor:
    """Compares the batched pass's ghost norms with examples' own backward passes.

    The forward check (`_independence_code`) cannot see a layer that mixes
    examples in the backward pass only: `x + k * (mean - stop_gradient(mean))`
    over the batch leaves every output unchanged and sends k / m of every
    example's gradient to the others (1.64 C at k = 16). Here the gradient
    norms of `independence.BACKWARD_CHECK_EXAMPLES` examples, picked by the
    secret `rows_seed`, are computed alone, one example at a time (the
    memory of one example's gradients, as `vectorized` would with a batch
    of one), and compared with the norms the step's records give them.
    Mixing in the backward pass changes every norm it reaches, so a few
    examples show it, at a cost that does not grow with m. Element-wise
    random layers (Dropout, GaussianNoise, ...) are the identity in both
    passes, so that both see the same computation; other random layers
    were already refused by the forward check. With a `loss_scale` both
    passes scale each loss alike and unscale in float32, so that the same
    examples overflow.

    Returns:
        int32 scalar: `independence.MIXING_OK` or `independence.BACKWARD_MIXES`.
    """
    variables = model.trainable_variables
    trainable = [tf.convert_to_tensor(v.value) for v in variables]
    states = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    with base.example_axis_guards(model), base.secret_seed_draws(model), \
            independence.without_elementwise_randomness(model):
        records, _, losses, _ = _forward(model, rules, x, y, sample_weight,
                                         apply_seed_updates=False, loss_scale=loss_scale)
        groups = _grouped(records, variables)
        squared = [tf.cast(squared_norm_of_sum(groups[i]), tf.float64) for i in sorted(groups)]
        batched = (tf.sqrt(tf.maximum(tf.add_n(squared), 0.0)) if squared
                   else tf.zeros(tf.shape(losses), tf.float64))
        examples = tf.argsort(tf.random.stateless_uniform(tf.shape(losses), rows_seed))
        examples = examples[:independence.BACKWARD_CHECK_EXAMPLES]
        batched = tf.gather(batched, examples)
        elements = {"x": x}
        if y is not None:
            elements["y"] = y
        if sample_weight is not None:
            elements["sample_weight"] = sample_weight
        elements = tf.nest.map_structure(lambda t: tf.gather(t, examples), elements)

        def alone(e):
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                loss, _ = base.stateless_loss(
                    model, trainable, states, base.add_batch_axis(e["x"]),
                    base.add_batch_axis(e.get("y")), base.add_batch_axis(e.get("sample_weight")))
                # The same scaling as the step's, so that the same examples overflow.
                loss = base.scaled_loss(loss, loss_scale)
            gradients = [base.unscaled_gradient(base.dense_gradient(g), loss_scale)
                         for g in tape.gradient(loss, trainable)]
            return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float64)))
                                     for g in gradients if g is not None]))

        reference = tf.map_fn(alone, elements, fn_output_signature=tf.float64)
    # Compared at 16-bit precision for a 16-bit model, whose two passes round
    # differently (rows_differ then allows HALF_RTOL), in bfloat16's range:
    # a norm above float16's largest, 65504, would otherwise be inf in one
    # pass and finite in the other.
    compute = keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)
    if compute in ("float16", "bfloat16"):
        batched, reference = tf.cast(batched, tf.bfloat16), tf.cast(reference, tf.bfloat16)
    if compute == "float16":
        # An example alone forms its weight gradients in float16, which
        # overflow sooner than the float32 Gram forms of its records (one
        # crafted example did, and stopped the run as "mixing"); its row says
        # nothing about mixing, and the step clips it from its own records.
        batched = tf.where(tf.math.is_finite(reference), batched, reference)
    return tf.where(independence.rows_differ(batched, reference),
                    tf.constant(independence.BACKWARD_MIXES, tf.int32),
                    tf.constant(independence.MIXING_OK, tf.int32))


def _keep_only_seed_updates(model, scope):
    """Applies the dropout-seed updates the forward pass made; discards the rest.

    The scope held back every state update. Seeds must advance (a new
    dropout mask per step). Any other non-trainable variable a layer writes
    in `call` (a running batch mean) would be computed from the whole
    micro-batch and stored in the model, unclipped and unnoised; it is
    dropped, as `VectorizedClipping` drops it, and the user is told once.
    """
    discarded = []
    for variable in model.non_trainable_variables:
        value = scope.updated_value(variable)
        if value is None:
            continue
        if base.is_seed_state(variable):
            variable.assign(value)
        else:
            discarded.append(variable.path)
    if discarded:
        warnings.warn(
            f"Non-trainable variables {discarded} are written during the forward pass "
            "(statistics of the batch); the DP step discards these writes, because a "
            "value computed from the micro-batch and kept in the model would bypass "
            "clipping and noise. They keep their values from before training.",
            stacklevel=3,
        )


def _per_example_losses(model, x, y, y_pred, sample_weight, loss_scale=None):
    """(losses [m], d (S loss_i) / d y_pred_i for every leaf of y_pred; S = 1 without a scale).

    Batched where a loss rule vouches for the model's loss
    (`loss_rules.batched_losses`: each example's loss reads its own row
    only, so the gradient of their sum is every example's own); else one
    `compute_loss` per example under `vectorized_map`.
    """
    with tf.GradientTape() as tape:
        tape.watch(y_pred)
        losses = loss_rules.batched_losses(model, y, y_pred, sample_weight)
        if losses is not None:
            total = tf.reduce_sum(base.scaled_loss(losses, loss_scale))
    if losses is not None:
        return losses, [tape.gradient(total, y_pred)]
    elements = {"x": x, "y_pred": y_pred}
    if y is not None:
        elements["y"] = y
    if sample_weight is not None:
        elements["sample_weight"] = sample_weight

    def one_example(e):
        y_pred_i = base.add_batch_axis(e["y_pred"])
        with tf.GradientTape() as tape:
            tape.watch(y_pred_i)
            loss = base.per_example_loss(
                model,
                base.add_batch_axis(e["x"]),
                base.add_batch_axis(e.get("y")),
                y_pred_i,
                base.add_batch_axis(e.get("sample_weight")),
            )
            scaled = base.scaled_loss(loss, loss_scale)
        leaves = tf.nest.flatten(y_pred_i)
        gradients = tape.gradient(scaled, leaves)
        gradients = [tf.zeros_like(t) if g is None else g for g, t in zip(gradients, leaves)]
        return loss, [g[0] for g in gradients]

    return tf.vectorized_map(one_example, elements)


def _grouped(records, variables):
    """Per trainable-variable index: its terms, one per kind (several calls merged)."""
    index = {id(v): i for i, v in enumerate(variables)}
    groups = {}
    for variable, term in records:
        if id(variable) not in index:
            raise TypeError(f"A ghost rule recorded a term for {variable!r}, which is not a "
                            "variable of the model; record the variable itself.")
        groups.setdefault(index[id(variable)], {}).setdefault(type(term), []).append(term)
    return {i: [kind.merged(terms) if len(terms) > 1 else terms[0]
                for kind, terms in kinds.items()]
            for i, kinds in groups.items()}


def _clipped_sum(terms, factors, keep, variable):
    """sum_i c_i * g_i for one variable, from its terms."""
    total = tf.add_n([term.clipped_sum(factors, keep) for term in terms])
    return tf.cast(tf.reshape(total, variable.shape), variable.dtype)


def gradient_records(model: keras.Model, rules, x, y, sample_weight, loss_scale=None):
    """The step's recorded pass: each trainable variable's per-example gradient terms.

    The forward and backward pass that ghost clipping runs once per
    micro-batch, before any norm: what its records cost alone is the first
    phase of `benchmarks/step_profile.py`. Advances the dropout seeds, as the
    step does.

    Args:
        model: the model, built.
        rules: `tf_megadp.clipping.ghost_rules.plan_rules(model, fallback)`.
        x, y, sample_weight: one micro-batch.
        loss_scale: as `clip_and_sum`'s.

    Returns:
        (groups, consistent, losses, y_pred): `groups` maps the index of a
        trainable variable to its terms (`tf_megadp.clipping.Term`, at most
        one per kind); `consistent` is whether every layer kept the example
        axis first; `losses` the per-example losses.
    """
    with base.example_axis_guards(model), base.secret_seed_draws(model):
        records, consistent, losses, y_pred = _forward(model, rules, x, y, sample_weight,
                                                       loss_scale=loss_scale)
    return _grouped(records, model.trainable_variables), consistent, losses, y_pred


def _clip_and_sum(model, rules, x, y, sample_weight, l2_norm_clip,
                  automatic_stability=None, *, mixing, examples_per_unit=1, loss_scale=None):
    groups, consistent, losses, y_pred = gradient_records(model, rules, x, y, sample_weight,
                                                          loss_scale)
    variables = model.trainable_variables
    batch_size = tf.shape(losses)[0]
    # The squared norm of each privacy unit's summed gradient (each example's
    # when a unit is one example), cross terms between its examples included.
    k = examples_per_unit
    squared = [squared_norm_of_sum([units.regrouped(term, k) for term in groups[i]])
               for i in sorted(groups)]
    _check_one_norm_per_example(squared, losses, [variables[i] for i in sorted(groups)], k)
    # float64 models clip in float64 (every term of a float64 variable is).
    dtype = tf.float64 if any(s.dtype == tf.float64 for s in squared) else tf.float32
    # A failed independence check gives every example a NaN norm: the
    # micro-batch then adds nothing (its examples count as non-finite).
    independent = tf.logical_and(consistent, tf.equal(mixing, independence.MIXING_OK))
    if squared:
        squared = tf.add_n([tf.cast(s, dtype) for s in squared])
        # Gram forms can round a zero norm to a tiny negative; keep NaN as NaN.
        norms = units.unit_rows(
            tf.sqrt(tf.where(squared < 0.0, tf.zeros_like(squared), squared)), k)
    else:
        norms = tf.zeros([batch_size], dtype)
    norms = tf.where(independent, norms, tf.fill(tf.shape(norms), tf.constant(float("nan"), dtype)))
    is_real = base.example_weights_present(sample_weight, batch_size)
    factors, nonfinite = base.clip_factors(norms, l2_norm_clip, is_real, automatic_stability)
    # Only rows with a non-finite norm need zeroing before the sums (0 * NaN
    # is NaN): padding has factor 0 and, with a finite norm, finite
    # gradients, so it needs no pass of its own.
    keep = tf.math.is_finite(norms)
    gradient_sum = [
        _clipped_sum(groups[i], factors, keep, v) if i in groups else None
        for i, v in enumerate(variables)
    ]
    return base.clipped_batch(gradient_sum, losses, y_pred, norms, is_real, nonfinite,
                              mixing=mixing)


def _check_one_norm_per_example(squared, losses, variables, examples_per_unit=1):
    """Every variable's norms must have one entry per example (m), or per unit (m / k)."""
    expected = None if losses.shape[0] is None else losses.shape[0] // examples_per_unit
    for norms, variable in zip(squared, variables):
        if not norms.shape.is_compatible_with([expected]):
            raise GhostClippingUnsupportedError(
                f"The per-example gradient records of {variable.path} have "
                f"{norms.shape[0]} rows, not one per example ({expected}): the layer "
                "owning it ran on a tensor whose first axis is not the example axis. "
                "Use clipping='vectorized', or keep the example axis first."
            )
