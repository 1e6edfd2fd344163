"""Specification of `tf-megadp plan` and the shipped TPU configurations.

Every configuration in tpu_configs/ must plan cleanly, and the epsilon it
prints must be the accountant's for the schedule the YAML states. The
architecture arithmetic is checked against a keras-hub model, and each kind
of infeasibility must fail with an error naming the failing number.
"""

import copy
import glob
import json
import math
import os
import re

import pytest
import yaml

from tf_megadp import accounting, cli
from tf_megadp.jobs.bert import plan
from tf_megadp.schedules import BatchSizeSchedule, Phase

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "tpu_configs")
CONFIGS = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.yaml")))
BERT_LARGE = dict(num_layers=24, hidden_dim=1024, num_heads=16, intermediate_dim=4096,
                  vocabulary_size=30522, sequence_length=128)


def raw(path):
    with open(path, encoding="utf-8") as stream:
        return yaml.safe_load(stream)


def accountant_epsilon(config):
    """Epsilon straight from the accountant, for the schedule the YAML states."""
    training = config["training"]
    schedule = BatchSizeSchedule(
        [Phase(**phase) for phase in training["phases"]],
        num_examples=training["num_examples"],
        micro_batch_size=training["micro_batch_size"],
        num_replicas=config["hardware"]["replicas"],
    )
    return accounting.compute_epsilon(
        delta=training["delta"], schedule=schedule,
        noise_multiplier=training["noise_multiplier"], accountant=training["accountant"])


def run_cli(capsys, *argv):
    status = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def write(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


class TestShippedConfigs:
    def test_the_required_slices_and_bert_base_are_shipped(self):
        names = {raw(path)["hardware"]["name"] for path in CONFIGS}
        assert {"v3-128", "v3-1024", "v4-256"} <= names
        assert any(raw(path)["model"]["num_layers"] == 12 for path in CONFIGS)

    @pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
    def test_config_plans_and_prints_the_accountants_epsilon(self, path, capsys):
        status, out, err = run_cli(capsys, path)
        assert status == 0, err
        printed = float(re.search(r"epsilon = ([0-9.]+)", out).group(1))
        expected = accountant_epsilon(raw(path))
        # Printed rounded UP to 4 decimals.
        assert printed == math.ceil(expected * 1e4) / 1e4
        assert expected <= raw(path)["training"]["target_epsilon"]
        training = raw(path)["training"]
        assert f"{training['micro_batch_size']} per core" in out
        for phase in training["phases"]:
            assert f"k = {phase['accumulation_steps']} micro-steps" in out

    @pytest.mark.parametrize("path", [p for p in CONFIGS if raw(p)["model"]["num_layers"] == 24],
                             ids=os.path.basename)
    def test_bert_large_configs_grow_to_a_two_million_batch(self, path):
        config = raw(path)
        for key, value in BERT_LARGE.items():
            assert config["model"][key] == value
        batches = [phase["batch_size"] for phase in config["training"]["phases"]]
        assert batches[-1] == 2_097_152
        assert batches == sorted(batches) and batches[0] < batches[-1]
        for key in ("micro_batch_size", "noise_multiplier", "delta", "target_epsilon",
                    "optimizer", "num_examples"):
            assert key in config["training"]

    def test_json_plan_carries_the_accountants_epsilon_exactly(self, capsys):
        path = CONFIGS[0]
        status, out, _ = run_cli(capsys, path, "--json")
        assert status == 0
        result = json.loads(out)
        assert result["epsilon"] == accountant_epsilon(raw(path))
        training = raw(path)["training"]
        assert [p["accumulation_steps"] for p in result["phases"]] == [
            p["accumulation_steps"] for p in training["phases"]]
        assert result["logical_steps"] == sum(p["steps"] for p in training["phases"])


class TestArithmetic:
    def test_parameter_count_matches_a_keras_hub_bert(self):
        import keras_hub

        spec = plan.ModelSpec(num_layers=2, hidden_dim=32, num_heads=4, intermediate_dim=48,
                              vocabulary_size=101, sequence_length=16, max_predictions=4)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=101, num_layers=2, num_heads=4, hidden_dim=32,
            intermediate_dim=48, max_sequence_length=16)
        model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
        assert spec.parameter_count() == model.count_params()

    def test_vectorized_memory_holds_one_gradient_per_example(self):
        config = plan.load_config(CONFIGS[0])
        result = plan.make_plan(config)
        params = result["parameters"]
        vectorized = result["memory_bytes"]["vectorized"]
        assert vectorized["clipping"] == config.micro_batch_size * 4 * params
        assert vectorized["parameters"] == 4 * params

    def test_step_flops_scale_with_the_static_capacity(self):
        result = plan.make_plan(plan.load_config(CONFIGS[0]))
        per_example = result["flops_per_example"][result["clipping"]]
        for phase in result["phases"]:
            assert phase["flops_per_logical_step"] == pytest.approx(
                phase["capacity"] * per_example)


