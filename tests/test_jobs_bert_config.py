"""Specification of the one run configuration (`PretrainConfig`) of the BERT job.

`tf-megadp plan FILE`, `tf-megadp pretrain --config FILE` and
examples/pretrain_bert_mlm.py read a run file through one reader into one
dataclass; flags override its fields; unknown keys and sampling seeds are
refused by name; and a planned pico run trains end to end, refusing a
corpus or strategy other than the one it was planned for.
"""

import dataclasses
import json
import math

import pytest
import yaml

from tf_megadp import PrivacyConfigurationError, cli
from tf_megadp.jobs.bert import plan, pretraining, training
from tests.test_pretraining import write_corpus

SHIPPED = "tpu_configs/bert_large_v3_1024.yaml"


def parsed(*argv):
    """The `PretrainConfig` that a `tf-megadp` command line would run or plan."""
    args = cli.build_parser().parse_args(list(argv))
    return cli.run_config_from_args(args, args.config)


def pico_file(folder, corpus, cache, output, num_examples, **training):
    """A planned pico run on one CPU replica (the layout of tpu_configs/)."""
    config = {
        "name": "pico_cpu",
        # The TPU dtype policy: the planned run also checks the job under it.
        "model": {"preset": "pico", "vocabulary_size": 200, "sequence_length": 16,
                  "precision": "mixed_bfloat16"},
        "hardware": {"name": "cpu", "replicas": 1, "hbm_gib_per_replica": 4,
                     "peak_tflops_per_replica": 0.1},
        "training": {"num_examples": num_examples, "micro_batch_size": 8,
                     "clipping": "vectorized", "l2_norm_clip": 1.0, "noise_multiplier": 1.0,
                     "delta": 1e-4, "accountant": "rdp",
                     "optimizer": {"name": "adamw", "learning_rate": 2e-3, "warmup_steps": 1},
                     "phases": [{"steps": 2, "batch_size": 16, "accumulation_steps": 6}],
                     "max_truncation_probability": 1e-6,
                     **training},
        "data": {"corpus": [corpus], "cache_dir": str(cache), "max_characters": 300_000},
        "run": {"output_dir": str(output), "eval_every": 2, "verbose": 0},
    }
    path = folder / "pico.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


class TestOneConfiguration:
    def test_plan_and_pretrain_read_the_same_config_object(self):
        planned = parsed("plan", SHIPPED)
        run = parsed("pretrain", "--config", SHIPPED)
        assert planned == run == plan.load_config(SHIPPED)
        assert run.model == "large" and run.hardware.replicas == 1024
        assert run.phases()[0] == (2000, 262144, 18)

    def test_a_flag_overrides_the_files_field_in_both(self):
        run = parsed("pretrain", "--config", SHIPPED, "--micro-batch-size", "8",
                     "--accountant", "pld")
        assert run == parsed("plan", SHIPPED, "--micro-batch-size", "8", "--accountant", "pld")
        assert (run.micro_batch_size, run.accountant) == (8, "pld")
        assert dataclasses.replace(run, micro_batch_size=16, accountant="rdp") == parsed(
            "plan", SHIPPED)

    def test_the_plan_uses_the_overridden_field(self, capsys):
        # Ghost clipping fits 16 sequences per v3 core; vectorized holds 16
        # per-example gradients of BERT-Large (about 20 GiB) and does not.
        assert cli.main(["plan", SHIPPED, "--json"]) == 0
        assert cli.main(["plan", SHIPPED, "--clipping", "vectorized", "--json"]) == 2
        assert "vectorized clipping at micro_batch_size 16 exceeds" in capsys.readouterr().err

    def test_without_a_file_the_flags_build_the_defaults(self):
        assert parsed("pretrain") == pretraining.PretrainConfig()
        assert parsed("pretrain", "--noise-multiplier", "2").target_epsilon is None

    @pytest.mark.parametrize("section, key", [
        ("training", "sampling_seed"), ("training", "noise_seed"), ("run", "shared_secret"),
        ("data", "seed")])
    def test_a_sampling_seed_or_secret_is_refused(self, tmp_path, section, key):
        raw = yaml.safe_load(open(SHIPPED, encoding="utf-8"))
        raw.setdefault(section, {})[key] = 1234
        path = tmp_path / "seeded.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        with pytest.raises(PrivacyConfigurationError, match=f"{section}.{key}.*OS entropy"):
            plan.load_config(path)

    def test_the_public_seed_is_a_run_field(self, tmp_path):
        raw = yaml.safe_load(open(SHIPPED, encoding="utf-8"))
        raw["run"] = {"seed": 3}
        assert pretraining.run_config_from_dict(raw).seed == 3

    def test_an_unknown_key_is_named(self):
        raw = yaml.safe_load(open(SHIPPED, encoding="utf-8"))
        raw["run"] = {"eval_evry": 3}
        with pytest.raises(pretraining.PretrainError, match="unknown key 'eval_evry'"):
            pretraining.run_config_from_dict(raw)


