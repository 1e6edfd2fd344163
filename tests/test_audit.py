"""Specification of tf_megadp.audit: canaries, membership inference, empirical epsilon."""

import json
import math

import keras
import keras_hub
import numpy as np
import pytest
from scipy import optimize, stats
from sklearn import metrics

import tf_megadp
from tf_megadp import audit

# Tiny vocabulary for the masked-LM tests.
PAD, CLS, SEP, MASK = 0, 1, 2, 3
DIGITS = tuple(range(4, 14))
WORDS = tuple(range(14, 40))
VOCAB = 40
LENGTH = 8
FORMAT = audit.CanaryFormat([CLS, 20, 21, 22, None, None, None, SEP], DIGITS)


# ----------------------------------------------------------------------------
# Canaries and exposure
# ----------------------------------------------------------------------------


def test_format_fills_slots_and_counts_the_space():
    assert FORMAT.secret_positions == (4, 5, 6)
    assert FORMAT.space_size == 1000
    np.testing.assert_array_equal(
        FORMAT.fill((4, 9, 13)), [CLS, 20, 21, 22, 4, 9, 13, SEP]
    )
    every = FORMAT.all_secrets()
    assert every.shape == (1000, 3)
    assert len({tuple(s) for s in every}) == 1000
    assert set(every.ravel()) == set(DIGITS)


def test_format_from_vocabulary_tokens():
    vocabulary = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]", "my", "pin", "is"]
    vocabulary += [str(d) for d in range(10)]
    fmt = audit.CanaryFormat.from_vocabulary(
        ["[CLS]", "my", "pin", "is", None, None, "[SEP]"], "0123456789", vocabulary
    )
    assert fmt.template == (1, 5, 6, 7, None, None, 2)
    assert fmt.alphabet == tuple(range(8, 18))
    with pytest.raises(ValueError, match=r"\['code'\] are not in the vocabulary"):
        audit.CanaryFormat.from_vocabulary(["code", None], "01", vocabulary)


def test_format_rejects_bad_input():
    with pytest.raises(ValueError, match="secret slot"):
        audit.CanaryFormat([CLS, 20, SEP], DIGITS)
    with pytest.raises(ValueError, match="distinct"):
        audit.CanaryFormat([CLS, None], (4, 4))
    with pytest.raises(ValueError, match="alphabet"):
        FORMAT.fill((4, 9, 30))


def test_canaries_round_trip_through_a_file(tmp_path):
    other = audit.CanaryFormat([CLS, None, None, SEP], WORDS)
    canaries = audit.make_canaries(FORMAT, repetitions=(1, 4), num_controls=2, seed=0)
    canaries += audit.make_canaries(other, repetitions=(16,), canaries_per_repetition=1)
    path = tmp_path / "canaries.json"
    audit.save_canaries(path, canaries)
    assert audit.load_canaries(path) == canaries
    assert [p.name for p in tmp_path.iterdir()] == ["canaries.json"]  # no temp left
    path.write_text('{"canaries": [{"template": [1, null], "alphabet": [4, 5], '
                    '"secret": [9], "repetitions": 1}]}')
    with pytest.raises(ValueError, match="not a canary file"):
        audit.load_canaries(path)


def _digit_value(sequences):
    """Reads the three secret digits as a number 0..999."""
    digits = np.asarray(sequences)[:, list(FORMAT.secret_positions)] - DIGITS[0]
    return digits @ np.array([100, 10, 1])


@pytest.mark.parametrize("value", [999, 990, 500, 3, 0])
def test_exact_exposure_on_a_constructed_ranking(value):
    # Scoring a candidate by its number puts the secret with number v at rank
    # 1000 - v (it and every larger number score >= it).
    secret = tuple(DIGITS[int(d)] for d in f"{value:03d}")
    canary = audit.Canary(FORMAT, secret, repetitions=4)
    result = audit.canary_exposure(canary, lambda s: _digit_value(s).astype(float))
    assert result["exact"]
    assert result["rank"] == 1000 - value
    assert result["exposure"] == pytest.approx(math.log2(1000) - math.log2(1000 - value))
    assert result["exposure_lower"] == result["exposure"]
    assert result["repetitions"] == 4


