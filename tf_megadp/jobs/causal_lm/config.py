"""The causal-LM job's settings: `CausalLMConfig`, from flags.

Its privacy section is every job's `PrivacySettings`
(`tf_megadp.jobs.common.privacy`). The data and schedule defaults are the
masked-LM job's (`tf_megadp.jobs.bert.config.PretrainConfig`), so that
both jobs read the same cached corpus and compare at the same epsilon.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

from tf_megadp.jobs.common.errors import JobError
from tf_megadp.jobs.common.lora import check_lora_rank
from tf_megadp.jobs.common.privacy import PrivacySettings, check_privacy_unit

__all__ = ["DP_LEARNING_RATE", "NON_PRIVATE_LEARNING_RATE", "CausalLMConfig"]

# The peak learning rates of a run that sets none: the masked-LM job's
# (its DP ablation and non-private sweep, docs/results.md), not yet swept
# for this job.
DP_LEARNING_RATE = 8e-3
NON_PRIVATE_LEARNING_RATE = 2e-3
# LoRA's factors (DP or not): the fine-tuning job's LoRA rate, swept there
# for BERT (docs/results.md, section 6), not swept for this job.
LORA_LEARNING_RATE = 3e-2


@dataclasses.dataclass
class CausalLMConfig(PrivacySettings):
    """Settings of one causal-LM run: pretraining, or fine-tuning with `train` and `init_from`.

    Args:
        corpus: text or JSONL files (None: the offline default corpus of
            `tf-megadp pretrain`, docstrings of installed packages).
        document_separator: how plain-text files are cut into documents
            ("blank-line" or "line").
        max_characters: size cap of the default corpus.
        vocabulary_size: WordPiece vocabulary size (learned from the public
            default corpus, also for a user corpus).
        sequence_length: L, tokens per packed row ([CLS] text [SEP], then
            padding); the model reads the first L - 1 and predicts the last
            L - 1. One row is one privacy unit, unless `privacy_unit`.
        heldout_fraction: the share of rows held out for the scores.
        privacy_unit: user-level privacy (pretraining): the JSONL field
            naming each document's privacy unit (its user, author, account),
            as for `tf-megadp pretrain --privacy-unit`. Every logical step
            then Poisson-samples UNITS (`tf_megadp.PrivacyUnitSampler`), at
            most `examples_per_unit` rows of each, whose summed gradient is
            clipped to C: epsilon bounds what one unit risks, N counts the
            units of the training split, and `batch_size` and
            `micro_batch_size` count units (a micro-batch has
            micro_batch_size * examples_per_unit rows). None (default): one
            packed row is the unit.
        examples_per_unit: k, the most rows of one unit in a step.
        family: the decoder of a pretraining run, "gpt2" or "llama"
            (`tf_megadp.jobs.causal_lm.families`; None: "gpt2"). Fine-tuning
            continues the start's family (its file names it); a family
            given that differs is refused. The run records the family it
            trains.
        model: a size of `tf_megadp.jobs.bert.config.MODEL_PRESETS` (layers,
            hidden, heads, intermediate) for the backbone.
        batch_size: the expected logical batch B (Poisson sampling).
        steps: logical steps.
        micro_batch_size: m, rows per micro-batch.
        learning_rate: the peak AdamW learning rate (None: `DP_LEARNING_RATE`
            or `NON_PRIVATE_LEARNING_RATE`), warmed up linearly over
            `warmup_steps`, then cosine decay to a tenth.
        warmup_steps, weight_decay: AdamW's schedule and decay.
        eval_every: logical steps between held-out evaluations.
        init_from: fine-tuning: the model.keras of a `tf-megadp causal-lm`
            run to start from (its architecture, context and vocabulary
            are the run's; a DP release's ledger is composed into this
            run's epsilon). Needs `train`.
        init_public, init_data_disjoint: the user's statement of where
            `init_from` comes from, when no file tells (as for `tf-megadp
            pretrain --init-from`).
        lora_rank: fine-tuning: None (every weight trains) or r: LoRA
            factors of rank r on the attention query and value projections,
            every other weight of the start frozen.
        train: fine-tuning: JSONL (or CSV) of prompt/completion pairs; the
            loss and the scores are on the completion's tokens (and the
            [SEP] that ends it) only. One pair is one privacy unit.
        test: the pairs scored (None: `test_fraction` of `train` held out).
        prompt_field, completion_field: the fields of each pair.
        test_fraction: the share of `train` held out without `test`.
        checkpoint_every, checkpoint_minutes, stop_after_steps, resume,
            output_dir, cache_dir, verbose: as for `tf-megadp pretrain`.
        seed: seeds what may be public: the initialisation and the
            held-out split. Never the sampling nor the noise.
    """

    target_epsilon: float | None = 5.36
    corpus: Sequence[str] | None = None
    document_separator: str = "blank-line"
    max_characters: int = 3_000_000
    vocabulary_size: int = 512
    sequence_length: int = 64
    heldout_fraction: float = 0.05
    privacy_unit: str | None = None
    examples_per_unit: int = 4
    family: str | None = None
    model: str = "nano"
    batch_size: int = 256
    steps: int = 300
    micro_batch_size: int = 64
    learning_rate: float | None = None
    warmup_steps: int = 25
    weight_decay: float = 0.01
    eval_every: int = 25
    checkpoint_every: int = 0
    checkpoint_minutes: float = 10.0
    stop_after_steps: int | None = None
    resume: bool = False
    output_dir: str | None = None
    cache_dir: str | None = None
    verbose: int | str = "auto"
    seed: int = 0
    init_from: str | None = None
    init_public: bool = False
    init_data_disjoint: bool = False
    lora_rank: int | None = None
    train: str | None = None
    test: str | None = None
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    test_fraction: float = 0.1

    @property
    def fine_tuning(self) -> bool:
        """Whether the run fine-tunes a start on prompt/completion pairs (else it pretrains)."""
        return self.train is not None

    @property
    def rows_per_unit(self) -> int:
        """k, the rows of one privacy unit's slot: `examples_per_unit` with a unit, else 1."""
        return self.examples_per_unit if self.privacy_unit else 1

    def learning_rate_choice(self) -> tuple[float, str]:
        """The peak learning rate, and where it comes from ("given" or the default of its kind)."""
        if self.learning_rate is not None:
            return float(self.learning_rate), "given"
        kind = "non-private" if self.non_private else "DP"
        if self.lora_rank is not None:
            return LORA_LEARNING_RATE, f"{kind} LoRA default"
        return (NON_PRIVATE_LEARNING_RATE if self.non_private else DP_LEARNING_RATE,
                f"{kind} default")

    def validate(self) -> None:
        """Raises `JobError` naming the first bad field (and how to fix it)."""
        from tf_megadp.jobs.bert.config import MODEL_PRESETS, SEPARATORS
        from tf_megadp.jobs.causal_lm.families import FAMILIES

        self.check_privacy()
        if self.model not in MODEL_PRESETS:
            raise JobError(f"model must be one of {', '.join(MODEL_PRESETS)}, got "
                           f"{self.model!r}.")
        if self.family is not None and self.family not in FAMILIES:
            raise JobError(f"family must be one of {', '.join(FAMILIES)}, got "
                           f"{self.family!r}.")
        if self.document_separator not in SEPARATORS:
            raise JobError(f"document_separator must be one of {', '.join(SEPARATORS)}, got "
                           f"{self.document_separator!r}.")
        positive = {"vocabulary_size": self.vocabulary_size, "batch_size": self.batch_size,
                    "steps": self.steps, "micro_batch_size": self.micro_batch_size,
                    "eval_every": self.eval_every, "max_characters": self.max_characters,
                    "examples_per_unit": self.examples_per_unit}
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise JobError(f"{name} must be a positive integer, got {value!r}.")
        if (isinstance(self.sequence_length, bool) or not isinstance(self.sequence_length, int)
                or self.sequence_length < 8):
            raise JobError(f"sequence_length must be an integer >= 8, got "
                           f"{self.sequence_length!r}.")
        for name in ("learning_rate", "weight_decay", "checkpoint_minutes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise JobError(f"{name} must be a finite number >= 0, got {value!r}.")
        if not 0 < self.heldout_fraction < 0.5:
            raise JobError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}.")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise JobError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}.")
        for path in self.corpus or ():
            if not any(character in path for character in "*?[") and not os.path.isfile(path):
                raise JobError(f"--corpus {path}: no such file.")
        if self.resume and not self.output_dir:
            raise JobError("--resume needs --output-dir of the run to continue.")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise JobError(f"stop_after_steps must be >= 1, got {self.stop_after_steps}.")
        if bool(self.train) != bool(self.init_from):
            raise JobError(
                "Fine-tuning needs both --train (prompt/completion pairs) and --init-from (the "
                "model.keras of a `tf-megadp causal-lm` run); pretraining takes neither.")
        if self.privacy_unit is not None and self.train:
            raise JobError(
                f"--privacy-unit {self.privacy_unit} is for pretraining on --corpus FILE.jsonl; "
                "fine-tuning with --train takes one prompt/completion pair as the privacy "
                "unit. Drop --privacy-unit.")
        check_privacy_unit(self.privacy_unit, self.corpus)
        if self.test and not self.train:
            raise JobError("--test names the test split of --train: pass --train FILE too.")
        for name in ("train", "test", "init_from"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise JobError(f"--{name.replace('_', '-')} {path}: no such file.")
        if not 0 < self.test_fraction < 0.5:
            raise JobError(f"test_fraction must be in (0, 0.5), got {self.test_fraction}.")
        check_lora_rank(self.lora_rank)
        if self.lora_rank is not None and not self.fine_tuning:
            raise JobError(
                f"--lora-rank {self.lora_rank} adapts a trained start: pass --init-from and "
                "--train, or drop --lora-rank to pretrain every weight.")
        if self.init_public and self.init_data_disjoint:
            raise JobError(
                "--init-public and --init-data-disjoint are two statements of where "
                "--init-from comes from: give the one that holds.")
        if self.noise is not None:
            raise JobError(
                f"--noise {self.noise}: the causal-LM job trains with independent noise "
                "(DP-SGD) for now. Drop --noise.")
