"""Specification of the main job, `tf-megadp pretrain`, on a tiny configuration.

One run is interrupted after two logical steps (checkpoint), resumed to the
end, and must report the epsilon the accountant gives for the whole schedule.
Bad input must give one line on stderr, exit status 2 and no output folder.

Attacks on what the job writes: nothing under its output folder lets its
Poisson draws be recomputed (the sampling secret is in no file, no seed it
records reproduces them, and every start draws afresh), and a rare word of a
private corpus does not reach the published vocabulary unless the user asks
for a vocabulary learned on that corpus.
"""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import zipfile

import h5py
import numpy as np
import pytest

from tf_megadp import accounting, cli, distribute
from tf_megadp.data import PoissonSampler, TokenShards, write_token_shards
from tf_megadp.steps import BatchSizeSchedule
from tf_megadp.jobs.bert.pretraining import PretrainConfig, prepare_data, run_pretraining

SUBJECTS = ["the model", "a student", "our team", "the network", "each layer", "the sampler"]
VERBS = ["computes", "clips", "reads", "writes", "trains", "reports", "samples", "adds"]
OBJECTS = ["the gradient", "a batch", "some noise", "the epsilon", "every example", "the loss"]


# A rare identifier of the "private" corpus: in 20 of its 400 documents, which
# is enough for a vocabulary learned on the corpus to hold it as one token.
RARE_WORD = "vexquorbitzal"


def write_corpus(folder, documents=400, seed=0):
    """Generated sentences: real-looking text, no third-party content."""
    rng = np.random.default_rng(seed)
    lines = []
    for index in range(documents):
        sentences = [
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{int(rng.integers(1, 50))} times."
            for _ in range(int(rng.integers(2, 5)))
        ]
        if index % 20 == 0:
            sentences.append(f"the {RARE_WORD} account.")
        lines.append(" ".join(sentences))
    path = folder / "private.txt"
    path.write_text("\n\n".join(lines), encoding="utf-8")
    return str(path)


def tiny_config(corpus, cache_dir, output_dir, **overrides):
    settings = dict(
        corpus=[corpus], output_dir=str(output_dir), cache_dir=str(cache_dir),
        model="pico", sequence_length=16, vocabulary_size=200, micro_batch_size=8,
        batch_size=16, steps=4, eval_every=2, checkpoint_every=1, target_epsilon=None,
        noise_multiplier=1.0, accountant="rdp", warmup_steps=1, verbose=0,
        # The public vocabulary is learned from this much of the default corpus.
        max_characters=300_000,
    )
    settings.update(overrides)
    return PretrainConfig(**settings)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    return root, write_corpus(root), root / "cache"


class Captured:
    """What the job's sampling randomness was, seen from inside the process only.

    `secrets`: every value `shared_sampling_secret` returned (one per start
    of the job); `draws`: (sampler number, step, sorted indices) of every
    Poisson step drawn.
    """

    def __init__(self, monkeypatch):
        self.secrets, self.draws, self._samplers = [], [], {}
        real_secret = distribute.shared_sampling_secret
        real_draw = PoissonSampler.draw

        def secret(*args, **kwargs):
            value = real_secret(*args, **kwargs)
            self.secrets.append(value)
            return value

        def draw(sampler, step):
            result = real_draw(sampler, step)
            number = self._samplers.setdefault(id(sampler), len(self._samplers))
            self.draws.append((number, step, result.indices.copy()))
            return result

        monkeypatch.setattr(distribute, "shared_sampling_secret", secret)
        monkeypatch.setattr(PoissonSampler, "draw", draw)

    def first_draw(self, sampler_number=0):
        return next(d[2] for d in self.draws if d[0] == sampler_number and d[1] == 0)


# The resumed run averages its weights (EMA) and normalizes its per-example
# gradients: a checkpoint must carry both across the interruption.
RECIPE = dict(ema_momentum=0.5, per_example_scaling="automatic")

# Long enough for the job's model to leave the unigram plateau on the test
# corpus at the non-private default learning rate, with a held-out split
# large enough that the noise margin is 2 points of accuracy (measured at
# 2e-3: 0.075 unigram, 0.094 threshold; 0.104 at step 100, 0.168 at 150).
LEARNING_RUN = dict(model="nano", steps=150, batch_size=64, micro_batch_size=128, eval_every=50,
                    heldout_fraction=0.3)


@pytest.fixture(scope="module")
def resumed_capture(workspace):
    """The job stopped after 2 of 4 steps, then resumed; its randomness and log captured."""
    root, corpus, cache = workspace
    output = root / "run"
    captured_log = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        captured = Captured(monkeypatch)
        first = run_pretraining(tiny_config(corpus, cache, output, stop_after_steps=2, **RECIPE),
                                log=captured_log.append)
        # The stopped start's checkpoint, which the resumed start overwrites.
        captured.stopped_output = root / "stopped_run"
        shutil.copytree(output / "checkpoint", captured.stopped_output / "checkpoint")
        resumed_log = []
        report = run_pretraining(tiny_config(corpus, cache, output, resume=True, **RECIPE),
                                 log=resumed_log.append)
    captured.log, captured.resumed_log = captured_log, resumed_log
    return first, report, output, captured


@pytest.fixture(scope="module")
def resumed_run(resumed_capture):
    return resumed_capture[:3]


@pytest.fixture(scope="module")
def second_run(workspace):
    """The same job started again (one step), its randomness and log captured.

    At learning rate 0 (the draws do not depend on it): a run that cannot
    learn, for the unigram-baseline verdict.
    """
    root, corpus, cache = workspace
    output = root / "again"
    stdout = io.StringIO()  # Not a terminal: Keras's "auto" bar would write \r updates.
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(stdout):
        captured = Captured(monkeypatch)
        captured.log = []
        captured.report = run_pretraining(
            tiny_config(corpus, cache, output, steps=1, checkpoint_every=0, eval_every=1,
                        learning_rate=0.0, verbose="auto"),
            log=captured.log.append)
    captured.stdout = stdout.getvalue()
    return output, captured


def output_files(folder):
    """(name, bytes) of every file under `folder`, zip members (model.keras, .npz) too."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        data = path.read_bytes()
        yield name, data
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for member in archive.namelist():
                    yield f"{name}!{member}", archive.read(member)


def secret_encodings(secret):
    """The ways a 128-bit integer could sit in a text or binary file."""
    forms = [str(secret), format(secret, "x"), format(secret, "X"), format(secret, "#x")]
    encoded = [form.encode() for form in forms]
    encoded += [secret.to_bytes(16, "little"), secret.to_bytes(16, "big")]
    for half in (secret & (2**64 - 1), secret >> 64):
        signed = half - 2**64 if half >= 2**63 else half
        encoded += [half.to_bytes(8, "little"), half.to_bytes(8, "big"),
                    str(half).encode(), str(signed).encode()]
    return encoded


def json_strings(value):
    """Every string anywhere in a JSON document."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from json_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from json_strings(item)


