"""Specification of `tf-megadp causal-lm` (`tf_megadp.jobs.causal_lm`).

The data: a packed row r is one example that reads r[:-1] and predicts
r[1:], with only the text's tokens as targets; a prompt/completion pair is
one row whose targets are the completion and its end; the unigram baseline
and the held-out perplexity are those of their definitions. The job: bad
settings are refused by name before anything runs; a private run spends
the epsilon accounted for its whole schedule, reports held-out accuracy
and perplexity beside the unigram baseline and the privacy unit (one
packed sequence, or with --privacy-unit FIELD every document of one user:
then N counts the users and epsilon is accounted over them), writes the
release (whose weights carry their ledger) and privacy.json, refuses a
resume that changes its privacy, and, stopped
after one step and resumed with --resume alone, ends as the whole run;
fine-tuning that release composes its ledger into the new epsilon.
`--plan` gives the run's own N, schedule, sigma and epsilon (a resume's,
a composed start's) and its cost, refuses what the run refuses, and
writes nothing. A
Llama (`--family llama`) runs the same private step and release; a
fine-tuning run continues its start's family (read from the file: a
`--family` that differs, or a resume that changes it, is refused), and
never trains it on rows longer than those its run trained on. The runs
train a pico GPT-2 or Llama for a few steps on generated text: they check
the machinery, not what it learns. The resume, the non-private twin and
the fine-tuning, LoRA and the Llama run are `slow` (a run costs about 15 s, nearly all of it the
private step's tracing and XLA compilation).
"""

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.test_pretraining import write_corpus
from tf_megadp import cli
from tf_megadp.jobs.causal_lm import data
from tf_megadp.jobs.causal_lm.config import CausalLMConfig
from tf_megadp.jobs.common.errors import JobError


class TestData:
    def test_a_row_predicts_its_next_text_tokens_only(self):
        # [CLS] 7 8 9 [SEP] [PAD] [PAD]
        x, y, w = data.next_token_examples([[1, 7, 8, 9, 2, 0, 0]])
        assert x["token_ids"].tolist() == [[1, 7, 8, 9, 2, 0]]
        assert x["padding_mask"].tolist() == [[1, 1, 1, 1, 1, 0]]
        assert y.tolist() == [[7, 8, 9, 2, 0, 0]]
        assert w.tolist() == [[1, 1, 1, 0, 0, 0]]

    def test_the_unigram_baseline_predicts_the_most_frequent_training_target(self):
        train_y = np.array([[7, 7, 8, 2], [7, 9, 2, 0]])
        train_w = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])  # counted: 7 x3, 8, 9
        y = np.array([[7, 8, 6, 2]])
        w = np.array([[1.0, 1.0, 1.0, 0.0]])
        baseline = data.unigram_baseline(train_y, train_w, y, w, vocabulary_size=10)
        assert baseline.token == 7 and baseline.accuracy == pytest.approx(1 / 3)
        # add-one over the 10 tokens: p(7) = 4/15, p(8) = 2/15, p(6) = 1/15
        expected = math.exp(-(math.log(4 / 15) + math.log(2 / 15) + math.log(1 / 15)) / 3)
        assert baseline.perplexity == pytest.approx(expected)

    def test_a_pair_is_one_row_whose_targets_are_its_completion_and_its_end(self):
        import keras_hub

        vocabulary = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]", "what", "is", "two",
                      "plus", "one", "three", "four"]
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
        x, y, w = data.completion_examples(["what is two plus one plus two", "two plus two"],
                                           ["three", "four"], tokenizer, sequence_length=8)
        # Row 0 is too long: the prompt loses its start ("what is"), the completion stays.
        assert x["token_ids"].tolist() == [[1, 7, 8, 9, 8, 7, 10], [1, 7, 8, 7, 11, 2, 0]]
        assert y.tolist() == [[7, 8, 9, 8, 7, 10, 2], [7, 8, 7, 11, 2, 0, 0]]
        assert w.tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 0, 0]]

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
                (dict(family="mamba"), "family must be one of gpt2, llama"),
                (dict(noise="bandmf"), "independent noise"),
                (dict(sequence_length=4), "sequence_length must be an integer >= 8"),
                (dict(resume=True), "--resume needs --output-dir"),
                (dict(corpus=[str(tmp_path / "none.txt")]), "no such file"),
                (dict(target_epsilon=None), "--target-epsilon or --noise-multiplier"),
                (dict(train=str(tmp_path)), "needs both --train .* and --init-from"),
                (dict(lora_rank=0), "lora_rank must be a positive integer"),
                (dict(lora_rank=4), "--lora-rank 4 adapts a trained start"),
                (dict(privacy_unit="user"), "pass --corpus FILE.jsonl"),
                (dict(privacy_unit="", corpus=[str(tmp_path / "*.jsonl")]),
                 "privacy_unit must name a JSONL field"),
                (dict(privacy_unit="user", train=str(tmp_path / "pairs.jsonl"),
                      init_from=str(tmp_path / "model.keras")),
                 "--privacy-unit user is for pretraining .* Drop --privacy-unit"),
                (dict(examples_per_unit=0), "examples_per_unit must be a positive integer")):
            with pytest.raises(JobError, match=message):
                CausalLMConfig(**settings).validate()

    def test_the_cli_refuses_a_resume_without_a_run(self, tmp_path, capsys):
        status = cli.main(["causal-lm", "--output-dir", str(tmp_path / "none"), "--resume"])
        assert status == 2 and "no checkpoint" in capsys.readouterr().err