@pytest.fixture(scope="module")
def planned_pico(tmp_path_factory):
    root = tmp_path_factory.mktemp("planned")
    corpus, cache = write_corpus(root), root / "cache"
    # N of the prepared training split: the plan must state the run's own N.
    probe = pretraining.PretrainConfig(corpus=[corpus], cache_dir=str(cache), model="pico",
                                       sequence_length=16, vocabulary_size=200,
                                       max_characters=300_000)
    _, train, _ = pretraining.prepare_data(probe)
    return root, corpus, cache, len(train)


class TestAPlannedPicoRun:
    def test_it_runs_end_to_end_as_planned(self, planned_pico, capsys):
        root, corpus, cache, n = planned_pico
        path = pico_file(root, corpus, cache, root / "run", n)
        assert cli.main(["plan", path, "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert cli.main(["pretrain", "--config", path]) == 0
        report = json.loads((root / "run" / "report.json").read_text(encoding="utf-8"))
        assert report["schedule"] == planned["schedule"]
        assert report["logical_steps"] == 2 and report["num_examples"] == n
        assert report["epsilon"] == pytest.approx(planned["epsilon"], rel=1e-9)
        assert report["config"]["hardware"]["name"] == "cpu"
        assert report["config"]["precision"] == "mixed_bfloat16"
        assert all(math.isfinite(record["loss"]) for record in report["history"])

    def test_another_corpus_size_is_refused(self, planned_pico, capsys):
        root, corpus, cache, n = planned_pico
        path = pico_file(root, corpus, cache, root / "other_n", n + 1)
        assert cli.main(["pretrain", "--config", path]) == 2
        assert f"to {n} and plan again" in capsys.readouterr().err
        assert not (root / "other_n").exists()

    def test_an_infeasible_plan_stops_the_run(self, planned_pico, capsys):
        root, corpus, cache, n = planned_pico
        path = pico_file(root, corpus, cache, root / "infeasible", n)
        assert cli.main(["pretrain", "--config", path, "--noise-multiplier", "0.3",
                         "--target-epsilon", "1"]) == 2
        assert "exceeds target_epsilon 1" in capsys.readouterr().err


def test_the_non_private_baseline_is_refused_on_several_workers(tmp_path, monkeypatch):
    """It trains with Keras's fit, which cannot run there: the job says so before any work.

    (The private job trains on several workers with a custom loop of
    tf_megadp.PrivateStep: the slow test of tests/test_distribute.py on two
    loopback workers.)
    """
    from tf_megadp import distribute

    monkeypatch.setattr(distribute, "_worker_count", lambda strategy: 2)
    config = pretraining.PretrainConfig(output_dir=str(tmp_path / "run"), strategy="default",
                                        non_private=True)
    with pytest.raises(pretraining.PretrainError, match="non-private baseline"):
        pretraining.run_pretraining(config, log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def _documented_commands(path="docs/tpu.md"):
    """(command, comment, block has "not run here") of every bash block line of the doc."""
    import re
    import shlex

    text = open(path, encoding="utf-8").read()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        marked = "not run here" in block
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            command, _, comment = line.partition(" #")
            command = command.strip()
            if command and not command.startswith("#"):
                try:
                    argv = shlex.split(command)
                except ValueError:  # a quoted value over several lines (TF_CONFIG)
                    argv = command.split()
                yield argv, comment, marked


def _as_cli_arguments(argv):
    if argv[0] == "tf-megadp":
        return argv[1:]
    if argv[:2] == ["python3", "examples/pretrain_bert_mlm.py"]:
        return ["pretrain", *argv[2:]]
    return None


def test_every_command_in_docs_tpu_runs_in_a_test_or_is_marked(capsys):
    """Plan commands run here; CPU-replica pretrain commands are the scenarios' runs."""
    import pathlib

    from tests import distributed_scenarios as scenarios

    folder = pathlib.Path("/scenario")
    seen = {"plan": 0, "cpu": 0}
    for argv, comment, marked in _documented_commands():
        arguments = _as_cli_arguments(argv)
        if arguments is None:
            assert marked, f"{' '.join(argv)}: neither tested nor marked 'not run here'"
            continue
        args = cli.build_parser().parse_args(arguments)  # every documented flag exists
        if arguments[0] == "plan":
            expected = 2 if "exit 2" in comment else 0
            assert cli.main(arguments) == expected, " ".join(argv)
            capsys.readouterr()
            seen["plan"] += 1
        elif "not run here" in comment or marked:
            continue
        else:
            config = cli.run_config_from_args(args, args.config)
            replicas = config.cpu_replicas
            assert replicas in (2, 4), f"{' '.join(argv)} is not one the tests run"
            reference = cli.run_config_from_args(
                cli.build_parser().parse_args(
                    scenarios.job_argv(folder, "corpus.txt", replicas, folder / "out")), None)
            run_only = {key: getattr(reference, key) for key in (
                "corpus", "cache_dir", "output_dir", "max_characters")}
            assert dataclasses.replace(config, **run_only) == reference
            seen["cpu"] += 1
    assert seen == {"plan": 5, "cpu": 2}


class TestTheLearningRate:
    """Issue 41: the non-private baseline has its own default; the run says where its rate came from."""

    def test_each_kind_of_run_has_its_default_and_a_given_rate_wins(self, tmp_path):
        from tf_megadp.jobs.bert.config import DP_LEARNING_RATE, NON_PRIVATE_LEARNING_RATE

        assert parsed("pretrain").learning_rate_choice() == (DP_LEARNING_RATE, "DP default")
        assert parsed("pretrain", "--non-private").learning_rate_choice() == (
            NON_PRIVATE_LEARNING_RATE, "non-private default")
        # At the DP rate the baseline collapsed to the unigram plateau (docs/results.md).
        assert NON_PRIVATE_LEARNING_RATE < DP_LEARNING_RATE
        assert parsed("pretrain", "--non-private", "--learning-rate", "0.008"
                      ).learning_rate_choice() == (0.008, "given")
        # A run file's rate is given too (the shipped BERT-Large file sets 1e-3).
        assert parsed("pretrain", "--config", SHIPPED).learning_rate_choice() == (1e-3, "given")

    def test_the_plan_states_the_rate_the_run_will_use(self, planned_pico, capsys):
        root, corpus, cache, n = planned_pico
        raw = yaml.safe_load(open(pico_file(root, corpus, cache, root / "unused", n),
                                  encoding="utf-8"))
        del raw["training"]["optimizer"]["learning_rate"]
        path = root / "default-rate.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        assert cli.main(["plan", str(path), "--json"]) == 0
        from tf_megadp.jobs.bert.config import DP_LEARNING_RATE

        assert json.loads(capsys.readouterr().out)["optimizer"]["learning_rate"] == DP_LEARNING_RATE


class TestRecipeOptions:
    """Weight averaging, automatic clipping and batch-scaled learning rates as run fields."""

    def test_flags_and_file_keys_set_the_same_fields(self, tmp_path):
        run = parsed("pretrain", "--ema-momentum", "0.9", "--per-example-scaling", "automatic",
                     "--automatic-scaling-stability", "0.05", "--learning-rate-scaling", "sqrt",
                     "--reference-batch-size", "64", "--document-separator", "line")
        assert (run.ema_momentum, run.per_example_scaling, run.automatic_scaling_stability,
                run.learning_rate_scaling, run.reference_batch_size,
                run.document_separator) == (0.9, "automatic", 0.05, "sqrt", 64, "line")
        assert parsed("pretrain", "--ema-momentum", "none").ema_momentum is None
        raw = yaml.safe_load(open(SHIPPED, encoding="utf-8"))
        raw["training"]["per_example_scaling"] = "automatic"
        raw["training"]["optimizer"].update(ema_momentum=0.9, learning_rate_scaling="sqrt",
                                            reference_batch_size=64)
        raw["data"] = {"document_separator": "line"}
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(raw), encoding="utf-8")
        from_file = pretraining.load_run_config(path)
        assert (from_file.ema_momentum, from_file.per_example_scaling,
                from_file.learning_rate_scaling, from_file.reference_batch_size,
                from_file.document_separator) == (0.9, "automatic", "sqrt", 64, "line")

    @pytest.mark.parametrize("field, value, message", [
        ("ema_momentum", 1.0, "ema_momentum must be in \\(0, 1\\)"),
        ("per_example_scaling", "normalized", "per_example_scaling must be one of clip, automatic"),
        ("learning_rate_scaling", "square", "learning_rate_scaling must be one of none, sqrt"),
        ("document_separator", "tab", "document_separator must be one of blank-line, line"),
        ("automatic_scaling_stability", 0.0, "automatic_scaling_stability must be > 0"),
        ("reference_batch_size", 0, "reference_batch_size must be a positive integer"),
    ])
    def test_bad_values_are_named(self, field, value, message):
        with pytest.raises(pretraining.PretrainError, match=message):
            dataclasses.replace(pretraining.PretrainConfig(), **{field: value}).validate()

    @pytest.mark.parametrize("scaling, power", [("none", 0.0), ("sqrt", 0.5), ("linear", 1.0)])
    def test_the_learning_rate_follows_each_phases_batch(self, scaling, power):
        config = pretraining.PretrainConfig(
            schedule=[(4, 16), (6, 64)], learning_rate=1e-3, warmup_steps=2,
            learning_rate_scaling=scaling, reference_batch_size=32, micro_batch_size=8)
        schedule = config.make_schedule(num_examples=1000, num_replicas=1)
        optimizer = training._inner_optimizer(config, schedule, None)

        def reference(step):  # warmup to 1e-3 over 2 steps, cosine to 10 % over 8
            shape = (step / 2 if step < 2 else
                     0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 8)))
            return 1e-3 * shape * ((16 if step < 4 else 64) / 32) ** power

        for step in range(10):
            # The optimizer's schedule object, called at logical step `step`.
            assert float(optimizer._learning_rate(step)) == pytest.approx(reference(step), rel=1e-5)


