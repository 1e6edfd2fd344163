"""A public start that has learned: the public corpus source by source, 10- and 30-minute recipes, DP.

Studies (each writes `--output-dir`/<study>.json and prints a table; the
machine's load average is recorded before and after every run, as it may be
shared):

- ``throughput``: rows per second of non-private training, per model preset,
  sequence length and micro-batch (the marginal rate between a 4- and a
  12-step run, so that compilation and evaluation cancel), and how long
  preparing the public corpus takes.
- ``sources``: what each public source buys. Every source's documents are
  split by a hash into training documents and 2 % held-out documents; one
  vocabulary is learned from all training documents; a model is trained at
  the same fixed budget on each source alone and on all of them, and every
  model is scored on every source's held-out documents and on a sample of
  the held-out packages' docstrings (scipy, scikit-learn, matplotlib: the
  fine-tuning task's text, never trained on), with the job's own masked
  evaluation (`tf-megadp evaluate`).
- ``budgets``: the `tf-megadp public-model` recipes of about 10 and 30
  minutes (`tf_megadp.jobs.bert.public_model.RECIPES`), each built with
  `public_model()` into `--cache-dir`, and their report: held-out MLM
  accuracy on the public corpus's own held-out split, the unigram baseline,
  the wall time.
- ``dp``: the chosen recipe again with DP-SGD at epsilon 5.36 (the main
  job, same model, corpus, steps and batch), against its non-private twin.
- ``vocabulary``: how finely a vocabulary splits English prose: pieces per
  word and the share of manual-page sentences (and held-out docstrings) cut
  at 64 and 128 tokens, for the job's default vocabulary (512, learned from
  docstrings) and the public model's.

Run (one TensorFlow process; hours for budgets and dp):

    python benchmarks/public_start.py --study throughput
    python benchmarks/public_start.py --study sources
    python benchmarks/public_start.py --study budgets      # the 10- and 30-minute recipes
    python benchmarks/public_start.py --study dp
    python benchmarks/public_start.py --study vocabulary
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

ALL_SOURCES = ("docstrings", "more-docstrings", "man", "doc", "package-docs")
# Sources trained on alone in the sources study (package-docs is too small alone).
ALONE = ("docstrings", "more-docstrings", "man", "doc")
EVAL_BUCKETS = 50  # 1 in 50 documents (2 %) of every source is held out


def load_average() -> float:
    return os.getloadavg()[0]


def log(message: str) -> None:
    print(message, flush=True)


def write_jsonl(path: str, documents) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        for text in documents:
            handle.write(json.dumps({"text": text}) + "\n")
    os.replace(path + ".tmp", path)
    return path


def save(args, study: str, results) -> None:
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, f"{study}.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1, default=str)


def run_job(label: str, **settings) -> dict:
    """One `run_pretraining` (reused if its folder holds a completed report)."""
    from tf_megadp.jobs.bert.pretraining import PretrainConfig, run_pretraining

    report_path = os.path.join(settings["output_dir"], "report.json")
    if os.path.isfile(report_path):
        with open(report_path, encoding="utf-8") as handle:
            report = json.load(handle)
        if report.get("completed") and "benchmark_seconds" in report:
            log(f"{label}: reusing {report_path}")
            return report
    shutil.rmtree(settings["output_dir"], ignore_errors=True)
    before, started = load_average(), time.time()
    report = run_pretraining(PretrainConfig(**settings), log=lambda *_: None)
    report["benchmark_load"] = [before, load_average()]
    report["benchmark_seconds"] = time.time() - started
    with open(report_path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, default=str)
    log(f"{label}: held-out {report['heldout_mlm_accuracy']:.4f} (unigram "
        f"{report['unigram_baseline_accuracy']:.4f}), {report['benchmark_seconds'] / 60:.1f} min, "
        f"load {before:.2f} -> {load_average():.2f}")
    return report


# -- throughput ----------------------------------------------------------------------


def study_throughput(args) -> dict:
    from tf_megadp.jobs.bert.pretraining import PretrainConfig, prepare_data

    results = {"prepare": {}, "rows_per_s": {}}
    common = dict(public_sources=",".join(ALL_SOURCES), vocabulary_size=args.vocabulary_size,
                  max_characters=args.max_characters, heldout_fraction=args.heldout_fraction,
                  cache_dir=os.path.join(args.cache_dir, "corpora"), non_private=True,
                  target_epsilon=None)
    for length in args.sequence_lengths:
        before, started = load_average(), time.time()
        _, train, heldout = prepare_data(PretrainConfig(sequence_length=length, **common), log)
        results["prepare"][length] = {
            "seconds": time.time() - started, "load": [before, load_average()],
            "training_sequences": len(train), "heldout_sequences": len(heldout),
            "vocabulary_size": train.vocabulary_size,
            "manifest": {k: v for k, v in train.manifest.items() if k not in ("shards",)}}
        log(f"prepared L={length}: {len(train):,} training sequences in "
            f"{time.time() - started:.0f} s")
    for preset in args.presets:
        for length in args.sequence_lengths:
            for micro in args.micro_batch_sizes:
                # Three evaluations; the rate between the first and the last leaves the
                # compilation out and keeps two evaluations of the small held-out split in.
                every = args.throughput_steps
                name = f"{preset}-L{length}-m{micro}"
                report = run_job(name, model=preset, sequence_length=length, steps=3 * every,
                                 batch_size=args.batch_size, micro_batch_size=micro,
                                 eval_every=every, checkpoint_minutes=0,
                                 max_truncation_probability=args.truncation_probability,
                                 verbose=0, output_dir=os.path.join(args.output_dir, "throughput",
                                                                    name), **common)
                first, last = report["history"][0], report["history"][-1]
                rows = report["examples_per_s"] * report["train_time_s"] * (
                    (last["step"] - first["step"]) / (3 * every))
                rate = rows / (last["wall_time_s"] - first["wall_time_s"])
                results["rows_per_s"][name] = {
                    "preset": preset, "sequence_length": length, "micro_batch_size": micro,
                    "rows_per_s": rate, "sequences_per_s": rate * args.batch_size / (
                        report["examples_per_s"] * report["train_time_s"] / (3 * every)),
                    "load": report["benchmark_load"],
                    "parameters": report["model"]["parameters"]}
                log(f"{name}: {rate:.0f} padded rows/s, "
                    f"{results['rows_per_s'][name]['sequences_per_s']:.0f} sequences/s")
                save(args, "throughput", results)
    return results


# -- sources -------------------------------------------------------------------------


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:4], "little") % EVAL_BUCKETS


def source_splits(args) -> dict:
    """{source: (training documents, held-out documents)} and the held-out packages' sample."""
    from tf_megadp.jobs.bert.public_text import (HELD_OUT_MIN_CHARACTERS, SourceRoots,
                                                 _python_files, held_out_files)
    from tf_megadp.jobs.bert.corpus import _docstrings
    from tf_megadp.jobs.bert.public_text import public_corpus_documents

    splits = {}
    for source in ALL_SOURCES:
        documents = public_corpus_documents([source], 10**10, progress=log,
                                            cache_dir=os.path.join(args.cache_dir, "corpora"))
        train = [d for d in documents if _bucket(d) != 0]
        heldout = [d for d in documents if _bucket(d) == 0]
        splits[source] = (train, heldout)
    # The fine-tuning task's text: never in any public source; a sample to score on.
    _, folders = held_out_files(SourceRoots())
    docstrings = sorted({text for folder in folders for path in _python_files(folder)
                         for text in _docstrings(path) if len(text) >= HELD_OUT_MIN_CHARACTERS})
    rng = np.random.default_rng(0)
    sample = [docstrings[i] for i in sorted(rng.choice(len(docstrings),
                                                        min(3000, len(docstrings)), replace=False))]
    splits["held-out packages"] = ([], sample)
    return splits