class TestInfeasible:
    def base(self):
        return copy.deepcopy(raw([p for p in CONFIGS if "v3_128" in p][0]))

    def test_memory_over_hbm_names_the_number(self, tmp_path, capsys):
        config = self.base()
        config["training"]["micro_batch_size"] = 64
        for phase in config["training"]["phases"]:
            phase["accumulation_steps"] = math.ceil(phase["accumulation_steps"] / 16) + 1
        status, _, err = run_cli(capsys, write(tmp_path, config))
        assert status == 2
        assert "per-core memory" in err and "exceeds the 16 GiB HBM" in err

    def test_epsilon_over_target_names_the_number(self, tmp_path, capsys):
        config = self.base()
        config["training"]["target_epsilon"] = 1.0
        status, _, err = run_cli(capsys, write(tmp_path, config))
        assert status == 2
        assert "exceeds target_epsilon 1" in err and "noise_multiplier" in err

    def test_capacity_below_the_batch_names_the_fix(self, tmp_path, capsys):
        config = self.base()
        config["training"]["phases"][-1]["accumulation_steps"] = 4000
        status, _, err = run_cli(capsys, write(tmp_path, config))
        assert status == 2
        assert "smaller than batch_size 2097152" in err and "at least 4096" in err

    def test_truncation_too_likely_names_the_probability(self, tmp_path, capsys):
        config = self.base()
        config["training"]["phases"][-1]["accumulation_steps"] = 4096
        status, _, err = run_cli(capsys, write(tmp_path, config))
        assert status == 2
        assert "truncation probability" in err and "accumulation_steps" in err

    @pytest.mark.parametrize("mutate, message", [
        (lambda c: c["training"].update(delta="1e-9"), "delta must be a finite number"),
        (lambda c: c["training"].update(clipping="naive"), "training.clipping"),
        (lambda c: [c["training"].pop(k) for k in ("noise_multiplier", "target_epsilon")],
         "noise_multiplier"),
        (lambda c: c.update(extra=1), "unknown key 'extra'"),
        (lambda c: c["training"].update(lerning_rate=1), "unknown key 'lerning_rate'"),
        (lambda c: c["training"]["optimizer"].update(name="lamb"), "trains with AdamW"),
        (lambda c: c["model"].update(num_heads=7), "matches no preset"),
        (lambda c: c["training"].pop("num_examples"), "training.num_examples"),
    ])
    def test_bad_config_is_one_clear_error(self, tmp_path, capsys, mutate, message):
        config = self.base()
        mutate(config)
        status, out, err = run_cli(capsys, write(tmp_path, config))
        assert status == 2 and out == ""
        assert message in err and len(err.strip().splitlines()) == 1

    def test_missing_file(self, tmp_path, capsys):
        status, _, err = run_cli(capsys, str(tmp_path / "absent.yaml"))
        assert status == 2 and "cannot read config" in err


class TestAgainstAMeasuredStep:
    """The memory model against the one measured BERT-Large DP step (docs/tpu.md)."""

    def test_plan_memory_is_within_25_percent_of_the_measured_peak(self, capsys):
        import importlib.util

        root = os.path.dirname(CONFIG_DIR)
        spec = importlib.util.spec_from_file_location(
            "bert_large_check", os.path.join(root, "benchmarks", "bert_large_check.py"))
        check = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(check)
        saved = os.path.join(root, "benchmarks", "bert_large_check_cpu.json")
        assert check.main(["--compare", saved]) == 0, capsys.readouterr().out
        out = capsys.readouterr().out
        ratios = [float(r) for r in re.findall(r"measured/plan ([0-9.]+)", out)]
        assert len(ratios) == 2 and all(0.75 <= r <= 1.25 for r in ratios), out