def tiny_config(corpus, root, output, **settings):
    values = dict(corpus=[corpus] if corpus else None, output_dir=str(output),
                  cache_dir=str(root / "cache"),
                  model="pico", sequence_length=16, vocabulary_size=200, micro_batch_size=16,
                  batch_size=16, steps=2, eval_every=1, noise_multiplier=1.0,
                  target_epsilon=None, accountant="rdp", warmup_steps=1, verbose=0,
                  # The public vocabulary is learned from this much of the default corpus.
                  max_characters=100_000)
    values.update(settings)
    return CausalLMConfig(**values)


def whole_schedule_epsilon(report):
    from tf_megadp import accounting
    from tf_megadp.steps import BatchSizeSchedule

    return accounting.compute_epsilon(
        delta=report["delta"], schedule=BatchSizeSchedule.from_dict(report["schedule"]),
        noise_multiplier=report["noise_multiplier"], accountant="rdp")


@pytest.fixture(scope="module")
def private_run(tmp_path_factory):
    """A private run of 2 steps on generated text (16 s: one XLA compilation of the step)."""
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    root = tmp_path_factory.mktemp("causal_lm")
    corpus = write_corpus(root)
    report = run_causal_lm(tiny_config(corpus, root, root / "run"), log=lambda *_: None)
    return report, corpus, root


@pytest.mark.filterwarnings("ignore::UserWarning")
class TestAPrivateRun:
    def test_it_spends_the_epsilon_of_its_whole_schedule(self, private_run):
        report, _, _ = private_run
        assert report["private"] and report["completed"] and report["logical_steps"] == 2
        assert report["sampling"] == "poisson"
        assert report["epsilon"] == pytest.approx(whole_schedule_epsilon(report), rel=1e-9)
        assert report["delta"] == pytest.approx(1 / report["num_examples"] ** 1.1)
        assert "packed sequence of 16 tokens" in report["privacy_unit"]

    def test_it_reports_accuracy_and_perplexity_beside_the_unigram_baseline(self, private_run):
        report, _, _ = private_run
        assert 0.0 <= report["heldout_accuracy"] <= 1.0
        assert 1.0 < report["heldout_perplexity"] < 200 * 1.5
        assert 0.0 < report["unigram_baseline_accuracy"] < 1.0
        assert 1.0 < report["unigram_baseline_perplexity"] < 200
        assert report["learned"] in (True, False)
        assert report["learned_threshold"] > report["unigram_baseline_accuracy"]
        assert [h["step"] for h in report["history"]] == [1, 2]
        assert report["vocabulary"]["public"] is True

    def test_it_writes_the_release_and_its_ledger(self, private_run):
        from tf_megadp.run import provenance

        report, _, root = private_run
        for name in ("model.keras", "vocab.txt", "privacy.json", "report.json", "report.png",
                     "checkpoint"):
            assert (root / "run" / name).exists(), name
        [record] = provenance.read_file_provenance(root / "run" / "model.keras")
        assert record.ledger.total_steps == report["logical_steps"]
        assert str(root) not in (root / "run" / "report.json").read_text()  # no machine path

    def test_a_resume_that_changes_the_privacy_is_refused_by_name(self, private_run, capsys):
        _, _, root = private_run
        status = cli.main(["causal-lm", "--output-dir", str(root / "run"), "--resume",
                           "--noise-multiplier", "2.0"])
        assert status == 2 and "noise_multiplier: 1.0 -> 2.0" in capsys.readouterr().err


