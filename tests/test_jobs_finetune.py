"""Specification of `tf-megadp finetune` (`tf_megadp.jobs.finetune`).

The data: labelled JSONL or CSV with named fields, a stratified held-out
split, refusals that name the file, line and fix; the default task is
balanced, deterministic and names no package. The job: a start of unknown
origin needs a statement, a bad label word is refused before anything
trains, a private run reports its test accuracy beside the majority class
and an epsilon within its target, writes the release (whose weights carry
their ledger) and privacy.json, and a run stopped and resumed with
--resume alone ends with the uninterrupted run's steps and epsilon.
The runs here train an untrained pico BERT on a tiny task: they check the
machinery, not what it learns (docs/results.md, "Private fine-tuning",
measures that).
"""

import json
import shutil

import numpy as np
import pytest

from tf_megadp import cli
from tf_megadp.jobs.common.errors import JobError
from tf_megadp.jobs.finetune import data
from tf_megadp.jobs.finetune.config import FinetuneConfig
from tf_megadp.jobs.finetune.run import run_finetuning

WORDS = ["good", "bad", "film", "plot", "acting", "great", "dull", "fine", "the", "was",
         "it", "is", "a", "very", "not"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tiny_task(path, n=96, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        label = str(rng.choice(["pos", "neg"]))
        word = "good" if label == "pos" else "bad"
        words = list(rng.choice(WORDS[2:], 5)) + [word]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return write_jsonl(path, rows)


class TestData:
    def test_jsonl_and_csv_read_the_same_examples(self, tmp_path):
        rows = [{"review": "good film", "stars": "5"}, {"review": "bad plot", "stars": "1"}]
        jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
        (tmp_path / "a.csv").write_text("review,stars\ngood film,5\nbad plot,1\n")
        expected = (["good film", "bad plot"], ["5", "1"])
        assert data.read_labelled(jsonl, "review", "stars") == expected
        assert data.read_labelled(str(tmp_path / "a.csv"), "review", "stars") == expected

    def test_a_line_without_its_field_is_refused_by_file_and_line(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "label": "a"}, {"text": "y"}])
        with pytest.raises(JobError, match=r"a\.jsonl:2: no 'label' field.*--label-field"):
            data.read_labelled(path)
        (tmp_path / "b.jsonl").write_text('{"text": "x", "label": "a"}\nnot json\n')
        with pytest.raises(JobError, match=r"b\.jsonl:2: not a JSON object"):
            data.read_labelled(str(tmp_path / "b.jsonl"))

    def test_the_held_out_split_is_stratified_and_a_foreign_test_label_refused(self, tmp_path):
        task = data.task_from_files(tiny_task(tmp_path / "t.jsonl", n=100), None,
                                    test_fraction=0.2)
        assert task.labels == ("neg", "pos")
        assert len(task.test_texts) == 20 and len(task.train_texts) == 80
        train_share = np.mean(task.train_labels)
        assert abs(np.mean(task.test_labels) - train_share) < 0.06
        other = write_jsonl(tmp_path / "o.jsonl", [{"text": "x", "label": "meh"}])
        with pytest.raises(JobError, match=r"\['meh'\] are not among the task's"):
            data.task_from_files(str(tmp_path / "t.jsonl"), other)

    def test_the_default_task_is_balanced_deterministic_and_names_no_package(self):
        task = data.default_task(per_class=60)
        again = data.default_task(per_class=60)
        assert task.train_texts == again.train_texts and task.test_texts == again.test_texts
        assert task.labels == ("scipy", "scikit-learn", "matplotlib")
        counts = np.bincount(np.concatenate([task.train_labels, task.test_labels]))
        assert counts.tolist() == [60, 60, 60]
        assert task.majority_class_accuracy() == pytest.approx(1 / 3)
        for text in task.train_texts + task.test_texts:
            lowered = text.lower()
            assert not any(name in lowered for name in ("scipy", "sklearn", "matplotlib",
                                                         "pyplot", "scikit")), text


