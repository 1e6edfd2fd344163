"""The fine-tuning job's settings: `FinetuneConfig`, from flags.

Its privacy section is every job's `PrivacySettings`
(`tf_megadp.jobs.common.privacy`); the defaults here are this job's, from
the DP fine-tuning literature adapted to the size of the data
(`FinetuneConfig.batch_size_for`) and documented where they were measured.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

from tf_megadp.jobs.common.errors import JobError
from tf_megadp.jobs.common.lora import check_lora_rank
from tf_megadp.jobs.common.privacy import PrivacySettings

__all__ = ["DEFAULT_TEMPLATE", "LEARNING_RATES", "OBJECTIVES", "FinetuneConfig"]

OBJECTIVES = ("prompt", "head")
# The template of a task that names none (the seed paper's for sentiment).
DEFAULT_TEMPLATE = "{text} it was [MASK] ."
# The peak AdamW learning rate (linear decay to 0) of a run that sets none,
# by (objective, private, LoRA): the best of a sweep on the default task's
# validation split (docs/results.md, section 6), never on its test split.
# Each is inside its sweep's range (its neighbours were worse). The head's
# LoRA rates were not swept: they are the prompt's.
LEARNING_RATES = {
    ("prompt", True, False): 1e-2, ("prompt", False, False): 3e-3,
    ("head", True, False): 1e-2, ("head", False, False): 3e-3,
    ("prompt", True, True): 3e-2, ("prompt", False, True): 3e-2,
    ("head", True, True): 3e-2, ("head", False, True): 3e-2,
}


@dataclasses.dataclass
class FinetuneConfig(PrivacySettings):
    """Settings of one fine-tuning run.

    Args:
        train: the labelled training file (JSONL or CSV); None: the default
            task (`tf_megadp.jobs.finetune.data.default_task`).
        test: the labelled test file; None: `test_fraction` of `train` held out.
        text_field, label_field: the fields of each example.
        labels: the class names in order (None: the training labels, sorted;
            the default task's its own).
        label_words: the word the model predicts at [MASK] for each label
            (`--objective prompt`; each one token of the vocabulary). None:
            the labels themselves (the default task's its own words).
        template: the prompt, with `{text}` and one `[MASK]` (None:
            `DEFAULT_TEMPLATE`, or the default task's own).
        test_fraction: the share of `train` held out without a test file.
        init_from: the BERT to start from: a run's model.keras (the public
            model of `tf-megadp public-model`, or a DP release, whose ledger
            is composed) or a local keras-hub preset folder.
        init_public, init_data_disjoint: the user's statement of where
            `init_from` comes from, when no file tells (as for `tf-megadp
            pretrain --init-from`).
        objective: "prompt" (the label as a word at [MASK], through the
            pretrained MLM head) or "head" (a classifier on [CLS]).
        lora_rank: None (every weight trains) or r: LoRA factors of rank r on
            the attention query and value projections, the rest of the
            backbone frozen (the MLM head, or the pooler and head, train).
        sequence_length: T, tokens per example (the text is cut, the prompt kept).
        batch_size: the expected logical batch B (None: `batch_size_for(N)`).
        epochs: passes over the training data (expected: Poisson steps
            draw each example with probability B / N per step). 30 by
            default: on the default task's validation split, 30 epochs
            against 10 took DP prompt fine-tuning at epsilon 8 from 0.704
            to 0.741 and its non-private twin from 0.840 to 0.849
            (docs/results.md, section 6).
        micro_batch_size: m, examples per micro-batch.
        learning_rate: the peak AdamW learning rate, decayed linearly to 0
            (None: `LEARNING_RATES` of the objective and kind of run).
        weight_decay: AdamW's.
        eval_every: logical steps between test evaluations (and checkpoints
            at the latest; the test split is never trained on).
        checkpoint_every, checkpoint_minutes, stop_after_steps, resume,
            output_dir, cache_dir, verbose: as for `tf-megadp pretrain`.
        seed: seeds what may be public: the model's new weights (a head, LoRA
            factors), the held-out split. Never the sampling nor the noise.
    """

    target_epsilon: float | None = 8.0
    l2_norm_clip: float = 0.1
    train: str | None = None
    test: str | None = None
    text_field: str = "text"
    label_field: str = "label"
    labels: Sequence[str] | None = None
    label_words: Sequence[str] | None = None
    template: str | None = None
    test_fraction: float = 0.2
    init_from: str | None = None
    init_public: bool = False
    init_data_disjoint: bool = False
    objective: str = "prompt"
    lora_rank: int | None = None
    sequence_length: int = 64
    batch_size: int | None = None
    epochs: float = 30.0
    micro_batch_size: int = 64
    learning_rate: float | None = None
    weight_decay: float = 0.0
    eval_every: int = 10
    checkpoint_every: int = 0
    checkpoint_minutes: float = 10.0
    stop_after_steps: int | None = None
    resume: bool = False
    output_dir: str | None = None
    cache_dir: str | None = None
    verbose: int | str = "auto"
    seed: int = 0

    def learning_rate_choice(self) -> tuple[float, str]:
        """The peak learning rate, and where it comes from ("given" or the default of its kind)."""
        if self.learning_rate is not None:
            return float(self.learning_rate), "given"
        kind = "non-private" if self.non_private else "DP"
        lora = self.lora_rank is not None
        return (LEARNING_RATES[(self.objective, not self.non_private, lora)],
                f"{kind} {self.objective}{' LoRA' if lora else ''} default")

    @staticmethod
    def batch_size_for(num_examples: int) -> int:
        """The default logical batch for N examples: N / 4, within [64, 1024].

        Li et al. train with B about 1,000 on 67,000 examples (SST-2); DP
        needs large batches (the noise on the mean falls as 1 / B), and a
        run of N / B steps per epoch needs a few. With fewer than ~4,000
        examples it is N / 4: four steps per epoch.
        """
        return int(min(1024, max(64, num_examples // 4)))

    def validate(self) -> None:
        """Raises `JobError` naming the first bad field (and how to fix it)."""
        self.check_privacy()
        if self.objective not in OBJECTIVES:
            raise JobError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                           f"{self.objective!r}.")
        positive = {"sequence_length": self.sequence_length,
                    "micro_batch_size": self.micro_batch_size, "eval_every": self.eval_every}
        if self.batch_size is not None:
            positive["batch_size"] = self.batch_size
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise JobError(f"{name} must be a positive integer, got {value!r}.")
        check_lora_rank(self.lora_rank)
        for name in ("epochs", "learning_rate", "weight_decay", "test_fraction",
                     "checkpoint_minutes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise JobError(f"{name} must be a finite number >= 0, got {value!r}.")
        if not self.epochs > 0:
            raise JobError(f"epochs must be > 0, got {self.epochs}.")
        if not 0 < self.test_fraction < 0.5:
            raise JobError(f"test_fraction must be in (0, 0.5), got {self.test_fraction}.")
        if self.test and not self.train:
            raise JobError("--test names the test split of --train: pass --train FILE too.")
        for name in ("train", "test"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise JobError(f"--{name} {path}: no such file.")
        if self.resume and not self.output_dir:
            raise JobError("--resume needs --output-dir of the run to continue.")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise JobError(f"stop_after_steps must be >= 1, got {self.stop_after_steps}.")
        if self.init_public and self.init_data_disjoint:
            raise JobError(
                "--init-public and --init-data-disjoint are two statements of where "
                "--init-from comes from: give the one that holds.")
        if self.init_from and not os.path.exists(self.init_from):
            raise JobError(f"--init-from {self.init_from}: no such file or directory.")
        if self.noise is not None:
            raise JobError(
                f"--noise {self.noise}: the fine-tuning job trains with independent noise "
                "(a few epochs of few steps, where correlated noise buys little). Drop --noise.")
