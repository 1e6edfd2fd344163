"""Specification of tf_megadp.accounting.

Every epsilon is checked against dp_accounting itself: the test builds the
dp_accounting events of the run by hand and asks a fresh dp_accounting
accountant, independently of the module's own event construction.
"""

import dataclasses
import json
import logging
import math
import re
import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import stats

from tf_megadp import accounting
from tf_megadp.accounting import engines, events
from tf_megadp.accounting import matrix_factorization as mf
from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.accounting import (
    LedgerEntry,
    PrivacyAccountant,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    ledger_from_schedule,
)
from tf_megadp.accounting import RunDescription
from tf_megadp.steps import BatchSizeSchedule, Phase
from tests.log_records import logged_messages


def reference_epsilon(events, delta, accountant):
    """epsilon of `events` by a fresh dp_accounting accountant."""
    engine = (
        pld.PLDAccountant(value_discretization_interval=1e-4)
        if accountant == "pld"
        else rdp.RdpAccountant()
    )
    return engine.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)


def poisson(steps, q, sigma):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
        steps,
    )


# -- Agreement with dp_accounting ------------------------------------------------


@pytest.mark.parametrize(
    "accountant, num_examples, batch_size, steps, sigma, delta",
    [
        ("rdp", 60_000, 256, 1_000, 1.1, 1e-5),
        ("rdp", 1_000_000, 4_096, 500, 0.8, 1e-7),
        ("rdp", 10_000, 10_000, 3, 5.0, 1e-5),  # q = 1: full batch
        ("pld", 50_000, 500, 300, 1.3, 1e-6),
    ],
)
def test_constant_batch_matches_dp_accounting(
    accountant, num_examples, batch_size, steps, sigma, delta
):
    expected = reference_epsilon(
        [poisson(steps, batch_size / num_examples, sigma)], delta, accountant
    )
    got = compute_epsilon(
        num_examples=num_examples,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=sigma,
        delta=delta,
        accountant=accountant,
    )
    assert got == pytest.approx(expected, rel=1e-12)


def test_three_phases_with_changing_q_and_sigma_match_dp_accounting():
    phases = [(100, 0.001, 0.9), (200, 0.004, 1.1), (50, 0.016, 1.6)]
    account = PrivacyAccountant(num_examples=1_000_000, delta=1e-7, accountant="pld")
    for steps, q, sigma in phases:
        account.record(steps, sampling_rate=q, noise_multiplier=sigma)
    expected = reference_epsilon([poisson(*phase) for phase in phases], 1e-7, "pld")
    assert account.epsilon() == pytest.approx(expected, rel=1e-12)


def test_three_phase_schedule_is_accounted_per_phase_with_truncation():
    # The tf_megadp sampler truncates Poisson steps at each phase's capacity;
    # for_poisson sizes the capacity so truncation is rare, and then the
    # coupling bound reports the untruncated Poisson epsilon at
    # delta - (1 + e^eps_hi) * sum_t P[Binomial(N + 1, q_t) > c_t].
    schedule = BatchSizeSchedule.for_poisson(
        [(100, 1_000), (200, 4_000), (50, 16_000)],
        num_examples=1_000_000,
        micro_batch_size=1_024,
        noise_multipliers=[None, None, 1.6],
    )
    delta = 1e-7
    events = [
        poisson(phase.steps, phase.batch_size / 1_000_000, sigma)
        for phase, sigma in zip(schedule.phases, [1.0, 1.0, 1.6])
    ]
    mass = sum(
        phase.steps * stats.binom.sf(schedule.capacity(phase), 1_000_001, phase.batch_size / 1e6)
        for phase in schedule.phases
    )
    assert 0 < mass < 1e-12
    upper = reference_epsilon(events, delta / 2, "rdp")
    expected = reference_epsilon(events, delta - (1 + math.exp(upper)) * mass, "rdp")
    got = compute_epsilon(schedule=schedule, noise_multiplier=1.0, delta=delta, accountant="rdp")
    assert got == pytest.approx(expected, rel=1e-12)
    ledger = ledger_from_schedule(schedule, 1.0)
    assert [entry.max_batch_size for entry in ledger] == [
        schedule.capacity(phase) for phase in schedule.phases
    ]
    assert [entry.noise_multiplier for entry in ledger] == [1.0, 1.0, 1.6]


def test_frequent_truncation_uses_the_exact_truncated_event():
    # Capacity 230 for an expected batch of 200: a step truncates ~2 % of the
    # time, far too often for the coupling bound, so the exact PLD is used.
    # (sigma = 2 keeps dp_accounting's exact truncated PLD to a few seconds.)
    delta = 1e-6
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=20_000, sampling_probability=0.01, truncated_batch_size=230,
            noise_multiplier=2.0,
        ),
        20,
    )
    expected = reference_epsilon([event], delta, "pld")
    got = compute_epsilon(
        num_examples=20_000, batch_size=200, steps=20, noise_multiplier=2.0,
        max_batch_size=230, delta=delta,
    )
    assert got == pytest.approx(expected, rel=1e-12)
    untruncated = reference_epsilon([poisson(20, 0.01, 2.0)], delta, "pld")
    assert got > untruncated  # Truncation costs privacy; it is not ignored.
    with pytest.raises(ValueError, match="accountant='pld'"):
        compute_epsilon(
            num_examples=20_000, batch_size=200, steps=20, noise_multiplier=2.0,
            max_batch_size=230, delta=delta, accountant="rdp",
        )