def test_ties_count_against_the_secret():
    canary = audit.Canary(FORMAT, (4, 4, 4), repetitions=1)
    result = audit.canary_exposure(canary, lambda s: np.zeros(len(s)))
    assert result["rank"] == 1000
    assert result["exposure"] == 0.0


def test_sampled_exposure_estimates_the_rank_and_its_lower_bound_covers():
    secret = tuple(DIGITS[int(d)] for d in "899")  # rank 101, exposure 3.31 bits
    canary = audit.Canary(FORMAT, secret, repetitions=1)
    exact = math.log2(1000) - math.log2(101)
    estimates, lowers = [], []
    for seed in range(200):
        result = audit.canary_exposure(
            canary,
            lambda s: _digit_value(s).astype(float),
            num_candidates=400,
            extrapolate=False,
            seed=seed,
        )
        assert not result["exact"] and result["exposure_extrapolated"] is None
        estimates.append(result["exposure"])
        lowers.append(result["exposure_lower"])
    assert np.mean(estimates) == pytest.approx(exact, abs=0.05)
    # A 95% bound may exceed the truth in at most ~5% of draws (3.5% exactly
    # here; the slack covers the randomness of 200 draws).
    assert np.mean(np.array(lowers) > exact) <= 0.08
    assert np.mean(lowers) < exact


def test_extrapolated_exposure_sees_past_the_sampling_resolution():
    # Six digits: 10^6 candidates whose scores are normal quantiles of their
    # number, so the secret numbered v has rank 10^6 - v exactly.
    wide = audit.CanaryFormat([CLS] + [None] * 6 + [SEP], DIGITS)
    powers = 10 ** np.arange(5, -1, -1)

    def score_fn(sequences):
        value = (np.asarray(sequences)[:, 1:7] - DIGITS[0]) @ powers
        return stats.norm.ppf((value + 0.5) / 1e6)

    secret = tuple(DIGITS[int(d)] for d in "999995")  # rank 5: 17.6 bits
    canary = audit.Canary(wide, secret, repetitions=16)
    exact = math.log2(1e6) - math.log2(5)
    result = audit.canary_exposure(canary, score_fn, num_candidates=2000, seed=0)
    assert result["exposure"] == pytest.approx(math.log2(1e6))  # saturated: k = 0
    assert result["exposure_lower"] < 11.0  # resolution of 2000 samples
    assert result["exposure_extrapolated"] == pytest.approx(exact, abs=1.5)


def test_large_spaces_must_be_sampled():
    wide = audit.CanaryFormat([CLS] + [None] * 6 + [SEP], DIGITS)
    canary = audit.Canary(wide, (4,) * 6, repetitions=1)
    with pytest.raises(ValueError, match="num_candidates"):
        audit.canary_exposure(canary, lambda s: np.zeros(len(s)))


def test_exposure_rejects_impossible_ranks():
    assert audit.exposure(1, 1024) == 10.0
    with pytest.raises(ValueError):
        audit.exposure(0, 1024)
    with pytest.raises(ValueError):
        audit.exposure(2000, 1024)


def test_make_canaries_draws_distinct_reproducible_secrets():
    canaries = audit.make_canaries(
        FORMAT, repetitions=(1, 4, 16), canaries_per_repetition=3, num_controls=2, seed=7
    )
    assert [c.repetitions for c in canaries] == [1] * 3 + [4] * 3 + [16] * 3 + [0] * 2
    assert len({c.secret for c in canaries}) == len(canaries)
    again = audit.make_canaries(
        FORMAT, repetitions=(1, 4, 16), canaries_per_repetition=3, num_controls=2, seed=7
    )
    assert again == canaries
    with pytest.raises(ValueError, match="space"):
        audit.make_canaries(FORMAT, canaries_per_repetition=400)


