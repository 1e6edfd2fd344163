"""Specification of one-run auditing: the bound, the secret coins, canaries, and failing broken steps."""

import copy
import math
import pickle
from fractions import Fraction

import h5py
import keras
import numpy as np
import pytest
from scipy import optimize, stats

import tf_megadp
from tf_megadp import audit
from tf_megadp.audit import planted_bugs
from tf_megadp.audit.audit_run import one_run_audit_run
from tf_megadp.errors import PrivacyConfigurationError

pytestmark = pytest.mark.filterwarnings(
    "ignore:CanaryCoins\\(seed=:UserWarning",
    "ignore:DPOptimizer with noise_multiplier=0:UserWarning",
)


# ----------------------------------------------------------------------------
# The bound, against independent references
# ----------------------------------------------------------------------------


def _exact_tail(r, v, p):
    """P[Binomial(r, p) >= v] in exact rational arithmetic (p a Fraction)."""
    return sum(math.comb(r, j) * p**j * (1 - p) ** (r - j) for j in range(v, r + 1))


def _reference_p_value(m, r, v, epsilon, delta):
    """Theorem 5.2 of Steinke et al. written out term by term, in exact arithmetic."""
    p = Fraction(1) / (1 + Fraction(math.exp(-epsilon)))
    f = lambda w: _exact_tail(r, max(w, 0), p)  # noqa: E731
    ratio = max(((f(v - i) - f(v)) / i for i in range(1, v + 1)), default=Fraction(0))
    return float(min(f(v) + 2 * m * Fraction(delta) * ratio, 1))


@pytest.mark.parametrize("m,r,v,epsilon,delta", [
    (100, 40, 35, 1.0, 0.0), (100, 40, 35, 1.0, 1e-3), (50, 50, 50, 3.0, 1e-4),
    (30, 10, 0, 0.5, 0.01), (200, 60, 41, 0.0, 1e-5), (80, 80, 70, 2.5, 1e-6),
])
def test_p_value_is_the_theorem_evaluated_exactly(m, r, v, epsilon, delta):
    assert audit.one_run_p_value(m, r, v, epsilon, delta) == pytest.approx(
        _reference_p_value(m, r, v, epsilon, delta), rel=1e-9, abs=1e-15)


def test_without_delta_the_count_is_dominated_by_randomized_response():
    # An epsilon-DP guess is at best right with probability e^eps / (1 + e^eps).
    for r, v, epsilon in [(100, 80, 1.0), (1000, 900, 2.0), (20, 20, 5.0)]:
        accuracy = math.exp(epsilon) / (1 + math.exp(epsilon))
        assert audit.one_run_p_value(5000, r, v, epsilon) == pytest.approx(
            stats.binomtest(v, r, accuracy, alternative="greater").pvalue)


def _leaky_randomized_response(m, epsilon, delta_true):
    """P[correct = v] when each of m guesses faces an exactly (eps, delta)-DP mechanism.

    Canary i's output is S_i with probability delta + (1 - delta) q and -S_i
    otherwise (q = e^eps / (1 + e^eps)): with probability delta the bit
    leaks, else randomized response. P[out = s | S = s] = delta + (1 - delta) q
    = e^eps P[out = s | S = -s] + delta, so it is (eps, delta)-DP and no
    better. The attacker guesses every output.
    """
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    return stats.binom.pmf(np.arange(m + 1), m, delta_true + (1 - delta_true) * q)


@pytest.mark.parametrize("epsilon,delta", [(1.0, 0.0), (1.0, 2e-3), (3.0, 1e-3), (0.5, 5e-3)])
def test_p_value_covers_an_exactly_dp_mechanism_and_needs_its_delta_term(epsilon, delta):
    m = 300
    pmf = _leaky_randomized_response(m, epsilon, delta)
    tail = np.cumsum(pmf[::-1])[::-1]  # P[correct >= v]
    p_values = np.array([audit.one_run_p_value(m, m, v, epsilon, delta) for v in range(m + 1)])
    assert np.all(tail <= p_values + 1e-12)
    # The confidence holds exactly: the bound exceeds the true epsilon with
    # probability at most 5 %.
    bounds = np.array([audit.one_run_epsilon_lower_bound(m, m, v, delta=delta) for v in range(m + 1)])
    assert pmf[bounds > epsilon].sum() <= 0.05
    if delta > 0:
        # Teeth: leaving out the delta term, the same count overshoots.
        no_delta = np.array([audit.one_run_p_value(m, m, v, epsilon, 0.0) for v in range(m + 1)])
        assert np.any(tail > no_delta + 1e-6)