def test_a_callbacks_repeated_evaluations_build_each_step_once_and_equal_dp_accounting():
    # A PrivacyCallback asks for epsilon of the same steps at growing counts
    # (every log, every budget probe). Each distinct step's PLD is built once
    # per process; every epsilon must still be what a fresh dp_accounting
    # PLDAccountant gives for the same events, for untruncated steps, rare
    # truncation (coupling bound) and frequent truncation (exact PLD).
    delta, n, q, sigma = 1e-6, 20_000, 0.01, 2.0
    engines._step_pld.cache_clear()
    for steps in (10, 20):
        untruncated = compute_epsilon(num_examples=n, batch_size=200, steps=steps,
                                      noise_multiplier=sigma, delta=delta)
        assert untruncated == pytest.approx(
            reference_epsilon([poisson(steps, q, sigma)], delta, "pld"), rel=1e-9)

        rare = compute_epsilon(num_examples=n, batch_size=200, steps=steps,
                               noise_multiplier=sigma, max_batch_size=290, delta=delta)
        mass = steps * stats.binom.sf(290, n + 1, q)
        assert 0 < 2 * mass < delta / 2
        upper = reference_epsilon([poisson(steps, q, sigma)], delta / 2, "pld")
        slack = (1 + math.exp(upper)) * mass
        assert rare == pytest.approx(
            reference_epsilon([poisson(steps, q, sigma)], delta - slack, "pld"), rel=1e-9)

        frequent = compute_epsilon(num_examples=n, batch_size=200, steps=steps,
                                   noise_multiplier=sigma, max_batch_size=230, delta=delta)
        exact = dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(
                dataset_size=n, sampling_probability=q, truncated_batch_size=230,
                noise_multiplier=sigma),
            steps)
        assert frequent == pytest.approx(reference_epsilon([exact], delta, "pld"), rel=1e-9)
    # Two distinct steps: the Poisson step (shared by the untruncated run and
    # the coupling bound) and the exact truncated step; six evaluations.
    assert engines._step_pld.cache_info().misses == 2


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_nested_composed_and_self_composed_events_compose_like_dp_accounting(accountant):
    # Both tf_megadp accountants walk composed events in order and multiply
    # self-composed counts into their steps; a fresh dp_accounting accountant
    # walking the same tree is the reference. A count not multiplied (3 x 2
    # of the second step) or a part skipped would change epsilon.
    first, second = poisson(1, 0.01, 2.0).event, poisson(1, 0.02, 1.5).event
    nested = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.ComposedDpEvent([first, poisson(2, 0.02, 1.5)]), 3),
        first,
    ])
    expected = reference_epsilon([nested], 1e-6, accountant)
    accountants = [engines.TruncationAwareAccountant(accountant)]
    if accountant == "pld":
        accountants.append(engines._CachedPLDAccountant())
    for engine in accountants:
        assert engine.compose(nested).get_epsilon(1e-6) == pytest.approx(expected, rel=1e-9)
        # An event neither can account, deep in the tree, is refused, not skipped.
        hidden = dp_accounting.ComposedDpEvent([
            second, dp_accounting.SelfComposedDpEvent(dp_accounting.UnsupportedDpEvent(), 2)])
        assert not engine.supports(hidden)
        with pytest.raises(dp_accounting.UnsupportedEventError):
            engine.compose(hidden)


def test_shuffle_is_reported_as_poisson_with_a_loud_warning():
    expected = reference_epsilon([poisson(100, 0.01, 1.0)], 1e-5, "rdp")
    with pytest.warns(UserWarning, match="UNDERSTATES.*Chua et al.*Poisson"):
        got = compute_epsilon(
            num_examples=60_000, batch_size=600, steps=100, noise_multiplier=1.0,
            delta=1e-5, sampling="shuffle", accountant="rdp",
        )
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_default_accountant_is_pld_which_is_tighter_than_rdp():
    settings = dict(num_examples=60_000, batch_size=256, steps=1_000, noise_multiplier=1.1, delta=1e-5)
    assert accounting.DEFAULT_ACCOUNTANT == "pld"
    assert compute_epsilon(**settings) < compute_epsilon(**settings, accountant="rdp")


def test_steps_past_the_schedule_end_stay_in_the_last_phase():
    schedule = BatchSizeSchedule([Phase(10, 100, 1), Phase(20, 400, 4)],
                                 num_examples=10_000, micro_batch_size=100)
    ledger = ledger_from_schedule(schedule, 1.0, steps=50)
    assert [entry.steps for entry in ledger] == [10, 40]
    ledger = ledger_from_schedule(schedule, 1.0, steps=5)
    assert [entry.steps for entry in ledger] == [5]


def test_zero_steps_spend_nothing():
    assert compute_epsilon(num_examples=100, batch_size=10, steps=0,
                           noise_multiplier=1.0, delta=1e-3) == 0.0


# -- Monotonicity ----------------------------------------------------------------


def rdp_epsilon(steps=200, batch_size=100, sigma=1.0):
    return compute_epsilon(num_examples=10_000, batch_size=batch_size, steps=steps,
                           noise_multiplier=sigma, delta=1e-5, accountant="rdp")


def test_epsilon_grows_with_steps_and_sampling_rate_and_falls_with_noise():
    by_steps = [rdp_epsilon(steps=t) for t in (1, 10, 100, 1_000, 10_000)]
    by_batch = [rdp_epsilon(batch_size=b) for b in (10, 100, 1_000, 5_000, 10_000)]
    by_sigma = [rdp_epsilon(sigma=s) for s in (0.5, 0.8, 1.0, 2.0, 8.0)]
    assert np.all(np.diff(by_steps) > 0)
    assert np.all(np.diff(by_batch) > 0)
    assert np.all(np.diff(by_sigma) < 0)


def test_pld_epsilon_is_monotone_too():
    def epsilon(steps, batch_size, sigma):
        return compute_epsilon(num_examples=10_000, batch_size=batch_size, steps=steps,
                               noise_multiplier=sigma, delta=1e-5)

    base = epsilon(100, 100, 1.0)
    assert epsilon(101, 100, 1.0) >= base
    assert epsilon(100, 101, 1.0) >= base
    assert epsilon(100, 100, 1.01) <= base


# -- Calibration -----------------------------------------------------------------


@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_calibration_round_trips_within_one_percent_rdp(target):
    settings = dict(num_examples=60_000, batch_size=256, steps=2_000)
    sigma = calibrate_noise_multiplier(target, 1e-5, accountant="rdp", **settings)
    epsilon = compute_epsilon(noise_multiplier=sigma, delta=1e-5, accountant="rdp", **settings)
    assert epsilon <= target
    assert epsilon >= 0.99 * target
    # Smallest: 1 % less noise breaks the budget.
    assert compute_epsilon(noise_multiplier=0.99 * sigma, delta=1e-5,
                           accountant="rdp", **settings) > target


