"""Specification of tf_megadp.accounting.matrix_factorization: correlated noise, proven against dense references.

Every claim is checked against an independent computation: the streaming
noise against solving C x = z with the dense matrix, the error against
||A C^{-1}||_F^2 / n formed densely, the sensitivity against brute force
over every participation pattern, and the epsilons against dp_accounting
events built by hand (and the Gaussian mechanism's closed form). Sizes are
small: the whole file runs in seconds.
"""

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import linalg, stats

from tf_megadp.accounting import compute_epsilon
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.errors import PrivacyConfigurationError


def dense(coefficients, n):
    """The n x n lower-triangular Toeplitz matrix with first column `coefficients` (padded or cut)."""
    column = np.zeros(n)
    given = np.asarray(coefficients, dtype=np.float64)[:n]
    column[: given.size] = given
    return linalg.toeplitz(column, np.zeros(n))


def dense_mse(strategy):
    """||A C^{-1}||_F^2 / n with every matrix formed."""
    n = strategy.shape[0]
    workload = np.tril(np.ones((n, n)))
    return float(np.sum((workload @ np.linalg.inv(strategy)) ** 2) / n)


def monotone(size, rng):
    """Random positive non-increasing coefficients."""
    return np.sort(rng.uniform(0.05, 1.0, size))[::-1]