def test_insert_canaries_adds_each_copy_once_and_keeps_the_corpus():
    rng = np.random.default_rng(0)
    corpus = rng.integers(14, 40, size=(50, 10)).astype(np.int32)
    canaries = audit.make_canaries(
        FORMAT, repetitions=(1, 4), canaries_per_repetition=2, num_controls=1, seed=1
    )
    new, owner = audit.insert_canaries(corpus, canaries, seed=3)
    assert new.shape == (50 + 2 * 1 + 2 * 4, 10)
    np.testing.assert_array_equal(new[owner == -1], corpus)  # order preserved
    for index, canary in enumerate(canaries):
        rows = new[owner == index]
        assert len(rows) == canary.repetitions  # controls are never inserted
        for row in rows:
            np.testing.assert_array_equal(row[:LENGTH], canary.token_ids)
            np.testing.assert_array_equal(row[LENGTH:], PAD)
    with pytest.raises(ValueError, match="does not fit"):
        audit.insert_canaries(corpus[:, :5], canaries)


# ----------------------------------------------------------------------------
# Membership inference
# ----------------------------------------------------------------------------


def _naive_roc_points(members, nonmembers):
    """(FPR, TPR) of every rule "member iff score >= t", by counting."""
    thresholds = np.concatenate([np.unique(np.concatenate([members, nonmembers])), [np.inf]])
    return [
        (np.mean(nonmembers >= t), np.mean(members >= t)) for t in thresholds
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_membership_metrics_match_scikit_learn_and_counting(seed):
    rng = np.random.default_rng(seed)
    # Rounded scores make ties, the case where ROC code most often goes wrong.
    members = np.round(rng.normal(0.7, 1.0, 3000), 1)
    nonmembers = np.round(rng.normal(0.0, 1.0, 4000), 1)
    result = audit.membership_metrics(members, nonmembers)
    labels = np.r_[np.ones(3000), np.zeros(4000)]
    scores = np.r_[members, nonmembers]
    assert result["auc"] == pytest.approx(metrics.roc_auc_score(labels, scores), abs=1e-12)
    # Mann-Whitney: P(member > non-member) + P(tie) / 2.
    pairs = members[:, None] - nonmembers[None, :]
    assert result["auc"] == pytest.approx(np.mean(pairs > 0) + 0.5 * np.mean(pairs == 0))
    points = _naive_roc_points(members, nonmembers)
    for level in (0.01, 0.001):
        expected = max(tpr for fpr, tpr in points if fpr <= level)
        assert result[f"tpr_at_fpr_{level:g}"] == pytest.approx(expected)
    assert result["advantage"] == pytest.approx(max(t - f for f, t in points))
    assert result["num_members"] == 3000 and result["num_nonmembers"] == 4000


def test_membership_metrics_on_a_hand_example():
    result = audit.membership_metrics([3.0, 2.0, 0.5], [1.0, 0.0], fpr_levels=(0.4,))
    assert result["auc"] == pytest.approx(5 / 6)
    assert result["tpr_at_fpr_0.4"] == pytest.approx(2 / 3)
    assert result["advantage"] == pytest.approx(2 / 3)


def test_membership_scores_reference_free_and_calibrated():
    np.testing.assert_allclose(audit.membership_scores([0.5, 2.0]), [-0.5, -2.0])
    np.testing.assert_allclose(
        audit.membership_scores([0.5, 2.0], reference_losses=[1.0, 2.0]), [0.5, 0.0]
    )
    with pytest.raises(ValueError, match="one loss per"):
        audit.membership_scores([0.5, 2.0], reference_losses=[1.0])
    with pytest.raises(ValueError, match="finite"):
        audit.membership_metrics([np.nan], [0.0])


def test_calibration_removes_per_example_difficulty():
    # Members are 0.1 nats easier than they would be otherwise, but difficulty
    # varies by 1 nat between sequences: only the calibrated attack sees it.
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0.0, 1.0, 4000)
    is_member = np.arange(4000) < 2000
    reference = difficulty + rng.normal(0, 0.01, 4000)
    target = difficulty - 0.1 * is_member + rng.normal(0, 0.01, 4000)
    free = audit.membership_scores(target)
    calibrated = audit.membership_scores(target, reference)
    free_auc = audit.membership_metrics(free[is_member], free[~is_member])["auc"]
    cal_auc = audit.membership_metrics(calibrated[is_member], calibrated[~is_member])["auc"]
    assert free_auc < 0.65 < 0.99 < cal_auc