def test_calibration_round_trips_within_one_percent_pld():
    settings = dict(num_examples=100_000, batch_size=5_000, steps=200)
    sigma = calibrate_noise_multiplier(2.0, 1e-5, **settings)
    epsilon = compute_epsilon(noise_multiplier=sigma, delta=1e-5, **settings)
    assert 0.99 * 2.0 <= epsilon <= 2.0


class TestCalibrationCost:
    """Issue 47: calibrate_noise_multiplier(target_epsilon=1000) ran 9 minutes past 8 GB.

    A step's PLD spans privacy losses up to ~1 / (2 sigma^2), so the PLD
    search at a huge target built ever larger grids. Calibration now builds
    no PLD beyond `PLD_GRID_BUDGET` points: it answers (within 1 %) above the
    sigma where that budget ends and refuses below it, by name. The budget
    is lowered here so that each check builds only small PLDs; the spy
    fails the old search at its first oversized PLD, before building it.
    """

    BUDGET = 100_000
    RUN = dict(num_examples=1_000, batch_size=64, steps=20)

    @pytest.fixture
    def built(self, monkeypatch):
        from tf_megadp.accounting import calibration

        monkeypatch.setattr(calibration, "PLD_GRID_BUDGET", self.BUDGET, raising=False)
        sizes = []
        original = engines._step_pld

        def spy(event):
            points = engines.pld_grid_points(event)
            assert points <= self.BUDGET, f"a PLD of {points:,} points for {event}"
            sizes.append(points)
            return original(event)

        monkeypatch.setattr(engines, "_step_pld", spy)
        return sizes

    def test_the_grid_size_is_the_size_of_the_pld_that_is_built(self):
        for event in (dp_accounting.PoissonSampledDpEvent(0.064, dp_accounting.GaussianDpEvent(1.0)),
                      dp_accounting.TruncatedSubsampledGaussianDpEvent(1_000, 0.064, 80, 1.0)):
            built = engines._step_pld(event)
            assert engines.pld_grid_points(event) == pytest.approx(
                built._pmf_remove.size, abs=3)
        # An unsampled Gaussian composed 4 times is one of sigma / 2.
        four = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 4)
        assert engines.pld_grid_points(four) == pytest.approx(
            engines._gaussian_pld(1.0)._pmf_remove.size, abs=3)

    def test_a_huge_target_is_refused_by_name_after_one_bounded_pld(self, built):
        with pytest.raises(PrivacyConfigurationError) as refused:
            calibrate_noise_multiplier(1000.0, 1e-5, **self.RUN)
        assert len(built) <= 1
        message = str(refused.value)
        assert "PLD" in message and "accountant='rdp'" in message
        largest = float(re.search(r"largest target that PLD calibrates for this run is "
                                  r"epsilon = ([0-9.]+)", message).group(1))
        assert 3.0 < largest < 1000.0
        # Just above that largest target, still refused; just below, answered.
        with pytest.raises(PrivacyConfigurationError, match="largest target"):
            calibrate_noise_multiplier(largest * 1.02, 1e-5, **self.RUN)
        target = largest * 0.97
        sigma = calibrate_noise_multiplier(target, 1e-5, **self.RUN)
        assert 0.99 * target <= compute_epsilon(noise_multiplier=sigma, delta=1e-5,
                                                **self.RUN) <= target
        assert len(built) <= 12

    def test_rdp_calibrates_the_same_target_at_once(self, built):
        sigma = calibrate_noise_multiplier(1000.0, 1e-5, accountant="rdp", **self.RUN)
        epsilon = compute_epsilon(noise_multiplier=sigma, delta=1e-5, accountant="rdp", **self.RUN)
        assert 0.99 * 1000 <= epsilon <= 1000
        assert built == []


def test_a_prior_ledger_is_composed_first_and_calibration_spends_what_it_leaves():
    # A run that continues a DP release on the same data (the BERT job's
    # --init-from): its epsilon composes the release's steps, and a target
    # epsilon bounds the whole.
    prior = PrivacyLedger()
    prior.record(300, sampling_rate=0.004, noise_multiplier=0.9)
    settings = dict(num_examples=60_000, batch_size=480, steps=200)
    epsilon = compute_epsilon(noise_multiplier=1.2, delta=1e-6, accountant="rdp",
                              prior=prior, **settings)
    assert epsilon == pytest.approx(reference_epsilon(
        [poisson(300, 0.004, 0.9), poisson(200, 0.008, 1.2)], 1e-6, "rdp"), rel=1e-12)
    alone = calibrate_noise_multiplier(3.0, 1e-6, accountant="rdp", **settings)
    sigma = calibrate_noise_multiplier(3.0, 1e-6, accountant="rdp", prior=prior, **settings)
    assert sigma > alone
    assert 0.99 * 3.0 <= compute_epsilon(noise_multiplier=sigma, delta=1e-6, accountant="rdp",
                                         prior=prior, **settings) <= 3.0


def test_calibration_with_a_schedule_keeps_phases_that_fix_their_noise():
    schedule = BatchSizeSchedule.for_poisson(
        [(100, 1_000), (100, 4_000)], num_examples=1_000_000, micro_batch_size=1_024,
        noise_multipliers=[None, 2.0],
    )
    sigma = calibrate_noise_multiplier(1.0, 1e-7, schedule=schedule, accountant="rdp")
    epsilon = compute_epsilon(schedule=schedule, noise_multiplier=sigma, delta=1e-7,
                              accountant="rdp")
    assert 0.99 <= epsilon <= 1.0
    fixed = BatchSizeSchedule([Phase(10, 100, 1, 1.0)], num_examples=1_000, micro_batch_size=100)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        calibrate_noise_multiplier(1.0, 1e-4, schedule=fixed)


@pytest.fixture
def absl_records():
    with logged_messages("absl") as messages:
        yield messages


