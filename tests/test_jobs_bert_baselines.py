"""Specification of a run's verdict against the unigram baseline, and of ratios to a baseline.

Issue 41: the non-private baseline, at the DP learning rate, ended on the
unigram plateau (0.044) and a user read "DP is 3x better than non-private".
A run at or below the baseline (within the noise of the held-out positions)
is marked as not learned, and no ratio is taken against such a baseline.
"""

import math

import pytest

from tf_megadp.jobs.bert.baselines import (
    BaselineDidNotLearnError,
    accuracy_ratio,
    learning_verdict,
)
from tf_megadp.jobs.common.verdicts import STANDARD_ERRORS


class TestTheVerdict:
    def test_the_plateau_itself_did_not_learn(self):
        # A collapsed model predicts the most frequent token: exactly the baseline.
        verdict = learning_verdict(0.0402, 0.0402, 10_000)
        assert verdict["learned"] is False
        assert verdict["unigram_baseline_accuracy"] == 0.0402

    def test_the_margin_is_three_binomial_standard_errors_of_the_held_out_positions(self):
        p, n = 0.04, 10_000
        threshold = p + STANDARD_ERRORS * math.sqrt(p * (1 - p) / n)
        verdict = learning_verdict(0.05, p, n)
        assert verdict["learned_threshold"] == pytest.approx(threshold)
        assert verdict["heldout_masked_positions"] == n
        assert learning_verdict(threshold - 1e-6, p, n)["learned"] is False
        assert learning_verdict(threshold + 1e-6, p, n)["learned"] is True
        # Fewer positions, more noise: the same accuracy no longer counts.
        assert learning_verdict(threshold + 1e-6, p, 300)["learned"] is False

    def test_a_run_never_evaluated_has_no_verdict(self):
        assert learning_verdict(float("nan"), 0.04, 100)["learned"] is None


class TestTheRatio:
    def test_a_ratio_against_a_baseline_that_learned(self):
        baseline = {"heldout_mlm_accuracy": 0.14, "unigram_baseline_accuracy": 0.04,
                    "learned": True}
        assert accuracy_ratio({"heldout_mlm_accuracy": 0.07}, baseline) == pytest.approx(0.5)

    @pytest.mark.parametrize("learned, why", [(False, "did not learn"),
                                              (None, "no learned verdict")])
    def test_no_ratio_against_a_baseline_that_did_not_learn(self, learned, why):
        # The numbers: 0.131 / 0.044 would read "DP is 3x better".
        baseline = {"heldout_mlm_accuracy": 0.044, "unigram_baseline_accuracy": 0.044}
        if learned is not None:
            baseline["learned"] = learned
        with pytest.raises(BaselineDidNotLearnError, match=f"{why}.*tune its --learning-rate"):
            accuracy_ratio({"heldout_mlm_accuracy": 0.131}, baseline)

    def test_the_study_script_prints_no_ratio_against_it(self, tmp_path):
        import json
        import runpy

        study = runpy.run_path("benchmarks/batch_size_study.py")
        runs = tmp_path / "recipe"
        common = {"schedule": {"phases": [{"steps": 300, "batch_size": 256}]},
                  "examples_processed_expected": 76800, "wall_time_s": 100.0,
                  "unigram_baseline_accuracy": 0.044, "history": []}
        rows = {"default": {**common, "private": True, "heldout_mlm_accuracy": 0.131,
                            "epsilon": 5.35, "delta": 1e-5, "noise_multiplier": 0.6,
                            "learned": True},
                "nonprivate-lr-8e-3": {**common, "private": False, "heldout_mlm_accuracy": 0.044,
                                       "learned": False}}
        for name, report in rows.items():
            (runs / name).mkdir(parents=True)
            (runs / name / "report.json").write_text(json.dumps(report))
        table = study["table"](str(tmp_path), "recipe")
        assert "3.0" not in table and "2.98" not in table
        assert "none (baseline did not learn)" in table
        assert "No ratio to the non-private baseline" in table
