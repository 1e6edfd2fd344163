"""Specification of float16 compute under DP (`tf_megadp.training.loss_scaling`).

Under `mixed_float16` each example's loss is scaled by the `DPOptimizer`'s
fixed `loss_scale` and its gradient unscaled in float32 before its norm. The
attack: Keras's own `LossScaleOptimizer` skips a whole step when any example
overflows, so one crafted example decides whether everybody's update is
applied. Here that example contributes zero, as one example's own outcome,
and the others' update is the clipped sum a float32 per-example reference
gives them; an example whose own float16 weight gradients overflow while its
ghost records do not moves the sum by at most C, and stops nothing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_megadp
from tests import reference
from tf_megadp import PrivacyConfigurationError

pytestmark = [
    pytest.mark.filterwarnings("ignore:DPOptimizer\\(seed="),
    pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:.*fixed-size batches, not Poisson draws"),
]

CLIP = 2.0  # Clips the first two examples (norms 3.8, 2.3), not the third (1.5).
SCALE = 2.0**10
# Every example's target is a normal draw but the crafted one's: its loss
# gradient (2 x 3e4 x SCALE) overflows float16 (max 65504) in the backward
# pass of the float16 hidden layer, and is finite in float32.
CRAFTED_TARGET = 3e4


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _dense(activation="tanh"):
    """Float16 hidden layer, float32 output (as Keras's mixed precision guide keeps logits)."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation=activation),
                             keras.layers.Dense(2, dtype="float32")])


def _float32_twin(model, activation="tanh"):
    """The same architecture and weights in float32: the reference's model."""
    keras.mixed_precision.set_global_policy("float32")
    try:
        twin = _dense(activation)
    finally:
        keras.mixed_precision.set_global_policy("mixed_float16")
    twin.set_weights(model.get_weights())
    return twin


def _dp_optimizer(**kwargs):
    return tf_megadp.DPOptimizer(keras.optimizers.SGD(1.0), l2_norm_clip=CLIP,
                                 noise_multiplier=0.0, seed=0, **kwargs)


def _examples(n=4):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


class TestKerasLossScaleOptimizer:
    """`model.compile` wraps a mixed_float16 model's optimizer; the private model unwraps it."""

    @pytest.mark.parametrize("order", ["make_private_first", "compile_first"])
    def test_the_wrapper_is_replaced_by_the_dp_optimizer_with_its_initial_scale(
            self, mixed_float16, order):
        model = _dense()
        optimizer = _dp_optimizer()
        if order == "make_private_first":
            tf_megadp.make_private(model)
        model.compile(optimizer=optimizer, loss="mse")
        if order == "compile_first":
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            tf_megadp.make_private(model)
        assert model.optimizer is optimizer
        assert optimizer.loss_scale == 2.0**15  # Keras's initial_scale, now fixed.
        assert optimizer.get_config()["loss_scale"] == 2.0**15

    def test_a_given_loss_scale_is_kept_and_a_second_one_refused(self, mixed_float16):
        model = tf_megadp.make_private(_dense())
        optimizer = _dp_optimizer(loss_scale=SCALE)
        model.compile(optimizer=optimizer, loss="mse")  # Keras's default wrapper: dropped.
        assert model.optimizer is optimizer and optimizer.loss_scale == SCALE
        explicit = keras.optimizers.LossScaleOptimizer(_dp_optimizer(), initial_scale=64.0)
        model.compile(optimizer=explicit, loss="mse")
        assert model.optimizer.loss_scale == 64.0
        with pytest.raises(PrivacyConfigurationError, match="pass it once"):
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                _dp_optimizer(loss_scale=SCALE), initial_scale=64.0), loss="mse")

    def test_a_wrapped_dp_optimizer_of_a_model_not_made_private_names_the_fix(
            self, mixed_float16):
        model = _dense()
        model.compile(optimizer=_dp_optimizer(), loss="mse")
        with pytest.raises(PrivacyConfigurationError, match="make_private"):
            tf_megadp.model_ledger(model)

    def test_a_saved_model_loads_its_dp_optimizer_and_ledger_unwrapped(
            self, mixed_float16, tmp_path):
        # Keras saves compile's arguments but not auto_scale_loss: loading
        # wrapped the saved DPOptimizer again, and its state (the ledger)
        # could not load into the wrapper.
        x, y = _examples()
        model = tf_megadp.make_private(_dense())
        model.compile(optimizer=_dp_optimizer(loss_scale=SCALE, clipping="vectorized"),
                      loss="mse")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        model.save(tmp_path / "model.keras")
        loaded = keras.models.load_model(tmp_path / "model.keras")
        assert isinstance(loaded.optimizer, tf_megadp.DPOptimizer)
        assert loaded.optimizer.loss_scale == SCALE
        assert tf_megadp.model_ledger(tf_megadp.make_private(loaded)).total_steps == 1

    @pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), "big"])
    def test_a_loss_scale_must_be_a_finite_positive_number(self, value):
        with pytest.raises(ValueError, match="loss_scale"):
            _dp_optimizer(loss_scale=value)

    def test_a_custom_strategy_must_take_the_loss_scale(self):
        class Unscaled(tf_megadp.ClippingStrategy):
            def clip_and_sum(self, model, x, y, sample_weight, l2_norm_clip):
                raise AssertionError("never called")

        with pytest.raises(TypeError, match="accepts `loss_scale`"):
            _dp_optimizer(clipping=Unscaled(), loss_scale=SCALE)
        _dp_optimizer(clipping=Unscaled())  # Never passed the keyword without a scale.


