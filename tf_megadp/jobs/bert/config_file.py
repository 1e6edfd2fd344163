"""The run configuration as a file (tpu_configs/*.yaml): YAML sections to a `PretrainConfig`.

One table (`_YAML_FIELDS`) maps every key to a field, so that `tf-megadp
plan`, `tf-megadp pretrain --config` and the examples read a file the same
way; secrets in a file are refused.
"""

from __future__ import annotations

import os
from typing import Any

from tf_megadp.jobs.bert.config import MODEL_PRESETS, Hardware, PretrainConfig, PretrainError

__all__ = ["load_run_config", "run_config_from_dict"]

# YAML section -> {key: PretrainConfig field}. One run configuration: `tf-megadp
# plan`, `tf-megadp pretrain --config` and the example read files through this
# table only, so a key means the same everywhere.
_YAML_FIELDS = {
    "model": {"preset": "model", "vocabulary_size": "vocabulary_size",
              "sequence_length": "sequence_length", "max_predictions": "max_predictions",
              "dropout": "dropout", "precision": "precision", "loss_scale": "loss_scale",
              "max_sequence_length": "max_sequence_length", "init_from": "init_from",
              "init_data_disjoint": "init_data_disjoint", "init_public": "init_public",
              "lora_rank": "lora_rank",
              "freeze_embeddings": "freeze_embeddings"},
    "training": {"num_examples": "num_examples", "micro_batch_size": "micro_batch_size",
                 "clipping": "clipping", "l2_norm_clip": "l2_norm_clip",
                 "per_example_scaling": "per_example_scaling",
                 "automatic_scaling_stability": "automatic_scaling_stability",
                 "adaptive_clipping_quantile": "adaptive_clipping_quantile",
                 "adaptive_clipping_learning_rate": "adaptive_clipping_learning_rate",
                 "adaptive_clipping_count_stddev": "adaptive_clipping_count_stddev",
                 "noise_multiplier": "noise_multiplier", "noise": "noise", "bands": "bands",
                 "delta": "delta",
                 "target_epsilon": "target_epsilon", "accountant": "accountant",
                 "max_truncation_probability": "max_truncation_probability",
                 "non_private": "non_private"},
    "data": {"corpus": "corpus", "vocabulary": "vocabulary",
             "vocabulary_from_training_corpus": "vocabulary_from_training_corpus",
             "document_separator": "document_separator",
             "max_characters": "max_characters", "heldout_fraction": "heldout_fraction",
             "public_sources": "public_sources",
             "privacy_unit": "privacy_unit", "examples_per_unit": "examples_per_unit",
             "canaries": "canaries", "cache_dir": "cache_dir"},
    "run": {"output_dir": "output_dir", "eval_every": "eval_every",
            "checkpoint_every": "checkpoint_every", "checkpoint_minutes": "checkpoint_minutes",
            "stop_after_steps": "stop_after_steps",
            "strategy": "strategy", "tpu": "tpu", "cpu_replicas": "cpu_replicas",
            "seed": "seed", "verbose": "verbose"},
}
_ARCHITECTURE_KEYS = ("num_layers", "hidden_dim", "num_heads", "intermediate_dim")
_OPTIMIZER_FIELDS = {"learning_rate": "learning_rate", "weight_decay": "weight_decay",
                     "beta_1": "beta_1", "beta_2": "beta_2", "warmup_steps": "warmup_steps",
                     "learning_rate_scaling": "learning_rate_scaling",
                     "reference_batch_size": "reference_batch_size",
                     "ema_momentum": "ema_momentum"}
_HARDWARE_KEYS = ("name", "replicas", "hbm_gib_per_replica", "peak_tflops_per_replica",
                  "utilization")
_PHASE_KEYS = ("steps", "batch_size", "accumulation_steps")


def _refuse_secrets(value: Any, where: str) -> None:
    """A run file may hold no sampling seed or secret, anywhere.

    The Poisson draws and the noise key come from OS entropy at every start;
    a value written in a config would be published with it (configs are
    shared and committed) and would let anyone recompute the draws.
    """
    from tf_megadp.errors import PrivacyConfigurationError

    if isinstance(value, dict):
        for key, item in value.items():
            lowered = str(key).lower()
            seedlike = "seed" in lowered and f"{where}.{key}" != "config.run.seed"
            if seedlike or "secret" in lowered or "noise_key" in lowered:
                raise PrivacyConfigurationError(
                    f"{where}.{key}: a run configuration may not hold a sampling seed, "
                    "noise seed or secret; the Poisson draws and the noise key come from "
                    "OS entropy at every start (run.seed seeds only the public model "
                    "initialisation, masking and held-out split). Delete the key.")
            _refuse_secrets(item, f"{where}.{key}")
    elif isinstance(value, list):
        for item in value:
            _refuse_secrets(item, where)


def _mapping(value: Any, where: str, allowed) -> dict:
    if not isinstance(value, dict):
        raise PretrainError(f"{where} must be a mapping, got {type(value).__name__}.")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise PretrainError(
            f"{where}: unknown key {unknown[0]!r}" + (f" (and {unknown[1:]})" if unknown[1:] else "")
            + f"; expected one of {sorted(allowed)}.")
    return value


