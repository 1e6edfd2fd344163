"""Audits a finished `tf-megadp pretrain` run: what `tf-megadp audit RUN_DIR` does.

The run directory holds everything needed: the trained model
(`model.keras`), the run's settings (in `report.json`), which locate the
prepared corpus in the cache, and, when the run was started with
`--canaries N`, the inserted canaries (`canaries.json`). Members are
training sequences that are not canaries; non-members are the held-out
split, which the model never saw. Both are masked once, with a fixed seed,
so every attack sees the same inputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Callable

import keras
import numpy as np

from tf_megadp.audit.runner import run_audit
from tf_megadp.files import write_json_atomically
from tf_megadp.jobs.bert import pretraining, run_files, text, training
from tf_megadp.jobs.common import run_folder
from tf_megadp.jobs.common.privacy import default_delta
from tf_megadp.jobs.bert.config import PretrainConfig

__all__ = ["audit_pretraining_run", "load_run_model"]


def _masked_batches(rows: np.ndarray, batcher: text.MaskedLMBatcher, batch_size: int,
                    seed: int) -> list:
    x, y, w = training.masked_rows(rows, batcher, seed)
    return [
        ({key: value[start:start + batch_size] for key, value in x.items()},
         y[start:start + batch_size], w[start:start + batch_size])
        for start in range(0, len(rows), batch_size)
    ]


def load_run_model(config: PretrainConfig, vocabulary_size: int, model_path: str) -> keras.Model:
    """The run's trained model: the job's `build_model` with the saved weights.

    `keras.models.load_model` rebuilds a mixed_bfloat16 (mixed_float16) run
    with its MLM head in bfloat16 (float16) too (the head's float32 policy is set after
    construction and is not in its config), and that head raises on its
    first call; building the model the way the job did keeps every layer's
    policy.

    Args:
        config: the run's `PretrainConfig`.
        vocabulary_size: V of the run's prepared vocabulary.
        model_path: the run's `model.keras`.

    Returns:
        The `BertMaskedLM` holding the run's weights.

    Raises:
        PretrainError: the file does not hold weights for every layer of the
            model `config` describes (an audit of freshly initialized layers
            would understate what the run leaks).
    """
    model = training.build_model(config, vocabulary_size)
    with warnings.catch_warnings():
        # Only the weights matter here: the release holds no optimizer state,
        # and keras-hub compiles its tasks with one.
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        # Keras only warns when a layer keeps its initial weights.
        warnings.filterwarnings("error", message="Skipping nested container")
        try:
            model.load_weights(model_path)
        except (ValueError, UserWarning) as error:
            raise pretraining.PretrainError(
                f"{model_path} does not hold the model its run's {run_folder.REPORT_NAME} "
                f"describes (BERT-{config.model}, vocabulary {vocabulary_size}, sequence length "
                f"{config.sequence_length}); audit the folder the run wrote, unchanged: "
                f"{str(error).splitlines()[0]}"
            ) from error
    return model


def audit_pretraining_run(
    output_dir: str,
    *,
    num_members: int = 1000,
    cache_dir: str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs `tf_megadp.audit.run_audit` on a pretraining run and writes `audit.json`.

    Args:
        output_dir: the `--output-dir` of a completed `tf-megadp pretrain` run.
        num_members: training sequences used as members; as many held-out
            sequences as exist up to this number are the non-members.
        cache_dir: where the run's prepared corpus is kept (default: the
            pretraining default).
        seed: seed of the member choice and of the masking.
        log: where progress lines go.

    Returns:
        The audit report: `run_audit`'s numbers plus "theoretical_epsilon",
        "delta", "private" and "heldout_mlm_accuracy" of the run.

    Raises:
        PretrainError: the folder is not a completed run, or its corpus is
            no longer in the cache.
    """
    report_path = os.path.join(output_dir, run_folder.REPORT_NAME)
    model_path = os.path.join(output_dir, run_folder.MODEL_NAME)
    if not (os.path.isfile(report_path) and os.path.isfile(model_path)):
        raise pretraining.PretrainError(
            f"{output_dir} is not a completed pretraining run (it needs {run_folder.REPORT_NAME} "
            f"and {run_folder.MODEL_NAME}); run `tf-megadp pretrain --output-dir {output_dir}` first."
        )
    if num_members < 2:
        raise pretraining.PretrainError(f"num_members must be >= 2, got {num_members}.")
    with open(report_path, encoding="utf-8") as handle:
        run = json.load(handle)
    config = _run_config(output_dir, run)
    config = dataclasses.replace(config, output_dir=output_dir, resume=False,
                                 cache_dir=cache_dir or config.cache_dir)
    _, train, heldout = pretraining.prepare_data(config)
    canaries, canary_index = [], np.full(len(train), -1)
    if config.canaries:
        train, canaries, canary_index = pretraining.canary_split(config, train)

    rng = np.random.default_rng(seed)
    candidates = np.flatnonzero(canary_index < 0)
    members = np.sort(rng.choice(candidates, size=min(num_members, len(candidates)), replace=False))
    nonmembers = np.arange(min(len(heldout), num_members))
    batcher = text.MaskedLMBatcher.from_shards(train)
    batch_size = 256
    member_batches = _masked_batches(train.read(members), batcher, batch_size, seed)
    nonmember_batches = _masked_batches(heldout.read(nonmembers), batcher, batch_size, seed + 1)

    log(f"Auditing {output_dir}: {len(members)} members, {len(nonmembers)} non-members, "
        f"{len(canaries)} canaries (controls included).")
    model = load_run_model(config, train.vocabulary_size, model_path)
    delta = run["delta"] if run["private"] else default_delta(len(train))
    result = run_audit(
        model, member_batches, nonmember_batches, canaries,
        mask_token_id=text.SPECIAL_TOKENS.index("[MASK]"),
        pad_token_id=text.SPECIAL_TOKENS.index("[PAD]"),
        delta=delta, batch_size=batch_size, seed=seed,
    )
    result.update(
        private=run["private"],
        theoretical_epsilon=run["epsilon"] if run["private"] else math.inf,
        delta=delta,
        heldout_mlm_accuracy=run["heldout_mlm_accuracy"],
        canaries_per_repetition=config.canaries,
    )
    write_json_atomically(os.path.join(output_dir, run_files.AUDIT_NAME), result)
    log(_summary(result, output_dir))
    return result