def json_integers(value):
    """Every integer (and integral float) anywhere in a JSON document."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, float) and value.is_integer():
        yield int(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from json_integers(item)
    elif isinstance(value, list):
        for item in value:
            yield from json_integers(item)


class TestEndToEnd:
    def test_interrupted_run_checkpoints_and_stops_early(self, resumed_run):
        first, _, output = resumed_run
        assert first["logical_steps"] == 2
        assert not first["completed"]
        assert first["resumed_from_step"] == 0

    def test_resumed_run_completes_the_schedule(self, resumed_run):
        _, report, _ = resumed_run
        assert report["resumed_from_step"] == 2
        assert report["logical_steps"] == 4
        assert report["completed"]
        assert [h["step"] for h in report["history"]] == [2, 4]

    def test_report_epsilon_matches_the_accountant(self, resumed_run):
        _, report, _ = resumed_run
        from tf_megadp.steps import BatchSizeSchedule

        schedule = BatchSizeSchedule.from_dict(report["schedule"])
        expected = accounting.compute_epsilon(
            delta=report["delta"], schedule=schedule,
            noise_multiplier=report["noise_multiplier"], accountant="rdp")
        assert report["noise_multiplier"] == 1.0
        assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert report["history"][-1]["epsilon"] == pytest.approx(expected, rel=1e-9)

    def test_the_run_writes_its_artifacts(self, resumed_run):
        _, report, output = resumed_run
        for name in ("report.json", "report.png", "history.csv", "checkpoint", "model.keras",
                     "privacy.json", "tensorboard"):
            assert (output / name).exists(), name
        on_disk = json.loads((output / "report.json").read_text())
        assert on_disk["epsilon"] == report["epsilon"]
        assert 0.0 <= on_disk["heldout_mlm_accuracy"] <= 1.0
        assert 0.0 < on_disk["unigram_baseline_accuracy"] < 1.0

    def test_the_log_says_n_and_how_the_corpus_was_prepared(self, resumed_capture, workspace):
        first, _, _, captured = resumed_capture
        text = "\n".join(captured.log)
        assert f"Corpus: N = {first['num_examples']:,} training sequences of 16 tokens" in text
        assert f"held-out {first['heldout_examples']}" in text
        # The first run of the module built the shards: its progress lines are there.
        assert re.search(r"tokenizing: 100% \(400 / 400 documents", text), text
        assert f"wrote N = {first['num_examples'] + first['heldout_examples']:,} sequences" in text

    def test_the_exported_model_is_the_evaluated_average(self, resumed_run, workspace):
        """The last held-out accuracy is that of model.keras: the EMA weights, not the live ones."""
        import keras

        from tf_megadp.jobs.bert import pretraining, text, training

        _, report, output = resumed_run
        root, corpus, cache = workspace
        config = tiny_config(corpus, cache, output, **RECIPE)
        _, train, heldout = prepare_data(config)
        batcher = text.MaskedLMBatcher.from_shards(train)
        x, y, w = training.heldout_batches(heldout, batcher, config.micro_batch_size,
                                               config.seed)
        exported = pretraining.build_model(config, train.vocabulary_size)
        exported.load_weights(str(output / "model.keras"))
        predicted = np.argmax(exported.predict(x, batch_size=8, verbose=0), axis=-1)
        accuracy = float(np.sum((predicted == y) * w) / np.sum(w))
        # A pico model after 3 steps has near-tied logits: fit's compiled
        # evaluation and predict may break one tie differently (CI: 1 token
        # of 201). The weights themselves are compared exactly below.
        # One token's share of the weight, as a Python float: pytest >= 9.2
        # refuses a NumPy float32 tolerance.
        one_token = 1.01 / float(np.sum(w))
        assert accuracy == pytest.approx(report["heldout_mlm_accuracy"], abs=one_token)
        # The checkpoint keeps the trained weights apart from their average.
        live = pretraining.build_model(config, train.vocabulary_size)
        from tf_megadp.run.training_state import restore_training_state

        restore_training_state(live, str(output / "checkpoint"), training._compile_kwargs(True))
        averaged = live.optimizer.inner_optimizer._model_variables_moving_average
        assert len(averaged) == len(live.trainable_variables)
        for variable, average, released in zip(live.trainable_variables, averaged,
                                               exported.trainable_variables):
            np.testing.assert_allclose(keras.ops.convert_to_numpy(average),
                                       keras.ops.convert_to_numpy(released), atol=1e-6)
        assert any(not np.allclose(keras.ops.convert_to_numpy(v), keras.ops.convert_to_numpy(a))
                   for v, a in zip(live.trainable_variables, averaged))

    def test_resuming_with_other_settings_is_refused(self, resumed_run, workspace):
        root, corpus, cache = workspace
        _, _, output = resumed_run
        with pytest.raises(ValueError, match="noise_multiplier"):
            run_pretraining(tiny_config(corpus, cache, output, resume=True, noise_multiplier=2.0,
                                        **RECIPE),
                            log=lambda *_: None)

    def test_resuming_a_finished_run_reports_its_epsilon_and_trains_nothing(
            self, resumed_run, workspace, tmp_path):
        # Issue #27: with no step left the job reported PrivacyCallback.epsilon
        # of a callback that saw no fit: 0.0. (A kill after the last
        # checkpoint, before the report, leads here.)
        root, corpus, cache = workspace
        _, finished, output = resumed_run
        copy = tmp_path / "run"
        shutil.copytree(output / "checkpoint", copy / "checkpoint")
        # Issue 43: --resume alone takes every setting from the checkpoint;
        # an operational flag (--eval-every) may change.
        assert cli.main(["pretrain", "--output-dir", str(copy), "--resume", "--eval-every",
                         "3", "--json"]) == 0
        report = json.loads((copy / "report.json").read_text())
        assert report["config"]["eval_every"] == 3
        assert {k: v for k, v in report["config"].items()
                if k not in ("eval_every", "resume", "output_dir")} == {
            k: v for k, v in finished["config"].items()
            if k not in ("eval_every", "resume", "output_dir")}
        assert report["epsilon"] == pytest.approx(finished["epsilon"], rel=1e-12)
        assert report["logical_steps"] == 4 and report["resumes"] == [2, 4]
        assert json.loads((copy / "privacy.json").read_text())["steps"] == 4


class TestResumeFromTheRunFolder:
    """Issue 43: --resume takes the run's settings; it says where it resumed; its files agree."""

    def test_a_privacy_or_model_change_is_refused_by_name_before_the_corpus(
            self, resumed_run, monkeypatch, capsys):
        _, _, output = resumed_run
        from tf_megadp.jobs.bert import pretraining

        def prepare(*args, **kwargs):
            raise AssertionError("the corpus was prepared before the refusal")

        monkeypatch.setattr(pretraining, "prepare_data", prepare)
        for flag, value, field in (("--noise-multiplier", "2.0", "noise_multiplier"),
                                   ("--model", "nano", "model"),
                                   ("--l2-norm-clip", "0.5", "l2_norm_clip")):
            status = cli.main(["pretrain", "--output-dir", str(output), "--resume", flag, value])
            error = capsys.readouterr().err.strip().splitlines()[-1]
            assert status == 2 and f"{field}: " in error and flag in error, error

    def test_operational_fields_are_listed_once(self):
        from tf_megadp.jobs.bert.config import PretrainConfig
        from tf_megadp.jobs.common import run_folder

        fields = {field.name for field in dataclasses.fields(PretrainConfig)}
        assert run_folder.OPERATIONAL_FIELDS <= fields
        # Nothing that the ledger, the schedule or the model depends on.
        assert not run_folder.OPERATIONAL_FIELDS & {
            "noise_multiplier", "target_epsilon", "delta", "l2_norm_clip", "batch_size",
            "steps", "schedule", "micro_batch_size", "model", "corpus", "seed", "accountant",
            "non_private", "privacy_unit", "vocabulary_size", "sequence_length", "strategy"}

    def test_resume_alone_goes_past_the_step_where_the_last_start_stopped(
            self, resumed_capture):
        # --stop-after-steps ends one invocation: --resume alone took it from
        # the checkpoint, so a run stopped after step 1 stopped again after
        # step 2 and never completed (the two-replica resumes of
        # tests/test_distribute.py ended at step 2 of 3).
        from tf_megadp.jobs.bert import run_files

        stopped = resumed_capture[3].stopped_output
        assert run_files.pretrain_settings(str(stopped))["stop_after_steps"] == 2
        resume = ["pretrain", "--output-dir", str(stopped), "--resume"]
        config = cli.run_config_from_args(cli.build_parser().parse_args(resume), None)
        assert config.stop_after_steps is None
        again = cli.build_parser().parse_args(resume + ["--stop-after-steps", "1"])
        assert cli.run_config_from_args(again, None).stop_after_steps == 1

    def test_the_summary_names_the_noise_and_the_sampling(self, resumed_capture):
        summary = resumed_capture[3].resumed_log[-1]
        assert ("mechanism               independent Gaussian noise (DP-SGD) on Poisson "
                "sampling") in summary, summary

    def test_the_report_splits_the_train_time_between_fit_and_the_jobs_callbacks(
            self, resumed_run, resumed_capture):
        """Issue 49: the evaluation and checkpoint cadence counts in the train time, named."""
        _, resumed, _ = resumed_run
        parts = resumed["train_time_parts_s"]
        assert {"fit", "EvaluationAndCheckpoints"} <= set(parts)
        assert sum(parts.values()) == pytest.approx(resumed["train_time_s"], abs=0.01)
        summary = resumed_capture[3].resumed_log[-1]
        assert f"time                    train {resumed['train_time_s']:.1f} s: fit " in summary

    def test_the_resumed_run_says_where_it_resumed(self, resumed_capture):
        first, _, _, captured = resumed_capture
        line = next(line for line in captured.resumed_log if line.startswith("Resuming"))
        assert line == f"Resuming at logical step 2 of 4 (epsilon so far {first['epsilon']:.2f})."

    def test_history_counts_epochs_across_resumes_without_empty_columns(self, resumed_run):
        _, _, output = resumed_run
        import csv

        with open(output / "history.csv", newline="") as stream:
            rows = list(csv.DictReader(stream))
        assert [row["epoch"] for row in rows] == ["0", "1"]
        assert not [name for name in rows[0] if name.startswith("val_")]
        assert all(value not in ("", "NA") for row in rows for value in row.values())

    def test_report_and_privacy_report_agree(self, resumed_run, resumed_capture):
        _, report, output = resumed_run
        privacy = json.loads((output / "privacy.json").read_text())
        on_disk = json.loads((output / "report.json").read_text())
        assert on_disk["privacy_unit"] == privacy["privacy_unit"] == "example"
        assert privacy["data"]["privacy_unit"] == "example"
        phases = privacy["settings"]["schedule"]["phases"]
        assert privacy["settings"]["accumulation_steps"] == [
            phase["accumulation_steps"] for phase in phases]
        assert on_disk["vocabulary"]["size"] == on_disk["model"]["vocabulary_size"]
        assert on_disk["vocabulary"]["requested_size"] == 200
        # A vocabulary smaller than asked is said, once, with both figures.
        said = [line for line in resumed_capture[3].log if line.startswith("Vocabulary:")]
        if on_disk["vocabulary"]["size"] < 200:
            assert said == [said[0]] and f"{on_disk['vocabulary']['size']} tokens" in said[0]
        else:
            assert said == []