def test_bound_is_tight_for_randomized_response_and_the_naive_estimate_is_not():
    # Pure randomized response is the worst case of the theorem: the 95 %
    # bound exceeds the truth with probability just under 5 %.
    m, epsilon = 2000, 1.0
    pmf = _leaky_randomized_response(m, epsilon, 0.0)
    bounds = np.array([audit.one_run_epsilon_lower_bound(m, m, v) if pmf[v] > 1e-12 else 0.0
                       for v in range(m + 1)])
    assert 0.04 < pmf[bounds > epsilon].sum() <= 0.05
    mean_bound = float(pmf @ bounds)
    assert 0.8 * epsilon < mean_bound < epsilon
    v = np.arange(1, m)
    naive = np.log(v / (m - v))  # the observed accuracy's log-odds, no confidence
    assert pmf[1:m][naive > epsilon].sum() > 0.4


def test_p_value_is_monotone_so_bisection_finds_the_edge():
    for m, r, v, delta in [(1000, 200, 180, 1e-6), (500, 50, 50, 1e-4), (2000, 1000, 700, 0.0)]:
        epsilons = np.linspace(0, 12, 121)
        values = [audit.one_run_p_value(m, r, v, e, delta) for e in epsilons]
        assert np.all(np.diff(values) >= -1e-12)
        bound = audit.one_run_epsilon_lower_bound(m, r, v, delta=delta)
        assert audit.one_run_p_value(m, r, v, bound, delta) < 0.05
        assert audit.one_run_p_value(m, r, v, bound + 1e-5, delta) >= 0.05
    assert audit.one_run_epsilon_lower_bound(1000, 100, 50) == 0.0  # chance certifies nothing


def test_more_canaries_cannot_certify_more_than_their_number_allows():
    # Perfect guesses on r canaries certify about log(r / 3) nats at 95 %.
    for r in (100, 1000, 10000):
        bound = audit.one_run_epsilon_lower_bound(r, r, r)
        assert bound == pytest.approx(math.log(r / 3), abs=0.15)
    # The delta term grows with m: at delta = 1 / m the same guesses certify less.
    assert (audit.one_run_epsilon_lower_bound(10000, 5000, 5000, delta=1e-4)
            < audit.one_run_epsilon_lower_bound(10000, 5000, 5000, delta=1e-7) - 0.3)


def test_counts_are_validated():
    with pytest.raises(ValueError, match="num_correct <= num_guesses"):
        audit.one_run_p_value(10, 5, 6, 1.0)
    with pytest.raises(ValueError, match="delta"):
        audit.one_run_epsilon_lower_bound(10, 5, 5, delta=1.0)
    with pytest.raises(ValueError, match="confidence"):
        audit.one_run_epsilon_lower_bound(10, 5, 5, confidence=1.0)


def _gaussian_delta(epsilon, mu):
    """delta(eps) of the Gaussian mechanism with sensitivity / sigma = mu (Balle & Wang 2018)."""
    return stats.norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * stats.norm.cdf(
        -mu / 2 - epsilon / mu)


def test_whole_audit_with_rule_selection_stays_below_a_gaussian_mechanisms_epsilon():
    # Scores N(mu S, 1): a Gaussian mechanism per canary, (eps, delta)-DP on
    # the curve. The audit picks the best of its rules; Bonferroni pays for it.
    mu, delta, m = 3.0, 1e-6, 2000
    epsilon = optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, 50.0)
    bounds = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        included = rng.random(m) < 0.5
        scores = rng.normal(size=m) + mu * included
        bounds.append(audit.one_run_audit(scores, included, delta=delta).epsilon_lower_bound)
    bounds = np.array(bounds)
    assert np.all(bounds < epsilon)
    assert bounds.mean() > 2.5  # informative: several nats certified