def run_config_from_dict(raw: Any, where: str = "config") -> PretrainConfig:
    """A `PretrainConfig` from a parsed run file (the layout of tpu_configs/).

    Sections: `name`, `model` (a preset, or its layers/hidden/heads/
    intermediate sizes, which must match a preset; vocabulary_size,
    sequence_length, max_predictions, dropout, precision), `hardware`
    (`Hardware` fields: the run is planned), `training` (N, m, clipping, C,
    sigma and/or target epsilon, delta, accountant, `optimizer` (AdamW),
    `phases` of steps, batch_size and optionally accumulation_steps),
    `data` and `run` (the job's other settings).

    Raises:
        PretrainError: an unknown key (named), a wrong type or an
            inconsistent value.
        PrivacyConfigurationError: a sampling seed or secret in the file.
    """
    _refuse_secrets(raw, "config")
    top = _mapping(raw, where, ("name", "model", "hardware", "training", "data", "run"))
    fields: dict[str, Any] = {}
    if "name" in top:
        fields["name"] = str(top["name"])
    for section, table in _YAML_FIELDS.items():
        allowed = dict(table)
        if section == "model":
            allowed.update({key: None for key in _ARCHITECTURE_KEYS})
        if section == "training":
            allowed.update(optimizer=None, phases=None)
        values = _mapping(top.get(section, {}), f"{where}: {section}", allowed)
        for key, value in values.items():
            if table.get(key):
                fields[table[key]] = value
    model = top.get("model", {})
    given = {key: model[key] for key in _ARCHITECTURE_KEYS if key in model}
    if given:
        matches = [name for name, dims in MODEL_PRESETS.items()
                   if all(given[key] == dims[i] for i, key in enumerate(_ARCHITECTURE_KEYS)
                          if key in given)]
        if "preset" in model and model["preset"] not in matches:
            raise PretrainError(f"{where}: model {given} is not the preset {model['preset']!r}.")
        if not matches:
            raise PretrainError(
                f"{where}: model {given} matches no preset; the job builds "
                + ", ".join(f"{n} {d}" for n, d in MODEL_PRESETS.items())
                + " (layers, hidden, heads, intermediate).")
        fields.setdefault("model", matches[0])
    training = top.get("training", {})
    if "optimizer" in training:
        optimizer = _mapping(training["optimizer"], f"{where}: training.optimizer",
                             ("name", *_OPTIMIZER_FIELDS))
        if optimizer.get("name", "adamw") != "adamw":
            raise PretrainError(
                f"{where}: training.optimizer.name {optimizer['name']!r}: the job trains with "
                "AdamW; write name: adamw.")
        fields.update({_OPTIMIZER_FIELDS[k]: v for k, v in optimizer.items() if k != "name"})
    if "phases" in training:
        phases = training["phases"]
        if not isinstance(phases, list) or not phases:
            raise PretrainError(f"{where}: training.phases must be a non-empty list.")
        schedule = []
        for index, phase in enumerate(phases):
            phase = _mapping(phase, f"{where}: training.phases[{index}]", _PHASE_KEYS)
            if "steps" not in phase or "batch_size" not in phase:
                raise PretrainError(
                    f"{where}: training.phases[{index}] needs steps and batch_size.")
            schedule.append(tuple(phase[key] for key in _PHASE_KEYS if key in phase))
        fields["schedule"] = schedule
    if "hardware" in top:
        hardware = _mapping(top["hardware"], f"{where}: hardware", _HARDWARE_KEYS)
        try:
            fields["hardware"] = Hardware(**hardware)
        except (TypeError, ValueError) as error:
            raise PretrainError(f"{where}: {error}") from None
    if fields.get("corpus") is not None and isinstance(fields["corpus"], str):
        fields["corpus"] = [fields["corpus"]]
    if not {"noise_multiplier", "target_epsilon", "non_private"} & set(fields):
        # A file states its privacy: the flags' default target is not a plan.
        raise PretrainError(
            f"{where}: training needs noise_multiplier or target_epsilon (or non_private: true).")
    if "noise_multiplier" in fields and "target_epsilon" not in fields:
        # sigma stated alone: the run spends what sigma gives, no target.
        fields["target_epsilon"] = None
    try:
        config = PretrainConfig(**fields)
        config.validate()
        config.phases()
    except PretrainError as error:
        raise PretrainError(f"{where}: {error}") from None
    return config


def load_run_config(path: str | os.PathLike) -> PretrainConfig:
    """Reads a run configuration file (YAML); see `run_config_from_dict`.

    Raises:
        PretrainError: the file is unreadable, not YAML, or inconsistent
            (the message names the file and the key).
    """
    import yaml

    where = f"config {os.fspath(path)!r}"
    try:
        with open(path, encoding="utf-8") as stream:
            raw = yaml.safe_load(stream)
    except OSError as error:
        raise PretrainError(f"cannot read {where}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise PretrainError(f"{where} is not valid YAML: {error}") from None
    return run_config_from_dict(raw, where)
