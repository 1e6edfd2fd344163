"""The BERT job's one run configuration: `PretrainConfig`, from flags or a run file.

`tf-megadp plan FILE`, `tf-megadp pretrain --config FILE [flags]` and
examples/pretrain_bert_mlm.py build the same `PretrainConfig`: from a run
file (the layout of tpu_configs/, read by `load_run_config`) or from the
defaults, then overridden by the flags given (`tf_megadp.cli`). A planned
run (one with `hardware`) trains exactly the plan `tf-megadp plan` printed:
the job plans it again with the measured N and vocabulary before training.

No field holds a sampling seed or a secret, and a run file that names one
is refused: the Poisson draws and the noise key come from OS entropy at
every start.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

from tf_megadp.jobs.common.errors import JobError
from tf_megadp.jobs.common.lora import check_lora_rank
from tf_megadp.jobs.common.privacy import PrivacySettings, check_privacy_unit

__all__ = ["DEFAULT_LOSS_SCALE", "DP_LEARNING_RATE", "LEARNING_RATE_SCALINGS", "MODEL_PRESETS",
           "NON_PRIVATE_LEARNING_RATE", "PRECISIONS",
           "SEPARATORS", "Hardware", "PretrainConfig", "PretrainError", "parse_schedule"]

# (layers, hidden, heads, intermediate). "tiny" is what a 2-core CPU trains in minutes.
MODEL_PRESETS = {
    "pico": (1, 32, 2, 64),
    "nano": (2, 64, 2, 256),
    "tiny": (2, 128, 2, 512),
    "mini": (4, 256, 4, 1024),
    "small": (4, 512, 8, 2048),
    "medium": (8, 512, 8, 2048),
    "base": (12, 768, 12, 3072),
    "large": (24, 1024, 16, 4096),
}

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
# The fixed loss scale of a private mixed_float16 run when none is given:
# Keras's own initial scale (`LossScaleOptimizer(initial_scale=2**15)`).
DEFAULT_LOSS_SCALE = 2.0**15
# The learning rate of a run that sets none: each kind of run has its own,
# as the non-private baseline collapses to the unigram plateau at the DP
# rate (issue 41). DP: the best change of docs/results.md's ablation at
# epsilon 5.36 (0.114 held-out accuracy, 0.096 at 4e-3, 0.079 at 2e-3;
# 300 x 256). Non-private: the sweep of docs/benchmarks.md ("The
# non-private baseline's learning rate") on the same job.
DP_LEARNING_RATE = 8e-3
NON_PRIVATE_LEARNING_RATE = 2e-3
# How the learning rate follows the logical batch B: lr * (B / reference)^power.
LEARNING_RATE_SCALINGS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}
# How a plain-text corpus file is cut into documents (tf_megadp.jobs.bert.text).
SEPARATORS = ("blank-line", "line")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The accelerator slice, counted in replicas (TensorFlow TPU cores).

    Args:
        name: e.g. "v3-128".
        replicas: R, replicas in sync (v3: 2 per chip; v4: 1 per chip).
        hbm_gib_per_replica: memory each replica may use.
        peak_tflops_per_replica: peak 16-bit (bfloat16, or float16 under
            mixed_float16) TFLOP/s of one replica.
        utilization: fraction of peak assumed for the step-time estimate.
    """

    name: str
    replicas: int
    hbm_gib_per_replica: float
    peak_tflops_per_replica: float
    utilization: float = 1.0

    def __post_init__(self):
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"hardware.replicas must be a positive integer, got {self.replicas!r}.")
        for name in ("hbm_gib_per_replica", "peak_tflops_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"hardware.{name} must be a number > 0, got {value!r}.")
        if not isinstance(self.utilization, (int, float)) or not 0 < self.utilization <= 1:
            raise ValueError(
                f"hardware.utilization must be in (0, 1], got {self.utilization!r}.")


# Bad input for the pretraining job: every job's `JobError`.
PretrainError = JobError


@dataclasses.dataclass
class PretrainConfig(PrivacySettings):
    """Settings of one pretraining run (defaults: the README's CPU run).

    The privacy fields (target_epsilon, noise_multiplier, delta,
    l2_norm_clip, per_example_scaling, automatic_scaling_stability,
    adaptive_clipping_*, accountant, non_private, clipping, noise, bands,
    max_truncation_probability) are every job's `PrivacySettings`
    (`tf_megadp.jobs.common.privacy`); this job's target is epsilon 5.36.

    Args:
        corpus: text/JSONL files or globs; None uses the offline default corpus
            (docstrings of installed packages).
        output_dir: where the run writes everything; default a new folder
            under ./runs/.
        model: a `MODEL_PRESETS` name.
        sequence_length: L, tokens per sequence (one sequence = one privacy unit).
        vocabulary_size: WordPiece vocabulary size to learn. The default 512
            splits words into more pieces, which context predicts early: a
            small BERT leaves the unigram plateau in fewer steps than at 2048.
        vocabulary: a vocabulary file (one token per line, e.g. BERT's public
            `vocab.txt`) that you name as public; it replaces the learned one.
        vocabulary_from_training_corpus: learn the vocabulary from `corpus`
            itself. NOT private: the vocabulary is published with the model
            and its rare words (names, identifiers) appear in it verbatim,
            outside epsilon; the run warns and its report says so. By default
            a run on a user corpus learns its vocabulary from the public
            offline default corpus instead (or uses `vocabulary`).
        document_separator: how plain-text corpus files are cut into
            documents: "blank-line" (paragraphs) or "line" (one document
            per line). JSONL files always hold one document per line.
        max_characters: size cap of the default corpus (also when it only
            supplies the vocabulary of a user corpus).
        public_sources: the sources of the offline default corpus (and of
            the public vocabulary), comma-separated names of
            `tf_megadp.jobs.bert.public_text.PUBLIC_SOURCES` such as
            "docstrings,more-docstrings,man,doc,package-docs"; the
            docstrings of `HELD_OUT_PACKAGES` are never among them. None
            (default): the docstrings of the standard library, numpy,
            keras and tensorflow, as the job has always read them.
        heldout_fraction: share of sequences kept out of training for evaluation.
        privacy_unit: user-level privacy: the JSONL field naming each
            document's privacy unit (its author, account, patient). Every
            logical step then Poisson-samples UNITS (`tf_megadp.PrivacyUnitSampler`),
            at most `examples_per_unit` sequences of each, clipped together:
            epsilon bounds what one unit risks, N counts units, and
            `batch_size`, `schedule` and `micro_batch_size` count units (a
            micro-batch has micro_batch_size * examples_per_unit rows). None
            (default): the sequence is the unit.
        examples_per_unit: k, the most sequences of one unit in a step.
        canaries: for a privacy audit (`tf-megadp audit`), insert this many
            secret-sharer canaries per repetition count r in (1, 4, 16) into
            the training split, r copies each (every copy is one more
            training sequence, counted in N), and keep as many never-inserted
            controls; 0 (default) inserts none.
        micro_batch_size: m, examples per replica per micro-batch.
        batch_size: expected logical batch B of a constant schedule.
        steps: logical steps of a constant schedule.
        schedule: phases [(steps, batch_size), ...] (overrides batch_size/steps).
        learning_rate, warmup_steps, weight_decay: AdamW with linear warmup and
            cosine decay over the logical steps. A learning rate of None is
            the default of the run's kind (`learning_rate_choice`):
            `DP_LEARNING_RATE`, or `NON_PRIVATE_LEARNING_RATE` for the
            non-private baseline.
        learning_rate_scaling: "none", "sqrt" or "linear": the learning rate
            of a step of logical batch B is learning_rate * (B /
            reference_batch_size)^(0, 1/2 or 1), phase by phase of the
            schedule (a larger batch averages its noise and sampling error
            down, so it affords a larger step).
        reference_batch_size: the batch at which `learning_rate` applies as given.
        ema_momentum: None, or keep an exponential moving average of the
            weights (Keras's `use_ema` of the inner AdamW, De et al. 2022)
            with this momentum: held-out evaluations use the average
            (`keras.callbacks.SwapEMAWeights`) and the exported model is the
            average. Post-processing of the noisy updates: no privacy cost.
        dropout: BERT dropout rate. Off by default: the DP noise already
            regularizes.
        eval_every: logical steps between held-out evaluations (and epochs).
        checkpoint_every: logical steps between checkpoints (0, the
            default: no step-count interval; `checkpoint_minutes` applies).
        checkpoint_minutes: minutes of training between checkpoints
            (default 10; 0: none by time). Whatever the two intervals, a run
            also checkpoints after the first logical step of every start (a
            folder it cannot write fails then, not ten minutes later, and a
            kill from then on can be resumed) and at its end. One checkpoint
            of the default nano run (4 MiB) took 0.3 s on a loaded 2-core
            machine, 0.05 % of 10 minutes (benchmarks/
            checkpoint_cost.py).
        resume: continue the run in `output_dir` from its checkpoint, with
            the settings it was started with; only the `OPERATIONAL_FIELDS`
            of `tf_megadp.jobs.bert.run_files` may change (`tf-megadp
            pretrain --resume` takes the others from the checkpoint).
        stop_after_steps: end this invocation after this many logical steps
            (with a checkpoint), e.g. to fit a time slice; resume later.
        strategy, tpu: `tf_megadp.distribute.resolve_strategy` arguments.
        seed: seeds what may be public: model initialisation, the held-out
            split and its masks, and the canaries. Never the Poisson
            sampling, the training masks, dropout nor the DP noise: they
            come from secret OS entropy, fresh at every start and every
            resume, and are never written anywhere.
        cache_dir: where prepared corpora are kept for reuse.
        verbose: Keras `fit` verbosity; "auto": a progress bar when
            stdout is a terminal, else one line per evaluation (verbose 2).
        name: the run's name (a planned configuration's).
        num_examples: N the run was planned for; a corpus with another N
            is refused (the plan's epsilon would not be this run's).
        max_predictions: P, masked positions per sequence (default
            ceil(0.15 L)).
        beta_1, beta_2: AdamW's moment decay rates.
        hardware: a `Hardware` (replicas, HBM, peak FLOP/s): the run is
            planned (`make_plan`) before it trains, and a strategy with
            another replica count is refused.
        cpu_replicas: split the host CPU into this many logical devices and
            run `MirroredStrategy` over them (tests of multi-replica runs
            on machines without accelerators); needs strategy "mirrored".
        precision: "float32", "mixed_bfloat16" (the TPU dtype policy:
            compute in bfloat16, variables, per-example norms, accumulators,
            noise and the MLM logits in float32) or "mixed_float16" (the
            same in float16, for GPUs without bfloat16; the private step
            scales each example's loss by the fixed `loss_scale`).
        loss_scale: S, the fixed loss scale of a private mixed_float16 run
            (`DPOptimizer(loss_scale=S)`; docs/concepts.md, "Float16
            compute"); a power of two keeps the unscaling exact. The
            non-private baseline uses Keras's dynamic `LossScaleOptimizer`.
        init_from: continue pretraining from this model instead of random
            weights: the `model.keras` of a run of this job, or a local
            keras-hub preset directory (`tf_megadp.jobs.bert.initial_weights`).
            Its shape and vocabulary are the run's; a DP release composes
            the ledger its weights carry into this run's epsilon.
        init_data_disjoint: the user's statement that the training data of
            `init_from` share no example with `corpus`: its ledger is not
            composed (and a non-private init is accepted); recorded in the
            report.
        init_public: the user's statement that `init_from` was trained on
            public data only (a downloaded preset no file describes); the
            report says the user declared it. Refused for weights whose
            file carries a DP ledger.
        max_sequence_length: rows of the model's position table (None:
            `sequence_length`); set from `init_from`, whose table may be
            longer than the run's sequences.
        lora_rank: None (train every weight), or r: keras-hub's
            `backbone.enable_lora(r)` freezes the backbone and trains LoRA
            factors of rank r on each layer's query and value projections
            (and their biases); the MLM head trains.
        freeze_embeddings: keep the token, position and segment embedding
            tables (so the tied MLM decoder) as they start.
    """

    # This job's privacy: epsilon 5.36 (the seed paper's BERT-Large run).
    target_epsilon: float | None = 5.36
    corpus: Sequence[str] | None = None
    output_dir: str | None = None
    model: str = "nano"
    sequence_length: int = 64
    vocabulary_size: int = 512
    vocabulary: str | None = None
    vocabulary_from_training_corpus: bool = False
    document_separator: str = "blank-line"
    max_characters: int = 3_000_000
    public_sources: str | None = None
    heldout_fraction: float = 0.05
    privacy_unit: str | None = None
    examples_per_unit: int = 4
    canaries: int = 0
    micro_batch_size: int = 64
    batch_size: int = 256
    steps: int = 300
    schedule: Sequence[Sequence[int]] | None = None
    learning_rate: float | None = None
    warmup_steps: int = 25
    weight_decay: float = 0.01
    learning_rate_scaling: str = "none"
    reference_batch_size: int = 256
    ema_momentum: float | None = None
    dropout: float = 0.0
    eval_every: int = 25
    checkpoint_every: int = 0
    checkpoint_minutes: float = 10.0
    resume: bool = False
    stop_after_steps: int | None = None
    strategy: str = "default"
    tpu: str | None = None
    seed: int = 0
    cache_dir: str | None = None
    verbose: int | str = "auto"
    name: str | None = None
    num_examples: int | None = None
    max_predictions: int | None = None
    beta_1: float = 0.9
    beta_2: float = 0.999
    hardware: Any = None  # a tf_megadp plan Hardware: the run is then planned, and checked
    cpu_replicas: int | None = None
    precision: str = "float32"
    loss_scale: float = DEFAULT_LOSS_SCALE
    init_from: str | None = None
    init_data_disjoint: bool = False
    init_public: bool = False
    max_sequence_length: int | None = None
    lora_rank: int | None = None
    freeze_embeddings: bool = False

    def learning_rate_choice(self) -> tuple[float, str]:
        """The peak learning rate this run trains with, and where it comes from.

        Returns:
            `(rate, source)`: the rate that was set, source "given" (by
            --learning-rate or a run file's optimizer.learning_rate), or the
            default of the run's kind ("DP default", "non-private default").

        Example:
            >>> PretrainConfig(non_private=True, target_epsilon=None).learning_rate_choice()
            (0.002, 'non-private default')
        """
        if self.learning_rate is not None:
            return float(self.learning_rate), "given"
        if self.non_private:
            return NON_PRIVATE_LEARNING_RATE, "non-private default"
        return DP_LEARNING_RATE, "DP default"

    def validate(self) -> None:
        """Raises `PretrainError` naming the first bad field (and how to fix it).

        The checks run in this order, each group a method: the types of the
        numbers, the model and the sizes, every job's privacy settings
        (`PrivacySettings.check_privacy`), the training's ranges, the
        privacy unit, checkpointing, this job's privacy rules, the files,
        the initial weights and what trains, the hardware, and the data's
        numbers.
        """
        self._check_numbers()
        self._check_model_and_sizes()
        self.check_privacy()
        self._check_training_ranges()
        self._check_privacy_unit()
        self._check_checkpointing()
        self._check_job_privacy()
        self._check_files()
        self._check_initial_weights()
        self._check_hardware()
        self._check_data_numbers()

    def _check_numbers(self) -> None:
        for name in ("learning_rate", "weight_decay", "dropout", "heldout_fraction", "beta_1",
                     "beta_2", "ema_momentum", "checkpoint_minutes", "loss_scale"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise PretrainError(f"{name} must be a finite number, got {value!r}.")

    def _check_model_and_sizes(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise PretrainError(f"--model must be one of {', '.join(MODEL_PRESETS)}, got {self.model!r}.")
        positive = {
            "sequence_length": self.sequence_length,
            "vocabulary_size": self.vocabulary_size,
            "micro_batch_size": self.micro_batch_size,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "eval_every": self.eval_every,
            "reference_batch_size": self.reference_batch_size,
            "examples_per_unit": self.examples_per_unit,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PretrainError(f"{name} must be a positive integer, got {value!r}.")
        choices = {"document_separator": SEPARATORS,
                   "learning_rate_scaling": tuple(LEARNING_RATE_SCALINGS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise PretrainError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}.")

    def _check_training_ranges(self) -> None:
        if self.ema_momentum is not None and not 0 < self.ema_momentum < 1:
            raise PretrainError(
                f"ema_momentum must be in (0, 1) (or None for no averaging), got "
                f"{self.ema_momentum!r}.")
        if not 0 <= self.dropout < 1:
            raise PretrainError(f"dropout must be in [0, 1), got {self.dropout}.")
        if not 0 < self.heldout_fraction < 0.5:
            raise PretrainError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}.")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise PretrainError(f"stop_after_steps must be >= 1, got {self.stop_after_steps}.")
        if not isinstance(self.canaries, int) or self.canaries < 0:
            raise PretrainError(f"canaries must be a non-negative integer, got {self.canaries!r}.")

    def _check_privacy_unit(self) -> None:
        check_privacy_unit(self.privacy_unit, self.corpus)
        if self.privacy_unit is None:
            return
        if self.canaries:
            raise PretrainError(
                "--canaries with --privacy-unit is not supported: the audit inserts "
                "canaries as sequences, not as units. Audit a sequence-level run.")
        if self.hardware is not None:
            raise PretrainError(
                "A planned run (hardware) with --privacy-unit is not supported: the "
                "planner sizes micro-batches in sequences, not in units of "
                "examples_per_unit rows. Drop the hardware section.")

    def _check_checkpointing(self) -> None:
        if self.checkpoint_every < 0:
            raise PretrainError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}.")
        if self.checkpoint_minutes < 0:
            raise PretrainError(
                f"checkpoint_minutes must be >= 0, got {self.checkpoint_minutes}.")

    def _check_job_privacy(self) -> None:
        """This job's rules on top of every job's `check_privacy`."""
        if self.non_private and self.schedule and len(self.schedule) > 1:
            raise PretrainError(
                "The non-private baseline uses one batch size; pass --batch-size "
                "and --steps instead of a multi-phase schedule."
            )
        if self.noise is None:
            return
        if self.privacy_unit is not None:
            raise PretrainError(
                f"--noise {self.noise} with --privacy-unit is not supported: the job "
                "samples units by Poisson sampling only. Drop --noise (independent noise) "
                "for a user-level run.")
        fixed_order = self.bands != "auto" and (
            self.noise_accounting().get("sampling") == "fixed_order")
        if fixed_order and self.schedule and len(self.schedule) > 1:
            raise PretrainError(
                f"--noise {self.noise} samples in one fixed order, one batch size for the run "
                "(each example keeps its slot every epoch): pass --batch-size and --steps, or "
                "for a growing batch a --noise accounted with cyclic Poisson sampling.")

    def _check_files(self) -> None:
        if self.resume and not self.output_dir:
            raise PretrainError("--resume needs --output-dir of the run to continue.")
        if self.vocabulary and self.vocabulary_from_training_corpus:
            raise PretrainError(
                "Pass --vocabulary FILE (a public vocabulary) or "
                "--vocabulary-from-training-corpus, not both."
            )
        if self.vocabulary_from_training_corpus and not self.corpus:
            raise PretrainError(
                "--vocabulary-from-training-corpus needs --corpus: without it the run "
                "trains on the public default corpus, whose vocabulary is public anyway."
            )
        if self.vocabulary and not os.path.isfile(self.vocabulary):
            raise PretrainError(f"--vocabulary {self.vocabulary}: no such file.")
        if self.public_sources is not None:
            from tf_megadp.jobs.bert.public_text import parse_public_sources

            try:
                parse_public_sources(self.public_sources)
            except ValueError as error:
                raise PretrainError(f"--public-sources: {error}") from None

    def _check_initial_weights(self) -> None:
        check_lora_rank(self.lora_rank)
        if self.max_sequence_length is not None and (
                isinstance(self.max_sequence_length, bool)
                or not isinstance(self.max_sequence_length, int)
                or self.max_sequence_length < self.sequence_length):
            raise PretrainError(
                f"max_sequence_length must be an integer >= sequence_length="
                f"{self.sequence_length}, got {self.max_sequence_length!r}.")
        if self.init_data_disjoint and not self.init_from:
            raise PretrainError(
                "--init-data-disjoint states that the data of --init-from are disjoint from "
                "this corpus: pass --init-from PATH, or drop it.")
        if self.init_public and not self.init_from:
            raise PretrainError(
                "--init-public states that --init-from was trained on public data only: "
                "pass --init-from PATH, or drop it.")
        if self.init_public and self.init_data_disjoint:
            raise PretrainError(
                "--init-public and --init-data-disjoint are two statements of where "
                "--init-from comes from: give the one that holds.")
        if self.init_from and not self.resume and not os.path.exists(self.init_from):
            raise PretrainError(f"--init-from {self.init_from}: no such file or directory.")

    def _check_hardware(self) -> None:
        if self.precision not in PRECISIONS:
            raise PretrainError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}.")
        if not self.loss_scale > 0:
            raise PretrainError(f"loss_scale must be > 0, got {self.loss_scale!r}.")
        if self.loss_scale != DEFAULT_LOSS_SCALE and (
                self.precision != "mixed_float16" or self.non_private):
            raise PretrainError(
                f"--loss-scale {self.loss_scale:g} is the fixed loss scale of a private "
                "mixed_float16 run; this run (precision "
                f"{self.precision}{', non-private' if self.non_private else ''}) would not "
                "use it: pass --precision mixed_float16 without --non-private, or drop "
                "--loss-scale.")
        if self.cpu_replicas is not None:
            if isinstance(self.cpu_replicas, bool) or not isinstance(self.cpu_replicas, int) \
                    or self.cpu_replicas < 1:
                raise PretrainError(
                    f"cpu_replicas must be a positive integer, got {self.cpu_replicas!r}.")
            if self.strategy != "mirrored":
                raise PretrainError(
                    "--cpu-replicas splits the CPU into replicas of a MirroredStrategy: "
                    f"pass --strategy mirrored (not {self.strategy!r}).")

    def _check_data_numbers(self) -> None:
        if self.num_examples is not None and (
                isinstance(self.num_examples, bool) or not isinstance(self.num_examples, int)
                or self.num_examples < 2):
            raise PretrainError(f"num_examples must be an integer >= 2, got {self.num_examples!r}.")
        if self.max_predictions is not None and not 1 <= self.max_predictions <= self.sequence_length:
            raise PretrainError(
                f"max_predictions must be in [1, sequence_length={self.sequence_length}], "
                f"got {self.max_predictions!r}.")

    def phases(self) -> list[tuple[int, ...]]:
        """(steps, batch_size) or (steps, batch_size, accumulation_steps) per phase."""
        if self.schedule:
            phases = [tuple(int(v) for v in phase) for phase in self.schedule]
            if (any(len(p) not in (2, 3) or min(p) < 1 for p in phases)
                    or len({len(p) for p in phases}) != 1):
                raise PretrainError(
                    "schedule phases must all be (steps, batch_size) or all be (steps, "
                    "batch_size, accumulation_steps), each >= 1.")
            return phases
        return [(self.steps, self.batch_size)]

    def make_schedule(self, num_examples: int, num_replicas: int):
        """The run's `BatchSizeSchedule` for N examples on R replicas.

        Phases that state accumulation_steps keep them (the planned static
        capacity); otherwise each phase's k is the smallest whose capacity
        truncates a Poisson step with probability at most
        `max_truncation_probability`.
        """
        from tf_megadp.steps import BatchSizeSchedule, Phase

        phases = self.phases()
        try:
            if len(phases[0]) == 3:
                return BatchSizeSchedule(
                    [Phase(steps, batch, k) for steps, batch, k in phases],
                    num_examples=num_examples, micro_batch_size=self.micro_batch_size,
                    num_replicas=num_replicas)
            return BatchSizeSchedule.for_poisson(
                phases, num_examples=num_examples, micro_batch_size=self.micro_batch_size,
                num_replicas=num_replicas, truncation_probability=self.max_truncation_probability)
        except ValueError as error:
            raise PretrainError(str(error)) from None

    def architecture(self) -> tuple[int, int, int, int]:
        """(layers, hidden, heads, intermediate) of the model preset."""
        return MODEL_PRESETS[self.model]


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """'100x256,200x1024' -> [(100, 256), (200, 1024)] (steps x batch size)."""
    phases = []
    for part in text.split(","):
        try:
            steps, batch = part.lower().split("x")
            phases.append((int(steps), int(batch)))
        except ValueError:
            raise PretrainError(
                f"Cannot read schedule phase {part!r}: write STEPSxBATCH, e.g. 100x256,200x1024."
            ) from None
    return phases