def test_calibration_prints_no_unconverged_order_warnings_and_is_right(absl_records):
    # q = 0.1 at sigma near 1: dp_accounting's RDP excludes the fractional
    # orders whose series does not converge and logs one absl warning per
    # order (15 here before the fix; the issue saw 21 on another run).
    settings = dict(num_examples=1_000, batch_size=100, steps=50)
    rdp.RdpAccountant().compose(poisson(50, 0.1, 1.0)).get_epsilon(1e-5)
    direct = [m for m in absl_records if "failed to converge" in m]
    assert direct, "the direct dp_accounting call at these inputs must trigger the warnings"
    absl_records.clear()
    engines.epsilon.cache_clear()  # A cached epsilon would never reach dp_accounting.

    sigma = calibrate_noise_multiplier(2.0, 1e-5, accountant="rdp", **settings)

    assert not [m for m in absl_records if "failed to converge" in m]
    # Still right: a fresh dp_accounting accountant, given the same run,
    # spends at most the target at sigma and more than it at 1 % less noise.
    spent = reference_epsilon([poisson(50, 0.1, sigma)], 1e-5, "rdp")
    assert 0.99 * 2.0 <= spent <= 2.0
    assert reference_epsilon([poisson(50, 0.1, 0.99 * sigma)], 1e-5, "rdp") > 2.0


def test_other_absl_records_of_dp_accounting_still_pass(absl_records):
    logger = logging.getLogger("absl")
    with engines.quiet_unconverged_orders():
        logger.warning("Negative Renyi divergence of %s", -1.0)
        logger.warning("_compute_log_a_frac failed to converge after %d iterations", 1000)
    assert absl_records == ["Negative Renyi divergence of -1.0"]


# -- epochs= instead of steps, as in tensorflow-privacy and Opacus ---------------


@pytest.mark.parametrize(
    "epochs, num_examples, batch_size, steps",
    [(3, 60_000, 256, 704), (0.3, 1_000, 100, 3), (2, 1_000, 10, 200), (1e-9, 1_000, 10, 1)],
)
def test_epochs_account_ceil_of_epochs_n_over_b_steps(epochs, num_examples, batch_size, steps):
    # steps = ceil(epochs * N / B), computed here by hand, and epsilon against
    # a direct dp_accounting call on that many Poisson steps.
    assert accounting.steps_for_epochs(
        epochs, num_examples=num_examples, batch_size=batch_size) == steps
    expected = reference_epsilon(
        [poisson(steps, batch_size / num_examples, 1.1)], 1e-6, "rdp")
    got = compute_epsilon(num_examples=num_examples, batch_size=batch_size, epochs=epochs,
                          noise_multiplier=1.1, delta=1e-6, accountant="rdp")
    assert got == pytest.approx(expected, rel=1e-12)


def test_calibration_with_epochs_meets_the_target_on_those_steps():
    sigma = calibrate_noise_multiplier(2.0, 1e-5, num_examples=60_000, batch_size=256,
                                       epochs=3, accountant="rdp")
    spent = reference_epsilon([poisson(704, 256 / 60_000, sigma)], 1e-5, "rdp")
    assert 0.99 * 2.0 <= spent <= 2.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(steps=10, epochs=1), "not both"),
        (dict(steps=None, epochs=0), "epochs must be a finite number > 0"),
        (dict(steps=None, epochs=-2), "epochs must be a finite number > 0"),
        (dict(steps=None, epochs=float("nan")), "epochs must be a finite number > 0"),
        (dict(steps=None, epochs=True), "epochs must be a finite number > 0"),
    ],
)
def test_epochs_misuse_raises_naming_the_fix(overrides, message):
    settings = dict(num_examples=1_000, batch_size=10, steps=10, noise_multiplier=1.0,
                    delta=1e-4, accountant="rdp")
    settings.update(overrides)
    with pytest.raises(PrivacyConfigurationError, match=message):
        compute_epsilon(**settings)
    settings.pop("noise_multiplier")
    with pytest.raises(PrivacyConfigurationError, match=message):
        calibrate_noise_multiplier(1.0, settings.pop("delta"), **settings)


def test_epochs_with_a_schedule_raises():
    schedule = BatchSizeSchedule.constant(10, 100, num_examples=1_000, micro_batch_size=100)
    with pytest.raises(PrivacyConfigurationError, match="BatchSizeSchedule sets the steps"):
        compute_epsilon(schedule=schedule, epochs=2, noise_multiplier=1.0, delta=1e-4)
    with pytest.raises(PrivacyConfigurationError, match="BatchSizeSchedule sets the steps"):
        calibrate_noise_multiplier(1.0, 1e-4, schedule=schedule, epochs=2)


def test_neither_steps_nor_epochs_names_both():
    with pytest.raises(ValueError, match=r"steps \(or epochs\)"):
        compute_epsilon(num_examples=1_000, batch_size=10, noise_multiplier=1.0, delta=1e-4)


# -- The run description ------------------------------------------------------------


def test_a_run_is_described_once_and_every_entry_point_accounts_that_description():
    schedule = BatchSizeSchedule([Phase(20, 100, 4), Phase(10, 300, 10, noise_multiplier=2.0)],
                                 num_examples=5_000, micro_batch_size=64)
    for fields in (dict(schedule=schedule, noise_multiplier=1.2),
                   dict(num_examples=5_000, batch_size=100, epochs=2, noise_multiplier=1.2,
                        max_batch_size=400)):
        run = accounting.RunDescription(**fields)
        # N is the run's, whichever way it was described.
        assert run.num_examples == 5_000
        assert PrivacyAccountant.for_run(1e-5, accountant="rdp", **fields).ledger == run.ledger()
        accountant = PrivacyAccountant(5_000, 1e-5, accountant="rdp", ledger=run.ledger())
        assert run.dp_event() == accountant.dp_event()
        assert compute_epsilon(delta=1e-5, accountant="rdp", **fields) == accountant.epsilon()
    assert run.ledger().entries == (LedgerEntry(100, 0.02, 1.2, 400),)  # ceil(2 * 5000 / 100)
    # Fixed once built; a changed copy is checked again.
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.noise_multiplier = 0.5
    with pytest.raises(ValueError, match="not differentially private"):
        dataclasses.replace(run, noise_multiplier=0.0)


def test_a_description_is_checked_when_it_is_built():
    schedule = BatchSizeSchedule.constant(10, 100, num_examples=1_000, micro_batch_size=100)
    with pytest.raises(ValueError, match="differs from the schedule"):
        accounting.RunDescription(schedule=schedule, num_examples=999, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="not both"):
        accounting.RunDescription(schedule=schedule, batch_size=100, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="Phase 0 of the schedule sets no noise_multiplier"):
        accounting.RunDescription(schedule=schedule)
    with pytest.raises(TypeError, match="must be a BatchSizeSchedule"):
        accounting.RunDescription(schedule=[(10, 100)], noise_multiplier=1.0)
    with pytest.raises(ValueError, match="pass num_examples, noise_multiplier"):
        accounting.RunDescription(batch_size=10, steps=5)


