"""Specification of what a pretraining run trains (`tf_megadp.jobs.bert.trainable`).

`--lora-rank r` trains LoRA factors on the attention query and value
projections (with their biases) and the MLM head, nothing else;
`--freeze-embeddings` leaves the three tables (and the tied decoder) out.
A LoRA run's checkpoint must give a resume the factors it trained: Keras
alone restores the merged kernel into W and zeros A and B, and then
neither factor has a gradient (each one's is a product with the other).
"""

import keras
import numpy as np
import pytest

import tf_megadp
from tf_megadp.run.training_state import restore_training_state, save_training_state
from tf_megadp.jobs.bert import trainable, training
from tf_megadp.jobs.bert.config import PretrainConfig

PICO = PretrainConfig(model="pico", sequence_length=8, vocabulary_size=30)


def pico(**settings):
    keras.utils.set_random_seed(0)
    model = training.build_model(PICO, 30)
    trainable.restrict_training(model, PretrainConfig(**settings))
    return model


@pytest.mark.parametrize("settings, trained", [
    ({}, None),
    ({"freeze_embeddings": True}, lambda path: "embedding/" not in path),
    ({"lora_rank": 2}, lambda path: "lora_kernel" in path or path.endswith(("query/bias",
                                                                             "value/bias"))
     or path.startswith("mlm_head/")),
])
def test_what_trains(settings, trained):
    model = pico(**settings)
    paths = [variable.path for variable in model.weights]
    expected = [path for path in paths if trained is None or trained(path)]
    assert [variable.path for variable in model.trainable_variables] == expected
    assert trainable.describe(PretrainConfig(**settings)).split()[0] in (
        "every", "LoRA")


def test_a_resumed_lora_run_gets_back_the_factors_it_trained(tmp_path):
    model = pico(lora_rank=2)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(size=variable.shape).astype("float32"))
    model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.Adam(), l2_norm_clip=1.0,
                                                  noise_multiplier=1.0), loss="mse")
    model.optimizer.build(model.trainable_variables)
    name = trainable.save_lora_factors(model, str(tmp_path), 7)
    save_training_state(model, str(tmp_path), extra={trainable.LORA_FACTORS_KEY: name})
    saved = {variable.path: keras.ops.convert_to_numpy(variable) for variable in model.weights}

    resumed = pico(lora_rank=2)
    extra = restore_training_state(resumed, str(tmp_path), {"loss": "mse"})
    factors = [v for v in resumed.weights if "lora_kernel" in v.path]
    # What Keras alone restores: the merged kernel in W, both factors zero.
    assert factors and not any(np.any(keras.ops.convert_to_numpy(v)) for v in factors)
    trainable.restore_lora_factors(resumed, str(tmp_path), extra[trainable.LORA_FACTORS_KEY])
    for variable in resumed.weights:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), saved[variable.path],
                                      err_msg=variable.path)

    # A later checkpoint replaces the file; a checkpoint without one is refused.
    later = trainable.save_lora_factors(model, str(tmp_path), 8)
    trainable.remove_other_lora_factors(str(tmp_path), later)
    assert sorted(p.name for p in tmp_path.glob("lora-*")) == [later]
    with pytest.raises(ValueError, match="holds no LoRA factors"):
        trainable.restore_lora_factors(resumed, str(tmp_path), None)