def test_rules_are_a_fixed_family_paid_for_with_bonferroni():
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    scores = rng.normal(size=1000) + 2.0 * included
    rules = [(10, 0), (100, 0), (100, 100)]
    result = audit.one_run_audit(scores, included, delta=1e-6, guesses=rules)
    for k_in, k_out, correct, bound in result.rules:
        guess = audit.guesses_from_scores(scores, k_in, k_out)
        assert correct == int(np.sum(guess == np.where(included, 1, -1)))
        assert bound == pytest.approx(audit.one_run_epsilon_lower_bound(
            1000, k_in + k_out, correct, delta=1e-6, confidence=1 - 0.05 / 3))
    assert result.epsilon_lower_bound == max(rule[3] for rule in result.rules)
    assert result.num_included == int(included.sum())
    assert audit.default_guesses(1000)[0] == (2, 0)


def test_guesses_break_ties_by_index_and_validate():
    np.testing.assert_array_equal(
        audit.guesses_from_scores([1.0, 1.0, 0.0, 1.0], k_in=2, k_out=1), [1, 1, -1, 0])
    with pytest.raises(ValueError, match="k_in \\+ k_out"):
        audit.guesses_from_scores([1.0, 2.0], k_in=2, k_out=1)
    with pytest.raises(ValueError, match="finite"):
        audit.guesses_from_scores([1.0, np.nan], k_in=1)


# ----------------------------------------------------------------------------
# The auditor's coins
# ----------------------------------------------------------------------------


def test_coins_stay_secret_until_scored_and_are_scored_once():
    coins = audit.CanaryCoins(64)
    assert "64 canaries, secret, not scored" in repr(coins)
    # No attribute holds the coins where vars() shows them (before: the
    # name-mangled _CanaryCoins__included array did).
    assert not any(isinstance(value, np.ndarray) for value in vars(coins).values())
    with pytest.raises(RuntimeError, match="secret until the audit is scored"):
        coins.reveal()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(coins)
    with pytest.raises(TypeError, match="cannot be pickled"):
        copy.deepcopy(coins)
    result = coins.score(np.arange(64.0), delta=0.0)
    included = coins.reveal()
    assert result.num_included == included.sum()
    with pytest.raises(RuntimeError, match="already scored"):
        coins.score(np.arange(64.0), delta=0.0)
    # Fair and fresh: two secret draws differ, and a large draw is balanced.
    assert not np.array_equal(audit.CanaryCoins(64)._included(), audit.CanaryCoins(64)._included())
    assert abs(audit.CanaryCoins(100_000)._included().mean() - 0.5) < 0.01


def test_seeded_coins_warn_and_are_marked():
    with pytest.warns(UserWarning, match="certifies nothing"):
        coins = audit.CanaryCoins(10, seed=3)
    assert coins.seeded and "seeded (not secret)" in repr(coins)
    assert coins.score(np.zeros(10), delta=0.0).seeded


def test_several_attacks_on_one_set_of_coins_share_the_confidence():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=500)
    coins = audit.CanaryCoins(500, seed=1)
    included = coins._included()
    scores = scores + 3.0 * included
    results = coins.score_attacks({"a": scores, "b": -scores}, delta=1e-6)
    alone = audit.one_run_audit(scores, included, delta=1e-6, confidence=1 - 0.05 / 2)
    assert results["a"].epsilon_lower_bound == alone.epsilon_lower_bound
    assert results["a"].confidence == 0.95
    assert results["b"].epsilon_lower_bound == 0.0  # the reversed attack certifies nothing
    with pytest.raises(RuntimeError, match="already scored"):
        coins.score(scores, delta=1e-6)


# ----------------------------------------------------------------------------
# White-box scores
# ----------------------------------------------------------------------------