def test_calibration_takes_the_run_without_its_noise_multiplier():
    with pytest.raises(TypeError, match="noise_multiplier"):
        calibrate_noise_multiplier(1.0, 1e-5, num_examples=1_000, batch_size=10, steps=10,
                                   noise_multiplier=1.0)


# -- Sampling kinds ---------------------------------------------------------------


def test_a_sampling_kind_without_an_accounting_rule_raises(monkeypatch):
    # A kind registered (say, balls-in-bins) but given no rule for the
    # accountant used to fall through to Poisson and report its epsilon.
    monkeypatch.setitem(events._KINDS, "balls_in_bins",
                        events.SamplingKind("balls_in_bins", step_event=None))
    ledger = PrivacyLedger([LedgerEntry(10, 0.01, 1.0, sampling="balls_in_bins")])
    account = PrivacyAccountant(1_000, 1e-4, accountant="rdp", ledger=ledger)
    with pytest.raises(PrivacyConfigurationError, match="No accounting rule.*balls_in_bins"):
        account.epsilon()
    with pytest.raises(PrivacyConfigurationError, match="No accounting rule"):
        account.dp_event()


# One row per registered sampling kind: the event of one step of `entry`, built
# directly with dp_accounting, and whether its epsilon carries a warning. A kind
# registered without a row here fails `test_every_sampling_kind_has_a_test_row`.
def _poisson_step(entry, num_examples):
    if entry.max_batch_size:
        return dp_accounting.TruncatedSubsampledGaussianDpEvent(
            num_examples, entry.sampling_rate, entry.max_batch_size, entry.noise_multiplier)
    return dp_accounting.PoissonSampledDpEvent(
        entry.sampling_rate, dp_accounting.GaussianDpEvent(entry.noise_multiplier))


SAMPLING_ROWS = {
    # kind: (reference step event, truncates, warns)
    "poisson": (_poisson_step, True, False),
    "shuffle": (_poisson_step, False, True),  # accounted as if Poisson, with a warning
}

# The noise records of the segment rows below: a BandMF of 4 bands and a BLT
# of 2 buffers (given parameters: no optimization in a table), as their
# mechanisms write them into a ledger.
BANDMF_RECORD = accounting.noise.BandMF(4).resolve(16).record()
BLT_RECORD = accounting.noise.BLT(2, buffer_decays=(0.9, 0.5),
                                  output_scales=(0.1, 0.2)).resolve(8).record()


# The kinds accounted by noise segment (correlated noise's samplers): the noise
# fields of an entry of the kind, and the event of a segment of that one entry
# (7 steps, N = 1,000) built directly from matrix_factorization and dp_accounting.
def _cyclic_segment(entry, num_examples):
    # 7 steps in windows of L = 4 from group 0: 2 rounds over groups of 250.
    if entry.max_batch_size:
        return dp_accounting.SelfComposedDpEvent(dp_accounting.TruncatedSubsampledGaussianDpEvent(
            250, entry.sampling_rate, entry.max_batch_size, entry.noise_multiplier), 2)
    return mf.cyclic_poisson_event(entry.noise_multiplier, num_examples=num_examples,
                                   batch_size=5, steps=7, cycle_length=4, num_bands=4)


def _fixed_order_segment(entry, num_examples):
    return mf.fixed_order_event(entry.noise_multiplier, mf.Sensitivity(1.9, True))


SEGMENT_ROWS = {
    # kind: (noise fields, reference segment event, truncates, warns)
    "cyclic_poisson": (dict(noise=BANDMF_RECORD, cycle_length=4),
                       _cyclic_segment, True, False),
    # Warns of its (zero-out) adjacency.
    "fixed_order": (dict(noise=BLT_RECORD, steps_per_epoch=2,
                         participations=4, sensitivity=1.9), _fixed_order_segment, False, True),
}

# One row per registered accountant: a fresh dp_accounting reference engine.
ACCOUNTANT_ROWS = {
    "pld": lambda: pld.PLDAccountant(value_discretization_interval=1e-4),
    "rdp": rdp.RdpAccountant,
}


# One row per kind of the ledger itself (steps-only, no sampler draws it):
# what its refusal says, and whether its epsilon is infinite (reports state
# it) rather than unknown (reports refuse).
REFUSED_ROWS = {
    "noiseless": ("applied with noise_multiplier 0.*Train with noise_multiplier > 0", True),
    "unaccounted": ("cannot be accounted.*Train with a PrivacyCallback", False),
}


def _stored(entry):
    """`entry` after the round trip of the optimizer's ledger variable (its JSON)."""
    [stored] = PrivacyLedger.from_json(PrivacyLedger([entry]).to_json()).entries
    return stored


def test_samplers_name_their_kind_whose_event_is_registered_once():
    from tf_megadp.data import PoissonSampler, PrivacyUnitSampler, ShuffleSampler

    kinds = {sampler: sampler.sampling_kind
             for sampler in (PoissonSampler, PrivacyUnitSampler, ShuffleSampler)}
    assert kinds == {PoissonSampler: "poisson", PrivacyUnitSampler: "poisson",
                     ShuffleSampler: "shuffle"}
    # The event lives with the kind only: a sampler has none of its own that
    # could differ from what the accountant composes.
    assert not any(hasattr(sampler, "step_event") for sampler in kinds)


def test_every_sampling_kind_has_a_test_row():
    assert set(accounting.sampling_kinds()) == set(SAMPLING_ROWS) | set(SEGMENT_ROWS)
    assert set(events._KINDS) == set(SAMPLING_ROWS) | set(SEGMENT_ROWS) | set(REFUSED_ROWS)