# ----------------------------------------------------------------------------
# Empirical epsilon
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (30, 100), (999, 1000)])
def test_clopper_pearson_matches_scipy_binomtest(k, n):
    lower = stats.binomtest(k, n, alternative="greater").proportion_ci(0.975).low
    upper = stats.binomtest(k, n, alternative="less").proportion_ci(0.975).high
    assert audit.clopper_pearson(k, n, confidence=0.975, side="lower") == pytest.approx(lower)
    assert audit.clopper_pearson(k, n, confidence=0.975, side="upper") == pytest.approx(upper)


def test_epsilon_lower_bound_is_the_formula_on_clopper_pearson_rates():
    tp, fp, tn, fn, delta = 900, 40, 960, 100, 1e-3
    tpr_lo = stats.binomtest(tp, tp + fn, alternative="greater").proportion_ci(0.975).low
    fpr_hi = stats.binomtest(fp, fp + tn, alternative="less").proportion_ci(0.975).high
    expected = max(
        math.log((tpr_lo - delta) / fpr_hi), math.log((1 - fpr_hi - delta) / (1 - tpr_lo))
    )
    assert audit.epsilon_lower_bound(tp, fp, tn, fn, delta=delta) == pytest.approx(expected)
    # An attack no better than chance certifies nothing.
    assert audit.epsilon_lower_bound(50, 50, 50, 50) == 0.0
    with pytest.raises(ValueError, match="non-member"):
        audit.epsilon_lower_bound(5, 0, 0, 5)


def _randomized_response_counts(epsilon, trials, seed, runs):
    """Confusion counts of the optimal attack on randomized response, per run.

    Each trial reports the secret bit truthfully with probability
    e^eps / (1 + e^eps): exactly eps-DP, and TPR / FPR = e^eps, so the attack
    that trusts the report is tight.
    """
    truthful = math.exp(epsilon) / (1 + math.exp(epsilon))
    rng = np.random.default_rng(seed)
    tp = rng.binomial(trials, truthful, size=runs)
    fp = rng.binomial(trials, 1 - truthful, size=runs)
    return tp, fp, trials - fp, trials - tp


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_lower_bound_never_exceeds_epsilon_of_randomized_response(epsilon):
    # The attack is tight, so a 95% bound overshoots in about 2% of seeds (see
    # the next test); at 99.9% an overshoot in these 60 runs would be a bug.
    for seed in range(20):
        counts = _randomized_response_counts(epsilon, 10_000, seed, runs=1)
        bound = audit.epsilon_lower_bound(*(int(c[0]) for c in counts), confidence=0.999)
        assert 0.5 * epsilon < bound <= epsilon


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_lower_bound_holds_with_the_stated_confidence(epsilon):
    trials = 2000
    tp, fp, tn, fn = _randomized_response_counts(epsilon, trials, 123, runs=500)
    bounds = np.array(
        [audit.epsilon_lower_bound(*counts) for counts in zip(tp, fp, tn, fn)]
    )
    # A 95% bound may exceed the truth in at most 5% of experiments.
    assert np.mean(bounds > epsilon) <= 0.05
    # The bound is informative: most of epsilon is certified...
    assert np.mean(bounds) > 0.75 * epsilon
    # ...and the check has teeth: the raw rates, without intervals, overshoot.
    naive = np.log(tp / fp)
    assert np.mean(naive > epsilon) > 0.3


def _gaussian_delta(epsilon, sensitivity_over_sigma):
    """delta(eps) of the Gaussian mechanism (Balle & Wang 2018, Theorem 8)."""
    mu = sensitivity_over_sigma
    return stats.norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * stats.norm.cdf(
        -mu / 2 - epsilon / mu
    )