def _job_argv(workspace, output, steps):
    """The pico job's command line, checkpointing every logical step."""
    _, corpus, cache = workspace
    return ["pretrain", "--corpus", corpus, "--cache-dir", str(cache), "--output-dir", str(output),
            "--model", "pico", "--sequence-length", "16", "--vocabulary-size", "200",
            "--max-characters", "300000", "--micro-batch-size", "8", "--batch-size", "16",
            "--steps", str(steps), "--eval-every", str(steps), "--checkpoint-every", "1",
            "--noise-multiplier", "1.0", "--accountant", "rdp", "--warmup-steps", "1"]


def _committed_steps(output):
    """The logical step of the job's committed checkpoint (0 without one)."""
    index = output / "checkpoint" / "training_state.json"
    return json.loads(index.read_text())["extra"]["logical_steps"] if index.exists() else 0


def _killed_job(argv, output, after_step, rng, timeout_s=600):
    """Starts `tf-megadp` ARGV and SIGKILLs it at a random moment once step `after_step` is saved.

    The watchdog only ends a hung child: on a loaded 2-core machine the
    child's start (TensorFlow, keras-hub, compilation) alone took over 120 s.
    """
    folder = pathlib.Path(__file__).resolve().parent.parent
    with open(output.parent / f"{output.name}-stderr.txt", "a") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tf_megadp.cli import main; sys.exit(main())",
             *argv], cwd=folder, stdout=subprocess.DEVNULL, stderr=stderr)
    watchdog = threading.Timer(timeout_s, child.kill)
    watchdog.start()
    try:
        while child.poll() is None and _committed_steps(output) < after_step:
            time.sleep(0.05)
        assert child.poll() is None, f"the job ended before step {after_step} ({child.returncode})"
        # Anywhere in the next step or so, its checkpoint included.
        time.sleep(float(rng.uniform(0.0, 0.3)))
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        watchdog.cancel()
    assert child.returncode == -signal.SIGKILL
    return _committed_steps(output)


def _run_job_with_kills(workspace, output, steps, kills, seed):
    """The job killed `kills` times at random steps, resumed each time; its report."""
    rng = np.random.default_rng(seed)
    argv = _job_argv(workspace, output, steps)
    resumed = []
    for number in range(kills):
        # Each start is killed after it saved a step of its own (a start
        # killed before that leaves no trace in the run), with room left for
        # the kills to come.
        committed = resumed[-1] if resumed else 0
        step = int(rng.integers(committed + 1, max(committed + 2, steps - kills + number)))
        resumed.append(_killed_job(argv + (["--resume"] if number else []), output, step, rng))
    assert cli.main(argv + ["--resume"]) == 0  # The last start runs to the end, here.
    return json.loads((output / "report.json").read_text()), resumed