class TestRefusals:
    def test_bad_settings_name_the_fix_before_anything_runs(self, tmp_path):
        for settings, message in (
                (dict(objective="mlm"), "objective must be one of prompt, head"),
                (dict(noise="bandmf"), "independent noise"),
                (dict(init_public=True, init_data_disjoint=True), "give the one that holds"),
                (dict(test=str(tmp_path / "t.jsonl")), "--test names the test split"),
                (dict(epochs=0), "epochs must be > 0")):
            with pytest.raises(JobError, match=message):
                FinetuneConfig(**settings).validate()

    def test_the_cli_refuses_a_missing_train_file(self, tmp_path, capsys):
        status = cli.main(["finetune", "--train", str(tmp_path / "missing.jsonl")])
        assert status == 2 and "no such file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def public_start(tmp_path_factory):
    """An untrained pico BERT published as a non-private run on the public corpus (no training)."""
    from tests.test_jobs_bert_initial_weights import VOCABULARY, publish
    from tf_megadp.jobs.bert import training
    from tf_megadp.jobs.bert.config import PretrainConfig

    import keras

    folder = tmp_path_factory.mktemp("start")
    # Not seed 0: test_jobs_bert_initial_weights's fabricated release holds
    # seed 0's untrained values, and a process that met it (an xdist worker)
    # rightly recognises them as that release's.
    keras.utils.set_random_seed(1)
    vocabulary = list(VOCABULARY) + [w for w in WORDS if w not in VOCABULARY]
    model = training.build_model(PretrainConfig(model="pico", sequence_length=16,
                                                vocabulary_size=len(vocabulary)),
                                 len(vocabulary))
    model.save(folder / "pico.keras")
    path = publish(folder / "pico.keras", folder / "public", private=False, corpus=None)
    (folder / "public" / "vocab.txt").write_text("".join(t + "\n" for t in vocabulary))
    return path


def tiny_config(task, start, output, **settings):
    values = dict(train=task, init_from=start, output_dir=str(output), sequence_length=16,
                  batch_size=32, micro_batch_size=16, epochs=2, accountant="rdp",
                  eval_every=2, verbose=0, label_words=["bad", "good"],
                  template="{text} it was [MASK]")
    values.update(settings)
    return FinetuneConfig(**values)


def test_a_start_of_unknown_origin_needs_a_statement(public_start, tmp_path):
    folder = tmp_path / "unknown"
    shutil.copytree(str(public_start).rsplit("/", 1)[0], folder)
    (folder / "report.json").unlink()
    config = tiny_config(tiny_task(tmp_path / "t.jsonl"), str(folder / "model.keras"),
                         tmp_path / "out")
    with pytest.raises(JobError, match="--init-public.*--init-data-disjoint"):
        run_finetuning(config, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_a_sequence_longer_than_the_starts_positions_is_refused_by_name(public_start, tmp_path):
    with pytest.raises(JobError, match="--sequence-length 64 exceeds the 16 positions.*pass "
                                       "--sequence-length 16 or less"):
        run_finetuning(FinetuneConfig(train=tiny_task(tmp_path / "t.jsonl"), init_from=public_start,
                                      output_dir=str(tmp_path / "out"), sequence_length=64))
    assert not (tmp_path / "out").exists()


def test_a_label_word_that_is_no_token_is_refused_before_training(public_start, tmp_path):
    config = tiny_config(tiny_task(tmp_path / "t.jsonl"), public_start, tmp_path / "out",
                         label_words=["bad", "superb"])
    with pytest.raises(JobError, match="'superb'.*not one token.*--label-words"):
        run_finetuning(config, log=lambda *_: None)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def stopped_and_resumed(public_start, tmp_path_factory):
    """A private prompt run stopped after 1 step and resumed with --resume alone, and its twin."""
    root = tmp_path_factory.mktemp("finetune")
    task = tiny_task(root / "t.jsonl")
    quiet = dict(log=lambda *_: None)
    whole = run_finetuning(tiny_config(task, public_start, root / "whole"), **quiet)
    run_finetuning(tiny_config(task, public_start, root / "stopped", stop_after_steps=1),
                   **quiet)
    assert cli.main(["finetune", "--output-dir", str(root / "stopped"), "--resume",
                     "--verbose", "0"]) == 0
    resumed = json.loads((root / "stopped" / "report.json").read_text())
    return whole, resumed, root


@pytest.mark.filterwarnings("ignore::UserWarning")
class TestAPrivateRun:
    def test_it_reports_test_accuracy_beside_the_majority_class_within_epsilon(
            self, stopped_and_resumed):
        whole, _, root = stopped_and_resumed
        assert whole["objective"] == "prompt" and whole["private"]
        assert whole["completed"] and whole["logical_steps"] == whole["schedule"]["phases"][0][
            "steps"]
        assert 0.0 <= whole["test_accuracy"] <= 1.0
        assert whole["majority_class_accuracy"] >= 0.5 and whole["learned"] in (True, False)
        assert 0 < whole["epsilon"] <= 8.0 * 1.0001
        assert whole["init"]["origin"] == "public"
        assert whole["prompt"]["label_words"] == {"neg": "bad", "pos": "good"}
        for name in ("model.keras", "vocab.txt", "privacy.json", "report.json", "report.png"):
            assert (root / "whole" / name).exists(), name
        privacy = json.loads((root / "whole" / "privacy.json").read_text())
        assert privacy["steps"] == whole["logical_steps"]
        parts = whole["train_time_parts_s"]
        assert {"fit", "EvaluationAndCheckpoints"} <= set(parts)
        assert sum(parts.values()) == pytest.approx(whole["train_time_s"], abs=0.01)

    def test_its_release_carries_its_ledger(self, stopped_and_resumed):
        from tf_megadp.run import provenance

        whole, _, root = stopped_and_resumed
        [record] = provenance.read_file_provenance(root / "whole" / "model.keras")
        assert record.ledger.total_steps == whole["logical_steps"]

    def test_resume_alone_ends_with_the_uninterrupted_steps_and_epsilon(
            self, stopped_and_resumed):
        whole, resumed, _ = stopped_and_resumed
        assert resumed["resumes"] == [1] and resumed["completed"]
        assert resumed["logical_steps"] == whole["logical_steps"]
        assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-9)