@pytest.mark.parametrize("selection", ["split", "union"])
def test_lower_bound_from_scores_respects_a_gaussian_mechanism(selection):
    # Output ~ N(mu * b, 1) for secret bit b: (eps, delta)-DP exactly on the
    # curve below; the attack thresholds the output.
    mu, delta = 1.0, 1e-3
    epsilon = optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, 50.0)
    grid = np.linspace(-2.0, 6.0, 41) if selection == "union" else None
    bounds = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        members, nonmembers = rng.normal(mu, 1.0, 5000), rng.normal(0.0, 1.0, 5000)
        result = audit.epsilon_lower_bound_from_scores(
            members, nonmembers, delta=delta, selection=selection, thresholds=grid, seed=seed
        )
        assert result["tp"] + result["fn"] > 0 and result["fp"] + result["tn"] > 0
        bounds.append(result["epsilon_lower_bound"])
    assert max(bounds) <= epsilon
    assert min(bounds) > 0.3 * epsilon


def test_threshold_selection_must_be_paid_for():
    rng = np.random.default_rng(0)
    members, nonmembers = rng.normal(1, 1, 100), rng.normal(0, 1, 100)
    with pytest.raises(ValueError, match="fixed"):
        audit.epsilon_lower_bound_from_scores(members, nonmembers, selection="union")
    with pytest.raises(ValueError, match="split"):
        audit.epsilon_lower_bound_from_scores(
            members, nonmembers, selection="split", thresholds=[0.0]
        )


def test_best_threshold_on_null_scores_certifies_nothing():
    # Members and non-members from the same distribution: epsilon is 0, and
    # picking the luckiest threshold must not manufacture a positive bound.
    for seed in range(10):
        rng = np.random.default_rng(seed)
        scores = rng.normal(0, 1, (2, 300))
        result = audit.epsilon_lower_bound_from_scores(*scores, seed=seed)
        assert result["epsilon_lower_bound"] == 0.0


# ----------------------------------------------------------------------------
# Masked LM end to end (tiny BERT)
# ----------------------------------------------------------------------------


def _tiny_masked_lm(seed):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    return keras_hub.models.BertMaskedLM(backbone, preprocessor=None)


def _mlm_batch(token_ids, positions):
    labels = np.take_along_axis(token_ids, positions, axis=1)
    masked = token_ids.copy()
    np.put_along_axis(masked, positions, MASK, axis=1)
    x = {
        "token_ids": masked.astype(np.int32),
        "segment_ids": np.zeros_like(masked, dtype=np.int32),
        "padding_mask": (token_ids != PAD).astype(np.int32),
        "mask_positions": positions.astype(np.int32),
    }
    return x, labels.astype(np.int32), np.ones(labels.shape, np.float32)


def _random_positions(rng, rows, count=2):
    # Content positions 1 .. LENGTH - 2 (never [CLS] or [SEP]).
    return np.stack(
        [rng.choice(np.arange(1, LENGTH - 1), size=count, replace=False) for _ in range(rows)]
    )


def _random_rows(rng, rows):
    body = rng.choice(np.array(WORDS + DIGITS), size=(rows, LENGTH - 2))
    return np.concatenate(
        [np.full((rows, 1), CLS), body, np.full((rows, 1), SEP)], axis=1
    ).astype(np.int32)


def _batches(token_ids, positions, size=64):
    return [
        _mlm_batch(token_ids[i : i + size], positions[i : i + size])
        for i in range(0, len(token_ids), size)
    ]


@pytest.fixture(scope="module")
def trained():
    """A tiny BERT trained without privacy on random rows plus canaries.

    It trains under an `AuditCallback` that audits after the second (last)
    epoch, with a reference model for the calibrated attack.
    """
    rng = np.random.default_rng(0)
    members = _random_rows(rng, 64)
    nonmembers = _random_rows(rng, 64)
    canaries = audit.make_canaries(
        FORMAT, repetitions=(1, 16), canaries_per_repetition=2, num_controls=4, seed=0
    )
    corpus, _ = audit.insert_canaries(members, canaries, pad_token_id=PAD, seed=0)
    # Fresh masks for each of 30 passes over the corpus, as a masked-LM
    # pipeline draws them; fit's 2 epochs repeat the 30 passes.
    rows = np.concatenate([corpus] * 30)
    x, y, w = _mlm_batch(rows, _random_positions(rng, len(rows)))
    model = _tiny_masked_lm(0)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    fixed = np.random.default_rng(1)
    member_batches = _batches(members, _random_positions(fixed, len(members)))
    nonmember_batches = _batches(nonmembers, _random_positions(fixed, len(nonmembers)))
    callback = audit.AuditCallback(
        member_batches,
        nonmember_batches,
        canaries,
        mask_token_id=MASK,
        pad_token_id=PAD,
        every_n_epochs=2,
        reference_model=_tiny_masked_lm(1),
        batch_size=1024,
    )
    history = model.fit(
        # 98 rows x 30 = 49 batches of 60: no partial batch, one trace.
        x, y, sample_weight=w, batch_size=60, epochs=2, verbose=0, callbacks=[callback]
    )
    return {
        "model": model,
        "canaries": canaries,
        "member_batches": member_batches,
        "nonmember_batches": nonmember_batches,
        "callback": callback,
        "history": history.history,
    }