# Ghost without XLA (its three compiled passes cost 13 s here): the same
# arithmetic; the slow BERT test below runs it compiled.
@pytest.mark.parametrize("clipping", [
    "vectorized", pytest.param(lambda: tf_megadp.GhostClipping(jit_compile=False), id="ghost")])
def test_an_example_that_overflows_contributes_zero_and_the_others_update_is_applied(
        mixed_float16, clipping):
    x, y = _examples()
    y[3] = CRAFTED_TARGET
    model = tf_megadp.make_private(_dense())
    clipping = clipping if isinstance(clipping, str) else clipping()
    model.compile(optimizer=_dp_optimizer(loss_scale=SCALE, clipping=clipping), loss="mse")
    twin = _float32_twin(model)
    before = reference.weights(model)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    update = [after - b for after, b in zip(reference.weights(model), before)]
    # The float32 reference of the three others alone, divided by the step's B = 4.
    others = reference.naive_clipped_update(twin, keras.losses.MeanSquaredError(),
                                            x[:3], y[:3], CLIP, 4)
    assert int(model.optimizer.nonfinite_examples.value) == 1
    for got, expected in zip(update, others):
        # float16 compute: about 1e-3 of the update (measured 3e-5 on 5e-2..2e-1).
        np.testing.assert_allclose(got, expected, atol=2e-3 * np.max(np.abs(expected)) + 1e-4)
    # One step is one step of the ledger, overflow or not.
    assert int(model.optimizer.iterations.numpy()) == 1
    assert tf_megadp.model_ledger(model).total_steps == 1


@pytest.mark.parametrize("clipping", [
    "vectorized", pytest.param(lambda: tf_megadp.GhostClipping(jit_compile=False), id="ghost")])
def test_an_example_whose_own_weight_gradients_overflow_moves_the_sum_by_at_most_c(
        mixed_float16, clipping):
    # A linear hidden layer and an input of 300: the example's float16 weight
    # gradient (300 x its scaled output gradient) overflows, while its ghost
    # records (the input, the output gradient) and their float32 Gram forms
    # do not. Vectorized drops it; ghost clips it from its records. Before,
    # ghost's backward independence check compared its finite norm with the
    # example's own overflowing pass and stopped the run as "mixing".
    x, y = _examples()
    model = tf_megadp.make_private(_dense(activation=None))
    clipping = clipping if isinstance(clipping, str) else clipping()
    model.compile(optimizer=_dp_optimizer(loss_scale=SCALE, clipping=clipping), loss="mse")
    x[3] = 300.0
    y[3] = np.asarray(model(x[3:4]))[0] + 1.0
    twin = _float32_twin(model, activation=None)
    before = reference.weights(model)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    # The un-noised sum (B = 4, SGD(1)) less the float32 reference of the others.
    summed = -4 * reference.flat([a - b for a, b in zip(reference.weights(model), before)])
    others = -4 * reference.flat(reference.naive_clipped_update(
        twin, keras.losses.MeanSquaredError(), x[:3], y[:3], CLIP, 4))
    assert np.linalg.norm(summed - others) <= CLIP * 1.01
    assert int(model.optimizer.iterations.numpy()) == 1


def test_the_loss_scale_keeps_small_float16_gradients_exact(mixed_float16):
    # A loss of 1e-6 x mse: its float16 output gradients lie near 6e-8, the
    # smallest float16, and mostly flush to zero unscaled. Scaled by 2^15
    # (and unscaled in float32) the clipped sum is the float32 one.
    x, y = _examples()

    class TinyLoss(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return 1e-6 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    tiny_loss = TinyLoss()

    errors = {}
    for scale in (None, 2.0**15):
        model = _dense()
        strategy = tf_megadp.VectorizedClipping(jit_compile=False)
        model.compile(loss=tiny_loss, auto_scale_loss=False)
        batch = strategy.clip_and_sum(model, x, y, None, 1.0, **(
            {} if scale is None else {"loss_scale": scale}))
        twin = _float32_twin(model)
        # Divisor -1: the reference's -(1/B) sum is then the clipped sum itself.
        expected = reference.flat(reference.naive_clipped_update(twin, tiny_loss, x, y, 1.0, -1))
        got = reference.flat([tf.convert_to_tensor(g) for g in batch.gradient_sum])
        errors[scale] = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert errors[2.0**15] < 5e-3, errors
    assert errors[None] > 10 * errors[2.0**15], errors


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["vectorized", "ghost", "auto"])
def test_a_mixed_float16_bert_clips_like_the_float32_reference(clipping):
    """Tiny BertMaskedLM: encoder in mixed_float16, MLM head in float32 (as the job's bfloat16)."""
    import keras_hub

    def bert(policy):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8, dropout=0.0, dtype=policy)
        model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
        if policy is not None:
            model.masked_lm_head.dtype_policy = "float32"
        return model

    x, y, w = reference.bert_batch(8)
    model, twin = bert("mixed_float16"), bert(None)
    model(x)
    twin(x)
    twin.set_weights(model.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(1.0), l2_norm_clip=0.1, noise_multiplier=0.0, seed=0,
        clipping=clipping, loss_scale=2.0**15), loss=loss, weighted_metrics=[])
    before = reference.weights(model)
    model.train_on_batch(x, y, sample_weight=w)
    update = reference.flat([a - b for a, b in zip(reference.weights(model), before)])
    expected = reference.flat(reference.naive_clipped_update(twin, loss, x, y, 0.1, 8,
                                                             sample_weight=w))
    # Measured: relative L2 7.2e-4 (vectorized), 7.0e-4 (ghost and auto).
    assert np.linalg.norm(update - expected) / np.linalg.norm(expected) < 5e-3