class TestThePlan:
    """`tf-megadp causal-lm --plan`: the run's own checks and numbers, nothing trained or written."""

    def test_the_plan_is_what_the_run_did_and_writes_nothing(self, private_run):
        from tf_megadp.jobs.causal_lm import plan

        report, corpus, root = private_run
        planned = plan.make_plan(tiny_config(corpus, root, root / "planned"),
                                 log=lambda *_: None)
        assert not (root / "planned").exists()
        for name in ("num_examples", "schedule", "noise_multiplier", "epsilon", "delta",
                     "trainable_parameters", "training_sequences", "heldout_target_tokens",
                     "privacy_unit", "learning_rate"):
            assert planned[name] == report[name], name
        # Static slots for a Poisson batch of expected size 16 that overflows them
        # with probability below 1e-9.
        assert planned["capacity"] == planned["accumulation_steps"] * 16 > 16
        assert planned["truncation_probability"] < 1e-9
        flops, memory = planned["flops_per_row"], planned["memory_bytes"]
        assert flops["ghost"] > flops["non_private"]
        assert memory["ghost"]["total"] > memory["non_private"]["total"]
        assert planned["dp_over_non_private"]["memory"] == pytest.approx(
            memory["ghost"]["total"] / memory["non_private"]["total"])

    def test_a_resumed_run_plans_its_saved_settings(self, private_run, capsys):
        report, _, root = private_run
        status = cli.main(["causal-lm", "--output-dir", str(root / "run"), "--resume",
                           "--plan", "--json"])
        planned = json.loads(capsys.readouterr().out)
        assert status == 0 and planned["resumed_from_step"] == report["logical_steps"]
        assert planned["epsilon"] == report["epsilon"]
        assert planned["schedule"] == report["schedule"]

    def test_it_prints_the_privacy_and_the_cost(self, private_run, capsys):
        _, corpus, root = private_run
        status = cli.main(["causal-lm", "--corpus", corpus, "--cache-dir", str(root / "cache"),
                           "--output-dir", str(root / "printed"), "--model", "pico",
                           "--sequence-length", "16", "--vocabulary-size", "200",
                           "--max-characters", "100000", "--batch-size", "16",
                           "--micro-batch-size", "8", "--steps", "3", "--noise-multiplier",
                           "1.0", "--plan"])
        out, err = capsys.readouterr()
        assert status == 0, err
        assert not (root / "printed").exists()
        assert "micro-batches of 8" in out and "sigma = 1.0000" in out
        assert "DP / non-private" in out and "FLOPs per row" in out

    def test_it_refuses_what_the_run_refuses(self, private_run, capsys):
        _, corpus, root = private_run
        status = cli.main(["causal-lm", "--corpus", corpus, "--cache-dir", str(root / "cache"),
                           "--output-dir", str(root / "refused"), "--model", "pico",
                           "--sequence-length", "16", "--vocabulary-size", "200",
                           "--max-characters", "100000", "--batch-size", "100000", "--plan"])
        assert status == 2 and "--batch-size 100000 is larger than" in capsys.readouterr().err

    def test_fine_tuning_a_release_plans_its_composed_ledger(self, private_run):
        from tf_megadp.jobs.causal_lm import plan

        report, _, root = private_run
        pairs = write_pairs(root / "planned_pairs.jsonl")
        planned = plan.make_plan(CausalLMConfig(
            init_from=str(root / "run" / "model.keras"), train=pairs,
            output_dir=str(root / "planned_tuning"), sequence_length=16, batch_size=16,
            micro_batch_size=16, steps=2, noise_multiplier=1.0, target_epsilon=None,
            accountant="rdp"), log=lambda *_: None)
        assert planned["init"]["origin"] == "release"
        assert planned["epsilon"] > whole_schedule_epsilon(planned)
        assert planned["trainable_parameters"] == report["trainable_parameters"]


