"""The public BERT that examples and fine-tuning start from: built once, without DP, and cached.

`public_model()` (and `tf-megadp public-model`) pretrains a keras-hub
`BertMaskedLM` WITHOUT DP on the offline public corpus
(`tf_megadp.jobs.bert.public_text`: docstrings, manual pages and
documentation installed on this machine; the docstrings of
`HELD_OUT_PACKAGES` held out), with the main job (`run_pretraining`,
``non_private=True``), and returns the path of its `model.keras`. The
run's folder is the usual one: model.keras, vocab.txt, report.json (which
says a non-private run trained it on the public default corpus, so
`--init-from` reads its origin as "public" and composes nothing).

The folder is cached under ``<cache>/public-models/<key>``, where the key
hashes the run's settings and what the corpus depends on (the Python,
TensorFlow, Keras, keras-hub and NumPy versions and the name, size and
modification time of every file the sources read). A second call with the
same settings finds it and trains nothing. A build killed part-way resumes
from its last checkpoint (every 10 minutes) at the next call.

The recipes (`RECIPES`) are the settings measured to train in about 10 and
30 minutes on a 2-core CPU (docs/results.md, "A public start that has
learned"; `benchmarks/public_start.py --study budgets` measures them again).

Example:
```python
from tf_megadp.jobs.bert.public_model import public_model

path = public_model()            # builds the default recipe once, then returns the cached path
path = public_model(minutes=10)  # the 10-minute recipe
```
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable

from tf_megadp.jobs.bert.config import PretrainConfig, PretrainError

__all__ = ["DEFAULT_MINUTES", "PUBLIC_MODEL_SOURCES", "RECIPES", "public_model",
           "public_model_config", "public_model_folder", "public_model_help"]

# Every public source (`tf_megadp.jobs.bert.public_text.PUBLIC_SOURCES`).
PUBLIC_MODEL_SOURCES = "docstrings,more-docstrings,man,doc,package-docs"
# What every recipe shares. All the public text there is (about 57 M
# characters here); 1 % of its sequences held out (about a thousand: the
# accuracy's standard error is about 0.005 and evaluating costs seconds).
# A non-private step loses nothing to a truncated Poisson batch, so the
# batch's capacity is its expected size (probability 0.5 of truncating a
# few examples) instead of the private runs' padding for 1e-9.
_COMMON = {"public_sources": PUBLIC_MODEL_SOURCES, "max_characters": 64_000_000,
           "heldout_fraction": 0.01, "micro_batch_size": 64,
           "max_truncation_probability": 0.5}
# minutes -> the settings measured to train in about that long on the
# 2-core CPU of docs/results.md ("A public start that has learned"). Small
# batches and many steps: at an equal number of sequences, 1,600 steps of 64
# beat 400 of 256 (held-out 0.152 against 0.089 for nano), and a tiny BERT
# with 256-sequence batches had not left the unigram plateau after 460 steps.
RECIPES: dict[int, dict[str, Any]] = {
    10: {**_COMMON, "model": "nano", "sequence_length": 64, "vocabulary_size": 8192,
         "batch_size": 64, "steps": 3000, "learning_rate": 2e-3, "warmup_steps": 150,
         "eval_every": 600},
    30: {**_COMMON, "model": "tiny", "sequence_length": 64, "vocabulary_size": 8192,
         "batch_size": 128, "steps": 2400, "learning_rate": 2e-3, "warmup_steps": 120,
         "eval_every": 480},
}
# What each recipe measured (docs/results.md; `benchmarks/public_start.py`
# measures it again): minutes of training and held-out MLM accuracy.
MEASURED: dict[int, str] = {
    10: "measured: 5.4 min of training on a 2-core CPU, held-out MLM accuracy 0.160 "
        "against the unigram 0.057",
    30: "measured: 17.9 min of training on a 2-core CPU beside another run, held-out MLM "
        "accuracy 0.295 against the unigram 0.057",
}
DEFAULT_MINUTES = 10
# The settings a caller may change (the others are the recipe's, or fixed:
# a public model is non-private and reads the public corpus only).
OVERRIDABLE = ("model", "vocabulary_size", "sequence_length", "steps", "batch_size",
               "micro_batch_size", "learning_rate", "warmup_steps", "max_characters",
               "public_sources", "heldout_fraction", "seed")
_KEY_VERSION = 1


def _cache_root(cache_dir: str | None) -> str:
    if cache_dir:
        return os.path.abspath(cache_dir)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tf_megadp")


def public_model_help() -> tuple[str, str]:
    """(description, recipes): the `tf-megadp public-model` help, with each recipe's figures."""
    description = (
        "Builds, once, the public BERT that examples and `tf-megadp finetune` start from: a "
        "keras-hub BertMaskedLM pretrained WITHOUT DP on the offline public corpus (docstrings, "
        "manual pages and documentation installed on this machine; the docstrings of scipy, "
        "scikit-learn and matplotlib held out), cached under ~/.cache/tf_megadp/public-models "
        "and reused. Prints the path of its model.keras.")
    recipes = "; ".join(
        f"--minutes {minutes}: BERT-{recipe['model']}, vocabulary {recipe['vocabulary_size']}, "
        f"{recipe['steps']} steps of {recipe['batch_size']} sequences of "
        f"{recipe['sequence_length']} tokens ({MEASURED[minutes]})"
        for minutes, recipe in sorted(RECIPES.items()))
    return description, f"{recipes}. Default: --minutes {DEFAULT_MINUTES}."


