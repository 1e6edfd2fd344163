"""Specification of `tf-megadp causal-lm` (`tf_megadp.jobs.causal_lm`).

The data: a packed row r is one example that reads r[:-1] and predicts
r[1:], with only the text's tokens as targets; the unigram baseline and the
held-out perplexity are those of their definitions. The job: bad settings
are refused by name before anything runs; a private run stopped after one
step and resumed with --resume alone ends with the planned steps and the
epsilon accounted for the whole schedule, reports held-out accuracy and
perplexity beside the unigram baseline, the privacy unit (one packed
sequence), and writes the release (whose weights carry their ledger) and
privacy.json. The runs train a pico GPT-2 for a few steps on generated
text: they check the machinery, not what it learns.
"""

import json
import math

import numpy as np
import pytest

from tests.test_pretraining import write_corpus
from tf_megadp import cli
from tf_megadp.jobs.causal_lm import data
from tf_megadp.jobs.causal_lm.config import CausalLMConfig
from tf_megadp.jobs.common.errors import JobError


class _Rows:
    """The `read` and `len` of a `TokenShards`, over rows in memory."""

    def __init__(self, rows):
        self.rows = np.asarray(rows, np.int32)

    def __len__(self):
        return len(self.rows)

    def read(self, indices):
        return self.rows[indices]


class TestData:
    def test_a_row_predicts_its_next_text_tokens_only(self):
        # [CLS] 7 8 9 [SEP] [PAD] [PAD]
        x, y, w = data.next_token_examples([[1, 7, 8, 9, 2, 0, 0]])
        assert x["token_ids"].tolist() == [[1, 7, 8, 9, 2, 0]]
        assert x["padding_mask"].tolist() == [[1, 1, 1, 1, 1, 0]]
        assert y.tolist() == [[7, 8, 9, 2, 0, 0]]
        assert w.tolist() == [[1, 1, 1, 0, 0, 0]]

    def test_the_unigram_baseline_predicts_the_most_frequent_training_target(self):
        train = _Rows([[1, 7, 7, 8, 2], [1, 7, 9, 2, 0]])  # targets: 7 x3, 8, 9
        y = np.array([[7, 8, 6, 2]])
        w = np.array([[1.0, 1.0, 1.0, 0.0]])
        baseline = data.unigram_baseline(train, y, w, vocabulary_size=10)
        assert baseline.token == 7 and baseline.accuracy == pytest.approx(1 / 3)
        # add-one over the 5 text tokens: p(7) = 4/10, p(8) = 2/10, p(6) = 1/10
        expected = math.exp(-(math.log(0.4) + math.log(0.2) + math.log(0.1)) / 3)
        assert baseline.perplexity == pytest.approx(expected)

    def test_held_out_perplexity_is_that_of_the_targets_alone(self):
        vocabulary = 6

        def model(x, training=False):
            # Uniform over the vocabulary, except token 5 twice as likely at every position.
            logits = np.zeros(x["token_ids"].shape + (vocabulary,), np.float32)
            logits[..., 5] = math.log(2.0)
            return logits

        y = np.array([[5, 3, 0], [5, 5, 4]])
        w = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], np.float32)
        x = {"token_ids": np.zeros((2, 3), np.int32)}
        scores = data.heldout_scores(model, x, y, w, batch_size=1)
        assert scores["heldout_accuracy"] == pytest.approx(3 / 5)
        log_p = [math.log(2 / 7)] * 3 + [math.log(1 / 7)] * 2
        assert scores["heldout_perplexity"] == pytest.approx(math.exp(-sum(log_p) / 5))


class TestRefusals:
    def test_bad_settings_name_the_fix_before_anything_runs(self, tmp_path):
        for settings, message in (
                (dict(model="huge"), "model must be one of"),
                (dict(noise="bandmf"), "independent noise"),
                (dict(sequence_length=4), "sequence_length must be an integer >= 8"),
                (dict(resume=True), "--resume needs --output-dir"),
                (dict(corpus=[str(tmp_path / "none.txt")]), "no such file"),
                (dict(target_epsilon=None), "--target-epsilon or --noise-multiplier")):
            with pytest.raises(JobError, match=message):
                CausalLMConfig(**settings).validate()

    def test_the_cli_refuses_a_resume_without_a_run(self, tmp_path, capsys):
        status = cli.main(["causal-lm", "--output-dir", str(tmp_path / "none"), "--resume"])
        assert status == 2 and "no checkpoint" in capsys.readouterr().err