@pytest.mark.slow  # two more runs (30 s); the checkpoint is `run_folder`'s, as every job's
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_run_stopped_and_resumed_alone_ends_as_the_whole_run(private_run):
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    whole, corpus, root = private_run
    stopped = run_causal_lm(tiny_config(corpus, root, root / "stopped", stop_after_steps=1),
                            log=lambda *_: None)
    assert stopped["logical_steps"] == 1 and not stopped["completed"]
    assert stopped["epsilon"] < whole["epsilon"]
    assert cli.main(["causal-lm", "--output-dir", str(root / "stopped"), "--resume",
                     "--verbose", "0"]) == 0
    resumed = json.loads((root / "stopped" / "report.json").read_text())
    assert resumed["logical_steps"] == whole["logical_steps"] and resumed["completed"]
    assert resumed["resumed_from_step"] == 1 and resumed["resumes"] == [1]
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-9)


@pytest.mark.slow  # a second whole run; the machinery is the private run's
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_non_private_twin_reports_no_epsilon(private_run):
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    _, corpus, root = private_run
    report = run_causal_lm(tiny_config(corpus, root, root / "twin", non_private=True,
                                       noise_multiplier=None), log=lambda *_: None)
    assert report["private"] is False and report["epsilon"] is None
    assert report["completed"] and not (root / "twin" / "privacy.json").exists()