class TestBandedStrategies:
    def test_the_full_sqrt_strategy_squares_to_the_prefix_sum_matrix(self):
        # Fichtenberger et al.: C C = A for c_k = prod_{i<=k} (2i - 1) / (2i).
        n = 12
        c = dense(mf.sqrt_coefficients(n), n)
        np.testing.assert_allclose(c @ c, np.tril(np.ones((n, n))), atol=1e-12)
        np.testing.assert_allclose(mf.sqrt_coefficients(3), [1.0, 0.5, 0.375])

    def test_unit_norm_scales_the_column_and_nothing_else(self):
        c = mf.unit_norm([2.0, 1.0, -0.5])
        assert np.linalg.norm(c) == pytest.approx(1.0)
        np.testing.assert_allclose(c / c[0], [1.0, 0.5, -0.25])

    @pytest.mark.parametrize("coefficients", [[], [0.0, 1.0], [-1.0], [1.0, np.nan], [[1.0]]])
    def test_coefficients_without_an_invertible_c_are_refused(self, coefficients):
        with pytest.raises(PrivacyConfigurationError, match="coefficient"):
            mf.unit_norm(coefficients)

    @pytest.mark.parametrize("bands", [1, 3, 7, 20])
    def test_the_streaming_inverse_solves_c_x_equals_z(self, bands):
        rng = np.random.default_rng(bands)
        n = 20
        c = np.concatenate([[rng.uniform(0.5, 2.0)], rng.normal(0.0, 0.4, bands - 1)])
        z = rng.standard_normal((n, 3))
        expected = np.linalg.solve(dense(c, n), z)
        np.testing.assert_allclose(mf.banded_inverse_stream(c, z), expected, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(mf.inverse_coefficients(c, n),
                                   np.linalg.inv(dense(c, n))[:, 0], rtol=1e-10, atol=1e-12)

    def test_prefix_sum_mse_is_the_dense_frobenius_error(self):
        rng = np.random.default_rng(0)
        n = 30
        c = mf.unit_norm(monotone(6, rng))
        assert mf.prefix_sum_mse(mf.inverse_coefficients(c, n)) == pytest.approx(
            dense_mse(dense(c, n)), rel=1e-10)
        # Independent noise: Var of the t-th prefix sum is t + 1.
        assert mf.prefix_sum_mse(np.r_[1.0, np.zeros(n - 1)]) == pytest.approx((n + 1) / 2)

    @pytest.mark.parametrize("bands", [4, 16])
    def test_optimized_bands_beat_the_sqrt_start_and_independent_noise(self, bands):
        n = 256
        optimized = mf.optimal_band_coefficients(n, bands)
        start = mf.unit_norm(mf.sqrt_coefficients(bands))
        error = mf.prefix_sum_mse(mf.inverse_coefficients(optimized, n))
        assert error < mf.prefix_sum_mse(mf.inverse_coefficients(start, n)) < (n + 1) / 2
        assert error == pytest.approx(dense_mse(dense(optimized, n)), rel=1e-9)
        assert np.linalg.norm(optimized) == pytest.approx(1.0)
        assert np.all(optimized > 0) and np.all(np.diff(optimized) < 0)

    def test_the_optimum_is_a_local_minimum_of_the_unit_norm_error(self):
        n, bands = 128, 6
        optimized = mf.optimal_band_coefficients(n, bands)
        best = mf.prefix_sum_mse(mf.inverse_coefficients(optimized, n))
        rng = np.random.default_rng(1)
        for _ in range(10):
            moved = mf.unit_norm(optimized + 1e-3 * rng.standard_normal(bands))
            assert mf.prefix_sum_mse(mf.inverse_coefficients(moved, n)) >= best * (1 - 1e-9)

    def test_one_band_is_independent_noise(self):
        np.testing.assert_array_equal(mf.optimal_band_coefficients(50, 1), [1.0])

    def test_optima_are_cached_by_steps_and_bands_and_read_only(self):
        first = mf.optimal_band_coefficients(300, 8)
        assert mf.optimal_band_coefficients(300, 8) is first
        assert mf.optimal_band_coefficients(301, 8) is not first
        with pytest.raises(ValueError, match="read-only"):
            first[0] = 1.0

    def test_more_bands_than_steps_are_refused(self):
        with pytest.raises(PrivacyConfigurationError, match="num_bands <= 10"):
            mf.optimal_band_coefficients(10, 11)

    @pytest.mark.slow
    def test_a_hundred_thousand_steps_optimize_without_dense_matrices(self):
        n = 100_000
        optimized = mf.optimal_band_coefficients(n, 64)
        error = mf.prefix_sum_mse(mf.inverse_coefficients(optimized, n))
        start = mf.unit_norm(mf.sqrt_coefficients(64))
        assert error < mf.prefix_sum_mse(mf.inverse_coefficients(start, n)) < (n + 1) / 2


class TestBufferedToeplitz:
    THETA = np.array([0.97, 0.6, 0.2])
    OMEGA = np.array([0.1, 0.3, 0.2])

    def test_coefficients_are_sums_of_decayed_scales(self):
        n = 15
        c = mf.blt_coefficients(self.THETA, self.OMEGA, n)
        expected = [1.0] + [sum(w * d ** (t - 1) for d, w in zip(self.THETA, self.OMEGA))
                            for t in range(1, n)]
        np.testing.assert_allclose(c, expected, rtol=1e-13)

    def test_the_buffer_recurrences_equal_the_toeplitz_matrix_and_its_inverse(self):
        n = 40
        c = dense(mf.blt_coefficients(self.THETA, self.OMEGA, n), n)
        x = np.random.default_rng(2).standard_normal((n, 2, 3))
        np.testing.assert_allclose(mf.blt_multiply_stream(self.THETA, self.OMEGA, x),
                                   np.einsum("tu,uij->tij", c, x), rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(mf.blt_inverse_stream(self.THETA, self.OMEGA, x),
                                   np.linalg.solve(c, x.reshape(n, -1)).reshape(x.shape),
                                   rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(mf.blt_inverse_coefficients(self.THETA, self.OMEGA, n),
                                   np.linalg.inv(c)[:, 0], rtol=1e-10, atol=1e-13)

    def test_the_inverse_column_is_computed_past_its_first_block(self):
        # 600 steps: three blocks of the blocked recurrence.
        n = 600
        reference = mf.blt_inverse_stream(self.THETA, self.OMEGA, np.r_[1.0, np.zeros(n - 1)])
        np.testing.assert_allclose(mf.blt_inverse_coefficients(self.THETA, self.OMEGA, n),
                                   reference, rtol=1e-9, atol=1e-15)

    def test_coefficients_are_exactly_non_increasing_for_decays_near_one(self):
        c = mf.blt_coefficients([0.99999, 0.9999, 0.5], [0.01, 0.02, 0.4], 5000)
        assert np.all(c >= 0) and np.all(np.diff(c) <= 0)

    @pytest.mark.parametrize("decays, scales", [([1.0], [0.1]), ([0.5], [0.1, 0.2]),
                                                ([], []), ([0.5], [np.inf])])
    def test_invalid_parameters_are_refused(self, decays, scales):
        with pytest.raises(PrivacyConfigurationError, match="BLT"):
            mf.check_blt_parameters(decays, scales)

    def test_optimized_blt_is_non_negative_non_increasing_and_beats_independent_noise(self):
        n = 500
        theta, omega = mf.optimal_blt_parameters(n, 3)
        assert np.all((theta > 0) & (theta < 1)) and np.all(omega > 0) and omega.sum() < 1
        assert np.all(np.diff(theta) <= 0)
        c = mf.blt_coefficients(theta, omega, n)
        assert np.all(np.diff(c) <= 0)
        error = (c @ c) * mf.prefix_sum_mse(mf.blt_inverse_coefficients(theta, omega, n))
        assert error == pytest.approx((c @ c) * dense_mse(dense(c, n)), rel=1e-8)
        assert error < 0.1 * (n + 1) / 2

    def test_with_equal_memory_one_pass_blt_beats_bands(self):
        # d buffers against d + 1 bands (d buffers too), one participation.
        n, d = 500, 3
        theta, omega = mf.optimal_blt_parameters(n, d)
        c = mf.blt_coefficients(theta, omega, n)
        blt = (c @ c) * mf.prefix_sum_mse(mf.blt_inverse_coefficients(theta, omega, n))
        bands = mf.prefix_sum_mse(mf.inverse_coefficients(mf.optimal_band_coefficients(n, d + 1), n))
        assert blt < bands / 2

    def test_blt_is_optimized_for_the_runs_participation(self):
        n, s, k = 400, 100, 4

        def multi_epoch_error(theta, omega):
            c = mf.blt_coefficients(theta, omega, n)
            sens = mf.minsep_sensitivity(c, n, min_separation=s, max_participations=k)
            assert sens.exact
            return sens.value ** 2 * mf.prefix_sum_mse(mf.blt_inverse_coefficients(theta, omega, n))

        for_epochs = mf.optimal_blt_parameters(n, 2, min_separation=s, max_participations=k)
        for_one_pass = mf.optimal_blt_parameters(n, 2)
        assert multi_epoch_error(*for_epochs) < multi_epoch_error(*for_one_pass)
        assert mf.optimal_blt_parameters(n, 2, min_separation=s, max_participations=k) is for_epochs
        # One participation, whatever the separation: one cache entry.
        assert mf.optimal_blt_parameters(n, 2, min_separation=n, max_participations=4) is (
            for_one_pass)


def patterns(n, separation, participations):
    """Every set of at most k steps of n, any two >= s apart."""
    for size in range(1, participations + 1):
        for chosen in itertools.combinations(range(n), size):
            if all(b - a >= separation for a, b in zip(chosen, chosen[1:])):
                yield list(chosen)


class TestSensitivity:
    N = 10

    @pytest.mark.parametrize("bands", [1, 4, 10])
    @pytest.mark.parametrize("separation, participations", [(1, 3), (2, 3), (3, 4), (4, 2), (9, 3)])
    def test_exact_for_non_increasing_coefficients_as_brute_force(self, bands, separation,
                                                                   participations):
        rng = np.random.default_rng(bands * 100 + separation * 10 + participations)
        c = monotone(bands, rng)
        columns = dense(c, self.N)
        brute = max(np.linalg.norm(columns[:, p].sum(axis=1))
                    for p in patterns(self.N, separation, participations))
        sens = mf.minsep_sensitivity(c, self.N, min_separation=separation,
                                     max_participations=participations)
        assert sens.exact
        assert sens.value == pytest.approx(brute, rel=1e-12)

    @pytest.mark.parametrize("separation, participations", [(1, 3), (2, 3), (3, 2)])
    def test_a_flagged_bound_for_coefficients_of_any_sign(self, separation, participations):
        rng = np.random.default_rng(separation)
        c = np.r_[1.0, rng.normal(0.0, 0.6, 4)]
        columns = dense(c, self.N)
        gram = np.abs(columns.T @ columns)
        # max_P sum_{i,j in P} |(C^T C)_ij| bounds the sensitivity for vector
        # gradients; signs per participation give the scalar worst case.
        absolute = max(gram[np.ix_(p, p)].sum()
                       for p in patterns(self.N, separation, participations))
        signed = max(np.linalg.norm(columns[:, p] @ np.array(signs)) ** 2
                     for p in patterns(self.N, separation, participations)
                     for signs in itertools.product([-1.0, 1.0], repeat=len(p)))
        sens = mf.minsep_sensitivity(c, self.N, min_separation=separation,
                                     max_participations=participations)
        assert not sens.exact
        assert sens.value ** 2 >= absolute * (1 - 1e-12) >= signed * (1 - 1e-12)

    def test_columns_that_cannot_overlap_are_exact_for_any_sign(self):
        c = np.array([1.0, -0.7, 0.9])
        columns = dense(c, self.N)
        signed = max(np.linalg.norm(columns[:, p] @ np.array(signs))
                     for p in patterns(self.N, 3, 3)
                     for signs in itertools.product([-1.0, 1.0], repeat=len(p)))
        sens = mf.minsep_sensitivity(c, self.N, min_separation=3, max_participations=3)
        assert sens.exact and sens.value == pytest.approx(signed, rel=1e-12)

    def test_epochs_longer_than_the_bands_cost_the_square_root_of_the_epochs(self):
        c = mf.optimal_band_coefficients(1000, 16)
        sens = mf.minsep_sensitivity(c, 1000, min_separation=250, max_participations=4)
        assert sens.exact and sens.value == pytest.approx(2.0, rel=1e-12)
        # Participations that do not fit count once each only.
        assert mf.minsep_sensitivity(c, 1000, min_separation=400, max_participations=10).value == (
            pytest.approx(math.sqrt(3), rel=1e-12))


def epsilon_of(event, delta=1e-6, accountant="pld"):
    engine = (pld.PLDAccountant(value_discretization_interval=1e-4) if accountant == "pld"
              else rdp.RdpAccountant())
    return engine.compose(event).get_epsilon(delta)


class TestEvents:
    def test_cyclic_poisson_bandmf_is_poisson_dp_sgd_on_one_group(self):
        # 60,000 examples in 16 groups: each round samples its group at
        # q = B L / N; 1000 steps are ceil(1000 / 16) = 63 rounds.
        event = mf.cyclic_poisson_event(1.1, num_examples=60_000, batch_size=250, steps=1000,
                                        cycle_length=16, num_bands=16)
        by_hand = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(250 * 16 / 60_000,
                                                dp_accounting.GaussianDpEvent(1.1)), 63)
        assert event == by_hand
        assert epsilon_of(event, accountant="rdp") == epsilon_of(by_hand, accountant="rdp")
        # The library's DP-SGD accounting of one group of N / L examples, 63 steps.
        assert compute_epsilon(num_examples=3750, batch_size=250, steps=63, noise_multiplier=1.1,
                               delta=1e-6, accountant="rdp") == pytest.approx(
            epsilon_of(by_hand, accountant="rdp"), rel=1e-12)

    def test_a_growing_batch_is_accounted_round_by_round(self):
        sizes = [100] * 32 + [200] * 48
        event = mf.cyclic_poisson_event(1.0, num_examples=16_000, batch_size=sizes, steps=80,
                                        cycle_length=16, num_bands=8)
        gaussian = dp_accounting.GaussianDpEvent(1.0)
        assert event == dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.1, gaussian), 2),
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.2, gaussian), 3),
        ])

    def test_a_round_with_two_batch_sizes_is_refused(self):
        sizes = [100] * 40 + [200] * 40
        with pytest.raises(PrivacyConfigurationError, match="multiple of cycle_length = 16"):
            mf.cyclic_poisson_event(1.0, num_examples=16_000, batch_size=sizes, steps=80,
                                    cycle_length=16, num_bands=8)

    def test_poisson_sampling_without_cycles_is_refused_under_bands(self):
        with pytest.raises(PrivacyConfigurationError, match="without cycles.*cycle_length >= 4"):
            mf.cyclic_poisson_event(1.0, num_examples=1000, batch_size=10, steps=100,
                                    cycle_length=1, num_bands=4)
        # One band is DP-SGD: plain Poisson sampling is its proof.
        assert mf.cyclic_poisson_event(1.0, num_examples=1000, batch_size=10, steps=100,
                                       cycle_length=1, num_bands=1) == (
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                0.01, dp_accounting.GaussianDpEvent(1.0)), 100))

    def test_a_cycle_shorter_than_the_bands_is_refused(self):
        with pytest.raises(PrivacyConfigurationError,
                           match="Raise cycle_length to at least 16, or lower num_bands to at most 4"):
            mf.cyclic_poisson_event(1.0, num_examples=1000, batch_size=10, steps=100,
                                    cycle_length=4, num_bands=16)

    def test_groups_too_small_for_the_batch_are_refused(self):
        with pytest.raises(PrivacyConfigurationError, match="cycle_length to at most 10"):
            mf.cyclic_poisson_event(1.0, num_examples=1000, batch_size=100, steps=100,
                                    cycle_length=16, num_bands=16)

    @pytest.mark.parametrize("sigma", [0.0, -1.0, math.inf, True])
    def test_no_noise_is_refused(self, sigma):
        with pytest.raises(PrivacyConfigurationError, match="noise_multiplier"):
            mf.cyclic_poisson_event(sigma, num_examples=1000, batch_size=10, steps=100,
                                    cycle_length=4, num_bands=4)

    def test_fixed_order_epochs_are_one_gaussian_mechanism(self):
        # 4 epochs of 250 steps, 16 bands: sens = 2, so sigma = 8 is Gaussian(4).
        c = mf.optimal_band_coefficients(1000, 16)
        sens = mf.minsep_sensitivity(c, 1000, min_separation=250, max_participations=4)
        event = mf.fixed_order_event(8.0, sens)
        assert event == dp_accounting.GaussianDpEvent(pytest.approx(4.0, rel=1e-12))
        # Its epsilon against the Gaussian mechanism's exact privacy profile
        # (Balle and Wang 2018), with mu = sens / sigma = 1/4.
        epsilon = epsilon_of(event)
        mu = 0.25
        delta = stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(
            -epsilon / mu - mu / 2)
        assert delta == pytest.approx(1e-6, rel=2e-2)