def tiny_config(corpus, root, output, **settings):
    values = dict(corpus=[corpus], output_dir=str(output), cache_dir=str(root / "cache"),
                  model="pico", sequence_length=16, vocabulary_size=200, micro_batch_size=16,
                  batch_size=16, steps=3, eval_every=1, noise_multiplier=1.0,
                  target_epsilon=None, accountant="rdp", warmup_steps=1, verbose=0,
                  # The public vocabulary is learned from this much of the default corpus.
                  max_characters=300_000)
    values.update(settings)
    return CausalLMConfig(**values)


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    """A private run stopped after 1 of 3 steps, then resumed with --resume alone."""
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    root = tmp_path_factory.mktemp("causal_lm")
    corpus = write_corpus(root)
    config = tiny_config(corpus, root, root / "run", stop_after_steps=1)
    stopped = run_causal_lm(config, log=lambda *_: None)
    assert cli.main(["causal-lm", "--output-dir", str(root / "run"), "--resume",
                     "--verbose", "0"]) == 0
    resumed = json.loads((root / "run" / "report.json").read_text())
    return stopped, resumed, config, root


@pytest.mark.filterwarnings("ignore::UserWarning")
class TestAPrivateRun:
    def test_resume_alone_ends_with_the_planned_steps_and_their_epsilon(
            self, stopped_and_resumed):
        from tf_megadp import accounting
        from tf_megadp.steps import BatchSizeSchedule

        stopped, resumed, config, _ = stopped_and_resumed
        assert stopped["logical_steps"] == 1 and not stopped["completed"]
        assert resumed["logical_steps"] == 3 and resumed["completed"]
        assert resumed["resumed_from_step"] == 1 and resumed["resumes"] == [1]
        schedule = BatchSizeSchedule.from_dict(resumed["schedule"])
        whole = accounting.compute_epsilon(delta=resumed["delta"], schedule=schedule,
                                           noise_multiplier=1.0, accountant="rdp")
        assert resumed["epsilon"] == pytest.approx(whole, rel=1e-9)
        assert stopped["epsilon"] < resumed["epsilon"]
        assert resumed["delta"] == pytest.approx(1 / resumed["num_examples"] ** 1.1)

    def test_it_reports_accuracy_and_perplexity_beside_the_unigram_baseline(
            self, stopped_and_resumed):
        _, resumed, _, _ = stopped_and_resumed
        assert 0.0 <= resumed["heldout_accuracy"] <= 1.0
        assert 1.0 < resumed["heldout_perplexity"] < 200 * 1.5
        assert 0.0 < resumed["unigram_baseline_accuracy"] < 1.0
        assert resumed["learned"] in (True, False)
        assert resumed["learned_threshold"] > resumed["unigram_baseline_accuracy"]
        assert "packed sequence of 16 tokens" in resumed["privacy_unit"]
        assert [h["step"] for h in resumed["history"]] == [1, 2, 3]
        assert resumed["vocabulary"]["public"] is True

    def test_it_writes_the_release_and_its_ledger(self, stopped_and_resumed):
        from tf_megadp.run import provenance

        _, resumed, _, root = stopped_and_resumed
        for name in ("model.keras", "vocab.txt", "privacy.json", "report.json", "report.png"):
            assert (root / "run" / name).exists(), name
        [record] = provenance.read_file_provenance(root / "run" / "model.keras")
        assert record.ledger.total_steps == resumed["logical_steps"]
        report_text = (root / "run" / "report.json").read_text()
        assert str(root) not in report_text  # no path of this machine

    def test_a_resume_that_changes_the_privacy_is_refused_by_name(self, stopped_and_resumed,
                                                                   capsys):
        _, _, _, root = stopped_and_resumed
        status = cli.main(["causal-lm", "--output-dir", str(root / "run"), "--resume",
                           "--noise-multiplier", "2.0"])
        assert status == 2 and "noise_multiplier: 1.0 -> 2.0" in capsys.readouterr().err


@pytest.mark.slow  # a second whole run; the machinery is the private run's
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_non_private_twin_reports_no_epsilon(tmp_path):
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    corpus = write_corpus(tmp_path)
    report = run_causal_lm(tiny_config(corpus, tmp_path, tmp_path / "twin", non_private=True,
                                       noise_multiplier=None), log=lambda *_: None)
    assert report["private"] is False and report["epsilon"] is None
    assert report["completed"] and not (tmp_path / "twin" / "privacy.json").exists()