def study_sources(args) -> dict:
    from tf_megadp.jobs.bert import text
    from tf_megadp.jobs.bert.evaluation import evaluate_model

    folder = os.path.join(args.output_dir, "sources")
    splits = source_splits(args)
    results = {"sizes": {s: {"training_documents": len(t), "training_characters": sum(map(len, t)),
                             "heldout_documents": len(h), "heldout_characters": sum(map(len, h))}
                         for s, (t, h) in splits.items()},
               "settings": {k: getattr(args, k) for k in (
                   "model", "vocabulary_size", "sequence_length", "steps", "batch_size",
                   "micro_batch_size", "learning_rate")},
               "rows": {}}
    log(json.dumps(results["sizes"], indent=1))
    vocabulary = os.path.join(folder, "vocab.txt")
    if not os.path.isfile(vocabulary):
        started = time.time()
        tokens = text.learn_vocabulary([d for s in ALL_SOURCES for d in splits[s][0]],
                                       args.vocabulary_size, progress=log)
        os.makedirs(folder, exist_ok=True)
        with open(vocabulary, "w", encoding="utf-8") as handle:
            handle.write("".join(t + "\n" for t in tokens))
        results["vocabulary_seconds"] = time.time() - started
    evaluations = {name: write_jsonl(os.path.join(folder, f"heldout-{name}.jsonl"), heldout)
                   for name, (_, heldout) in splits.items()}
    rows = {source: [source] for source in ALONE}
    rows["all"] = list(ALL_SOURCES)
    for row, sources in rows.items():
        corpus = write_jsonl(os.path.join(folder, f"train-{row}.jsonl"),
                             [d for s in sources for d in splits[s][0]])
        report = run_job(
            f"sources: {row}", corpus=[corpus], vocabulary=vocabulary, model=args.model,
            sequence_length=args.sequence_length, steps=args.steps,
            batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
            learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
            heldout_fraction=0.01, eval_every=args.steps, non_private=True,
            target_epsilon=None, max_truncation_probability=0.5, checkpoint_minutes=0,
            init_data_disjoint=False, cache_dir=os.path.join(args.cache_dir, "corpora"),
            output_dir=os.path.join(folder, f"run-{row}"), verbose=0)
        scores = {}
        for name, path in evaluations.items():
            result = evaluate_model(os.path.join(folder, f"run-{row}", "model.keras"),
                                    corpus=[path], sequence_length=args.sequence_length,
                                    heldout_fraction=0.45, micro_batch_size=args.micro_batch_size,
                                    cache_dir=os.path.join(args.cache_dir, "corpora"),
                                    log=lambda *_: None)
            scores[name] = {"accuracy": result["heldout_mlm_accuracy"],
                            "unigram": result["unigram_baseline_accuracy"],
                            "positions": result["heldout_masked_positions"]}
        results["rows"][row] = {"sources": sources, "scores": scores,
                                "own_heldout": report["heldout_mlm_accuracy"],
                                "minutes": report["benchmark_seconds"] / 60,
                                "load": report["benchmark_load"],
                                "training_sequences": report["training_sequences"]}
        log(f"{row}: " + ", ".join(f"{n} {s['accuracy']:.3f}" for n, s in scores.items()))
        save(args, "sources", results)
    return results