# Another whole run (about 10 s): slow (the 15-minute CI budget); the DP
# head and the non-private twin run in the study and the example.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_non_private_head_baseline_runs_and_says_so(public_start, tmp_path):
    report = run_finetuning(tiny_config(tiny_task(tmp_path / "t.jsonl"), public_start,
                                        tmp_path / "out", objective="head", non_private=True,
                                        target_epsilon=None), log=lambda *_: None)
    assert not report["private"] and report["epsilon"] is None
    assert report["objective"] == "head" and report["prompt"] is None
    assert not (tmp_path / "out" / "privacy.json").exists()


# -- examples/finetune_classifier.py: the job twice, DP and its non-private twin --


def finetune_example():
    import runpy

    return runpy.run_path("examples/finetune_classifier.py")


def test_the_example_refuses_a_non_private_model_of_user_text(tmp_path):
    from tests.test_jobs_bert_initial_weights import publish

    start = publish(_pico_file(tmp_path), tmp_path / "user-text", private=False)
    with pytest.raises(JobError, match="without DP"):
        finetune_example()["main"](["--public-model", start, "--train",
                                    tiny_task(tmp_path / "t.jsonl"), "--label-words",
                                    "bad,good", "--output-dir", str(tmp_path / "out")])


def _pico_file(folder):
    import keras

    from tests.test_jobs_bert_initial_weights import PICO, VOCABULARY
    from tf_megadp.jobs.bert import training
    from tf_megadp.jobs.bert.config import PretrainConfig

    keras.utils.set_random_seed(1)  # Not seed 0: see public_start.
    training.build_model(PretrainConfig(**PICO), len(VOCABULARY)).save(folder / "pico.keras")
    return folder / "pico.keras"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_example_prints_the_dp_run_beside_its_twin(public_start, tmp_path, capsys):
    reports = finetune_example()["main"](
        # 400 rows: the default batch of a smaller task holds more rows than it has.
        ["--public-model", public_start, "--train", tiny_task(tmp_path / "t.jsonl", n=400),
         "--label-words", "bad,good", "--epochs", "2", "--sequence-length", "16",
         "--output-dir", str(tmp_path / "out")])
    assert reports["dp"]["private"] and not reports["non_private"]["private"]
    assert 0 < reports["dp"]["epsilon"] <= 8.0 * 1.0001
    printed = capsys.readouterr().out
    assert "non-private prompt" in printed and "DP prompt" in printed