def _assert_same_epsilon_as_uninterrupted(report):
    # The uninterrupted run of the same steps, from dp_accounting (via the
    # accountant that test_accounting checks against it).
    schedule = BatchSizeSchedule.from_dict(report["schedule"])
    expected = accounting.compute_epsilon(
        delta=report["delta"], schedule=schedule, noise_multiplier=1.0, accountant="rdp")
    assert report["completed"] and report["logical_steps"] == schedule.total_steps
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_without_a_terminal_the_job_writes_one_line_per_evaluation(second_run):
    """Issue 47: piped to a file, Keras's bar wrote >1 MB of carriage-return updates."""
    from tf_megadp.jobs.common.run_folder import progress_verbosity

    _, captured = second_run
    assert "\r" not in captured.stdout and "\b" not in captured.stdout, captured.stdout
    lines = [line for line in captured.stdout.splitlines() if "loss" in line]
    assert len(lines) == len(captured.report["history"]) == 1, captured.stdout
    assert "heldout_mlm_accuracy" in lines[0]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert progress_verbosity("auto", Terminal()) == 1
    assert progress_verbosity("auto", io.StringIO()) == 2
    assert progress_verbosity(0, Terminal()) == 0


class TestTheUnigramBaseline:
    """Issue 41: a run that ends on the unigram plateau says so; the rate and its source are reported."""

    def test_a_run_forced_not_to_learn_is_flagged(self, second_run):
        from tf_megadp.jobs.bert.baselines import NOT_LEARNED_MESSAGE

        output, captured = second_run
        on_disk = json.loads((output / "report.json").read_text())
        assert on_disk["completed"] and on_disk["learning_rate"] == 0.0
        assert on_disk["learning_rate_source"] == "given"
        assert on_disk["learned"] is False
        assert on_disk["heldout_mlm_accuracy"] <= on_disk["learned_threshold"]
        assert on_disk["learned_threshold"] > on_disk["unigram_baseline_accuracy"] > 0
        assert on_disk["heldout_masked_positions"] > 0
        assert NOT_LEARNED_MESSAGE in "\n".join(captured.log)

    def test_the_report_says_which_rate_and_where_it_came_from(self, resumed_capture):
        from tf_megadp.jobs.bert.config import DP_LEARNING_RATE

        first, report, output, captured = resumed_capture
        assert report["learning_rate"] == DP_LEARNING_RATE == report["config"]["learning_rate"]
        assert report["learning_rate_source"] == "DP default"
        assert report["learned"] in (True, False)
        assert f"Learning rate {DP_LEARNING_RATE:g} (DP default)" in "\n".join(captured.log)

    # A whole non-private run long enough to leave the unigram plateau
    # (~60 s on the 2-core machine): slow (CI time, issue 26).
    @pytest.mark.slow
    def test_the_non_private_default_learns_on_the_test_corpus(self, workspace, tmp_path):
        root, corpus, cache = workspace
        report = run_pretraining(
            tiny_config(corpus, cache, tmp_path / "run", non_private=True, noise_multiplier=None,
                        checkpoint_every=0, **LEARNING_RUN),
            log=lambda *_: None)
        assert report["learning_rate_source"] == "non-private default"
        assert report["learned"] is True, report["history"]
        assert report["heldout_mlm_accuracy"] > report["learned_threshold"]


# Two whole job runs (about 40 CPU-seconds each): slow (CI time, issue 26).
@pytest.mark.slow
@pytest.mark.parametrize("noise, sampling", [("bandmf", "cyclic_poisson"),
                                             ("blt", "fixed_order")])
def test_the_job_trains_with_correlated_noise_at_the_epsilon_it_calibrated(
        workspace, tmp_path, noise, sampling):
    _, corpus, cache = workspace
    # PLD: RDP's coupling bound for truncation is too loose at this tiny N.
    config = tiny_config(corpus, cache, tmp_path / "run", noise=noise, bands=2,
                         noise_multiplier=None, target_epsilon=8.0, checkpoint_every=0,
                         accountant="pld")
    log = []
    report = run_pretraining(config, log=log.append)
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert report["sampling"] == sampling and report["noise"]["kind"] == noise
    # Issue 47: the printed summary said "Poisson" and never named the mechanism.
    said = {"bandmf": "BandMF correlated noise (2 bands) on cyclic Poisson sampling (2 groups",
            "blt": "BLT correlated noise (2 buffers) on fixed-order sampling"}[noise]
    summary = log[-1]
    assert f"mechanism               {said}" in summary, summary
    assert said in "\n".join(log[:-1])  # and the announcement before training
    assert "Poisson, " not in summary and "DP-SGD" not in summary
    assert privacy["settings"]["noise_strategy"] == report["noise"]
    [entry] = privacy["ledger"]
    assert (entry["sampling"], json.loads(entry["noise"])["kind"], entry["steps"],
            entry["segment_start"]) == (sampling, noise, 4, True)
    # The ledger's epsilon is the one sigma was calibrated for, as
    # dp_accounting computes it for the mechanism over the job's schedule
    # (up to the float32 sigma the steps recorded).
    schedule = BatchSizeSchedule.from_dict(report["schedule"])
    assert report["epsilon"] == pytest.approx(accounting.compute_epsilon(
        delta=report["delta"], schedule=schedule, noise_multiplier=report["noise_multiplier"],
        accountant="pld", **config.noise_accounting()), rel=1e-6)
    assert report["epsilon"] <= 8.0


class TestPreemption:
    """Issue #27: `tf-megadp pretrain --resume` after SIGKILLs at random points."""

    def test_a_default_job_killed_once_resumes_with_resume_alone(self, workspace, tmp_path,
                                                                 capsys):
        # Issue 43: no checkpoint flag (the default: after the first logical
        # step, every 10 minutes, at the end) and `--resume` with no other
        # flag. The one job kill of CI (about 60 CPU-seconds).
        _, corpus, cache = workspace
        output = tmp_path / "run"
        argv = ["pretrain", "--corpus", corpus, "--cache-dir", str(cache), "--output-dir",
                str(output), "--model", "pico", "--sequence-length", "16",
                "--vocabulary-size", "200", "--max-characters", "300000",
                "--micro-batch-size", "8", "--batch-size", "16", "--steps", "3",
                "--noise-multiplier", "1.0", "--accountant", "rdp", "--warmup-steps", "1"]
        committed = _killed_job(argv, output, 1, np.random.default_rng(0))
        assert committed >= 1
        capsys.readouterr()
        assert cli.main(["pretrain", "--output-dir", str(output), "--resume"]) == 0
        report = json.loads((output / "report.json").read_text())
        _assert_same_epsilon_as_uninterrupted(report)
        assert report["resumes"] == [committed] and report["logical_steps"] == 3
        # The saved settings hold the rate as a number; the report still
        # says it was the DP default, not a rate the user gave.
        assert report["learning_rate_source"] == "DP default"
        if committed < 3:
            assert f"Resuming at logical step {committed} of 3 (epsilon so far " in (
                capsys.readouterr().out)

    # Each kill costs another start of TensorFlow and keras-hub (one kill:
    # about 50 CPU-seconds): slow (CI time, issue 26). CI kills the library's
    # runs (tests/test_preemption.py) and resumes the job (test_distribute).
    @pytest.mark.slow
    @pytest.mark.parametrize("kills, steps, seed", [(1, 3, 0), (3, 8, 1)])
    def test_a_killed_job_resumes_and_reports_the_uninterrupted_epsilon(
            self, workspace, tmp_path, kills, steps, seed):
        report, resumed = _run_job_with_kills(workspace, tmp_path / "run", steps=steps,
                                              kills=kills, seed=seed)
        _assert_same_epsilon_as_uninterrupted(report)
        assert report["resumes"] == resumed and len(resumed) == kills


