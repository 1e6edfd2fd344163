"""Specification of a run's folder (`tf_megadp.jobs.common.run_folder`).

A LoRA run's checkpoint must give a resume the factors it trained: Keras
alone restores the merged kernel into W and zeros A and B, and then
neither factor has a gradient (each one's is a product with the other).
A resume keeps every setting but the operational ones.
"""

import dataclasses

import keras
import numpy as np
import pytest

import tf_megadp
from tf_megadp.jobs.bert import trainable, training
from tf_megadp.jobs.bert.config import PretrainConfig
from tf_megadp.jobs.common import run_folder
from tf_megadp.jobs.common.errors import JobError
from tf_megadp.run.training_state import restore_training_state

PICO = PretrainConfig(model="pico", sequence_length=8, vocabulary_size=30)


def pico(**settings):
    keras.utils.set_random_seed(0)
    model = training.build_model(PICO, 30)
    trainable.restrict_training(model, PretrainConfig(**settings))
    return model


def test_a_resumed_lora_run_gets_back_the_factors_it_trained(tmp_path):
    model = pico(lora_rank=2)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(size=variable.shape).astype("float32"))
    model.compile(optimizer=tf_megadp.DPOptimizer(keras.optimizers.Adam(), l2_norm_clip=1.0,
                                                  noise_multiplier=1.0), loss="mse")
    model.optimizer.build(model.trainable_variables)
    checkpointer = run_folder.Checkpointer(str(tmp_path), lambda: {"note": "mine"})
    checkpointer.save(model)
    saved = {variable.path: keras.ops.convert_to_numpy(variable) for variable in model.weights}

    resumed = pico(lora_rank=2)
    extra = restore_training_state(resumed, str(tmp_path / run_folder.CHECKPOINT_NAME),
                                   {"loss": "mse"})
    assert extra["note"] == "mine" and extra["logical_steps"] == 0
    factors = [v for v in resumed.weights if "lora_kernel" in v.path]
    # What Keras alone restores: the merged kernel in W, both factors zero.
    assert factors and not any(np.any(keras.ops.convert_to_numpy(v)) for v in factors)
    run_folder.restore_lora_factors(resumed, str(tmp_path), extra[run_folder.LORA_FACTORS_KEY])
    for variable in resumed.weights:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), saved[variable.path],
                                      err_msg=variable.path)

    # A later checkpoint replaces the file; a checkpoint without one is refused.
    checkpointer.save(model)
    later = restore_training_state(pico(lora_rank=2), str(tmp_path / run_folder.CHECKPOINT_NAME),
                                   {"loss": "mse"})[run_folder.LORA_FACTORS_KEY]
    assert sorted(p.name for p in (tmp_path / run_folder.CHECKPOINT_NAME).glob("lora-*")) == [
        later]
    with pytest.raises(ValueError, match="holds no LoRA factors"):
        run_folder.restore_lora_factors(resumed, str(tmp_path), None)


def test_a_resume_may_change_only_the_operational_settings():
    saved = run_folder.config_dict(PICO)
    run_folder.check_same_run(saved, dataclasses.replace(PICO, eval_every=3, verbose=0))
    with pytest.raises(JobError, match=r"l2_norm_clip: 1.0 -> 0.5.*Drop --l2-norm-clip"):
        run_folder.check_same_run(saved, dataclasses.replace(PICO, l2_norm_clip=0.5))
    # A setting an older release did not save ran as its default: a resume keeps that too.
    older = {name: value for name, value in saved.items() if name != "lora_rank"}
    run_folder.check_same_run(older, PICO)
    with pytest.raises(JobError, match=r"lora_rank: None -> 2.*Drop --lora-rank"):
        run_folder.check_same_run(older, dataclasses.replace(PICO, lora_rank=2))