def _run_config(output_dir: str, run: dict[str, Any]) -> PretrainConfig:
    """The run's whole settings: its checkpoint's, which locate its corpus on this machine.

    report.json names files by name only (it is published); a report written
    before it did (its output_dir an absolute path) still serves.
    """
    try:
        return run_files.resumed_config(run_files.pretrain_settings(output_dir))
    except pretraining.PretrainError:
        settings = run.get("config") or {}
        if not os.path.isabs(str(settings.get("output_dir") or "")):
            raise pretraining.PretrainError(
                f"{output_dir} has no {run_folder.CHECKPOINT_NAME} with the run's settings: the "
                f"audit reads there where the run's corpus is ({run_folder.REPORT_NAME} names "
                "files by name only). Audit the run folder as training left it.") from None
        return run_files.resumed_config(settings)


def _summary(result: dict[str, Any], output_dir: str) -> str:
    epsilon = result["theoretical_epsilon"]
    lines = [
        "",
        "=" * 64,
        f"theoretical epsilon     {'inf (non-private)' if math.isinf(epsilon) else f'{epsilon:.3f}'}"
        f"   delta {result['delta']:.3g}",
        f"membership inference    AUC {result['mia_auc']:.4f}   TPR@1%FPR "
        f"{result['mia_tpr_at_fpr_0.01']:.4f}   TPR@0.1%FPR {result['mia_tpr_at_fpr_0.001']:.4f}",
        f"empirical epsilon (LB)  {result.get('mia_eps_lower_bound', float('nan')):.3f} "
        "(membership inference, 95% Clopper-Pearson)",
    ]
    for count in sorted({c["repetitions"] for c in result["canaries"]}):
        label = "controls (never seen)" if count == 0 else f"canaries inserted {count}x"
        lines.append(f"exposure {label:<24} mean {result[f'exposure_r{count}_mean']:.2f} bits, "
                     f"max {result[f'exposure_r{count}_max']:.2f}")
    lines += [f"report                  {os.path.join(output_dir, 'audit.json')}", "=" * 64]
    return "\n".join(lines)