def test_white_box_score_is_the_presence_likelihood_ratio():
    rng = np.random.default_rng(2)
    steps, m, q, sigma = 50, 400, 0.1, 0.7
    present = rng.random((steps, m)) < q
    observations = present + sigma * rng.normal(size=(steps, m))
    scores = audit.white_box_scores(observations, np.full(steps, q), shift=np.ones(steps))
    # Reference: the mixture density ratio written with scipy, using the
    # same robust centre and scale of each step.
    centre = np.median(observations, axis=1, keepdims=True)
    scale = stats.median_abs_deviation(observations, axis=1, scale="normal")[:, None]
    z = (observations - centre) / scale
    mu = 1.0 / scale
    reference = np.log((1 - q) + q * stats.norm.pdf(z - mu) / stats.norm.pdf(z)).sum(axis=0)
    np.testing.assert_allclose(scores, reference, rtol=1e-9, atol=1e-9)
    # With the claimed sigma instead of a measured shift: a negative signal
    # orients records that presences move downwards.
    claimed = audit.white_box_scores(observations, q, noise_multipliers=np.full(steps, sigma))
    flipped = audit.white_box_scores(-observations, q, noise_multipliers=np.full(steps, sigma),
                                     signal=-1.0)
    np.testing.assert_allclose(flipped, claimed)
    assert stats.spearmanr(claimed, present.sum(axis=0)).statistic > 0.3
    with pytest.raises(ValueError, match="non-zero"):
        audit.white_box_scores(observations, q, shift=np.ones(steps), signal=0.0)


# ----------------------------------------------------------------------------
# Gradient canaries in the DP step
# ----------------------------------------------------------------------------

FEATURES = 4


def _linear_model(spare):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES + spare,)), keras.layers.Dense(1)])


def _arrays(n, spare, seed=0):
    rng = np.random.default_rng(seed)
    x = np.zeros((n, FEATURES + spare), np.float32)
    x[:, :FEATURES] = rng.normal(size=(n, FEATURES))
    return x, x[:, :FEATURES].sum(axis=1, keepdims=True).astype(np.float32)


def _gradient_canary_run(m=300, steps=200, batch_size=20, n=400, sigma=0.0, lr=0.5,
                         callbacks=(), seed=0):
    x, y = _arrays(n, m, seed)
    schedule = tf_megadp.BatchSizeSchedule.constant(steps, batch_size, num_examples=n,
                                                    micro_batch_size=64)
    model = _linear_model(m)
    coordinates = audit.CanaryCoordinates.on_rows(
        model.layers[0].kernel, np.arange(FEATURES, FEATURES + m))
    canaries = audit.GradientCanaryAudit(model, schedule, coordinates, delta=1e-6, seed=seed)
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, schedule=schedule, seed=seed)
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(lr), l2_norm_clip=1.0, noise_multiplier=sigma, schedule=schedule,
        clipping=canaries.clipping(), seed=seed), loss="mse", steps_per_execution=25)
    history = model.fit(sampler.as_dataset(), verbose=0, callbacks=list(callbacks))
    return model, canaries, schedule, history


def test_gradient_canaries_are_dirac_gradients_of_norm_c_sampled_like_examples():
    steps, batch_size, n, lr = 200, 20, 400, 0.5
    model, canaries, schedule, _ = _gradient_canary_run(steps=steps, batch_size=batch_size, n=n,
                                                        lr=lr)
    observations, observed = canaries.recorder.observations()
    assert observed.all()
    # Without noise, each step moves a canary's weight by exactly one
    # presence, lr * C / B, or not at all: never two presences in one sum.
    presences = observations / (lr * 1.0 / batch_size)
    np.testing.assert_allclose(presences, np.round(presences), atol=1e-4)
    assert set(np.unique(np.round(presences))) <= {0.0, 1.0}
    # The records are the released iterates: the last one is the model's.
    np.testing.assert_allclose(canaries.recorder.current_values().numpy(),
                               model.layers[0].kernel.numpy()[FEATURES:, 0])
    result = canaries.score()
    included = canaries.coins.reveal()
    counts = np.round(presences).sum(axis=0)
    assert np.all(counts[~included] == 0)  # excluded canaries never enter a sum
    # Included ones join each step with the examples' rate q = B / N.
    q = schedule.sampling_rate(0)
    mean = counts[included].mean()
    assert abs(mean - q * steps) < 4 * math.sqrt(q * (1 - q) * steps / included.sum())
    assert counts[included].var() == pytest.approx(q * (1 - q) * steps, rel=0.3)
    # Noise-free: every guess is right, and the bound is what the number of
    # canaries allows (90 perfect guesses out of 8 rules).
    assert result.num_correct == result.num_guesses == 90
    assert result.epsilon_lower_bound == pytest.approx(audit.one_run_epsilon_lower_bound(
        300, 90, 90, delta=1e-6, confidence=1 - 0.05 / 8))