class TestCorrelatedNoise:
    """--noise bandmf|blt --bands b: the mechanism, its sampling and its calibration."""

    def test_the_flags_choose_the_mechanism_and_the_sampling_its_proof_needs(self):
        bandmf = parsed("pretrain", "--noise", "bandmf", "--bands", "8")
        assert (bandmf.noise, bandmf.bands) == ("bandmf", 8)
        accounting = bandmf.noise_accounting()
        assert accounting["cycle_length"] == 8 and accounting["noise"].num_bands == 8
        blt = parsed("pretrain", "--noise", "blt", "--bands", "3").noise_accounting()
        assert blt["sampling"] == "fixed_order" and blt["noise"].num_buffers == 3
        assert parsed("pretrain").noise_accounting() == {}

    @pytest.mark.parametrize("fields, message", [
        (dict(noise="dpftrl"), "noise must be one of bandmf, blt"),
        (dict(noise="bandmf", bands=0), "bands must be a positive integer"),
        (dict(noise="bandmf", non_private=True, target_epsilon=None),
         "the non-private baseline adds none"),
        (dict(noise="bandmf", privacy_unit="author", corpus=["a.jsonl"]),
         "Drop --noise \\(independent noise\\) for a user-level run"),
        (dict(noise="blt", schedule=[(4, 16), (4, 64)]),
         "pass --batch-size and --steps, or for a growing batch a --noise accounted with "
         "cyclic Poisson sampling"),
    ])
    def test_settings_without_a_proof_are_refused_naming_the_fix(self, fields, message):
        with pytest.raises(pretraining.PretrainError, match=message):
            dataclasses.replace(pretraining.PretrainConfig(), **fields).validate()

    @pytest.mark.parametrize("noise, sampling, cycle, said", [
        (None, "poisson", None, "independent Gaussian noise (DP-SGD) on Poisson sampling"),
        ({"record": '{"kind":"bandmf","num_bands":4,"strategy":"0123456789ab"}'},
         "cyclic_poisson", 4,
         "BandMF correlated noise (4 bands) on cyclic Poisson sampling (4 groups: step t "
         "samples group t mod 4)"),
        ({"record": '{"kind":"blt","num_buffers":3,"strategy":"0123456789ab"}'},
         "fixed_order", None,
         "BLT correlated noise (3 buffers) on fixed-order sampling (one secret order, the "
         "same every epoch)"),
    ])
    def test_the_summary_names_the_mechanism_and_its_sampling(self, noise, sampling, cycle,
                                                              said):
        """Issue 47: a BandMF run's summary said "Poisson" and never named the mechanism."""
        from tf_megadp.jobs.bert.run_files import run_summary

        report = {
            "heldout_mlm_accuracy": 0.1, "unigram_baseline_accuracy": 0.04, "learned": True,
            "learned_threshold": 0.05, "heldout_masked_positions": 1000, "completed": True,
            "learning_rate": 8e-3, "learning_rate_source": "DP default",
            "privacy_unit": "example", "num_examples": 100, "training_sequences": 100,
            "private": True, "epsilon": 5.0, "delta": 1e-5, "noise_multiplier": 1.0,
            "l2_norm_clip": 1.0, "accountant": "pld", "adaptive_clipping": None,
            "noise": noise, "sampling": sampling, "cycle_length": cycle,
            "vocabulary": {"source": "public"}, "logical_steps": 10, "examples_per_s": 1.0,
            "wall_time_s": 1.0, "train_time_s": 0.9,
            "train_time_parts_s": {"fit": 0.7, "EvaluationAndCheckpoints": 0.2}}
        summary = run_summary(report, "run")
        assert f"mechanism               {said}\n" in summary, summary
        assert "Poisson, PLD" not in summary
        # A sequence-level run ("example" in report.json) counts N in sequences, the unit.
        assert "trained on              N = 100 training sequences (the privacy unit)" in summary

    def test_sigma_is_calibrated_for_the_mechanism(self):
        from tf_megadp import accounting
        from tf_megadp.jobs.common.privacy import plan_privacy

        config = pretraining.PretrainConfig(noise="bandmf", bands=4, accountant="rdp",
                                            target_epsilon=2.0, batch_size=64, steps=40)
        schedule = config.make_schedule(num_examples=4096, num_replicas=1)
        sigma, delta, epsilon = plan_privacy(config, schedule)
        assert epsilon == pytest.approx(accounting.compute_epsilon(
            delta=delta, schedule=schedule, noise_multiplier=sigma, accountant="rdp",
            noise=config.noise_accounting()["noise"], cycle_length=4), rel=1e-12)
        assert 0.99 * 2.0 <= epsilon <= 2.0
        # Each example joins one step in 4 at 4 times the rate: not DP-SGD's sigma.
        independent, _, _ = plan_privacy(
            dataclasses.replace(config, noise=None), schedule)
        assert sigma != pytest.approx(independent, rel=1e-3)