def write_pairs(path, n=64, seed=0):
    """Prompt/completion pairs of the generated corpus's words: "<subject> ..." -> "<verb>"."""
    from tests.test_pretraining import OBJECTS, SUBJECTS, VERBS

    rng = np.random.default_rng(seed)
    lines = [json.dumps({"prompt": f"{rng.choice(SUBJECTS)} then", "completion":
                         f"{rng.choice(VERBS)} {rng.choice(OBJECTS)}"}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow  # a third run (20 s); its machinery is the pretraining run's
def test_fine_tuning_a_dp_release_composes_its_ledger(private_run):
    # Through the `tf-megadp` launcher, in its own process: it imports the
    # library on first use, so the release's ledger must be read when the
    # start's weights are loaded, not by an import that happened before.
    _, _, root = private_run
    pairs = write_pairs(root / "pairs.jsonl")
    output = root / "tuned"
    command = [sys.executable, "-m", "tf_megadp_cli", "causal-lm", "--init-from",
               str(root / "run" / "model.keras"), "--train", pairs, "--output-dir", str(output),
               "--sequence-length", "16", "--batch-size", "16", "--micro-batch-size", "16",
               "--steps", "2", "--noise-multiplier", "1.0", "--accountant", "rdp",
               "--verbose", "0"]
    root_of_repository = str(pathlib.Path(__file__).parents[1])
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            cwd=root_of_repository,
                            env={**os.environ, "PYTHONPATH": root_of_repository})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((output / "report.json").read_text())
    assert report["objective"].startswith("next token of the completion")
    assert report["init"]["origin"] == "release"
    assert "one prompt/completion pair" in report["privacy_unit"]
    alone = whole_schedule_epsilon(report)
    # The release's steps come first: more than this run's own epsilon.
    assert report["epsilon"] > alone and report["completed"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_canary_example_attacks_both_releases(tmp_path, capsys):
    """examples/causal_lm_canaries.py on a pico GPT-2 for 2 steps: every canary of both models
    scored among the 10^4 secrets (exposure in [0, 13.3] bits), the table printed."""
    import runpy

    example = runpy.run_path("examples/causal_lm_canaries.py")
    rows = example["main"](
        ["--output-dir", str(tmp_path / "out"), "--corpus-bytes", "200000", "--steps", "2"],
        # The job's vocabulary size: the secrets' digits must be tokens of it.
        model="pico", sequence_length=16, micro_batch_size=16, batch_size=16, warmup_steps=1,
        cache_dir=str(tmp_path / "cache"))
    assert [row[0] for row in rows] == ["DP"] * 8 + ["non-private"] * 8
    assert sorted(row[1] for row in rows[:8]) == [0, 0, 1, 1, 8, 8, 32, 32]
    for _, _, _, bits, rank, _ in rows:
        assert 0.0 <= bits <= 4 * math.log2(10) + 1e-9 and 1 <= rank <= 10 ** 4
    printed = capsys.readouterr().out
    assert "| DP | 32 |" in printed and "| non-private | 0 |" in printed


@pytest.mark.slow  # two more runs (20 s); LoRA's records are exact in test_clipping_causal_lm
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lora_on_a_dp_release_composes_its_ledger_and_resumes_alone(private_run):
    """LoRA from the release: only the factors train, the release's ledger comes first, and a
    run stopped after one step and resumed with --resume alone ends as the whole run would."""
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    whole, _, root = private_run
    pairs = write_pairs(root / "lora_pairs.jsonl")
    settings = dict(init_from=str(root / "run" / "model.keras"), train=pairs, lora_rank=2)
    stopped = run_causal_lm(tiny_config(None, root, root / "lora", stop_after_steps=1,
                                        **settings), log=lambda *_: None)
    assert stopped["trains"] == "LoRA rank 2" and stopped["init"]["origin"] == "release"
    assert stopped["trainable_parameters"] < whole["trainable_parameters"] / 10
    assert stopped["learning_rate_source"] == "DP LoRA default"
    assert cli.main(["causal-lm", "--output-dir", str(root / "lora"), "--resume",
                     "--verbose", "0"]) == 0
    resumed = json.loads((root / "lora" / "report.json").read_text())
    assert resumed["completed"] and resumed["resumes"] == [1]
    # The release's 2 steps, then these 2: more than this run's own epsilon.
    assert resumed["epsilon"] > whole_schedule_epsilon(resumed)
    assert resumed["init"]["origin"] == "release" and resumed["trains"] == "LoRA rank 2"


@pytest.mark.slow  # a second LoRA run; the machinery is the one above
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lora_on_data_disjoint_from_the_release_resumes_without_its_ledger(private_run):
    # LoRA keeps the release's values (every weight but the factors): its
    # resume recognises them, and the run's saved declaration sets them aside.
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    _, _, root = private_run
    pairs = write_pairs(root / "disjoint_pairs.jsonl", seed=1)
    config = tiny_config(None, root, root / "lora_disjoint", stop_after_steps=1,
                         init_from=str(root / "run" / "model.keras"), train=pairs,
                         lora_rank=2, init_data_disjoint=True)
    assert run_causal_lm(config, log=lambda *_: None)["init"]["origin"] == "disjoint"
    assert cli.main(["causal-lm", "--output-dir", str(root / "lora_disjoint"), "--resume",
                     "--verbose", "0"]) == 0
    resumed = json.loads((root / "lora_disjoint" / "report.json").read_text())
    assert resumed["completed"] and resumed["init"]["origin"] == "disjoint"
    assert resumed["epsilon"] == pytest.approx(whole_schedule_epsilon(resumed), rel=1e-9)


def write_user_corpus(path, sizes, seed=0):
    """Generated JSONL documents of the generated corpus's words, `sizes[u]` by user u."""
    from tests.test_pretraining import OBJECTS, SUBJECTS, VERBS

    rng = np.random.default_rng(seed)
    lines = []
    for user, size in enumerate(sizes):
        for _ in range(size):
            text = " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                            for _ in range(int(rng.integers(2, 5))))
            lines.append(json.dumps({"text": text, "user": f"user-{user:02d}"}))
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# Two prolific users and ten who wrote little: far fewer units than sequences.
USER_SIZES = [60, 40] + [6] * 10


@pytest.fixture(scope="module")
def user_level_run(private_run, tmp_path_factory):
    """A private run of 2 steps over the users of a JSONL corpus (--privacy-unit user, 15 s).

    It shares the private run's cache: the public vocabulary is learned once.
    """
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    root = tmp_path_factory.mktemp("causal_lm_users")
    corpus = write_user_corpus(root / "notes.jsonl", USER_SIZES)
    config = tiny_config(corpus, root, root / "run", privacy_unit="user", examples_per_unit=2,
                         batch_size=4, micro_batch_size=4,
                         cache_dir=str(private_run[2] / "cache"))
    log = []
    report = run_causal_lm(config, log=log.append)
    return report, config, "\n".join(log), root


@pytest.mark.filterwarnings("ignore::UserWarning")
class TestAUserLevelRun:
    def test_n_counts_the_users_and_epsilon_is_accounted_over_them(self, user_level_run):
        from tf_megadp import accounting
        from tf_megadp.jobs.bert.units import load_unit_ids
        from tf_megadp.jobs.causal_lm.data import corpus_splits
        from tf_megadp.steps import BatchSizeSchedule

        report, config, _, _ = user_level_run
        _, train, _ = corpus_splits(config)
        users = np.unique(load_unit_ids(train)).size
        assert report["num_examples"] == users == len(USER_SIZES)
        assert report["training_sequences"] == len(train) > 2 * users
        assert report["examples_per_unit"] == 2 and report["completed"]
        assert report["delta"] == pytest.approx(1 / users ** 1.1)
        # The run's 2 steps of B = 4 expected users, 4 user slots per micro-batch,
        # accounted over N = the users (Poisson sampling with q = 4 / U).
        schedule = BatchSizeSchedule.constant(2, 4, num_examples=users, micro_batch_size=4)
        expected = accounting.compute_epsilon(delta=1 / users ** 1.1, schedule=schedule,
                                              noise_multiplier=1.0, accountant="rdp")
        assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
        over_sequences = accounting.compute_epsilon(
            delta=1 / users ** 1.1, noise_multiplier=1.0, accountant="rdp",
            schedule=BatchSizeSchedule.constant(2, 4, num_examples=len(train),
                                                micro_batch_size=4))
        assert over_sequences < 0.5 * report["epsilon"]  # what N = sequences would claim

    def test_the_report_and_the_log_name_the_unit(self, user_level_run):
        report, _, log, root = user_level_run
        assert report["privacy_unit"].startswith("one user: every document with the same 'user'")
        privacy = json.loads((root / "run" / "privacy.json").read_text())
        # The optimizer clips what the sampler lays out: k rows of one user.
        assert privacy["privacy_unit"] == "user"
        assert privacy["data"]["examples_per_unit"] == 2
        assert (f"N = {report['num_examples']:,} privacy units ('user'; "
                f"{report['training_sequences']:,} training sequences)") in log

    def test_a_resume_that_changes_the_unit_is_refused_by_name(self, user_level_run, capsys):
        _, _, _, root = user_level_run
        status = cli.main(["causal-lm", "--output-dir", str(root / "run"), "--resume",
                           "--privacy-unit", "author"])
        assert status == 2 and "privacy_unit: 'user' -> 'author'" in capsys.readouterr().err


@pytest.mark.slow  # two more runs (30 s); the resume is the sequence-level run's
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_user_level_run_stopped_and_resumed_alone_ends_as_the_whole_run(user_level_run):
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    whole, config, _, root = user_level_run
    stopped = run_causal_lm(dataclasses.replace(config, output_dir=str(root / "stopped"),
                                                stop_after_steps=1), log=lambda *_: None)
    assert stopped["logical_steps"] == 1 and stopped["epsilon"] < whole["epsilon"]
    # --resume alone: the unit, k and N are the saved run's.
    assert cli.main(["causal-lm", "--output-dir", str(root / "stopped"), "--resume",
                     "--verbose", "0"]) == 0
    resumed = json.loads((root / "stopped" / "report.json").read_text())
    assert resumed["completed"] and resumed["resumes"] == [1]
    assert resumed["num_examples"] == whole["num_examples"]
    assert resumed["privacy_unit"] == whole["privacy_unit"]
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-9)


def test_a_corpus_without_the_units_field_is_refused_before_anything_is_written(
        user_level_run, tmp_path):
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    cache = user_level_run[1].cache_dir  # its public vocabulary is learned already
    corpus = write_user_corpus(tmp_path / "notes.jsonl", [3, 3])
    plain = tmp_path / "notes.txt"
    plain.write_text("one document.\n\nanother one.", encoding="utf-8")
    for path, message in ((corpus, "no string or integer field 'author'"),
                          (str(plain), "is not JSONL")):
        config = tiny_config(path, tmp_path, tmp_path / "run", privacy_unit="author",
                             cache_dir=cache)
        with pytest.raises(JobError, match=message):
            run_causal_lm(config, log=lambda *_: None)
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_family_reads_no_later_token(family):
    """Changing the last tokens changes no earlier position's prediction: what the held-out
    next-token scores of either family rest on (a model that read ahead would copy)."""
    from tf_megadp.jobs.causal_lm.families import build_model

    model = build_model(family, "pico", vocabulary_size=50, context=8)
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 50, (2, 8)).astype("int32")
    changed = tokens.copy()
    changed[:, 5:] = (tokens[:, 5:] + 1) % 50
    mask = np.ones_like(tokens)
    before = np.asarray(model({"token_ids": tokens, "padding_mask": mask}))
    after = np.asarray(model({"token_ids": changed, "padding_mask": mask}))
    np.testing.assert_allclose(after[:, :5], before[:, :5], atol=1e-5)
    assert np.abs(after[:, 5:] - before[:, 5:]).max() > 1e-3


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A private run of a pico Llama, 2 steps on generated text (one more XLA compilation)."""
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    root = tmp_path_factory.mktemp("causal_lm_llama")
    corpus = write_corpus(root)
    report = run_causal_lm(tiny_config(corpus, root, root / "run", family="llama"),
                           log=lambda *_: None)
    return report, root


def model_config(path):
    """The config.json of a .keras file (what `--init-from` reads of the model)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json"))