def test_audit_secrets_never_reach_files_or_the_optimizer_variables(tmp_path):
    model, canaries, _, _ = _gradient_canary_run(m=50, steps=20, n=200)
    secret_names = {"canary_included", "canary_key", "canary_last_step", "canary_records"}
    assert not secret_names & {v.name for v in model.optimizer.variables}
    assert not secret_names & {v.name for v in model.variables}
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    names = []
    with h5py.File(path, "r") as handle:
        handle.visit(names.append)
    assert not any("canary" in name for name in names)
    assert "secret" in repr(canaries.coins) and "key" not in repr(canaries.coins)


def test_gradient_canaries_refuse_a_variable_the_loss_does_not_reach():
    class WithSpare(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.spare = self.add_weight(shape=(10,), initializer="zeros", name="spare")

        def call(self, x):
            return self.dense(x)

    model = WithSpare()
    model(np.zeros((1, FEATURES), np.float32))
    x, y = _arrays(100, 0)
    schedule = tf_megadp.BatchSizeSchedule.constant(5, 10, num_examples=100, micro_batch_size=32)
    canaries = audit.GradientCanaryAudit(
        model, schedule, audit.CanaryCoordinates((model.spare.path,) * 3, (0, 1, 2)),
        delta=1e-6, seed=0)
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), 1.0, 1.0, schedule=schedule, clipping=canaries.clipping(),
        seed=0), loss="mse")
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, schedule=schedule, seed=0)
    with pytest.raises(PrivacyConfigurationError, match="does not reach"):
        model.fit(sampler.as_dataset(), verbose=0)


def test_canary_coordinates_are_validated():
    model = _linear_model(10)
    kernel = model.layers[0].kernel
    with pytest.raises(ValueError, match="share a coordinate"):
        audit.CanaryCoordinates((kernel.path, kernel.path), (3, 3))
    with pytest.raises(ValueError, match="Rows must lie"):
        audit.CanaryCoordinates.on_rows(kernel, [FEATURES + 10])
    random = audit.CanaryCoordinates.random(model, 8, seed=0)
    assert len(set(zip(random.variable_paths, random.flat_indices))) == 8
    with pytest.raises(TypeError, match="BatchSizeSchedule"):
        audit.GradientCanaryAudit(model, None, random, delta=1e-6)


def test_audit_callback_scores_a_one_run_audit_into_the_logs():
    callback_holder = {}

    def run():
        x, y = _arrays(200, 100)
        schedule = tf_megadp.BatchSizeSchedule.constant(50, 10, num_examples=200,
                                                        micro_batch_size=32)
        model = _linear_model(100)
        canaries = audit.GradientCanaryAudit(model, schedule, audit.CanaryCoordinates.on_rows(
            model.layers[0].kernel, np.arange(FEATURES, FEATURES + 100)), delta=1e-6, seed=0)
        callback = audit.AuditCallback(one_run=canaries)
        callback_holder["callback"] = callback
        tf_megadp.make_private(model)
        model.compile(optimizer=tf_megadp.DPOptimizer(
            keras.optimizers.SGD(0.5), 1.0, 1.0, schedule=schedule,
            clipping=canaries.clipping(), seed=0), loss="mse", steps_per_execution=10)
        sampler = tf_megadp.PoissonSampler.from_arrays(x, y, schedule=schedule, seed=0)
        return model.fit(sampler.as_dataset(), verbose=0, callbacks=[callback]).history

    history = run()
    result = callback_holder["callback"].one_run_results["white_box"]
    assert history["audit_one_run_white_box_eps_lower_bound"] == [result.epsilon_lower_bound]
    assert history["audit_one_run_white_box_guesses"] == [result.num_guesses]
    with pytest.raises(ValueError, match="Nothing to audit"):
        audit.AuditCallback()
    with pytest.raises(TypeError, match="finish"):
        audit.AuditCallback(one_run=object())


# ----------------------------------------------------------------------------
# It must be able to fail: broken DP steps against the accountant's epsilon
# ----------------------------------------------------------------------------

# sigma for epsilon ~2 and ~8 at delta 1e-6 with q = 0.005 over 1000 steps
# (calibrate_noise_multiplier); each test asserts the accountant's epsilon
# of its own run, which is the claim the bound is set against.
SIGMA = {2.0: 0.8005, 8.0: 0.5266}
AUDIT = dict(num_canaries=2000, steps=1000, sampling_rate=0.005, delta=1e-6, seed=0,
             log=lambda line: None)