@pytest.mark.parametrize("kind", sorted(REFUSED_ROWS))
def test_each_ledger_kind_records_steps_only_and_is_refused_with_its_own_message(kind):
    message, infinite = REFUSED_ROWS[kind]
    registered = events.sampling_kind(kind)
    assert (registered.steps_only, registered.step_event) == (True, None)
    assert registered.infinite_epsilon == infinite
    entry = LedgerEntry.steps_only(5, kind)
    assert _stored(entry) == entry
    with pytest.raises(ValueError, match="records a count of steps only"):
        LedgerEntry(5, 0.1, 1.0, sampling=kind)
    ledger = PrivacyLedger([LedgerEntry(3, 0.1, 1.0), entry])
    assert ledger.total_steps == 8
    account = PrivacyAccountant(1_000, 1e-4, accountant="rdp", ledger=ledger)
    for refused in (account.epsilon, account.dp_event):
        with pytest.raises(PrivacyConfigurationError, match="^5 logical steps.*" + message):
            refused()
    # The other refused kinds' messages are not this one's.
    for other, (other_message, _) in REFUSED_ROWS.items():
        if other != kind:
            with pytest.raises(PrivacyConfigurationError) as raised:
                account.epsilon()
            assert not re.search(other_message, str(raised.value))
    # No sampler, no plan: a run cannot be drawn or planned with this kind.
    assert kind not in accounting.sampling_kinds()
    with pytest.raises(ValueError, match="records a count of steps only"):
        compute_epsilon(num_examples=1_000, batch_size=10, steps=5, noise_multiplier=1.0,
                        delta=1e-4, sampling=kind)
    if infinite:
        assert ledger.infinite_epsilon_steps == 5 and ledger.unreportable_steps() is None
        report = account.report()
        assert report["epsilon"] == math.inf
        assert "5 logical steps had no noise" in " ".join(report["warnings"])
    else:
        assert ledger.infinite_epsilon_steps == 0 and ledger.unreportable_steps() == (kind, 5)
        with pytest.raises(PrivacyConfigurationError, match=message):
            account.report()


@pytest.mark.parametrize("kind", sorted(SAMPLING_ROWS))
def test_each_sampling_kind_makes_its_reference_event(kind, recwarn):
    reference, truncates, warns = SAMPLING_ROWS[kind]
    registered = events.sampling_kind(kind)
    assert (registered.truncates, bool(registered.warning)) == (truncates, warns)
    for max_batch_size in (0, 30) if truncates else (0,):
        entry = LedgerEntry(7, 0.02, 1.3, max_batch_size, kind)
        assert _stored(entry) == entry
        assert events.entry_event(entry, 1_000) == dp_accounting.SelfComposedDpEvent(
            reference(entry, 1_000), 7)
    if not truncates:
        with pytest.raises(ValueError, match="max_batch_size only applies"):
            LedgerEntry(7, 0.02, 1.3, 30, kind)
    report = PrivacyAccountant(1_000, 1e-4, accountant="rdp",
                               ledger=PrivacyLedger([LedgerEntry(7, 0.02, 1.3, 0, kind)])).report()
    assert bool(report["warnings"]) == warns


@pytest.mark.parametrize("kind", sorted(SEGMENT_ROWS))
def test_each_segment_kind_makes_its_reference_event(kind, recwarn):
    fields, reference, truncates, warns = SEGMENT_ROWS[kind]
    registered = events.sampling_kind(kind)
    assert (registered.truncates, bool(registered.warning)) == (truncates, warns)
    assert registered.step_event is None and registered.accounted
    for max_batch_size in (0, 30) if truncates else (0,):
        entry = LedgerEntry(7, 0.02, 1.3, max_batch_size, kind, segment_start=True, **fields)
        assert _stored(entry) == entry
        assert events.ledger_event([entry], 1_000) == dp_accounting.ComposedDpEvent(
            [reference(entry, 1_000)])
    report = PrivacyAccountant(1_000, 1e-4, accountant="rdp", ledger=PrivacyLedger([
        LedgerEntry(7, 0.02, 1.3, 0, kind, segment_start=True, **fields)])).report()
    assert bool(report["warnings"]) == warns


def test_sampling_kinds_need_their_own_name():
    with pytest.raises(ValueError, match="clashes"):
        accounting.register_sampling_kind(events.SamplingKind("poisson", step_event=None))
    with pytest.raises(ValueError, match="sampling must be one of"):
        LedgerEntry(1, 0.1, 1.0, sampling="unregistered")


def test_every_accountant_has_a_test_row():
    assert set(accounting.accountant_names()) == set(ACCOUNTANT_ROWS)


@pytest.mark.parametrize("name", sorted(ACCOUNTANT_ROWS))
def test_each_accountant_matches_its_reference_engine(name):
    run = [poisson(300, 0.01, 1.1), poisson(100, 0.05, 2.0)]
    expected = ACCOUNTANT_ROWS[name]().compose(dp_accounting.ComposedDpEvent(run)).get_epsilon(1e-5)
    ledger = PrivacyLedger([LedgerEntry(300, 0.01, 1.1), LedgerEntry(100, 0.05, 2.0)])
    got = PrivacyAccountant(10_000, 1e-5, accountant=name, ledger=ledger).epsilon()
    assert got == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="already registered"):
        accounting.register_accountant(name)(ACCOUNTANT_ROWS[name])


# -- The report ------------------------------------------------------------------


def test_report_is_publishable_json_and_reproduces_epsilon(tmp_path):
    account = PrivacyAccountant(num_examples=50_000, delta=1e-6, accountant="rdp")
    account.record(300, sampling_rate=0.01, noise_multiplier=1.3)
    path = tmp_path / "privacy.json"
    account.save_report(path, settings={"l2_norm_clip": 1.0})
    report = json.loads(path.read_text())
    assert report["epsilon"] == pytest.approx(account.epsilon())
    assert report["delta"] == 1e-6 and report["steps"] == 300
    assert report["accountant"] == "rdp" and report["num_examples"] == 50_000
    assert report["privacy_unit"] == "example"
    assert report["sampling"]["accounted_as"] == "poisson"
    assert report["settings"] == {"l2_norm_clip": 1.0}
    assert PrivacyAccountant.from_report(report).epsilon() == pytest.approx(report["epsilon"])
    assert [p.name for p in tmp_path.iterdir()] == ["privacy.json"]  # No temp left.