# -- candidates ----------------------------------------------------------------------


def parse_candidate(text: str) -> dict:
    """"tiny:128:8192:256:270:2e-3" -> the settings of a candidate recipe.

    preset : sequence length : vocabulary : batch : steps : learning rate
    """
    try:
        preset, length, vocabulary, batch, steps, rate = text.split(":")
        return {"model": preset, "sequence_length": int(length),
                "vocabulary_size": int(vocabulary), "batch_size": int(batch),
                "steps": int(steps), "learning_rate": float(rate)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a candidate is preset:length:vocabulary:batch:steps:learning_rate, "
            "e.g. tiny:128:8192:256:270:2e-3") from None


def study_candidates(args) -> dict:
    """Candidate recipes, each trained as `public_model` would (its settings), into --output-dir."""
    import dataclasses

    from tf_megadp.jobs.bert.public_model import public_model_config

    path = os.path.join(args.output_dir, "candidates.json")
    results = {}
    if os.path.isfile(path):  # Candidates of earlier calls stay in the table.
        with open(path, encoding="utf-8") as handle:
            results = json.load(handle)
    for candidate in args.candidate:
        name = "{model}-L{sequence_length}-V{vocabulary_size}-B{batch_size}-{steps}-lr{learning_rate:g}".format(
            **candidate)
        config = public_model_config(args.minutes[0], cache_dir=args.cache_dir,
                                     warmup_steps=max(10, candidate["steps"] // 20), **candidate)
        settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        settings.update(output_dir=os.path.join(args.output_dir, "candidates", name),
                        eval_every=max(1, candidate["steps"] // args.evaluations), verbose=0)
        report = run_job(name, **settings)
        results[name] = {**candidate, "heldout_mlm_accuracy": report["heldout_mlm_accuracy"],
                         "unigram": report["unigram_baseline_accuracy"],
                         "train_minutes": report["train_time_s"] / 60,
                         "minutes": report["benchmark_seconds"] / 60,
                         "load": report["benchmark_load"],
                         "history": [(h["step"], round(h["wall_time_s"]),
                                      h["heldout_mlm_accuracy"]) for h in report["history"]]}
        save(args, "candidates", results)
    return results


# -- budgets and dp ------------------------------------------------------------------


def study_budgets(args) -> dict:
    from tf_megadp.jobs.bert.public_model import RECIPES, public_model

    results = {}
    for minutes in args.minutes:
        before, started = load_average(), time.time()
        path = public_model(minutes, cache_dir=args.cache_dir, log=log)
        with open(os.path.join(os.path.dirname(path), "report.json"), encoding="utf-8") as handle:
            report = json.load(handle)
        results[minutes] = {
            "recipe": RECIPES[minutes], "path": path,
            "heldout_mlm_accuracy": report["heldout_mlm_accuracy"],
            "unigram_baseline_accuracy": report["unigram_baseline_accuracy"],
            "train_minutes": report["train_time_s"] / 60,
            "wall_minutes": report["wall_time_s"] / 60,
            "this_call_minutes": (time.time() - started) / 60,
            "load": [before, load_average()],
            "training_sequences": report["training_sequences"],
            "heldout_examples": report["heldout_examples"],
            "history": [(h["step"], h["heldout_mlm_accuracy"]) for h in report["history"]]}
        log(f"{minutes}-minute recipe: held-out {report['heldout_mlm_accuracy']:.4f} (unigram "
            f"{report['unigram_baseline_accuracy']:.4f}), trained "
            f"{report['train_time_s'] / 60:.1f} min, wall {report['wall_time_s'] / 60:.1f} min")
        save(args, "budgets", results)
    return results


def study_dp(args) -> dict:
    import dataclasses

    from tf_megadp.jobs.bert.public_model import public_model, public_model_config

    minutes = args.minutes[0]
    path = public_model(minutes, cache_dir=args.cache_dir, log=log)
    with open(os.path.join(os.path.dirname(path), "report.json"), encoding="utf-8") as handle:
        public = json.load(handle)
    config = public_model_config(minutes, cache_dir=args.cache_dir)
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    results = {"non_private": {"heldout_mlm_accuracy": public["heldout_mlm_accuracy"],
                               "unigram": public["unigram_baseline_accuracy"],
                               "minutes": public["wall_time_s"] / 60},
               "dp": {}}
    for rate in args.dp_learning_rates:
        settings.update(non_private=False, target_epsilon=args.target_epsilon,
                        learning_rate=rate, max_truncation_probability=1e-9,
                        output_dir=os.path.join(args.output_dir, "dp", f"lr{rate:g}"))
        report = run_job(f"DP lr {rate:g}", **settings)
        results["dp"][rate] = {
            "heldout_mlm_accuracy": report["heldout_mlm_accuracy"],
            "unigram": report["unigram_baseline_accuracy"], "epsilon": report["epsilon"],
            "delta": report["delta"], "noise_multiplier": report["noise_multiplier"],
            "minutes": report["benchmark_seconds"] / 60, "load": report["benchmark_load"],
            "ratio": report["heldout_mlm_accuracy"] / public["heldout_mlm_accuracy"]}
        log(f"DP lr {rate:g}: {report['heldout_mlm_accuracy']:.4f} at epsilon "
            f"{report['epsilon']:.3f}; non-private {public['heldout_mlm_accuracy']:.4f}; ratio "
            f"{results['dp'][rate]['ratio']:.3f}")
        save(args, "dp", results)
    return results


# -- vocabulary ----------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def split_statistics(vocabulary: list[str], texts: list[str], lengths=(64, 128)) -> dict:
    """Pieces per word, [UNK] share, and the share of texts cut at each length (with [CLS], [SEP])."""
    import keras_hub
    import tensorflow as tf

    from tf_megadp._keras_compat import keras_hub_pretokenize

    tokenizer = keras_hub.tokenizers.WordPieceTokenizer(vocabulary=vocabulary, lowercase=True,
                                                        oov_token="[UNK]")
    pieces = [len(t) for t in tokenizer.tokenize(tf.constant(texts)).to_list()]
    unknown_id = vocabulary.index("[UNK]")
    unknown = sum(int(np.sum(np.asarray(t) == unknown_id))
                  for t in tokenizer.tokenize(tf.constant(texts)).to_list())
    words = [len(w) for w in keras_hub_pretokenize(tf.constant(texts), True).to_list()]
    return {"texts": len(texts), "pieces_per_word": float(sum(pieces) / max(sum(words), 1)),
            "unknown_share": unknown / max(sum(pieces), 1),
            "mean_pieces": float(np.mean(pieces)),
            **{f"cut_at_{n}": float(np.mean([p > n - 2 for p in pieces])) for n in lengths}}


def study_vocabulary(args) -> dict:
    from tf_megadp.jobs.bert import prepare, text
    from tf_megadp.jobs.bert.pretraining import PretrainConfig
    from tf_megadp.jobs.bert.public_model import public_model

    splits = source_splits(args)
    man = splits["man"][1]
    sentences = [s for d in man for p in d.split("\n\n") for s in _SENTENCE_END.split(p)
                 if len(s.split()) >= 3]
    paragraphs = [p for d in man for p in d.split("\n\n")]
    docstrings = splits["held-out packages"][1]
    vocabularies = {
        "job default (512, docstrings)": prepare._public_vocabulary(
            PretrainConfig(cache_dir=os.path.join(args.cache_dir, "corpora")), log)}
    for minutes in args.minutes:
        path = public_model(minutes, cache_dir=args.cache_dir, build=False)
        vocabularies[f"public model, {minutes}-minute recipe"] = text.read_vocabulary_file(
            os.path.join(os.path.dirname(path), "vocab.txt"))
    results = {}
    for name, vocabulary in vocabularies.items():
        results[name] = {"size": len(vocabulary),
                         "man-page sentences": split_statistics(vocabulary, sentences),
                         "man-page paragraphs": split_statistics(vocabulary, paragraphs),
                         "held-out packages' docstrings": split_statistics(vocabulary, docstrings)}
        log(f"{name}: {json.dumps(results[name])}")
    save(args, "vocabulary", results)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", required=True,
                        choices=["throughput", "candidates", "sources", "budgets", "dp",
                                 "vocabulary"])
    parser.add_argument("--output-dir", default=os.path.join("runs", "public_start"))
    parser.add_argument("--cache-dir", default=None,
                        help="the public models' and corpora's cache root (default "
                             "~/.cache/tf_megadp)")
    parser.add_argument("--minutes", type=int, nargs="+", default=[10, 30],
                        help="budgets: the recipes to build; dp and vocabulary: the first "
                             "is the recipe compared")
    # throughput
    parser.add_argument("--presets", nargs="+", default=["nano", "tiny", "mini", "small"])
    parser.add_argument("--sequence-lengths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--max-characters", type=int, default=64_000_000)
    parser.add_argument("--heldout-fraction", type=float, default=0.01)
    parser.add_argument("--throughput-steps", type=int, default=8,
                        help="steps between the three evaluations of a throughput run")
    parser.add_argument("--truncation-probability", type=float, default=1e-2,
                        help="non-private runs: the Poisson batch's capacity (a truncated "
                             "step costs no privacy here; a smaller one pads more rows)")
    # sources (and throughput's batch)
    parser.add_argument("--model", default="mini")
    parser.add_argument("--vocabulary-size", type=int, default=8192)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    # candidates
    parser.add_argument("--candidate", type=parse_candidate, nargs="+", default=[],
                        help="preset:length:vocabulary:batch:steps:learning_rate (the other "
                             "settings are the first --minutes recipe's)")
    parser.add_argument("--evaluations", type=int, default=6,
                        help="held-out evaluations per candidate run")
    # dp
    parser.add_argument("--target-epsilon", type=float, default=5.36)
    parser.add_argument("--dp-learning-rates", type=float, nargs="+", default=[8e-3])
    args = parser.parse_args(argv)
    from tf_megadp.jobs.bert.public_model import _cache_root

    args.cache_dir = _cache_root(args.cache_dir)
    log(f"load average {load_average():.2f} (the machine may be shared)")
    return {"throughput": study_throughput, "candidates": study_candidates,
            "sources": study_sources, "budgets": study_budgets,
            "dp": study_dp, "vocabulary": study_vocabulary}[args.study](args)


if __name__ == "__main__":
    main()