def _audit(epsilon, **settings):
    report = one_run_audit_run(noise_multiplier=SIGMA[epsilon], target_epsilon=epsilon,
                               **AUDIT, **settings)
    assert report["theoretical_epsilon"] == pytest.approx(epsilon, rel=0.02)
    return report


def test_correct_step_at_epsilon_2_stays_below_the_claim():
    report = _audit(2.0, canaries="gradient")
    bound = report["white_box"]["epsilon_lower_bound"]
    assert bound < report["theoretical_epsilon"]
    assert report["white_box"]["seeded"] and report["scoring"]["observed_steps"] == 1000


def test_correct_step_at_epsilon_8_is_certified_well_above_zero_and_below_the_claim():
    report = _audit(8.0, canaries="gradient")
    bound = report["white_box"]["epsilon_lower_bound"]
    assert 0.8 < bound < report["theoretical_epsilon"]


@pytest.mark.parametrize("bug", ["halved-noise", "double-counted"])
def test_gradient_canaries_catch_a_broken_noise_stage(bug):
    report = _audit(2.0, canaries="gradient", planted_bug=bug)
    # The ledger still reports epsilon 2; the audit proves it wrong.
    assert report["white_box"]["epsilon_lower_bound"] > report["theoretical_epsilon"]


def test_input_canaries_catch_an_example_that_escapes_the_clip():
    report = _audit(2.0, canaries="input", planted_bug="unclipped-example")
    for attack in ("white_box", "black_box"):
        assert report[attack]["epsilon_lower_bound"] > report["theoretical_epsilon"]


def test_input_canaries_on_the_correct_step_stay_below_the_claim():
    report = _audit(2.0, canaries="input")
    for attack in ("white_box", "black_box"):
        assert report[attack]["epsilon_lower_bound"] < report["theoretical_epsilon"]
    assert report["num_examples"] == 4000  # excluded canaries are weight-0 rows: N is fixed


@pytest.mark.slow
def test_fresh_secret_audits_hold_and_catch_every_bug():
    """Secret coins, noise and sampling (no seeds): 5 correct runs, 2 per bug.

    About 2 minutes on 2 cores. Figures for docs/audit.md come from
    benchmarks/one_run_audit_study.py.
    """
    settings = dict(AUDIT, seed=None, num_canaries=5000)
    for _ in range(5):
        report = one_run_audit_run(noise_multiplier=SIGMA[2.0], **settings)
        assert report["white_box"]["epsilon_lower_bound"] < report["theoretical_epsilon"]
    for canaries, bug in [("gradient", "halved-noise"), ("gradient", "double-counted"),
                          ("input", "unclipped-example"), ("input", "double-counted")]:
        for _ in range(2):
            report = one_run_audit_run(noise_multiplier=SIGMA[2.0], canaries=canaries,
                                       planted_bug=bug, **settings)
            assert report["white_box"]["epsilon_lower_bound"] > report["theoretical_epsilon"]
    # What gradient canaries cannot see: a bug upstream of the clipped sum.
    report = one_run_audit_run(noise_multiplier=SIGMA[2.0], canaries="gradient",
                               planted_bug="unclipped-example", **settings)
    assert report["white_box"]["epsilon_lower_bound"] < report["theoretical_epsilon"]


def test_one_run_cli_options_run_a_small_audit_and_write_json(tmp_path, capsys):
    import argparse
    import json

    from tf_megadp.audit import audit_run

    assert audit_run.PLANTED_BUG_NAMES == tuple(sorted(planted_bugs.PLANTED_BUGS))
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", nargs="?")
    audit_run.add_one_run_arguments(parser)
    output = tmp_path / "one_run.json"
    args = parser.parse_args(["--one-run", "--num-canaries", "100", "--steps", "50",
                              "--sampling-rate", "0.05", "--epsilon", "4",
                              "--plant-bug", "halved-noise", "--output", str(output)])
    assert audit_run.run_one_run_from_args(args) == 0
    report = json.loads(output.read_text())
    assert report["planted_bug"] == "halved-noise" and not report["seeded"]
    assert report["theoretical_epsilon"] == pytest.approx(4.0, rel=0.02)
    assert "white-box one-run lower bound" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["--one-run", "--plant-bug", "no-such-bug"])
