"""Specification of what a pretraining run trains (`tf_megadp.jobs.bert.trainable`).

`--lora-rank r` trains LoRA factors on the attention query and value
projections (with their biases) and the MLM head, nothing else;
`--freeze-embeddings` leaves the three tables (and the tied decoder) out.
(A LoRA run's checkpoint keeps its factors: tests/test_jobs_common_run_folder.py.)
"""

import keras
import pytest

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
