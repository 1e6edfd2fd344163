"""Scores a model without training it: what `tf-megadp evaluate MODEL` does.

MODEL is a run's `model.keras` or a local keras-hub preset folder of a
`BertMaskedLM`, read and loaded as `--init-from` reads and loads it
(`initial_weights`): its shape and vocabulary come from its files. The
corpus is prepared and split as a run on it with the same settings
(`prepare_data`: the same cache, the same held-out split), and the held-out
set is masked, scored and compared with the unigram baseline by the job's
own code (`training.heldout_set`, `fitting.weighted_accuracy`,
`baselines.learning_verdict`). A run's `model.keras`, evaluated on its
corpus with its seed, held-out fraction, sequence length and micro-batch
size, scores the held-out accuracy its report.json ends with.

Nothing is trained and nothing is released: the origin of the weights and
of their vocabulary (which decides what a training run may do with them)
does not matter here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from tf_megadp.jobs.bert.config import PretrainConfig, PretrainError

__all__ = ["evaluate_model", "evaluation_summary"]


def evaluate_model(
    model: str | os.PathLike,
    *,
    corpus: Sequence[str] | None = None,
    vocabulary: str | None = None,
    sequence_length: int | None = None,
    document_separator: str | None = None,
    heldout_fraction: float | None = None,
    micro_batch_size: int | None = None,
    seed: int = 0,
    cache_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Held-out masked-LM accuracy of `model` on a corpus, and the unigram baseline.

    Args:
        model: a run's `model.keras` or a keras-hub preset folder of a
            `BertMaskedLM` (with its task.json).
        corpus: text/JSONL files or globs (None: the offline default corpus).
        vocabulary: the model's public vocabulary file, for a model without
            one beside it.
        sequence_length: tokens per sequence (default: the model's positions).
        document_separator, heldout_fraction, micro_batch_size, seed,
            cache_dir: as the run's (defaults: `PretrainConfig`'s); the
            held-out split and its masks are a function of these and the
            corpus, and the held-out rows are cut to a multiple of
            `micro_batch_size`, as a run cuts them.
        log: where progress lines and the summary go.

    Returns:
        {"heldout_mlm_accuracy", "learned", "unigram_baseline_accuracy",
        "learned_threshold", "heldout_masked_positions", "heldout_examples",
        "model", "model_sha256", "model_preset", "vocabulary_size",
        "sequence_length", "corpus", "seed", "heldout_fraction",
        "micro_batch_size"}.

    Raises:
        PretrainError: MODEL is none of the two, is a preset of a backbone
            without an MLM head, or the corpus cannot be read.

    Example:
    ```python
    result = evaluate_model("runs/a/model.keras", corpus=["notes.txt"])
    result["heldout_mlm_accuracy"], result["unigram_baseline_accuracy"]
    ```
    """
    import keras

    from tf_megadp.jobs.bert import initial_weights, training
    from tf_megadp.jobs.bert.baselines import learning_verdict
    from tf_megadp.jobs.common import fitting
    from tf_megadp.jobs.bert.prepare import prepare_data

    init = initial_weights.read_initial_weights(model)
    if init.kind == "preset" and not os.path.isfile(os.path.join(init.path, "task.json")):
        raise PretrainError(
            f"{model} is a keras-hub preset of a backbone alone: it has no masked-LM head, "
            "and the held-out accuracy would score a randomly initialised one. Evaluate a "
            "BertMaskedLM (a run's model.keras, or a task preset with its task.json).")
    # Evaluation trains and releases nothing: a vocabulary learned from the
    # model's own training corpus is no reason to refuse (it is for a run).
    init = dataclasses.replace(init, vocabulary_public=None)
    settings = {name: value for name, value in (
        ("corpus", list(corpus) if corpus else None), ("vocabulary", vocabulary),
        ("sequence_length", sequence_length), ("document_separator", document_separator),
        ("heldout_fraction", heldout_fraction), ("micro_batch_size", micro_batch_size),
    ) if value is not None}
    config = initial_weights.configured(
        PretrainConfig(init_from=init.path, non_private=True, target_epsilon=None, seed=seed,
                       cache_dir=cache_dir, **settings),
        init, given=settings)
    log(f"Evaluating {model} (BERT-{config.model}, vocabulary {init.vocabulary_size}) on "
        f"{'the offline default corpus' if not config.corpus else ', '.join(config.corpus)}...")
    _, train, heldout = prepare_data(config, log)

    # As the job seeds its public randomness (the model's initialisation,
    # which the loaded weights then replace).
    keras.utils.set_random_seed(config.seed)
    _, held_out = training.heldout_set(train, heldout, config)
    network = training.build_model(config, train.vocabulary_size)
    initial_weights.load_into(network, init)
    accuracy = fitting.weighted_accuracy(network, held_out.x, held_out.y,
                                         held_out.sample_weight, config.micro_batch_size)
    positions = float(held_out.sample_weight.sum())
    result = {
        "heldout_mlm_accuracy": accuracy,
        # learned, unigram_baseline_accuracy, learned_threshold, heldout_masked_positions
        **learning_verdict(accuracy, held_out.unigram_accuracy, positions),
        "heldout_examples": len(heldout),
        "model": os.fspath(model),
        "model_sha256": init.sha256,
        "model_preset": config.model,
        "vocabulary_size": int(train.vocabulary_size),
        "sequence_length": config.sequence_length,
        "corpus": list(config.corpus) if config.corpus else None,
        "seed": config.seed,
        "heldout_fraction": config.heldout_fraction,
        "micro_batch_size": config.micro_batch_size,
    }
    log(evaluation_summary(result))
    return result


def evaluation_summary(result: dict[str, Any]) -> str:
    """The lines `tf-megadp evaluate` prints."""
    from tf_megadp.jobs.common.verdicts import STANDARD_ERRORS

    verdict = "yes" if result["learned"] else "NO: not above it by more than its noise"
    return "\n".join([
        "",
        "=" * 64,
        f"held-out MLM accuracy   {result['heldout_mlm_accuracy']:.4f}"
        f"   (unigram baseline {result['unigram_baseline_accuracy']:.4f})",
        f"above the baseline      {verdict} (threshold {result['learned_threshold']:.4f}: "
        f"+ {STANDARD_ERRORS:g} standard errors over "
        f"{result['heldout_masked_positions']:,.0f} masked positions)",
        f"held-out split          {result['heldout_examples']:,} sequences of "
        f"{result['sequence_length']} tokens (seed {result['seed']}, fraction "
        f"{result['heldout_fraction']:g})",
        f"model                   {result['model']} (BERT-{result['model_preset']}, "
        f"vocabulary {result['vocabulary_size']:,})",
        "=" * 64,
    ])