def _naive_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_secret_scores_match_a_naive_loop(trained):
    model = trained["model"]
    scorer = audit.MaskedLMScorer(model, mask_token_id=MASK, pad_token_id=PAD, batch_size=7)
    slots = FORMAT.secret_positions
    sequences = FORMAT.fill(FORMAT.sample_secrets(np.random.default_rng(3), 2))
    pseudo = scorer.secret_score_fn(slots, mode="pseudo")(sequences)
    joint = scorer.secret_score_fn(slots, mode="joint")(sequences)
    for row, sequence in enumerate(sequences):
        expected_pseudo = 0.0
        for slot in slots:
            x, _, _ = _mlm_batch(sequence[None], np.array([[slot]]))
            log_probs = _naive_log_softmax(model(x, training=False))
            expected_pseudo += log_probs[0, 0, sequence[slot]]
        x, _, _ = _mlm_batch(sequence[None], np.array([slots]))
        log_probs = _naive_log_softmax(model(x, training=False))
        expected_joint = sum(log_probs[0, j, sequence[s]] for j, s in enumerate(slots))
        assert pseudo[row] == pytest.approx(expected_pseudo, abs=1e-4)
        assert joint[row] == pytest.approx(expected_joint, abs=1e-4)


def test_scorer_rejects_a_mask_token_equal_to_padding():
    with pytest.raises(ValueError, match="must differ"):
        audit.MaskedLMScorer(None, mask_token_id=PAD, pad_token_id=PAD)


def test_example_losses_match_keras_loss(trained):
    model = trained["model"]
    scorer = audit.MaskedLMScorer(model, mask_token_id=MASK, pad_token_id=PAD, batch_size=16)
    x, y, w = trained["member_batches"][0]
    w = w.copy()
    w[0] = 0.0  # a padding example: dropped
    w[1, 1] = 0.0  # one masked position ignored
    losses = scorer.example_losses([(x, y, w)])
    per_token = keras.losses.sparse_categorical_crossentropy(
        y, model(x, training=False), from_logits=True
    ).numpy()
    expected = (per_token * w).sum(axis=1)[1:] / w.sum(axis=1)[1:]
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


def test_audit_callback_writes_the_report_into_history(trained):
    history, report = trained["history"], trained["callback"].last_report
    # Audited after epoch 2 only; History records that epoch's numbers.
    assert len(history["loss"]) == 2
    for key in ("mia_auc", "mia_calibrated_auc", "exposure_r16_mean", "mia_eps_lower_bound"):
        assert history["audit_" + key] == [pytest.approx(report[key])]
    assert "audit_canaries" not in history  # per-canary details stay in the report
    with pytest.raises(ValueError, match="one-shot"):
        audit.AuditCallback(iter([]), [], mask_token_id=MASK)


def test_audit_finds_memorized_canaries_and_members(trained):
    report = trained["callback"].last_report
    # Canaries seen 16 times are singled out among 1000 candidates; controls
    # (never seen) are not.
    assert report["exposure_r16_mean"] > 7.0
    assert report["exposure_r16_mean"] > report["exposure_r0_mean"] + 4.0
    assert {"exposure_r1_mean", "canary_eps_lower_bound_r16"} <= set(report)
    assert len(report["canaries"]) == len(trained["canaries"])
    assert all(item["exact"] for item in report["canaries"])
    # A model trained for 60 passes over 64 random sequences has lower loss on them.
    assert report["mia_auc"] > 0.6
    assert report["mia_num_members"] == report["mia_num_nonmembers"] == 64
    assert 0.0 <= report["mia_tpr_at_fpr_0.01"] <= 1.0
    assert report["mia_eps_lower_bound"] >= 0.0
    # The reference model never saw the members: calibration keeps the signal.
    assert report["mia_calibrated_auc"] > 0.6