class TestTheDrawsStaySecret:
    """Attack (e): from everything the job writes, recompute its Poisson draws.

    Before the fix the sampler was seeded with --seed (0 by default), which
    report.json records: PoissonSampler(train, schedule, seed=0) gave back
    every step's examples, and with them no amplification by subsampling.
    """

    def test_every_start_draws_a_fresh_secret(self, resumed_capture, second_run):
        _, _, _, resumed = resumed_capture
        _, again = second_run
        # One secret per start: the first invocation, its resume, the second run.
        secrets = resumed.secrets + again.secrets
        assert len(resumed.secrets) == 2 and len(again.secrets) == 1
        assert len(set(secrets)) == 3
        assert all(2**64 <= secret < 2**128 for secret in secrets)  # P(fail) < 2**-63

    def test_two_runs_of_the_same_job_draw_different_steps(self, resumed_capture, second_run):
        _, _, _, resumed = resumed_capture
        _, again = second_run
        first, other = resumed.first_draw(), again.first_draw()
        # Each index set is a Poisson draw of ~16 of N rows: equal by chance
        # with probability far below 1e-20.
        assert not (first.shape == other.shape and np.array_equal(first, other))

    def test_no_file_of_either_run_holds_the_sampling_secret(self, resumed_capture, second_run):
        _, _, run_output, resumed = resumed_capture
        again_output, again = second_run
        needles = [(secret, form) for secret in resumed.secrets + again.secrets
                   for form in secret_encodings(secret)]
        scanned = 0
        for folder in (run_output, again_output):
            for name, data in output_files(folder):
                scanned += 1
                for secret, form in needles:
                    assert form not in data, f"{folder.name}/{name} holds a sampling secret"
        # report, privacy report, history, checkpoint, model (and its members), ...
        assert scanned >= 10

    def test_no_integer_the_job_publishes_reproduces_its_draws(
            self, workspace, resumed_capture):
        root, corpus, cache = workspace
        _, report, output, resumed = resumed_capture
        from tf_megadp.steps import BatchSizeSchedule

        # The attacker knows the corpus and code (DP's threat model), reads
        # every integer in the published JSON and tries it, and every small
        # integer, as the sampler's seed.
        _, train, _ = prepare_data(tiny_config(corpus, cache, output))
        schedule = BatchSizeSchedule.from_dict(report["schedule"])
        candidates = set(range(256))
        for name in ("report.json", "privacy.json"):
            candidates |= {v for v in json_integers(json.loads((output / name).read_text()))
                           if v >= 0}
        assert report["config"]["seed"] in candidates
        actual = resumed.first_draw()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # seed= warns: that is the point
            for candidate in sorted(candidates):
                guess = PoissonSampler(train, schedule, seed=candidate).draw(0).indices
                assert not (guess.shape == actual.shape and np.array_equal(guess, actual)), (
                    f"seed {candidate} from the job's files reproduces its first step")