@pytest.mark.slow  # a Llama run (20 s); Llama's per-example norms are exact in test_clipping_causal_lm
@pytest.mark.filterwarnings("ignore::UserWarning")
class TestALlamaRun:
    def test_it_trains_an_untied_llama_at_the_epsilon_of_its_whole_schedule(self, llama_run):
        from tf_megadp.run import provenance

        report, root = llama_run
        assert report["private"] and report["completed"] and report["logical_steps"] == 2
        assert report["epsilon"] == pytest.approx(whole_schedule_epsilon(report), rel=1e-9)
        assert report["model"]["family"].startswith("Llama (")
        assert "untied head" in report["model"]["family"]
        assert report["model"]["tied_head"] is False and report["config"]["family"] == "llama"
        assert report["model"]["context"] == 15  # the tokens a row of 16 gives it
        backbone = model_config(root / "run" / "model.keras")
        assert backbone["registered_name"] == "keras_hub>LlamaCausalLM"
        [record] = provenance.read_file_provenance(root / "run" / "model.keras")
        assert record.ledger.total_steps == 2

    def test_a_resume_that_changes_the_family_is_refused_by_name(self, llama_run, capsys):
        _, root = llama_run
        status = cli.main(["causal-lm", "--output-dir", str(root / "run"), "--resume",
                           "--family", "gpt2"])
        assert status == 2 and "family: 'llama' -> 'gpt2'" in capsys.readouterr().err

    def test_fine_tuning_refuses_another_family_and_longer_rows_by_name(self, llama_run):
        from tf_megadp.jobs.causal_lm.run import run_causal_lm

        _, root = llama_run
        start = dict(init_from=str(root / "run" / "model.keras"),
                     train=write_pairs(root / "pairs.jsonl"))
        for settings, message in (
                (dict(family="gpt2"), r"--family gpt2: --init-from .* is a Llama "
                                      r"\(LlamaCausalLM\)"),
                (dict(sequence_length=32), "the start was trained on rows of 15 tokens; pass "
                                           "at most 16")):
            with pytest.raises(JobError, match=message):
                run_causal_lm(tiny_config(None, root, root / "refused", **start, **settings),
                              log=lambda *_: None)
        assert not (root / "refused").exists()

    def test_a_llama_start_whose_context_no_report_states_is_refused(self, llama_run):
        import shutil

        from tf_megadp.jobs.causal_lm.run import run_causal_lm

        _, root = llama_run
        alone = root / "alone"
        alone.mkdir()
        for name in ("model.keras", "vocab.txt"):  # no report.json
            shutil.copy(root / "run" / name, alone / name)
        with pytest.raises(JobError, match="no report.json beside it says how many tokens"):
            run_causal_lm(tiny_config(None, root, root / "refused", init_from=str(
                alone / "model.keras"), train=write_pairs(root / "pairs.jsonl")),
                log=lambda *_: None)

    def test_a_start_with_grouped_query_attention_is_refused_by_name(self, llama_run, tmp_path):
        import zipfile

        from tf_megadp.jobs.bert import initial_weights
        from tf_megadp.jobs.bert.config import PretrainError
        from tf_megadp.jobs.causal_lm.run import CAUSAL_LM_TASKS

        _, root = llama_run
        release = root / "run" / "model.keras"
        init = initial_weights.read_initial_weights(release, CAUSAL_LM_TASKS)
        assert (init.task, init.preset_name(), init.max_sequence_length) == (
            "keras_hub>LlamaCausalLM", "pico", 15)
        grouped = model_config(release)
        grouped["config"]["backbone"]["config"]["num_key_value_heads"] = 1
        with zipfile.ZipFile(release) as source, \
                zipfile.ZipFile(tmp_path / "model.keras", "w") as target:
            for item in source.infolist():
                target.writestr(item, json.dumps(grouped) if item.filename == "config.json"
                                else source.read(item))
        with pytest.raises(PretrainError, match="1 key/value heads for 2 query heads"):
            initial_weights.read_initial_weights(tmp_path / "model.keras", CAUSAL_LM_TASKS)


@pytest.mark.slow  # a second Llama run (20 s); its machinery is the GPT-2 fine-tuning's
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lora_fine_tuning_of_a_llama_release_composes_its_ledger(llama_run):
    """LoRA from the Llama release: its family is read from the file, only the factors on the
    query and value projections train, and the release's ledger comes first."""
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    whole, root = llama_run
    report = run_causal_lm(tiny_config(
        None, root, root / "tuned", init_from=str(root / "run" / "model.keras"),
        train=write_pairs(root / "tuned_pairs.jsonl"), lora_rank=2), log=lambda *_: None)
    assert report["completed"] and report["config"]["family"] == "llama"
    assert report["model"]["family"].startswith("Llama (") and report["model"]["context"] == 15
    assert report["init"]["origin"] == "release" and report["trains"] == "LoRA rank 2"
    # 1 layer, query and value (32 -> 2 heads x 16): Keras's EinsumDense factors A
    # (32 x 2 heads x rank 2) and B (rank 2 x 16) each; the untied head is frozen too.
    assert report["trainable_parameters"] == 2 * (32 * 2 * 2 + 2 * 16)
    assert report["epsilon"] > whole_schedule_epsilon(report)