def test_steps_within_budget_agrees_with_a_naive_search():
    account = PrivacyAccountant(num_examples=10_000, delta=1e-5, accountant="rdp")
    account.record(40, sampling_rate=0.01, noise_multiplier=1.0)
    step = LedgerEntry(1, 0.02, 1.0)

    def epsilon_after(extra):
        trial = account.ledger.copy()
        trial.append(LedgerEntry(extra, 0.02, 1.0))
        return account.epsilon(trial)

    target = (epsilon_after(25) + epsilon_after(26)) / 2
    naive = 0
    while epsilon_after(naive + 1) <= target:
        naive += 1
    assert naive == 25
    assert account.steps_within_budget(target, step) == naive
    assert account.steps_within_budget(target, step, limit=100) == naive
    assert account.steps_within_budget(target, step, limit=10) == 10
    assert account.steps_within_budget(target, step, limit=25) == 25
    assert account.steps_within_budget(account.epsilon() * 1.0001, step) == 0


# -- Bad input -------------------------------------------------------------------


@pytest.mark.parametrize("delta", [0, 1, -1e-5, 1.5, float("nan")])
def test_delta_outside_the_open_unit_interval_is_rejected(delta):
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        PrivacyAccountant(num_examples=1_000, delta=delta)


def test_delta_above_one_over_n_warns():
    with pytest.warns(UserWarning, match="larger than 1/N"):
        PrivacyAccountant(num_examples=1_000, delta=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrivacyAccountant(num_examples=1_000, delta=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(batch_size=2_000), "larger than num_examples"),
        (dict(noise_multiplier=0.0), "not differentially private"),
        (dict(noise_multiplier=-1.0), "noise_multiplier must be"),
        (dict(steps=-1), "steps must be >= 0"),
        (dict(sampling="random"), "sampling must be one of"),
        (dict(accountant="gdp"), "accountant must be one of"),
        (dict(batch_size=None), "pass batch_size"),
    ],
)
def test_invalid_runs_raise_clear_errors(overrides, message):
    settings = dict(num_examples=1_000, batch_size=10, steps=10, noise_multiplier=1.0,
                    delta=1e-4, accountant="rdp")
    settings.update(overrides)
    with pytest.raises(ValueError, match=message):
        compute_epsilon(**settings)


def test_sampling_rate_above_one_is_rejected():
    with pytest.raises(ValueError, match="larger than 1"):
        LedgerEntry(1, 1.5, 1.0)


@pytest.mark.slow
def test_coupling_bound_is_as_tight_as_the_exact_truncated_pld():
    # Rare truncation: the cheap coupling bound and dp_accounting's exact (and
    # ~10x slower) truncated PLD agree to 0.1 %. Run with `pytest -m slow`.
    schedule = BatchSizeSchedule.constant(
        500, 2_000, num_examples=200_000, micro_batch_size=512
    )
    (phase,) = schedule.phases
    exact = reference_epsilon(
        [dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(
                200_000, 0.01, schedule.capacity(phase), 1.0), 500)],
        1e-6, "pld",
    )
    got = compute_epsilon(schedule=schedule, noise_multiplier=1.0, delta=1e-6)
    assert got == pytest.approx(exact, rel=1e-3)


# -- Correlated noise (issue 39): every epsilon against dp_accounting's own events ------


def _gaussian_reference(sigma, delta, accountant):
    return reference_epsilon([dp_accounting.GaussianDpEvent(sigma)], delta, accountant)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_an_unsampled_gaussian_is_accounted_as_dp_accounting_accounts_it(accountant):
    # A fixed-order segment's event; the PLD accountant used to refuse it.
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(3.0),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3)])
    got = engines.TruncationAwareAccountant(accountant).compose(event).get_epsilon(1e-6)
    assert got == pytest.approx(reference_epsilon([event], 1e-6, accountant), rel=1e-12)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_bandmf_with_cyclic_poisson_equals_the_amplified_bandmf_event(accountant):
    noise = accounting.noise.BandMF(num_bands=8)
    got = compute_epsilon(num_examples=60_000, batch_size=250, steps=1_000, noise_multiplier=1.0,
                          delta=1e-6, noise=noise, cycle_length=8, accountant=accountant)
    event = mf.cyclic_poisson_event(1.0, num_examples=60_000, batch_size=250, steps=1_000,
                                    cycle_length=8, num_bands=8)
    assert got == pytest.approx(reference_epsilon([event], 1e-6, accountant), rel=1e-9)


def test_a_correlated_noise_run_after_a_release_composes_the_release_then_its_segment():
    # --init-from a release, continued with BandMF: the release's Poisson steps,
    # then the run's own segment from its step 0.
    prior = PrivacyLedger()
    prior.record(300, sampling_rate=0.004, noise_multiplier=0.9)
    noise = accounting.noise.BandMF(num_bands=4)
    got = compute_epsilon(num_examples=60_000, batch_size=250, steps=400, noise_multiplier=1.0,
                          delta=1e-6, noise=noise, cycle_length=4, accountant="rdp",
                          prior=prior)
    event = mf.cyclic_poisson_event(1.0, num_examples=60_000, batch_size=250, steps=400,
                                    cycle_length=4, num_bands=4)
    assert got == pytest.approx(
        reference_epsilon([poisson(300, 0.004, 0.9), event], 1e-6, "rdp"), rel=1e-9)
    [released, segment] = RunDescription(
        num_examples=60_000, batch_size=250, steps=400, noise_multiplier=1.0, noise=noise,
        cycle_length=4, prior=prior).ledger().entries
    assert (released.sampling, segment.sampling, segment.segment_start) == (
        "poisson", "cyclic_poisson", True)