class TestThePublishedVocabulary:
    """Attack: find a rare word of the private corpus in what the job publishes."""

    def test_by_default_the_rare_word_is_in_no_output_file(self, resumed_run):
        _, report, output = resumed_run
        vocabulary = (output / "vocab.txt").read_text(encoding="utf-8").split("\n")
        assert RARE_WORD not in vocabulary and len(vocabulary) > 100
        assert report["vocabulary"]["public"] is True
        assert report["vocabulary"]["source"].startswith("public: the offline default corpus")
        for name, data in output_files(output):
            assert RARE_WORD.encode() not in data.lower(), name

    # A whole job run for one flag (about 25 s): slow (the 15-minute CI
    # budget); the default, which publishes nothing private, is tested above.
    @pytest.mark.slow
    def test_the_flag_learns_it_on_the_corpus_warns_and_says_so(self, workspace, tmp_path):
        root, corpus, cache = workspace
        output = tmp_path / "corpus-vocabulary"
        with pytest.warns(UserWarning, match="NOT covered by epsilon"):
            report = run_pretraining(
                tiny_config(corpus, cache, output, steps=1, eval_every=1, checkpoint_every=0,
                            vocabulary_from_training_corpus=True),
                log=lambda *_: None)
        vocabulary = (output / "vocab.txt").read_text(encoding="utf-8").split("\n")
        assert RARE_WORD in vocabulary
        assert report["vocabulary"]["source"] == "training corpus (NOT private)"
        assert report["vocabulary"]["public"] is False
        on_disk = json.loads((output / "report.json").read_text())
        assert on_disk["vocabulary"]["source"] == "training corpus (NOT private)"
        assert "NOT covered" in on_disk["files"]["vocab.txt"]

    def test_a_public_vocabulary_file_is_used_as_named(self, workspace, tmp_path):
        # BERT's vocab.txt order ([PAD] first, the other specials later) is
        # accepted and reordered; the published file is what the model reads.
        root, corpus, cache = workspace
        tokens = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tokens += list("abcdefghijklmnopqrstuvwxyz0123456789.")
        tokens += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
        tokens += ["the", "model", "times"]
        path = tmp_path / "public-vocab.txt"
        path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
        config = tiny_config(corpus, cache, tmp_path / "unused", vocabulary=str(path))
        _, train, _ = prepare_data(config)
        from tf_megadp.jobs.bert.text import load_vocabulary

        vocabulary = load_vocabulary(train)
        assert vocabulary[:5] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
        assert sorted(vocabulary) == sorted(tokens) and RARE_WORD not in vocabulary

    def test_a_relative_cache_dir_finds_its_splits_vocabulary(self, workspace, tmp_path,
                                                              monkeypatch):
        # The splits name the corpus's vocab.txt relative to themselves: a
        # path relative to the working directory was looked up under the
        # split's folder, and the release's vocab.txt could not be copied.
        root, corpus, _ = workspace
        tokens = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
        tokens += list("abcdefghijklmnopqrstuvwxyz0123456789.")
        tokens += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
        (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
        monkeypatch.chdir(tmp_path)
        config = tiny_config(corpus, "cache", "unused", vocabulary="vocab.txt")
        _, train, heldout = prepare_data(config)
        from tf_megadp.jobs.bert.text import load_vocabulary

        assert load_vocabulary(train) == load_vocabulary(heldout) == tokens


class TestEvaluate:
    """Issue 47: there was no way to score a model without training it (a new user ran 1 step at lr 0)."""

    def test_a_runs_model_scores_its_reports_accuracy_and_baseline(self, resumed_run, workspace,
                                                                 capsys, tmp_path):
        _, report, output = resumed_run
        root, corpus, cache = workspace
        status = cli.main(["evaluate", str(output / "model.keras"), "--corpus", corpus,
                           "--micro-batch-size", "8", "--cache-dir", str(cache),
                           "--json", str(tmp_path / "evaluation.json")])
        assert status == 0
        printed = capsys.readouterr().out
        result = json.loads((tmp_path / "evaluation.json").read_text())
        # The job's held-out split, masks, scoring and baseline: the run's numbers.
        assert result["heldout_mlm_accuracy"] == pytest.approx(
            report["heldout_mlm_accuracy"], abs=1e-6)
        for name in ("unigram_baseline_accuracy", "learned_threshold",
                     "heldout_masked_positions", "learned", "heldout_examples"):
            assert result[name] == report[name], name
        assert (result["model_preset"], result["sequence_length"]) == ("pico", 16)
        assert (f"held-out MLM accuracy   {result['heldout_mlm_accuracy']:.4f}   (unigram "
                f"baseline {result['unigram_baseline_accuracy']:.4f})") in printed

    def test_a_backbone_preset_without_an_mlm_head_is_refused(self, tmp_path, capsys):
        import keras_hub

        keras_hub.models.BertBackbone(vocabulary_size=16, num_layers=1, num_heads=2,
                                      hidden_dim=8, intermediate_dim=16, max_sequence_length=8
                                      ).save_to_preset(str(tmp_path / "backbone"))
        assert cli.main(["evaluate", str(tmp_path / "backbone")]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and "no masked-LM head" in error[0], error


class TestReleasedStatistics:
    def test_report_names_what_epsilon_does_not_cover(self, resumed_run):
        _, report, output = resumed_run
        released = " ".join(report["released_outside_epsilon"])
        for statistic in ("training loss", "held-out", "timings", "truncated_steps",
                          "num_examples", "unigram"):
            assert statistic in released, statistic
        files = report["files"]
        assert files["model.keras"].startswith("release")
        assert files["checkpoint"].startswith("keep like the training data")
        assert set(files) <= {p.name for p in output.iterdir()}

    def test_loading_the_release_says_nothing_of_the_optimizer_it_has_none_of(self,
                                                                              resumed_run):
        """Issue 47: Keras warned "Skipping variable loading for optimizer 'adam'" on every load.

        keras-hub compiled the rebuilt task with its default optimizer, which
        found no state in the file: the release now loads as it was saved,
        uncompiled, and no warning is filtered for it.
        """
        import keras

        _, _, output = resumed_run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.models.load_model(output / "model.keras")
        assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
        assert not loaded.compiled

    def test_the_published_model_holds_no_optimizer_state(self, resumed_run):
        _, _, output = resumed_run
        with zipfile.ZipFile(output / "model.keras") as archive:
            config = json.loads(archive.read("config.json"))
            assert "compile_config" not in config or not config["compile_config"]
            with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
                assert "optimizer" not in weights


@pytest.fixture(scope="module")
def continued_release(resumed_run, workspace):
    """The resumed run's release continued with LoRA rank 2 for one logical step (issue 40).

    Returns:
        (the release's report, the continuation's report and folder, the release's folder).
    """
    root, corpus, cache = workspace
    _, release, output = resumed_run
    folder = root / "continued"
    report = run_pretraining(
        tiny_config(corpus, cache, folder, init_from=str(output / "model.keras"), lora_rank=2,
                    steps=1, eval_every=1, checkpoint_every=0,
                    vocabulary_size=release["model"]["vocabulary_size"]),
        log=lambda *_: None)
    return release, report, folder, output


class TestContinuingARelease:
    """--init-from a private run's model.keras: a DP release, whose ledger the new epsilon composes."""

    def test_epsilon_composes_the_releases_steps_as_dp_accounting_does(self, continued_release):
        release, report, folder, output = continued_release
        released = json.loads((output / "privacy.json").read_text())
        schedule = BatchSizeSchedule.from_dict(report["schedule"])
        steps = [(entry["steps"], entry["sampling_rate"], entry["noise_multiplier"])
                 for entry in released["ledger"]]
        steps.append((1, schedule.phases[0].batch_size / schedule.num_examples, 1.0))
        import dp_accounting
        from dp_accounting import rdp

        both = rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(sigma)), count) for count, q, sigma in steps
        ])).get_epsilon(report["delta"])
        # Truncation at the static capacity (probability < 1e-9 per step)
        # moves delta by about 1e-7 of itself in the accountant's bound.
        assert report["epsilon"] == pytest.approx(both, rel=1e-6)
        assert report["epsilon"] > released["epsilon"]
        privacy = json.loads((folder / "privacy.json").read_text())
        assert privacy["steps"] == released["steps"] + 1 == 5
        assert privacy["initial_weights"]["origin"] == "release"

    def test_the_report_records_the_init(self, continued_release):
        from tf_megadp.files import sha256_of_file

        _, report, _, output = continued_release
        init = report["init"]
        # Named, not located: the release lies outside this run's folder.
        assert init["path"] == "model.keras"
        assert init["sha256"] == sha256_of_file(output / "model.keras")
        assert (init["origin"], init["trained"]) == (
            "release", "a DP run (its weights file carries its ledger)")
        assert "is composed into this run's epsilon" in init["epsilon"]
        assert report["vocabulary"]["source"].startswith("public: the vocabulary")

    def test_no_report_names_a_path_of_this_machine(self, continued_release, workspace):
        """Issue 47: report.json, which calls itself publishable, held absolute paths.

        (init.path, init.privacy_report, init.vocabulary, the config's corpus,
        output_dir, cache_dir, vocabulary and init_from, the vocabulary's
        source; privacy.json's initial_weights.report.) Files inside the run
        folder are named relative to it, others by name only.
        """
        root = workspace[0]
        _, report, folder, output = continued_release
        machine = {str(root), str(root.resolve())}
        for run in (output, folder):
            for name in ("report.json", "privacy.json"):
                text = (run / name).read_text()
                absolute = [value for value in json_strings(json.loads(text))
                            if os.path.isabs(value)]
                assert absolute == [], (run / name, absolute)
                assert not any(path in text for path in machine), run / name
        config = report["config"]
        assert (config["output_dir"], config["corpus"], config["cache_dir"]) == (
            ".", ["private.txt"], "cache")
        assert (config["init_from"], config["vocabulary"]) == ("model.keras", "vocab.txt")
        privacy = json.loads((folder / "privacy.json").read_text())
        # The release's ledger came from its weights' record: named by binding.
        assert privacy["initial_weights"]["origin"] == "release"
        assert privacy["initial_weights"]["records"]

    def test_lora_trains_only_the_factors_and_the_head_the_rest_bit_identical(
            self, continued_release, workspace):
        """Frozen weights are never noised: every one of them is the release's, bit for bit.

        The release of a LoRA run holds W + s A B (Keras merges the factors
        on save): only the query and value projections, their biases and the
        MLM head may differ from the init.
        """
        import keras

        from tf_megadp.jobs.bert import pretraining

        release, report, folder, output = continued_release
        root, corpus, cache = workspace
        config = tiny_config(corpus, cache, folder, vocabulary_size=report["model"][
            "vocabulary_size"])
        before = pretraining.build_model(config, config.vocabulary_size)
        before.load_weights(str(output / "model.keras"))
        after = pretraining.build_model(config, config.vocabulary_size)
        after.load_weights(str(folder / "model.keras"))
        trained = ("query/", "value/", "mlm_head/")
        assert report["model"]["trainable_parameters"] < report["model"]["parameters"] / 5
        changed = set()
        for old, new in zip(before.weights, after.weights):
            same = np.array_equal(keras.ops.convert_to_numpy(old), keras.ops.convert_to_numpy(new))
            if not any(part in old.path for part in trained):
                assert same, old.path
            elif not same:
                changed.add(old.path.split("/")[-2])
        assert {"query", "value", "intermediate_dense"} <= changed


