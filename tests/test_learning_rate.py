"""Specification of `BatchScaledSchedule`: a learning rate that follows the logical batch."""

import keras
import pytest

from tf_megadp import BatchScaledSchedule, BatchSizeSchedule, Phase


def test_each_phase_gets_its_batch_ratio_to_the_power():
    batches = BatchSizeSchedule([Phase(3, 16, 1), Phase(2, 64, 4)], num_examples=1000,
                                micro_batch_size=16)
    base = keras.optimizers.schedules.CosineDecay(1e-3, 5)
    for power in (1.0, 0.5):
        rate = BatchScaledSchedule.for_batch_schedule(base, batches, reference_batch_size=32,
                                                      power=power)
        expected = [float(base(s)) * ((16 if s < 3 else 64) / 32) ** power for s in range(5)]
        assert [float(rate(s)) for s in range(5)] == pytest.approx(expected, rel=1e-6)


def test_a_keras_accumulating_baseline_advances_k_times_per_logical_step():
    batches = BatchSizeSchedule([Phase(2, 8, 1), Phase(2, 16, 2)], num_examples=100,
                                micro_batch_size=8)
    rate = BatchScaledSchedule.for_batch_schedule(1e-2, batches, reference_batch_size=8,
                                                  steps_per_logical_step=2)
    assert rate.boundaries == [4]
    assert [float(rate(s)) for s in (0, 3, 4)] == pytest.approx([1e-2, 1e-2, 2e-2])


def test_a_scaled_schedule_survives_serialization():
    schedule = BatchScaledSchedule(keras.optimizers.schedules.CosineDecay(1e-3, 10),
                                   boundaries=[4], factors=[0.5, 2.0])
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert [float(again(s)) for s in (0, 3, 4, 9)] == [float(schedule(s)) for s in (0, 3, 4, 9)]
    assert float(schedule(4)) == pytest.approx(2.0 * float(schedule.base(4)))


@pytest.mark.parametrize("kwargs, message", [
    ({"boundaries": [4], "factors": [1.0]}, "one factor per phase"),
])
def test_bad_layouts_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchScaledSchedule(keras.optimizers.schedules.CosineDecay(1e-3, 10), **kwargs)


def test_a_reference_batch_must_be_positive():
    batches = BatchSizeSchedule.constant(2, 8, num_examples=100, micro_batch_size=8)
    with pytest.raises(ValueError, match="reference_batch_size"):
        BatchScaledSchedule.for_batch_schedule(1e-3, batches, reference_batch_size=0)