def test_a_growing_schedule_of_whole_rounds_accounts_each_round_with_its_own_q():
    noise = accounting.noise.BandMF(num_bands=4)
    schedule = BatchSizeSchedule([Phase(40, 100, 4), Phase(20, 300, 8)], num_examples=10_000,
                                 micro_batch_size=64)
    run = RunDescription(schedule=schedule, noise_multiplier=1.2, noise=noise, cycle_length=4)
    # 10 rounds at q = 4 * 100 / N and 5 at 4 * 300 / N, over groups of N / 4,
    # truncated at each phase's capacity (256, 512).
    assert run.dp_event() == dp_accounting.ComposedDpEvent([dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.TruncatedSubsampledGaussianDpEvent(
            2_500, q, capacity, 1.2), count)
        for count, q, capacity in [(10, 0.04, 256), (5, 0.12, 512)]])])
    # Truncation is rare: RDP's coupling bound, within its slack of the untruncated rounds.
    got = compute_epsilon(schedule=schedule, noise_multiplier=1.2, delta=1e-6, noise=noise,
                          cycle_length=4, accountant="rdp")
    untruncated = reference_epsilon([dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.2)), count)
        for count, q in [(10, 0.04), (5, 0.12)]], 1e-6, "rdp")
    assert untruncated <= got <= untruncated * 1.01
    with pytest.raises(PrivacyConfigurationError, match="belong to one round"):
        compute_epsilon(schedule=BatchSizeSchedule([Phase(42, 100, 4), Phase(18, 300, 8)],
                                                   num_examples=10_000, micro_batch_size=64),
                        noise_multiplier=1.2, delta=1e-6, noise=noise, cycle_length=4)


@pytest.mark.parametrize("mechanism", ["bandmf", "blt"])
def test_fixed_order_epochs_are_one_gaussian_of_sigma_over_the_minsep_sensitivity(mechanism):
    noise = (accounting.noise.BandMF(num_bands=16) if mechanism == "bandmf"
             else accounting.noise.BLT(num_buffers=3))
    with pytest.warns(UserWarning, match="zero-out adjacency"):
        got = compute_epsilon(num_examples=10_000, batch_size=100, steps=400,
                              noise_multiplier=6.0, delta=1e-6, noise=noise,
                              sampling="fixed_order")
    # 4 epochs of s = 100 steps; the strategy's column from the mechanism itself.
    strategy = noise.resolve(400, steps_per_epoch=100)
    sens = mf.minsep_sensitivity(strategy.column(400), 400, min_separation=100,
                                 max_participations=4)
    assert sens.exact and (mechanism == "blt" or sens.value == pytest.approx(2.0))
    assert got == pytest.approx(_gaussian_reference(6.0 / sens.value, 1e-6, "pld"), rel=1e-9)


def test_two_noise_segments_compose_each_on_its_own_steps():
    """A run restarted at step 6 (cycle 4): two segments, the second from group 2."""
    common = dict(sampling="cyclic_poisson", noise=BANDMF_RECORD, cycle_length=4)
    ledger = PrivacyLedger([
        LedgerEntry(6, 0.08, 1.1, segment_start=True, **common),
        LedgerEntry(10, 0.08, 1.1, segment_start=True, cycle_position=2, **common)])
    got = PrivacyAccountant(1_000, 1e-5, accountant="rdp", ledger=ledger).epsilon()
    # Steps 0..5: rounds [0, 4) and [4, 6); steps 6..15: [6, 8), [8, 12), [12, 16).
    rounds = dp_accounting.PoissonSampledDpEvent(0.08, dp_accounting.GaussianDpEvent(1.1))
    assert got == pytest.approx(reference_epsilon(
        [dp_accounting.SelfComposedDpEvent(rounds, 2),
         dp_accounting.SelfComposedDpEvent(rounds, 3)], 1e-5, "rdp"), rel=1e-9)
    # One segment of the 16 steps would be 4 rounds: the restart costs one.
    one = PrivacyLedger([LedgerEntry(16, 0.08, 1.1, segment_start=True, **common)])
    assert PrivacyAccountant(1_000, 1e-5, accountant="rdp", ledger=one).epsilon() < got


@pytest.mark.parametrize("run, message", [
    (dict(noise="bandmf"), "Poisson sampling without cycles under BandMF"),
    (dict(noise="bandmf", cycle_length=2), "cycle_length = 2 is smaller than num_bands = 4"),
    (dict(noise="blt", cycle_length=4), "no privacy proof under Poisson or cyclic Poisson"),
    (dict(noise="bandmf", sampling="shuffle"), "no privacy proof with 'shuffle' batches"),
    (dict(noise=None, cycle_length=4, sampling="shuffle"), "describes cyclic Poisson"),
    (dict(noise=None, cycle_length=40), r"q = B L / N = 4 > 1"),
])
def test_a_run_without_a_proof_is_refused_naming_the_fix(run, message):
    noise = {"bandmf": accounting.noise.BandMF(4),
             "blt": accounting.noise.BLT(2), None: None}[run.pop("noise")]
    with pytest.raises(PrivacyConfigurationError, match=message):
        compute_epsilon(num_examples=1_000, batch_size=100, steps=40, noise_multiplier=2.0,
                        delta=1e-5, noise=noise, **run)


def test_calibration_takes_the_mechanism():
    noise = accounting.noise.BandMF(num_bands=4)
    run = dict(num_examples=60_000, batch_size=250, steps=1_000, noise=noise, cycle_length=4)
    sigma = calibrate_noise_multiplier(4.0, 1e-6, accountant="rdp", **run)
    assert 0.99 * 4.0 <= compute_epsilon(noise_multiplier=sigma, delta=1e-6, accountant="rdp",
                                         **run) <= 4.0
    # The rounds of L = 4 steps amplify like DP-SGD at 4 B over T / 4 steps.
    assert sigma == pytest.approx(calibrate_noise_multiplier(
        4.0, 1e-6, accountant="rdp", num_examples=60_000, batch_size=1_000, steps=250),
        rel=1e-6)


def test_a_noise_multiplier_too_small_for_a_pld_grid_is_refused_naming_rdp():
    # Before: sigma 1e-3 (clipping without noise, a diagnosis run) asked
    # dp_accounting for a 38 GiB privacy-loss grid and died of it.
    with pytest.raises(PrivacyConfigurationError, match=r"5,09\d,\d{3},\d{3} points.*'rdp'"):
        compute_epsilon(num_examples=5_000, batch_size=1_000, steps=10, noise_multiplier=1e-3,
                        delta=1e-5, accountant="pld")
    # RDP accounts the same run at once; a sigma at the limit still builds its PLD.
    assert compute_epsilon(num_examples=5_000, batch_size=1_000, steps=10,
                           noise_multiplier=1e-3, delta=1e-5, accountant="rdp") > 1e4
    assert engines.pld_grid_points(poisson(1, 0.2, 0.05)) < engines.PLD_GRID_LIMIT
