"""Specification of tf_megadp.accounting.noise.bandmf and .blt: `BandMF` and `BLT`, frozen and validated.

The value types describe a run's correlated noise to the optimizer (the
unit-norm strategy, the buffers) and to the accountant (the run's event).
Their numbers come from `matrix_factorization` (tests/test_matrix_factorization.py
proves those against dense references); here: what each type accepts, what
it refuses, and that it hands the run's numbers through unchanged.
"""

import dataclasses
import math

import dp_accounting
import numpy as np
import pytest
from scipy import linalg

from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.accounting.noise import BLT, BandMF
from tf_megadp.errors import PrivacyConfigurationError


class TestBandMF:
    def test_is_frozen_and_equal_by_value(self):
        mechanism = BandMF(num_bands=4)
        with pytest.raises(dataclasses.FrozenInstanceError):
            mechanism.num_bands = 8
        assert BandMF(4) == mechanism and hash(BandMF(4)) == hash(mechanism)
        assert mechanism.noise_buffers == 3

    def test_given_coefficients_are_kept_at_unit_norm(self):
        mechanism = BandMF(num_bands=3, coefficients=[2.0, 1.0, 0.5])
        np.testing.assert_allclose(mechanism.coefficients, np.array([2.0, 1.0, 0.5]) / math.sqrt(5.25))
        assert mechanism == BandMF(3, coefficients=(4.0, 2.0, 1.0))
        np.testing.assert_array_equal(mechanism.strategy(100), mechanism.coefficients)

    @pytest.mark.parametrize("kwargs, match", [
        ({"num_bands": 0}, "num_bands"),
        ({"num_bands": True}, "num_bands"),
        ({"num_bands": 2.0}, "num_bands"),
        ({"num_bands": 3, "coefficients": [1.0, 0.5]}, "needs 3 coefficients"),
        ({"num_bands": 2, "coefficients": [0.0, 1.0]}, "c_0 must be > 0"),
    ])
    def test_invalid_settings_are_refused(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            BandMF(**kwargs)

    def test_the_strategy_is_the_cached_optimum_of_the_run(self):
        assert BandMF(8).strategy(400) is mf.optimal_band_coefficients(400, 8)
        with pytest.raises(PrivacyConfigurationError, match="at most 5 bands"):
            BandMF(8, coefficients=np.ones(8)).strategy(5)

    def test_events_are_the_runs(self):
        mechanism = BandMF(16)
        assert mechanism.cyclic_poisson_event(
            1.0, num_examples=60_000, batch_size=250, steps=1000, cycle_length=16) == (
            mf.cyclic_poisson_event(1.0, num_examples=60_000, batch_size=250, steps=1000,
                                    cycle_length=16, num_bands=16))
        assert mechanism.fixed_order_event(8.0, steps=1000, steps_per_epoch=250) == (
            dp_accounting.GaussianDpEvent(pytest.approx(4.0, rel=1e-12)))
        with pytest.raises(PrivacyConfigurationError, match="without cycles"):
            mechanism.cyclic_poisson_event(1.0, num_examples=60_000, batch_size=250, steps=1000,
                                           cycle_length=1)

    def test_epochs_shorter_than_the_bands_pay_their_overlap(self):
        sens = BandMF(16).sensitivity(1000, steps_per_epoch=10)
        assert sens.exact and sens.value > math.sqrt(100)

    def test_for_run_spends_small_budgets_on_amplification_and_large_ones_on_cancellation(self):
        run = {"num_examples": 10_000, "batch_size": 100, "steps": 400, "delta": 1e-6,
               "candidate_bands": [1, 16]}
        assert BandMF.for_run(target_epsilon=0.5, **run).num_bands < (
            BandMF.for_run(target_epsilon=50.0, **run).num_bands)

    # Slow (15 s, CI's 15 minutes): tests/test_plan.py checks the same choice
    # (b = 1 a candidate, the least expected error) through the plan.
    @pytest.mark.slow
    def test_for_run_never_does_worse_than_dp_sgd_by_the_runs_expected_error(self):
        """Issue 50: b = 1 (DP-SGD, Poisson) is always a candidate, and wins where amplification pays most."""
        run = {"num_examples": 10_000, "batch_size": 100, "steps": 400, "delta": 1e-6}
        errors = BandMF.expected_errors(target_epsilon=0.2, candidate_bands=[4, 16], **run)
        assert set(errors) == {1, 4, 16}
        assert min(errors, key=errors.get) == 1
        assert BandMF.for_run(target_epsilon=0.2, candidate_bands=[4, 16], **run) == BandMF(1)
        # BandMF(1) is DP-SGD: no buffer, accounted with plain Poisson sampling.
        assert BandMF(1).noise_buffers == 0 and BandMF(1).accounted_sampling() == {}
        BandMF(1).check_sampling("poisson")
        # At a large budget the bands pay: the choice is the least error, never above b = 1's.
        errors = BandMF.expected_errors(target_epsilon=8.0, **run)
        chosen = BandMF.for_run(target_epsilon=8.0, **run).num_bands
        assert chosen > 1 and errors[chosen] == min(errors.values()) < errors[1]

    def test_for_run_refuses_bands_whose_groups_cannot_hold_a_batch(self):
        with pytest.raises(PrivacyConfigurationError, match="min\\(N // B, T\\) = 100"):
            BandMF.for_run(num_examples=10_000, batch_size=100, steps=400, target_epsilon=1.0,
                           delta=1e-6, candidate_bands=[1, 128])


class TestBLT:
    def test_is_frozen_and_validated(self):
        mechanism = BLT(num_buffers=2, buffer_decays=[0.9, 0.5], output_scales=[0.1, 0.2])
        with pytest.raises(dataclasses.FrozenInstanceError):
            mechanism.num_buffers = 3
        assert mechanism.buffer_decays == (0.9, 0.5) and mechanism.noise_buffers == 2
        with pytest.raises(PrivacyConfigurationError, match="both"):
            BLT(2, buffer_decays=[0.9, 0.5])
        with pytest.raises(PrivacyConfigurationError, match="needs 3"):
            BLT(3, buffer_decays=[0.9, 0.5], output_scales=[0.1, 0.2])
        with pytest.raises(PrivacyConfigurationError, match="\\(0, 1\\)"):
            BLT(1, buffer_decays=[1.2], output_scales=[0.1])

    def test_the_unit_norm_noise_is_the_buffers_output_scaled_by_the_norm(self):
        # sigma C_clip (C_unit^{-1} z)_t with C_unit = C / ||c||.
        n = 60
        mechanism = BLT(2, buffer_decays=[0.95, 0.3], output_scales=[0.2, 0.3])
        unit = mechanism.strategy(n)
        assert np.linalg.norm(unit) == pytest.approx(1.0)
        z = np.random.default_rng(0).standard_normal((n, 4))
        noise = mf.blt_inverse_stream(mechanism.buffer_decays, mechanism.output_scales, z) / unit[0]
        np.testing.assert_allclose(noise, np.linalg.solve(linalg.toeplitz(unit, np.zeros(n)), z),
                                   rtol=1e-10, atol=1e-12)

    def test_parameters_are_optimized_for_the_fixed_order_pass(self):
        mechanism = BLT(2)
        assert mechanism.parameters(400, steps_per_epoch=100) is mf.optimal_blt_parameters(
            400, 2, min_separation=100, max_participations=4)
        sens = mechanism.sensitivity(400, steps_per_epoch=100)
        assert sens.exact
        assert mechanism.fixed_order_event(3.0, steps=400, steps_per_epoch=100) == (
            dp_accounting.GaussianDpEvent(3.0 / sens.value))

    def test_sampling_amplification_is_refused(self):
        with pytest.raises(PrivacyConfigurationError, match="fixed-order epochs.*BandMF"):
            BLT(4).cyclic_poisson_event(1.0, num_examples=1000, batch_size=10, steps=100,
                                        cycle_length=4)