def test_run_audit_with_sampled_candidates_and_joint_scores(trained):
    report = audit.run_audit(
        trained["model"],
        trained["member_batches"][:1],
        trained["nonmember_batches"][:1],
        trained["canaries"],
        mask_token_id=MASK,
        pad_token_id=PAD,
        canary_mode="joint",
        num_candidates=200,
    )
    for item in report["canaries"]:
        assert not item["exact"]
        assert item["exposure_lower"] <= item["exposure"]
        assert 0.0 <= item["exposure_extrapolated"] <= math.log2(1000)
    assert "exposure_extrapolated_r16_mean" in report
    json.dumps(report)  # the CLI writes the report as JSON
    # Joint scores still single out one of the canaries seen 16 times, but
    # they mix the slots of all canaries that share the template, which is why
    # "pseudo" is the default.
    assert report["exposure_r16_max"] > 9.0


def test_masked_lm_canary_scores_are_the_canaries_exposures(trained):
    # The black-box score of secret-sharer canaries in a one-run audit is
    # their exposure, computed by the same machinery as run_audit.
    score_fn = audit.masked_lm_canary_scores(trained["canaries"], mask_token_id=MASK,
                                             pad_token_id=PAD, batch_size=1024)
    scores = score_fn(trained["model"])
    expected = [item["exposure"] for item in trained["callback"].last_report["canaries"]]
    np.testing.assert_allclose(scores, expected, rtol=1e-6)


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_the_job_audit_loads_the_run_model_as_the_job_built_it(tmp_path, precision):
    # The release is what `tf-megadp pretrain` writes; `keras.models.load_model`
    # would rebuild a mixed_bfloat16 run's MLM head in bfloat16, which raises.
    from tf_megadp.jobs.bert import pretraining
    from tf_megadp.jobs.common import run_folder
    from tf_megadp.jobs.bert.audit import load_run_model

    config = pretraining.PretrainConfig(model="pico", sequence_length=16, precision=precision)
    model = pretraining.build_model(config, VOCAB)
    rng = np.random.default_rng(0)
    # Weights no fresh model has, so a layer left at its initial weights shows.
    model.set_weights([w + rng.normal(0.0, 0.05, w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    path = str(tmp_path / run_folder.MODEL_NAME)
    tf_megadp.export_model(model, path)

    loaded = load_run_model(config, VOCAB, path)
    for saved, restored in zip(model.weights, loaded.weights, strict=True):
        assert saved.path == restored.path
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(restored))
    assert loaded.masked_lm_head.dtype_policy.name == model.masked_lm_head.dtype_policy.name
    assert loaded.backbone.dtype_policy.name == model.backbone.dtype_policy.name
    x = {
        "token_ids": rng.integers(5, VOCAB, size=(4, 16)),
        "segment_ids": np.zeros((4, 16), "int32"),
        "padding_mask": np.ones((4, 16), bool),
        "mask_positions": np.tile(np.arange(3), (4, 1)),
    }
    logits = loaded(x)
    assert logits.dtype == "float32"
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model(x)))


def test_the_job_audit_refuses_a_model_of_another_shape(tmp_path):
    from tf_megadp.jobs.bert import pretraining
    from tf_megadp.jobs.common import run_folder
    from tf_megadp.jobs.bert.audit import load_run_model

    config = pretraining.PretrainConfig(model="pico", sequence_length=16)
    path = str(tmp_path / run_folder.MODEL_NAME)
    tf_megadp.export_model(pretraining.build_model(config, VOCAB), path)
    with pytest.raises(pretraining.PretrainError, match="does not hold the model"):
        load_run_model(config, VOCAB + 1, path)
    longer = pretraining.PretrainConfig(model="pico", sequence_length=32)
    with pytest.raises(pretraining.PretrainError, match="sequence length 32"):
        load_run_model(longer, VOCAB, path)