def public_model_config(minutes: int = DEFAULT_MINUTES, *, cache_dir: str | None = None,
                        **overrides) -> PretrainConfig:
    """The `PretrainConfig` of a public model: a recipe, with `overrides` applied.

    Args:
        minutes: one of `RECIPES` (10 or 30).
        cache_dir: the cache root (default ~/.cache/tf_megadp); prepared
            corpora go to its ``corpora`` folder.
        **overrides: fields among `OVERRIDABLE`.

    Raises:
        PretrainError: an unknown recipe, a field that is not overridable
            (privacy settings, a user corpus), or an invalid value; each
            names the fix.
    """
    if minutes not in RECIPES:
        raise PretrainError(
            f"--minutes {minutes}: the public model has recipes measured for "
            f"{', '.join(str(m) for m in sorted(RECIPES))} minutes; choose one of them "
            "(and change --steps to train longer or shorter).")
    refused = sorted(set(overrides) - set(OVERRIDABLE))
    if refused:
        raise PretrainError(
            f"public_model does not take {', '.join(refused)}: a public model trains "
            "without DP on the offline public corpus only. It takes "
            f"{', '.join(OVERRIDABLE)}; use `tf-megadp pretrain` for anything else.")
    settings = {**RECIPES[minutes], **{k: v for k, v in overrides.items() if v is not None}}
    config = PretrainConfig(
        non_private=True, target_epsilon=None, corpus=None,
        cache_dir=os.path.join(_cache_root(cache_dir), "corpora"),
        verbose=2, **settings)
    config.validate()
    return config


def _key(config: PretrainConfig) -> str:
    """What the model depends on: its settings and the corpus sources' versions."""
    import importlib.metadata

    from tf_megadp.jobs.bert.prepare import public_corpus_sources
    from tf_megadp.jobs.common.run_folder import OPERATIONAL_FIELDS, config_dict

    settings = {k: v for k, v in config_dict(config).items()
                if k not in OPERATIONAL_FIELDS and k not in ("cache_dir", "output_dir")}
    versions = {name: importlib.metadata.version(name) for name in ("keras-hub",)}
    text = json.dumps({"version": _KEY_VERSION, "settings": settings, "versions": versions,
                       "sources": public_corpus_sources(config)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def public_model_folder(config: PretrainConfig, cache_dir: str | None = None) -> str:
    """The cache folder of the public model `config` builds (whether or not it exists)."""
    return os.path.join(_cache_root(cache_dir), "public-models",
                        f"{config.model}-v{config.vocabulary_size}-l{config.sequence_length}-"
                        f"{config.steps}x{config.batch_size}-{_key(config)}")


def _complete(folder: str) -> bool:
    from tf_megadp.jobs.common.run_folder import MODEL_NAME, REPORT_NAME

    report = os.path.join(folder, REPORT_NAME)
    if not (os.path.isfile(os.path.join(folder, MODEL_NAME)) and os.path.isfile(report)):
        return False
    try:
        with open(report, encoding="utf-8") as handle:
            return bool(json.load(handle).get("completed"))
    except (OSError, ValueError):
        return False


def public_model(minutes: int = DEFAULT_MINUTES, *, cache_dir: str | None = None,
                 build: bool = True, log: Callable[[str], None] = print,
                 **overrides) -> str:
    """The path of the cached public model's `model.keras`; built first if missing.

    Args:
        minutes: the recipe (`RECIPES`: 10 or 30 minutes of training
            on a 2-core CPU); its figures are in docs/results.md.
        cache_dir: the cache root (default ~/.cache/tf_megadp).
        build: False: never train; raise if the model is not cached.
        log: where the run's progress lines go (the path is returned, not
            printed).
        **overrides: recipe fields to change (`OVERRIDABLE`); another value
            is another model, cached under its own key.

    Returns:
        The absolute path of model.keras; vocab.txt and report.json lie beside it.

    Raises:
        PretrainError: bad settings (named), or `build=False` and the model
            is not cached.
    """
    from tf_megadp.jobs.common.run_folder import MODEL_NAME

    config = public_model_config(minutes, cache_dir=cache_dir, **overrides)
    folder = public_model_folder(config, cache_dir)
    if _complete(folder):
        return os.path.join(folder, MODEL_NAME)
    if not build:
        raise PretrainError(
            f"No public model with these settings in {os.path.dirname(folder)}: run "
            "`tf-megadp public-model` with them (or public_model(build=True)) to build it.")
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        # One build at a time; a second caller waits, then finds the model.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(folder):
            _build(config, folder, log)
    return os.path.join(folder, MODEL_NAME)


def _build(config: PretrainConfig, folder: str, log: Callable[[str], None]) -> None:
    from tf_megadp.jobs.bert.pretraining import run_pretraining
    from tf_megadp.jobs.common.run_folder import CHECKPOINT_NAME
    from tf_megadp.run.training_state import has_training_state

    partial = folder + ".partial"
    resume = has_training_state(os.path.join(partial, CHECKPOINT_NAME))
    if not resume and os.path.exists(partial):
        shutil.rmtree(partial)  # Killed before its first checkpoint: start again.
    log(f"Building the public model in {folder} ({'resuming' if resume else 'from scratch'}; "
        f"BERT-{config.model}, vocabulary {config.vocabulary_size}, {config.steps} steps of "
        f"{config.batch_size} sequences of {config.sequence_length} tokens)...")
    started = time.time()
    run_pretraining(dataclasses.replace(config, output_dir=partial, resume=resume), log=log)
    if os.path.exists(folder):
        shutil.rmtree(folder)  # An incomplete folder (a report without "completed").
    os.replace(partial, folder)
    log(f"Built in {(time.time() - started) / 60:.1f} minutes.")
