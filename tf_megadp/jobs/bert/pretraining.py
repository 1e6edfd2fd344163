"""The main job: DP masked-LM pretraining of a keras-hub BERT, end to end.

`run_pretraining(PretrainConfig(...))` prepares (or reuses) the token shards
of a corpus, splits off a held-out set, plans the logical steps with one
`BatchSizeSchedule`, calibrates sigma for a target epsilon, trains a
`keras_hub.models.BertMaskedLM` from scratch with `DPOptimizer` on honest
Poisson batches, and writes everything into one output directory:
checkpoints, TensorBoard logs, `history.csv`, `report.json` and `report.png`.
`tf-megadp pretrain` and `examples/pretrain_bert_mlm.py` are thin wrappers.

The run's settings are one `PretrainConfig` (`tf_megadp.jobs.bert.config`,
re-exported here); a planned one (with `hardware`) is planned again with the
measured N and vocabulary size before it trains. On R replicas of one host
the sampler's m * R-row micro-steps go to `fit` unchanged and Keras splits
them. Under several workers (`MultiWorkerMirroredStrategy`), where Keras
3.15's `fit` cannot run, the same private step trains in a custom loop
(`tf_megadp.PrivateStep`) that drives the same callbacks, and only the
chief writes the run's files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from typing import Any

import numpy as np

from tf_megadp.files import atomic_write, write_json_atomically
from tf_megadp.jobs.bert.config import (  # noqa: F401 (the job's names, for the audit job)
    MODEL_PRESETS,
    PRECISIONS,
    PretrainConfig,
    PretrainError,
    default_delta,
    load_run_config,
    run_config_from_dict,
)

__all__ = ["MODEL_PRESETS", "PRECISIONS", "PretrainConfig", "PretrainError", "build_model",
           "canary_split", "load_run_config", "prepare_data", "run_config_from_dict",
           "run_pretraining"]

CHECKPOINT_NAME = "checkpoint"
CANARIES_NAME = "canaries.json"
AUDIT_NAME = "audit.json"
# Secret-sharer canaries "the key of W1 W2 is D D D" (a random name W1 W2 per
# canary): 1000 candidate secrets each, ranked exactly.
CANARY_CONTEXT = ("the key of", "is")
CANARY_SECRET_LENGTH = 3
CANARY_ALPHABET = tuple("0123456789")
CANARY_REPETITIONS = (1, 4, 16)
MODEL_NAME = "model.keras"
VOCABULARY_NAME = "vocab.txt"
REPORT_NAME = "report.json"
PRIVACY_REPORT_NAME = "privacy.json"
TRAINING_CORPUS_VOCABULARY = "training corpus (NOT private)"
_TRAINING_CORPUS_VOCABULARY_WARNING = (
    "--vocabulary-from-training-corpus: the WordPiece vocabulary is learned from "
    "your corpus and published with the model (vocab.txt). It is NOT covered by "
    "epsilon: frequent enough words of the private text, names and identifiers "
    "included, appear in it verbatim. report.json marks the vocabulary "
    f"'{TRAINING_CORPUS_VOCABULARY}'. Drop the flag for a vocabulary learned from the "
    "public default corpus, or pass --vocabulary FILE with a public vocabulary."
)
# What report.json publishes beside the model that epsilon does not cover.
RELEASED_OUTSIDE_EPSILON = (
    "training loss and masked-LM accuracy on training batches (history.csv, "
    "tensorboard/, report.json history): exact statistics of the sampled batches",
    "held-out MLM accuracy: computed on the held-out split, which is not trained "
    "on and not protected by DP (publish it only if that text may be published)",
    "unigram baseline accuracy: the most frequent token of the training split, "
    "counted exactly",
    "num_examples and heldout_examples: the exact numbers of sequences",
    "wall_time_s, train_time_s, examples_per_s: timings",
    "truncated_steps: how many Poisson steps overflowed their capacity",
    "the vocabulary (vocab.txt), when vocabulary.public is false",
)
PLOT_NAME = "report.png"
HISTORY_NAME = "history.csv"


def _default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tf_megadp", "corpora")


def _default_corpus_sources() -> list:
    """What the default corpus (docstrings of installed packages) depends on."""
    import importlib.metadata
    import platform

    return [("python", platform.python_version())] + [
        (name, importlib.metadata.version(name)) for name in ("tensorflow", "keras", "numpy")]


def _vocabulary_plan(config: PretrainConfig) -> dict[str, Any]:
    """Where the run's vocabulary comes from, as JSON (part of the corpus cache key).

    Only the vocabulary learned from a user corpus depends on private text;
    the default is the public offline default corpus.
    """
    if config.vocabulary:
        from tf_megadp.files import sha256_of_file

        path = os.path.abspath(config.vocabulary)
        return {"kind": "file", "path": path, "sha256": sha256_of_file(path)}
    if config.corpus and config.vocabulary_from_training_corpus:
        return {"kind": "training corpus"}
    return {"kind": "default corpus", "max_characters": config.max_characters,
            "sources": _default_corpus_sources(), "size": config.vocabulary_size}


def vocabulary_report(config: PretrainConfig) -> dict[str, Any]:
    """The report's account of where the published vocabulary came from.

    Args:
        config: the run's settings.

    Returns:
        {"source": ..., "public": bool, "file": "vocab.txt"}; "public" is
        False only for a vocabulary learned from a user corpus, which
        epsilon does not cover.

    Example:
    ```python
    vocabulary_report(PretrainConfig())["source"]
    # 'public: the offline default corpus (docstrings of installed packages)'
    ```
    """
    plan = _vocabulary_plan(config)
    if plan["kind"] == "file":
        source, public = f"public: the file {config.vocabulary} (named public by the user)", True
    elif plan["kind"] == "training corpus":
        source, public = TRAINING_CORPUS_VOCABULARY, False
    else:
        source = "public: the offline default corpus (docstrings of installed packages)"
        public = True
    return {"source": source, "public": public, "file": VOCABULARY_NAME}


def _corpus_key(config: PretrainConfig) -> str:
    """Identifies a prepared corpus: its sources (with sizes and times) and settings."""
    import hashlib

    if config.corpus:
        from tf_megadp.jobs.bert import text

        try:
            files = text._expand_sources(config.corpus)
        except text.CorpusError as error:
            raise PretrainError(str(error)) from None
        sources = [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files]
    else:
        sources = _default_corpus_sources()
    key = json.dumps({
        "sources": sources, "L": config.sequence_length, "V": config.vocabulary_size,
        "chars": None if config.corpus else config.max_characters,
        "heldout": config.heldout_fraction, "seed": config.seed,
        "vocabulary": _vocabulary_plan(config),
        # Only files have separators; the default corpus's key stays as it was.
        **({"separator": config.document_separator} if config.corpus else {}),
    }, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _public_vocabulary(config: PretrainConfig, log=None):
    """The vocabulary to tokenize with: a token list, or None to learn it on the corpus.

    A vocabulary learned from the default corpus is cached by what it
    depends on (installed packages, size, character cap), so runs on any
    corpus reuse it.
    """
    import hashlib

    from tf_megadp.jobs.bert import text
    from tf_megadp.files import write_bytes_atomically

    plan = _vocabulary_plan(config)
    if plan["kind"] == "training corpus":
        return None
    try:
        if plan["kind"] == "file":
            return text.read_vocabulary_file(config.vocabulary)
        key = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
        path = os.path.join(config.cache_dir or _default_cache_dir(), f"vocabulary-{key}",
                            VOCABULARY_NAME)
        if not os.path.isfile(path):
            if log:
                log("  learning the public vocabulary from the offline default corpus...")
            vocabulary = text.learn_vocabulary(
                text.default_corpus_documents(config.max_characters), config.vocabulary_size,
                progress=log)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_bytes_atomically(path, "".join(t + "\n" for t in vocabulary).encode("utf-8"))
        return text.read_vocabulary_file(path)
    except text.CorpusError as error:
        raise PretrainError(str(error)) from None


def prepare_data(config: PretrainConfig, log=None):
    """Tokenizes `config.corpus` once into the cache and splits it; reused across runs.

    The cache folder is keyed by everything that changes the tokens (corpus,
    sequence length, vocabulary size, seed, held-out fraction), so a run and
    its later audit find the same split.

    Args:
        config: the run's settings.
        log: called with progress lines (files read, words counted,
            documents tokenized, sequences written), e.g. `print`; None is
            silent.

    The vocabulary is public by default: learned from the offline default
    corpus (also for a user corpus), or the file `config.vocabulary`. Only
    `config.vocabulary_from_training_corpus` learns it from the user's
    corpus (see `vocabulary_report`).

    Returns:
        (all, train, heldout): `TokenShards` of the whole corpus and of its
        two disjoint splits.

    Raises:
        PretrainError: the corpus cannot be read or is too small.

    Example:
    ```python
    corpus, train, heldout = prepare_data(PretrainConfig(corpus=["notes.txt"]))
    len(train), train.vocabulary_size
    ```
    """
    from tf_megadp import data
    from tf_megadp.jobs.bert import text

    folder = os.path.join(config.cache_dir or _default_cache_dir(), _corpus_key(config))
    try:
        return tuple(data.TokenShards(os.path.join(folder, name))
                     for name in ("all", "train", "heldout"))
    except (FileNotFoundError, ValueError):
        pass  # Not prepared yet (or damaged): build it.
    vocabulary = _public_vocabulary(config, log)
    try:
        corpus = text.prepare_corpus(
            os.path.join(folder, "all"),
            config.corpus,
            sequence_length=config.sequence_length,
            vocabulary_size=config.vocabulary_size,
            max_characters=config.max_characters,
            # Short leftovers (stream ends) waste a row; keep rows at least half full.
            min_tokens=max(1, min(16, config.sequence_length // 2)),
            vocabulary=vocabulary,
            separator=config.document_separator,
            progress=log,
        )
    except text.CorpusError as error:
        raise PretrainError(str(error)) from None
    total = len(corpus)
    heldout = max(1, int(round(total * config.heldout_fraction)))
    if total - heldout < 2:
        raise PretrainError(f"The corpus has only {total} sequences; it needs at least 3.")
    split_checksum = f"{corpus.manifest['checksum']}-heldout{heldout}-seed{config.seed}"
    splits = {}
    order = np.random.default_rng(config.seed).permutation(total)
    # The held-out split is written last: its manifest marks the whole folder complete.
    for name, indices in (("train", np.sort(order[heldout:])), ("heldout", np.sort(order[:heldout]))):
        directory = os.path.join(folder, name)
        rows = (corpus.read(indices[i:i + 65536]) for i in range(0, len(indices), 65536))
        data.write_token_shards(
            directory, rows, sequence_length=corpus.sequence_length,
            vocabulary_size=corpus.vocabulary_size, checksum=split_checksum,
            metadata={"vocabulary_file": os.path.join(folder, "all", "vocab.txt")},
        )
        splits[name] = data.TokenShards(directory)
    return corpus, splits["train"], splits["heldout"]


def canary_split(config: PretrainConfig, train):
    """The training split with `config.canaries` canaries per repetition count inserted.

    Returns:
        (shards, canaries, canary_index): canary_index gives, for each row,
        the index of the canary it holds or -1.
    """
    from tf_megadp import data
    from tf_megadp.jobs.bert import text
    from tf_megadp.audit import canaries as canary_lib

    folder = os.path.join(os.path.dirname(train.directory), f"train-canaries{config.canaries}")
    try:
        shards = data.TokenShards(folder)
        return (shards, canary_lib.load_canaries(os.path.join(folder, CANARIES_NAME)),
                np.load(os.path.join(folder, "canary_index.npy")))
    except (FileNotFoundError, ValueError):
        pass  # Not prepared yet (or damaged): build it.
    canaries = _make_canaries(text.load_vocabulary(train), config.canaries, config.seed)
    rows, canary_index = canary_lib.insert_canaries(
        train.read(np.arange(len(train))), canaries, seed=config.seed)
    # Shard files and the canary list first: the manifest, written last, marks the folder complete.
    os.makedirs(folder, exist_ok=True)
    canary_lib.save_canaries(os.path.join(folder, CANARIES_NAME), canaries)
    atomic_write(os.path.join(folder, "canary_index.npy"),
                 lambda temporary: np.save(temporary, canary_index))
    data.write_token_shards(
        folder, [rows], sequence_length=train.sequence_length,
        vocabulary_size=train.vocabulary_size,
        checksum=f"{train.manifest['checksum']}-canaries{config.canaries}-seed{config.seed}",
        metadata={"vocabulary_file": train.manifest["vocabulary_file"]})
    return data.TokenShards(folder), canaries, canary_index


def _make_canaries(vocabulary: list[str], per_repetition: int, seed: int) -> list:
    """Canaries "[CLS] the key of W1 W2 is D D D [SEP]", tokenized like the corpus.

    Each canary has its own random name W1 W2 (two whole-word tokens of the
    vocabulary), so its secret is tied to a context only it has, as in the
    secret sharer; with one shared context a model could at most learn the
    digits' overall frequencies there.
    """
    import keras_hub

    from tf_megadp.audit.canaries import Canary, CanaryFormat

    ids = {token: index for index, token in enumerate(vocabulary)}
    missing = [digit for digit in CANARY_ALPHABET if digit not in ids]
    if missing:
        raise PretrainError(
            f"Cannot make canaries: the vocabulary lacks the digit tokens {missing}; "
            "use a corpus with digits or pass --canaries 0."
        )
    names = [index for token, index in ids.items() if token.isalpha() and len(token) >= 3]
    plan = [r for r in CANARY_REPETITIONS for _ in range(per_repetition)] + [0] * per_repetition
    if len(names) ** 2 < 2 * len(plan):
        raise PretrainError(
            f"Cannot make {len(plan)} canaries: the vocabulary has only {len(names)} whole "
            "words to name them; lower --canaries."
        )
    tokenizer = keras_hub.tokenizers.WordPieceTokenizer(vocabulary=vocabulary, lowercase=True,
                                                        oov_token="[UNK]")
    prefix, infix = (
        [int(t) for t in np.asarray(tokenizer.tokenize(text))] for text in CANARY_CONTEXT)
    alphabet = [ids[digit] for digit in CANARY_ALPHABET]
    rng = np.random.default_rng(seed)
    canaries, used = [], set()
    for repetitions in plan:
        name = tuple(int(t) for t in rng.choice(names, size=2))
        while name in used:
            name = tuple(int(t) for t in rng.choice(names, size=2))
        used.add(name)
        template = [ids["[CLS]"], *prefix, *name, *infix,
                    *([None] * CANARY_SECRET_LENGTH), ids["[SEP]"]]
        canary_format = CanaryFormat(template, alphabet)
        secret = tuple(int(t) for t in canary_format.sample_secrets(rng, 1)[0])
        canaries.append(Canary(canary_format, secret, repetitions))
    return canaries


def _plan_privacy(config: PretrainConfig, schedule) -> tuple[float, float, float]:
    """(sigma, delta, epsilon of the full schedule)."""
    from tf_megadp import accounting

    n = schedule.num_examples
    delta = config.delta if config.delta is not None else default_delta(n)
    if config.non_private:
        return 0.0, delta, math.inf
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        try:
            sigma = accounting.calibrate_noise_multiplier(
                config.target_epsilon, delta, schedule=schedule, accountant=config.accountant)
        except (ValueError, RuntimeError) as error:
            raise PretrainError(
                f"target epsilon {config.target_epsilon} is unreachable for this schedule "
                f"({schedule.total_steps} steps over N={n}): {error}. Use fewer steps, a "
                "smaller batch or a larger epsilon."
            ) from None
    epsilon = accounting.compute_epsilon(delta=delta, schedule=schedule, noise_multiplier=sigma,
                                         accountant=config.accountant)
    if config.target_epsilon is not None and epsilon > config.target_epsilon * 1.0001:
        raise PretrainError(
            f"noise multiplier {sigma:g} spends epsilon {epsilon:.3f} over the "
            f"{schedule.total_steps} steps, more than target epsilon {config.target_epsilon}; "
            "raise --noise-multiplier or drop it to calibrate."
        )
    return sigma, delta, epsilon


def build_model(config: PretrainConfig, vocabulary_size: int):
    """The job's `keras_hub.models.BertMaskedLM` for `config` (preset, L, dropout, precision).

    Under `precision="mixed_bfloat16"` the encoder computes in bfloat16 and
    the MLM head in float32. keras-hub 0.32's `MaskedLMHead` does not
    autocast its variables (`autocast=False`, as it reads the shared token
    embedding) and adds its float32 output bias to logits cast to the
    compute dtype: in bfloat16 that addition raises. With a float32 head the
    tied embedding still runs the vocabulary projection in bfloat16 (its
    own layer autocasts), the logits are cast to float32 before the bias,
    and the softmax over V classes is float32, as TPU recipes keep it.
    Variables stay float32 either way; tf_megadp keeps per-example norms,
    accumulators and noise in float32.

    Args:
        config: the run's settings.
        vocabulary_size: V of the prepared vocabulary.
    """
    import keras_hub

    layers, hidden, heads, intermediate = config.architecture()
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary_size,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        max_sequence_length=config.sequence_length,
        dropout=config.dropout,
        # float32 is Keras's default: only a mixed policy is passed on.
        dtype=None if config.precision == "float32" else config.precision,
    )
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    if config.precision != "float32":
        # The head's own call (gather, dense, norm, projection, bias) follows
        # its policy; its sub-layers keep the backbone's bfloat16 policy.
        model.masked_lm_head.dtype_policy = "float32"
    return model


def _inner_optimizer(config: PretrainConfig, schedule, accumulation_steps: int | None):
    """AdamW with linear warmup and cosine decay over the logical steps.

    The learning rate of each phase is scaled with its batch as
    `config.learning_rate_scaling` says (`BatchScaledSchedule`), and the
    weights are averaged when `config.ema_momentum` is set.

    `accumulation_steps` is for the non-private baseline, which accumulates
    with Keras's own `gradient_accumulation_steps`; Keras then advances the
    learning-rate schedule every micro-batch, so its horizon is scaled to match.
    """
    import keras

    from tf_megadp.jobs.bert.config import LEARNING_RATE_SCALINGS
    from tf_megadp.learning_rate import BatchScaledSchedule

    total_steps = schedule.total_steps
    scale = accumulation_steps or 1
    warmup = min(config.warmup_steps, max(total_steps - 1, 0)) * scale
    learning_rate = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else config.learning_rate,
        decay_steps=max(total_steps * scale - warmup, 1),
        alpha=0.1,
        warmup_target=config.learning_rate if warmup else None,
        warmup_steps=warmup,
    )
    power = LEARNING_RATE_SCALINGS[config.learning_rate_scaling]
    if power:
        learning_rate = BatchScaledSchedule.for_batch_schedule(
            learning_rate, schedule, reference_batch_size=config.reference_batch_size,
            power=power, steps_per_logical_step=scale)
    ema = {} if config.ema_momentum is None else {"use_ema": True,
                                                  "ema_momentum": config.ema_momentum}
    return keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=config.weight_decay,
                                  beta_1=config.beta_1, beta_2=config.beta_2,
                                  gradient_accumulation_steps=accumulation_steps, **ema)


# The second word of a fixed evaluation set's masking key (public, from
# --seed): evaluation sets are not trained on, so their masks may be public.
_FIXED_SET_KEY = -1


def masked_rows(rows: np.ndarray, batcher, seed: int):
    """(x, y, sample_weight) as NumPy arrays: `rows` masked once, a function of `seed` alone.

    For fixed evaluation sets (held-out split, audit), outside the DP step:
    the key [seed, -1] is public.

    Args:
        rows: int [n, L] token rows.
        batcher: the `MaskedLMBatcher` whose masking to apply.
        seed: the public masking seed of this set.

    Returns:
        `(x, y, sample_weight)` of the n rows.
    """
    import tensorflow as tf

    x, y, w = batcher(
        tf.constant(rows.astype(np.int32)), tf.ones([len(rows)], tf.float32),
        key=tf.constant([seed, _FIXED_SET_KEY], tf.int64))
    return {k: v.numpy() for k, v in x.items()}, y.numpy(), w.numpy()


def _heldout_batches(heldout, batcher, micro_batch_size: int, seed: int):
    """Fixed masked batches of the held-out set, identical at every evaluation."""
    rows = heldout.read(np.arange(len(heldout)))
    size = len(rows) - len(rows) % micro_batch_size or len(rows)
    return masked_rows(rows[:size], batcher, seed)


def _unigram_accuracy(train, heldout_y, heldout_w, vocabulary_size: int) -> float:
    """Accuracy of always predicting the most frequent training token (id > 4)."""
    counts = np.zeros(vocabulary_size, np.int64)
    for start in range(0, len(train), 65536):
        rows = train.read(np.arange(start, min(start + 65536, len(train))))
        counts += np.bincount(rows.ravel(), minlength=vocabulary_size)
    counts[:5] = 0  # [PAD], [UNK], [CLS], [SEP], [MASK] are never targets.
    best = int(np.argmax(counts))
    return float(np.sum((heldout_y == best) * heldout_w) / np.sum(heldout_w))


def _divisor_at_most(total: int, wanted: int) -> int:
    for count in range(min(wanted, total), 0, -1):
        if total % count == 0:
            return count
    return 1


def _plot(history: list[dict[str, Any]], path: str, private: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    figure, accuracy_axis = plt.subplots(figsize=(7, 4))
    accuracy_axis.plot(steps, [h["heldout_mlm_accuracy"] for h in history], "o-", color="tab:blue")
    accuracy_axis.set_xlabel("logical step")
    accuracy_axis.set_ylabel("held-out MLM accuracy", color="tab:blue")
    if private:
        epsilon_axis = accuracy_axis.twinx()
        epsilon_axis.plot(steps, [h["epsilon"] for h in history], "s--", color="tab:red")
        epsilon_axis.set_ylabel("epsilon", color="tab:red")
    figure.tight_layout()
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=100))
    plt.close(figure)


@dataclasses.dataclass(frozen=True)
class _TestingSeeds:
    """Test-only reproducibility: never reachable from a flag or a config file.

    Comparing two runs (R replicas against one device) needs the same
    Poisson draws, masks, dropout and noise, which the job otherwise draws
    from fresh OS entropy: the sampling seed also fixes the masks' keys
    (the sampler's), the noise seed the dropout key (the optimizer's). Both
    library seeds warn and mark the run (its privacy report says the
    sampling and the noise are seeded: not for release); the values are
    written nowhere.
    """

    sampling_seed: int
    noise_seed: int
    noise_multiplier: float | None = None


def run_pretraining(config: PretrainConfig, *, log=print,
                    testing: _TestingSeeds | None = None) -> dict[str, Any]:
    """Runs (or resumes) one pretraining job and returns its report.

    Everything that can be checked before training is checked first, so bad
    input raises `PretrainError` before the output directory is created. A
    config with `hardware` is planned first (`tf_megadp.jobs.bert.plan.make_plan`,
    with the measured N and vocabulary size): an infeasible plan, or a
    strategy with another replica count, stops the run before it trains.

    Args:
        config: the run.
        log: where progress lines go.
        testing: tests only (`_TestingSeeds`); never set it for a real run.
    """
    config.validate()
    phases = config.phases()
    started = time.time()
    if config.vocabulary_from_training_corpus:
        warnings.warn(_TRAINING_CORPUS_VOCABULARY_WARNING, UserWarning, stacklevel=2)

    from tf_megadp import distribute

    output_dir = config.output_dir or os.path.join(
        "runs", time.strftime("pretrain-%Y%m%d-%H%M%S"))
    from tf_megadp.checkpointing import has_training_state

    # A checkpoint counts once committed: a run killed before its first one
    # (or while writing it) starts again.
    has_checkpoint = has_training_state(os.path.join(output_dir, CHECKPOINT_NAME))
    if config.resume and not has_checkpoint:
        raise PretrainError(f"--resume: no {CHECKPOINT_NAME} in {output_dir}.")
    if not config.resume and has_checkpoint:
        raise PretrainError(
            f"{output_dir} already holds a run; pass --resume to continue it or choose "
            "another --output-dir."
        )

    if config.cpu_replicas:
        distribute.configure_cpu_replicas(config.cpu_replicas)
        strategy = distribute.resolve_strategy(
            "mirrored", devices=[f"/cpu:{index}" for index in range(config.cpu_replicas)])
    else:
        strategy = distribute.resolve_strategy(config.strategy, tpu=config.tpu)
    several_workers = distribute._worker_count(strategy) > 1
    if several_workers and config.non_private:
        raise PretrainError(
            "The non-private baseline trains with Keras's fit, which cannot run under "
            "MultiWorkerMirroredStrategy with several workers (docs/tpu.md): run it on "
            "one host (strategies default, mirrored, tpu)."
        )
    chief = distribute.is_chief(strategy)
    replicas = strategy.num_replicas_in_sync
    log(f"Preparing the corpus ({'default offline corpus' if not config.corpus else 'user corpus'}; "
        f"vocabulary from {vocabulary_report(config)['source']})...")
    if not chief:
        # The chief prepares the cache first: workers sharing its folder
        # then only read it (without a shared folder each prepares its own).
        distribute.barrier(strategy)
    corpus, train, heldout = prepare_data(config, log)
    log(f"Corpus: N = {len(train):,} training sequences of {train.sequence_length} tokens "
        f"(the privacy unit), {len(heldout):,} held out.")
    canaries = None
    if config.canaries:
        train, canaries, _ = canary_split(config, train)
    if chief:
        distribute.barrier(strategy)
    if max(phase[1] for phase in phases) > len(train):
        raise PretrainError(
            f"The logical batch ({max(phase[1] for phase in phases)}) is larger than the "
            f"training corpus ({len(train)} sequences); lower --batch-size."
        )
    if config.num_examples is not None and config.num_examples != len(train):
        raise PretrainError(
            f"The run is planned for num_examples N={config.num_examples}, but the training "
            f"split holds {len(train)} sequences: its sampling rates and epsilon would not "
            f"be this run's. Set training.num_examples (--num-examples) to {len(train)} and "
            "plan again.")
    if config.hardware is not None:
        _check_planned_hardware(config, replicas, train.vocabulary_size)
    schedule = config.make_schedule(len(train), replicas)
    sigma, delta, planned_epsilon = _plan_privacy(config, schedule)
    if testing is not None and testing.noise_multiplier is not None:
        sigma = testing.noise_multiplier

    # Only the chief writes the run's files (the other workers of a
    # multi-worker run write nothing there).
    created = chief and not os.path.exists(output_dir)
    if chief:
        os.makedirs(output_dir, exist_ok=True)
    try:
        if canaries is not None and chief:
            from tf_megadp.audit.canaries import save_canaries

            save_canaries(os.path.join(output_dir, CANARIES_NAME), canaries)
        return _train(config, schedule, sigma, delta, planned_epsilon, corpus, train, heldout,
                      strategy, output_dir, started, log, testing)
    except BaseException:
        if created and not has_training_state(os.path.join(output_dir, CHECKPOINT_NAME)):
            shutil.rmtree(output_dir, ignore_errors=True)
        raise


class _Checkpointer:
    """Saves model and optimizer (so the privacy ledger) atomically at logical-step ends.

    Only the chief of several workers saves (`enabled`); the others' state
    is the same.
    """

    def __init__(self, output_dir: str, history: list, config: PretrainConfig, resumes: list,
                 enabled: bool = True):
        self.directory = os.path.join(output_dir, CHECKPOINT_NAME)
        self.history = history
        self.config = config
        self.resumes = resumes
        self.enabled = enabled

    def save(self, model) -> None:
        from tf_megadp.checkpointing import save_training_state

        if not self.enabled:
            return

        save_training_state(model, self.directory, extra={
            "logical_steps": int(model.optimizer.iterations.numpy()),
            "history": self.history,
            "resumes": self.resumes,
            "config": _config_dict(self.config),
        })


def _compile_kwargs(private: bool):
    import keras

    return {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": [keras.metrics.SparseCategoricalAccuracy(name="mlm_accuracy")],
        # Keras leaves XLA off on CPU-only machines; the DP step compiles its
        # per-example pass with XLA, so the baseline must too to compare fairly.
        "jit_compile": not private,
    }


def _check_planned_hardware(config: PretrainConfig, replicas: int, vocabulary_size: int) -> None:
    """A planned run trains on the hardware and model its plan was made for."""
    from tf_megadp.jobs.bert import plan

    if replicas != config.hardware.replicas:
        raise PretrainError(
            f"The run is planned for {config.hardware.replicas} replicas "
            f"({config.hardware.name}), but the strategy has {replicas}: its static "
            "capacities and per-core memory would not be the plan's. Run it on that "
            "slice, or set hardware.replicas and plan again.")
    # A learned vocabulary may come out a little smaller than asked; the
    # plan is redone below with the measured size. A larger one is not
    # the model that was planned.
    if vocabulary_size > config.vocabulary_size:
        raise PretrainError(
            f"The run is planned for vocabulary_size {config.vocabulary_size}, but its "
            f"vocabulary has {vocabulary_size} tokens; set model.vocabulary_size to "
            f"{vocabulary_size} and plan again.")
    # Raises InfeasiblePlanError naming the number, exactly as `tf-megadp plan` does.
    plan.make_plan(config, vocabulary_size=vocabulary_size)


def _train(config, schedule, sigma, delta, planned_epsilon, corpus, train, heldout,
           strategy, output_dir, started, log, testing=None):
    import keras

    import tf_megadp
    from tf_megadp import data, distribute
    from tf_megadp.jobs.bert import text
    from tf_megadp.checkpointing import export_model

    # Public randomness only (initialisation, the held-out masks): the
    # sampling, the training masks (keyed by the sampler's secret and each
    # example's content), dropout (keyed by the private step's secret) and
    # the noise draw secret OS entropy, which this seed never reaches.
    keras.utils.set_random_seed(config.seed)
    batcher = text.MaskedLMBatcher.from_shards(train, max_predictions=config.max_predictions)
    heldout_x, heldout_y, heldout_w = _heldout_batches(heldout, batcher, config.micro_batch_size, config.seed)
    unigram = _unigram_accuracy(train, heldout_y, heldout_w, train.vocabulary_size)
    total_steps = schedule.total_steps
    private = not config.non_private

    history: list[dict[str, Any]] = []
    resumed_from = 0
    # The logical step each --resume of this run started from.
    resumes: list[int] = []
    with strategy.scope():
        model = build_model(config, train.vocabulary_size)
        if config.resume:
            from tf_megadp.checkpointing import restore_training_state

            state = restore_training_state(
                model, os.path.join(output_dir, CHECKPOINT_NAME), _compile_kwargs(private))
            _check_same_run(state.get("config", {}), config)
            history = state.get("history", [])
            resumed_from = int(model.optimizer.iterations.numpy())
            resumes = state.get("resumes", []) + [resumed_from]
        else:
            if private:
                optimizer = tf_megadp.DPOptimizer(
                    _inner_optimizer(config, schedule, None),
                    l2_norm_clip=config.l2_norm_clip, noise_multiplier=sigma,
                    schedule=schedule, clipping=config.clipping,
                    per_example_scaling=config.per_example_scaling,
                    automatic_scaling_stability=config.automatic_scaling_stability,
                    seed=None if testing is None else testing.noise_seed)
            else:
                k = schedule.phases[0].accumulation_steps
                optimizer = _inner_optimizer(config, schedule, k if k > 1 else None)
            model.compile(optimizer=optimizer, **_compile_kwargs(private))
            model.optimizer.build(model.trainable_variables)
        if private:
            if not isinstance(model.optimizer, tf_megadp.DPOptimizer):
                raise PretrainError(f"{output_dir} holds a non-private run; resume it with --non-private.")
            # Strict: data that no tf_megadp Poisson sampler drew is refused.
            tf_megadp.make_private(model, require_poisson_sampling=True)
        elif isinstance(model.optimizer, tf_megadp.DPOptimizer):
            raise PretrainError(f"{output_dir} holds a private run; resume it without --non-private.")

    # Keras's own accumulation (non-private) also counts logical steps in
    # iterations. A restored DPOptimizer is always at a logical-step boundary
    # (its mid-step state is never saved).
    logical_done = int(model.optimizer.iterations.numpy())
    if logical_done >= total_steps:
        log(f"The run in {output_dir} already completed {logical_done} logical steps.")
    start_step = min(logical_done, total_steps)
    end_step = total_steps
    if config.stop_after_steps:
        end_step = min(total_steps, start_step + config.stop_after_steps)
    # The draws must stay secret: they come from a fresh 128-bit OS-entropy
    # secret (the chief's, shared in memory with every worker), never from
    # --seed, which report.json records. A resumed run draws fresh steps for
    # what remains, as private as those the interrupted run would have drawn.
    # The secret is passed straight on, so that no local of this frame (and
    # no traceback) holds it.
    if testing is None:
        sampler = data.PoissonSampler(
            train, schedule, shared_secret=distribute.shared_sampling_secret(strategy),
            start_step=start_step, end_step=end_step)
    else:
        sampler = data.PoissonSampler(train, schedule, seed=testing.sampling_seed,
                                          start_step=start_step, end_step=end_step)

    # Fed to fit as the sampler returned it (a derived dataset is refused).
    # With R replicas on this host, Keras splits each m * R-row micro-step
    # along its rows, replica r taking rows [r*m, (r+1)*m): the layout
    # distribute.replica_micro_batches gives one input pipeline. keras-hub
    # tasks cannot take a tf.distribute DistributedDataset in fit.
    dataset = sampler.as_dataset(batcher)
    if not private:  # The private fit does this itself.
        distribute.build_without_reading(model, dataset.element_spec)

    # One fit step consumes one micro-batch per replica: a sampler micro-step.
    remaining_micro = sampler.total_micro_steps
    evaluations = max(1, math.ceil((end_step - start_step) / config.eval_every))
    epochs = _divisor_at_most(remaining_micro, evaluations) if remaining_micro else 0
    steps_per_epoch = remaining_micro // epochs if epochs else 0

    # Keras's fit cannot run under several workers: there the same private
    # step runs in a custom loop that drives the same callbacks.
    several_workers = distribute._worker_count(strategy) > 1
    chief = distribute.is_chief(strategy)
    callbacks = []
    privacy = None
    if private:
        privacy = tf_megadp.PrivacyCallback(
            delta=delta, accountant=config.accountant,
            report_path=os.path.join(output_dir, PRIVACY_REPORT_NAME) if chief else None,
            target_epsilon=config.target_epsilon if config.noise_multiplier is None else None)
        callbacks.append(privacy)
    checkpointer = _Checkpointer(output_dir, history, config, resumes, enabled=chief)

    class _Evaluate(keras.callbacks.Callback):
        """Held-out MLM accuracy and epsilon at every epoch end, and checkpoints."""

        def on_train_batch_end(self, batch, logs=None):
            if config.checkpoint_every and private:
                optimizer = self.model.optimizer
                steps = int(optimizer.iterations.numpy())
                if (int(optimizer.micro_steps.numpy()) == 0 and steps
                        and steps % config.checkpoint_every == 0 and steps != self._last_saved):
                    self._last_saved = steps
                    checkpointer.save(self.model)

        def on_train_begin(self, logs=None):
            self._last_saved = -1

        def on_epoch_end(self, epoch, logs=None):
            # With weight averaging, the held-out accuracy is the average's:
            # the weights the run exports (fit leaves the average in the model).
            swap = [keras.callbacks.SwapEMAWeights()] if config.ema_momentum else None
            if several_workers:
                accuracy = _heldout_accuracy(self.model, heldout_x, heldout_y, heldout_w,
                                             config.micro_batch_size, swap)
            else:
                _, accuracy = self.model.evaluate(
                    heldout_x, heldout_y, sample_weight=heldout_w,
                    batch_size=config.micro_batch_size, verbose=0, callbacks=swap)
            steps = int(self.model.optimizer.iterations.numpy())
            record = {
                "step": steps,
                "heldout_mlm_accuracy": float(accuracy),
                "train_mlm_accuracy": float(logs.get("mlm_accuracy", float("nan"))),
                "loss": float(logs.get("loss", float("nan"))),
                "epsilon": float(privacy.epsilon) if privacy else math.inf,
                "wall_time_s": time.time() - started,
            }
            history.append(record)
            if logs is not None:
                logs["heldout_mlm_accuracy"] = float(accuracy)
            if epoch == self.params["epochs"] - 1:
                # Here, before fit's end replaces the weights by their average
                # (ema_momentum): a resumed run continues from the trained
                # weights, with the average in the optimizer.
                checkpointer.save(self.model)

    callbacks.append(_Evaluate())
    if chief:
        callbacks.append(keras.callbacks.CSVLogger(os.path.join(output_dir, HISTORY_NAME), append=config.resume))
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(output_dir, "tensorboard"), update_freq="epoch"))

    layers, hidden, heads, intermediate = MODEL_PRESETS[config.model]
    log(
        f"Training BERT-{config.model} ({layers} layers, hidden {hidden}) on N={len(train)} "
        f"sequences of {train.sequence_length} tokens; held-out {len(heldout)}.\n"
        f"Schedule: {schedule}; "
        + (f"sigma={sigma:.4f}, C={config.l2_norm_clip}, delta={delta:.3g}, planned "
           f"epsilon={planned_epsilon:.3f}." if private else "NON-PRIVATE baseline (no clipping, no noise).")
    )
    train_started = time.time()
    # Also with no epoch left (a run resumed after its last step): the
    # privacy callback then reports the ledger without training.
    with warnings.catch_warnings():
        # BertMaskedLM never uses the backbone's pooler; Keras's optimizer
        # warns about it on every non-private run.
        warnings.filterwarnings("ignore", message="Gradients do not exist for variables.*pooled")
        if several_workers:
            _fit_with_private_step(model, strategy, dataset, epochs=epochs,
                                   steps_per_epoch=steps_per_epoch, callbacks=callbacks)
        else:
            model.fit(dataset, epochs=epochs, steps_per_epoch=steps_per_epoch or None,
                      shuffle=False, callbacks=callbacks, verbose=config.verbose)
    train_seconds = time.time() - train_started

    final_steps = history[-1]["step"] if history else logical_done
    if not epochs:
        checkpointer.save(model)
    if chief:
        # The release: the model without any optimizer state, and the
        # vocabulary it reads (public unless --vocabulary-from-training-corpus).
        export_model(model, os.path.join(output_dir, MODEL_NAME))
        vocabulary_file = os.path.join(train.directory, train.manifest["vocabulary_file"])
        atomic_write(os.path.join(output_dir, VOCABULARY_NAME),
                     lambda temporary: shutil.copyfile(vocabulary_file, temporary))
    accuracy = history[-1]["heldout_mlm_accuracy"] if history else float("nan")
    epsilon = float(privacy.epsilon) if privacy else math.inf
    report = {
        "heldout_mlm_accuracy": accuracy,
        "unigram_baseline_accuracy": unigram,
        "private": private,
        "epsilon": epsilon if private else None,
        "delta": delta if private else None,
        "noise_multiplier": sigma if private else None,
        "l2_norm_clip": config.l2_norm_clip if private else None,
        "accountant": config.accountant if private else None,
        "sampling": "poisson",
        "schedule": schedule.to_dict(),
        "logical_steps": final_steps,
        "completed": final_steps >= total_steps,
        "examples_processed_expected": schedule.examples_processed(),
        "wall_time_s": time.time() - started,
        "train_time_s": train_seconds,
        "examples_per_s": (sampler.total_micro_steps * schedule.micro_batch_size * schedule.num_replicas)
        / max(train_seconds, 1e-9),
        "truncated_steps": sampler.truncated_steps,
        "resumed_from_step": resumed_from,
        "resumes": resumes,
        "model": {"preset": config.model, "layers": layers, "hidden": hidden, "heads": heads,
                  "vocabulary_size": train.vocabulary_size,
                  "sequence_length": train.sequence_length},
        "num_examples": len(train),
        "canaries": ({"per_repetition": config.canaries, "repetitions": list(CANARY_REPETITIONS),
                      "controls": config.canaries, "file": CANARIES_NAME}
                     if config.canaries else None),
        "heldout_examples": len(heldout),
        "vocabulary": {**vocabulary_report(config), "size": train.vocabulary_size},
        "released_outside_epsilon": list(RELEASED_OUTSIDE_EPSILON),
        "files": _file_guide(config, private),
        "history": history,
        "config": _config_dict(config),
    }
    if chief:
        write_json_atomically(os.path.join(output_dir, REPORT_NAME), report)
        if history:
            _plot(history, os.path.join(output_dir, PLOT_NAME), private)
    log(_summary(report, output_dir))
    return report


def _fit_with_private_step(model, strategy, dataset, *, epochs: int, steps_per_epoch: int,
                           callbacks: list) -> None:
    """`model.fit` of the sampler's dataset, as a custom loop of a `tf_megadp.PrivateStep`.

    Keras 3.15's `fit` cannot run under `MultiWorkerMirroredStrategy` with
    several workers (docs/tpu.md). This loop runs the private `fit`'s own
    step on every replica, each worker feeding its replicas' rows of the
    sampler's micro-steps (`distribute_micro_batches`), records the ledger
    after every micro-step as the private `fit` does, and drives the same
    callbacks at the same points: the privacy callback (epsilon, budget
    stop, report), evaluation and checkpoints, the CSV and TensorBoard logs.
    """
    import keras
    import tensorflow as tf

    import tf_megadp
    from tf_megadp import distribute
    from tf_megadp.data import sources
    from tf_megadp.ledger_keeping import LedgerRecorder

    hooks = keras.callbacks.CallbackList(callbacks, model=model, epochs=epochs,
                                         steps=steps_per_epoch, verbose=0)
    model.stop_training = False
    if not epochs:
        # A run resumed after its last step: the ledger is checked and
        # reported, nothing is trained.
        LedgerRecorder(sources.source_of(dataset), model=model, nothing_to_train=True,
                       require_poisson_sampling=True).begin()
        hooks.on_train_begin()
        hooks.on_train_end()
        return
    step = tf_megadp.PrivateStep(model)
    data = distribute.distribute_micro_batches(strategy, lambda context: dataset)
    step.begin(data)
    train = tf.function(lambda iterator: step.run(next(iterator)))
    iterator = iter(data)
    logs = {}
    hooks.on_train_begin()
    for epoch in range(epochs):
        model.reset_metrics()
        hooks.on_epoch_begin(epoch)
        for batch in range(steps_per_epoch):
            hooks.on_train_batch_begin(batch)
            logs = {name: float(value) for name, value in train(iterator).items()
                    if name not in ("logical_step", "applied")}
            step.record()  # Before any callback reads the ledger.
            hooks.on_train_batch_end(batch, logs)
            if model.stop_training:
                break
        logs = dict(logs)
        hooks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    # As fit: the weights' average replaces them (with use_ema), then the end.
    model.optimizer.finalize_variable_values(model.trainable_variables)
    hooks.on_train_end(logs)


def _heldout_accuracy(model, x, y, sample_weight, batch_size: int, swap=None) -> float:
    """The held-out masked-LM accuracy `evaluate` gives, without `evaluate`.

    Keras's `evaluate` cannot run under several workers either; this is its
    weighted accuracy over the masked positions, from the model's forward
    pass on this worker (its weights are every worker's).
    """
    import keras
    import numpy as np

    for callback in swap or ():
        callback.set_model(model)
        callback.on_test_begin()
    try:
        correct = weight = 0.0
        for start in range(0, len(y), batch_size):
            rows = slice(start, start + batch_size)
            logits = model({name: value[rows] for name, value in x.items()}, training=False)
            hits = np.argmax(keras.ops.convert_to_numpy(logits), axis=-1) == y[rows]
            correct += float(np.sum(hits * sample_weight[rows]))
            weight += float(np.sum(sample_weight[rows]))
    finally:
        for callback in swap or ():
            callback.on_test_end()
    return correct / weight



def _file_guide(config: PretrainConfig, private: bool) -> dict[str, str]:
    """What each file of the output directory is, and whether it may be published."""
    statistics = ("publish only if the statistics under released_outside_epsilon may "
                  "be public")
    vocabulary = vocabulary_report(config)
    guide = {
        MODEL_NAME: ("release: architecture and weights only (tf_megadp.export_model), "
                     + ("covered by epsilon" if private else "NOT private (baseline)")),
        VOCABULARY_NAME: ("release: the public vocabulary the model reads" if vocabulary["public"]
                          else "NOT covered by epsilon: learned from the training corpus"),
        REPORT_NAME: f"this report: {statistics}",
        PLOT_NAME: f"held-out accuracy and epsilon per evaluation: {statistics}",
        HISTORY_NAME: f"per-epoch training loss and metrics: {statistics}",
        "tensorboard": f"the same per-epoch logs: {statistics}",
        CHECKPOINT_NAME: ("keep like the training data: training state (optimizer "
                          "moments, settings, history) for --resume; never publish"),
    }
    if private:
        guide[PRIVACY_REPORT_NAME] = "release: the privacy report (epsilon, ledger)"
    if config.canaries:
        guide[CANARIES_NAME] = "keep secret: the audit's canary secrets"
    return guide


_RUN_CONTROL_FIELDS = {"resume", "stop_after_steps", "verbose", "output_dir", "cache_dir"}


def _check_same_run(saved: dict[str, Any], config: PretrainConfig) -> None:
    """A resumed run must keep the settings its ledger and schedule were planned with."""
    current = _config_dict(config)
    changed = sorted(
        name for name in current
        if name not in _RUN_CONTROL_FIELDS and name in saved and saved[name] != current[name]
    )
    if changed:
        details = ", ".join(f"{name}: {saved[name]!r} -> {current[name]!r}" for name in changed)
        raise PretrainError(
            f"--resume with different settings ({details}); resume with the settings the "
            "run was started with."
        )


def _config_dict(config: PretrainConfig) -> dict[str, Any]:
    values = dataclasses.asdict(config)
    values["corpus"] = list(config.corpus) if config.corpus else None
    values["schedule"] = [list(p) for p in config.schedule] if config.schedule else None
    return values


def _summary(report: dict[str, Any], output_dir: str) -> str:
    lines = [
        "",
        "=" * 64,
        f"held-out MLM accuracy   {report['heldout_mlm_accuracy']:.4f}"
        f"   (unigram baseline {report['unigram_baseline_accuracy']:.4f})",
    ]
    if report["private"]:
        lines.append(
            f"privacy                 epsilon = {report['epsilon']:.3f}, delta = {report['delta']:.3g}"
            f"  (sigma {report['noise_multiplier']:.4f}, C {report['l2_norm_clip']}, Poisson, "
            f"{report['accountant'].upper()})")
    else:
        lines.append("privacy                 NONE (non-private baseline)")
    lines.append(f"vocabulary              {report['vocabulary']['source']}")
    lines += [
        f"logical steps           {report['logical_steps']}   examples/s {report['examples_per_s']:.0f}"
        f"   wall time {report['wall_time_s']:.0f} s",
        f"report                  {os.path.join(output_dir, REPORT_NAME)}",
        "=" * 64,
    ]
    return "\n".join(lines)