class TestBadInput:
    def run_cli(self, capsys, *arguments):
        status = cli.main(["pretrain", *arguments])
        return status, capsys.readouterr().err.strip().splitlines()

    def common(self, workspace, output):
        root, corpus, cache = workspace
        return ["--cache-dir", str(cache), "--output-dir", str(output), "--model", "pico",
                "--sequence-length", "16", "--vocabulary-size", "200",
                "--micro-batch-size", "8", "--accountant", "rdp"]

    @pytest.mark.parametrize(
        "arguments, message",
        [
            (["--corpus", "/nonexistent/corpus.txt"], "corpus"),
            (["--batch-size", "100000"], "larger than the training corpus"),
            (["--target-epsilon", "1e-9", "--steps", "100000"], "unreachable"),
            (["--steps", "0"], "steps"),
            (["--vocabulary", "/nonexistent/vocab.txt"], "no such file"),
            (["--vocabulary", "VOCAB", "--vocabulary-from-training-corpus"], "not both"),
        ],
    )
    def test_one_line_error_exit_2_and_nothing_written(self, workspace, tmp_path, capsys,
                                                       arguments, message):
        root, corpus, cache = workspace
        output = tmp_path / "out"
        base = self.common(workspace, output)
        if "--corpus" not in arguments:
            base += ["--corpus", corpus]
        if "VOCAB" in arguments:
            (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n[SEP]\n[UNK]\n[MASK]\n")
            arguments = [str(tmp_path / "vocab.txt") if a == "VOCAB" else a for a in arguments]
        status, lines = self.run_cli(capsys, *base, *arguments)
        assert status == 2
        errors = [line for line in lines if line.startswith("tf-megadp: error:")]
        assert len(errors) == 1 and message in errors[0], lines
        assert not output.exists()


@pytest.fixture(scope="module")
def canary_run(workspace):
    root, corpus, cache = workspace
    output = root / "canaries"
    report = run_pretraining(
        tiny_config(corpus, cache, output, canaries=2, non_private=True, noise_multiplier=None,
                    checkpoint_every=0),
        log=lambda *_: None)
    return report, output


class TestCanariesAndAudit:
    """`pretrain --canaries N` plants secrets in the training split; `audit` measures them."""

    def test_canaries_are_extra_training_sequences(self, canary_run, resumed_run):
        report, output = canary_run
        _, plain, _ = resumed_run
        # 2 canaries for each r in (1, 4, 16): 42 more rows, each one privacy unit.
        assert report["num_examples"] == plain["num_examples"] + 2 * (1 + 4 + 16)
        assert report["canaries"]["per_repetition"] == 2

    def test_the_run_keeps_its_secrets_for_the_audit(self, canary_run):
        from tf_megadp.audit import load_canaries

        _, output = canary_run
        canaries = load_canaries(output / "canaries.json")
        assert sorted(c.repetitions for c in canaries) == [0, 0, 1, 1, 4, 4, 16, 16]
        # Each canary has its own context, so an attacker ranks its secret on its own.
        assert len({c.format.template for c in canaries}) == len(canaries)
        assert all(c.format.space_size == 1000 for c in canaries)

    def test_audit_command_reports_attacks_and_epsilon(self, canary_run, capsys):
        _, output = canary_run
        assert cli.main(["audit", str(output), "--members", "40", "--json"]) == 0
        printed = json.loads(capsys.readouterr().out.split("=" * 64)[-1])
        saved = json.loads((output / "audit.json").read_text())
        assert printed["mia_auc"] == saved["mia_auc"]
        assert 0.0 <= saved["mia_auc"] <= 1.0
        # Sequences too short to get a masked position carry no loss and are left out.
        assert 30 <= saved["mia_num_members"] <= 40
        assert saved["theoretical_epsilon"] == "Infinity" or saved["theoretical_epsilon"] == float("inf")
        ceiling = np.log2(1000)
        for r in (0, 1, 4, 16):
            assert 0.0 <= saved[f"exposure_r{r}_mean"] <= ceiling + 1e-9

    def test_audit_of_a_folder_without_a_run_is_one_line_exit_2(self, tmp_path, capsys):
        assert cli.main(["audit", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a completed pretraining run" in err[0]


MASKING_LENGTH = 16
MASKING_VOCABULARY = 200


@pytest.fixture(scope="module")
def masking_shards(tmp_path_factory):
    """Rows laid out as the job's: [CLS] 4..14 tokens [SEP] then [PAD]."""
    rng = np.random.default_rng(3)
    rows = np.zeros((512, MASKING_LENGTH), np.int64)
    for row in rows:
        real = int(rng.integers(4, MASKING_LENGTH - 1))
        row[0], row[1:real + 1], row[real + 1] = 1, rng.integers(5, MASKING_VOCABULARY, real), 2
    directory = tmp_path_factory.mktemp("masking")
    write_token_shards(directory, [rows], sequence_length=MASKING_LENGTH,
                                vocabulary_size=MASKING_VOCABULARY, checksum="masking")
    return TokenShards(directory)


def masking_schedule(shards):
    """Two phases of different accumulation, so micro-batch indices cross a phase change."""
    return BatchSizeSchedule.for_poisson([(2, 16), (2, 48)], num_examples=len(shards),
                                         micro_batch_size=8)


def as_arrays(element):
    x, y, sample_weight = element
    return [np.asarray(x[key]) for key in sorted(x)] + [np.asarray(y), np.asarray(sample_weight)]


def step_keys(sampler):
    """(logical step, its key) of every micro-batch, as the sampler's pipeline pairs them."""
    return [(step, sampler._step_key(step)) for step, _ in sampler._micro_batches_by_step()]


class TestTheMasksAreSecretAndPerExample:
    """The job's masking: secret, and a function of the example, never of its row.

    Before (issue 28, case 1), the masks were keyed by (--seed, micro-batch
    index), --seed printed in report.json, and applied by row: adding one
    example moved every later example of the sorted draw to another row,
    with other masks, and the un-noised clipped sum by 3.7 C on the tiny
    BERT below (5.6 C in the issue), accounted as C. Now each row's masks
    are keyed by the secret key of its logical step (from the sampler's OS
    entropy) and the row's own content; nothing public reaches them.
    """

    def test_adding_one_example_anywhere_moves_the_clipped_sum_by_at_most_c(
            self, masking_shards):
        import keras
        import tensorflow as tf

        from tests import reference
        from tf_megadp.clipping import AutoClipping
        from tf_megadp.jobs.bert.text import MaskedLMBatcher

        rows = masking_shards.read(np.arange(9)).astype(np.int32)
        added, rows = rows[0], rows[1:]  # the adversary's example, the others' draw
        batcher = MaskedLMBatcher.from_shards(masking_shards)
        key = tf.constant([11, 12], tf.int64)  # the step's key: the same for D and D'
        model = reference.tiny_bert(MASKING_VOCABULARY, MASKING_LENGTH)
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        strategy = AutoClipping(jit_compile=False)  # no XLA compilation: a tiny model
        mask = tf.function(lambda batch, weights: batcher(batch, weights, key=key))
        slots = len(rows) + 1

        def clipped_sum(batch, weights, clip):
            result = strategy.clip_and_sum(model, *mask(batch, weights), clip)
            flat = np.concatenate([np.ravel(g) for g in result.gradient_sum if g is not None])
            return flat, result.norms.numpy()

        without = np.zeros((slots, MASKING_LENGTH), np.int32)
        without[:len(rows)] = rows
        padded = np.r_[np.ones(len(rows)), 0.0].astype(np.float32)
        # C below every example's norm: every example adds a vector of norm C.
        clip = 0.5 * float(clipped_sum(without, padded, 1e9)[1][:len(rows)].min())
        base, _ = clipped_sum(without, padded, clip)
        moved = []
        for position in range(len(rows) + 1):
            with_added = np.insert(rows, position, added, axis=0)
            total, _ = clipped_sum(with_added, np.ones(slots, np.float32), clip)
            moved.append(np.linalg.norm(total - base) / clip)
        np.testing.assert_allclose(moved, 1.0, atol=1e-3)

    def test_the_pipeline_masks_each_micro_batch_as_a_lone_call_with_its_steps_key(
            self, masking_shards):
        from tf_megadp.jobs.bert.text import MaskedLMBatcher

        schedule = masking_schedule(masking_shards)
        batcher = MaskedLMBatcher.from_shards(masking_shards)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # seeded sampling: a test
            pipeline = [as_arrays(e) for e in PoissonSampler(
                masking_shards, schedule, seed=9).as_dataset(batcher, parallel_map=True)]
            raw = list(PoissonSampler(masking_shards, schedule, seed=9).micro_batches())
            keys = step_keys(PoissonSampler(masking_shards, schedule, seed=9))
        assert len(pipeline) == len(raw) == len(keys) == sum(
            phase.steps * phase.accumulation_steps for phase in schedule.phases)
        # Every micro-batch of a step has the step's key; steps have their own.
        assert len({tuple(key) for _, key in keys}) == schedule.total_steps
        # Eagerly, one call per micro-batch, last first: no shared state, no order.
        for index in reversed(range(len(raw))):
            rows, weights = raw[index]
            alone = as_arrays(batcher(rows, weights, key=keys[index][1]))
            for got, expected in zip(pipeline[index], alone):
                np.testing.assert_array_equal(got, expected)

    def test_the_key_and_the_content_change_the_masks_the_position_does_not(
            self, masking_shards):
        from tf_megadp.jobs.bert.text import MaskedLMBatcher

        rows = masking_shards.read(np.arange(64)).astype(np.int32)
        weights = np.ones(len(rows), np.float32)
        batcher = MaskedLMBatcher.from_shards(masking_shards)

        def masked(key, rows=rows):
            x, _, _ = batcher(rows, weights, key=np.array(key, np.int64))
            return x["token_ids"].numpy(), x["mask_positions"].numpy()

        tokens, positions = masked([5, 3])
        np.testing.assert_array_equal(masked([5, 3])[1], positions)
        assert not np.array_equal(masked([5, 4])[1], positions)
        assert not np.array_equal(masked([6, 3])[1], positions)
        # Rows rolled by 7: every example keeps its own masks at its new row.
        rolled_tokens, rolled_positions = masked([5, 3], np.roll(rows, 7, axis=0))
        np.testing.assert_array_equal(rolled_positions, np.roll(positions, 7, axis=0))
        np.testing.assert_array_equal(rolled_tokens, np.roll(tokens, 7, axis=0))

    def test_step_keys_are_secret_and_a_function_of_the_secret_and_the_step(
            self, masking_shards):
        schedule = masking_schedule(masking_shards)
        fresh = [step_keys(PoissonSampler(masking_shards, schedule)) for _ in range(2)]
        assert all(not np.array_equal(a[1], b[1]) for a, b in zip(*fresh))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = dict((step, tuple(key)) for step, key in step_keys(
                PoissonSampler(masking_shards, schedule, seed=1)))
            resumed = dict((step, tuple(key)) for step, key in step_keys(
                PoissonSampler(masking_shards, schedule, seed=1, start_step=3)))
        assert resumed == {step: key for step, key in whole.items() if step >= 3}

    def test_selection_is_a_uniform_subset_and_other_tokens_are_untouched(self, masking_shards):
        import tensorflow as tf
        from scipy import stats

        from tf_megadp.jobs.bert.text import MaskedLMBatcher

        # [CLS] ten real tokens [SEP] [PAD]...: ceil(0.15 * 10) = 2 of the ten.
        # Each row's tokens differ (equal rows get equal masks by design).
        rows = np.zeros((64, MASKING_LENGTH), np.int32)
        rows[:, 0], rows[:, 11] = 1, 2
        rows[:, 1:11] = 10 + (np.arange(10)[None, :] + np.arange(64)[:, None]) % 150
        weights = np.ones(64, np.float32)
        batcher = MaskedLMBatcher.from_shards(masking_shards)
        mask = tf.function(lambda key: batcher(rows, weights, key=key))
        counts = np.zeros(MASKING_LENGTH)
        for index in range(40):
            x, y, sample_weight = mask(tf.constant([0, index], tf.int64))
            x, y = {key: np.asarray(value) for key, value in x.items()}, np.asarray(y)
            positions, selected = x["mask_positions"], np.asarray(sample_weight) == 1
            assert np.all(selected.sum(axis=1) == 2) and np.all(selected[:, :2])
            chosen = positions[:, :2]
            assert np.all(chosen[:, 0] < chosen[:, 1])  # ascending, distinct
            assert np.all(positions[:, 2:] == 0)  # padding slots
            np.testing.assert_array_equal(y[:, :2], np.take_along_axis(rows, chosen, axis=1))
            untouched = np.ones_like(rows, bool)
            np.put_along_axis(untouched, chosen, False, axis=1)
            np.testing.assert_array_equal(x["token_ids"][untouched], rows[untouched])
            np.add.at(counts, chosen.ravel(), 1)
        assert not np.any(counts[[0, *range(11, MASKING_LENGTH)]])  # [CLS], [SEP], [PAD]
        assert stats.chisquare(counts[1:11]).pvalue > 1e-3
