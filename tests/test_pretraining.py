"""Specification of the main job, `tf-megadp pretrain`, on a tiny configuration.

One run is interrupted after two logical steps (checkpoint), resumed to the
end, and must report the epsilon the accountant gives for the whole schedule.
Bad input must give one line on stderr, exit status 2 and no output folder.
"""

import json
import os

import numpy as np
import pytest

from tf_megadp import accounting, cli
from tf_megadp.pretraining import PretrainConfig, run_pretraining

SUBJECTS = ["the model", "a student", "our team", "the network", "each layer", "the sampler"]
VERBS = ["computes", "clips", "reads", "writes", "trains", "reports", "samples", "adds"]
OBJECTS = ["the gradient", "a batch", "some noise", "the epsilon", "every example", "the loss"]


def write_corpus(folder, documents=400, seed=0):
    """Generated sentences: real-looking text, no third-party content."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(documents):
        sentences = [
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{int(rng.integers(1, 50))} times."
            for _ in range(int(rng.integers(2, 5)))
        ]
        lines.append(" ".join(sentences))
    path = folder / "corpus.txt"
    path.write_text("\n\n".join(lines), encoding="utf-8")
    return str(path)


def tiny_config(corpus, cache_dir, output_dir, **overrides):
    settings = dict(
        corpus=[corpus], output_dir=str(output_dir), cache_dir=str(cache_dir),
        model="pico", sequence_length=16, vocabulary_size=200, micro_batch_size=8,
        batch_size=16, steps=4, eval_every=2, checkpoint_every=1, target_epsilon=None,
        noise_multiplier=1.0, accountant="rdp", warmup_steps=1, verbose=0,
    )
    settings.update(overrides)
    return PretrainConfig(**settings)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    return root, write_corpus(root), root / "cache"


@pytest.fixture(scope="module")
def resumed_run(workspace):
    root, corpus, cache = workspace
    output = root / "run"
    first = run_pretraining(tiny_config(corpus, cache, output, stop_after_steps=2), log=lambda *_: None)
    report = run_pretraining(tiny_config(corpus, cache, output, resume=True), log=lambda *_: None)
    return first, report, output


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
        from tf_megadp.schedules import BatchSizeSchedule

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

    def test_resuming_with_other_settings_is_refused(self, resumed_run, workspace):
        root, corpus, cache = workspace
        _, _, output = resumed_run
        with pytest.raises(ValueError, match="noise_multiplier"):
            run_pretraining(tiny_config(corpus, cache, output, resume=True, noise_multiplier=2.0),
                            log=lambda *_: None)


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
        ],
    )
    def test_one_line_error_exit_2_and_nothing_written(self, workspace, tmp_path, capsys,
                                                       arguments, message):
        root, corpus, cache = workspace
        output = tmp_path / "out"
        base = self.common(workspace, output)
        if "--corpus" not in arguments:
            base += ["--corpus", corpus]
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
