"""Private fine-tuning, measured: prompt against head, full against LoRA, DP against non-private.

Every run is `tf-megadp finetune` (`run_finetuning`) from the same public
start, on the job's default task (which package a docstring summary comes
from) unless `--train`/`--test` name another. Three commands:

    # 1. Choose the learning rates on a validation split (the training split,
    #    split again 80/20); the test split is not read.
    python benchmarks/finetune_study.py sweep --init-from PUBLIC/model.keras --output-dir D

    # 2. The evidence on the test split: each objective x {every weight, LoRA}
    #    x {epsilon 3, epsilon 8, non-private}, --repeats times (the sampling
    #    and the noise come from fresh OS entropy each time; --seed changes the
    #    new weights' initialisation).
    python benchmarks/finetune_study.py grid --init-from PUBLIC/model.keras --output-dir D

    # 0. Why a head on [CLS] learns nothing under DP: each objective
    #    non-private, with clipping alone (sigma 0.1), and at epsilon 8; what
    #    each model predicts on the test split (the share of its most
    #    predicted class, the spread of its logits across examples).
    python benchmarks/finetune_study.py diagnose --init-from PUBLIC/model.keras --output-dir D

    # 3. The table (mean and standard error over repeats), the baselines
    #    (majority class; TF-IDF + logistic regression, a bag of words, not
    #    private) and the plot.
    python benchmarks/finetune_study.py table --output-dir D --plot docs/finetune_study.png

Each run's report is appended to D/results.jsonl (with the load average of
the machine when it ended); a run already there is skipped, so a killed
study continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

CONDITIONS = {
    # name: (objective, lora, epsilon or None for non-private)
    **{f"{objective}-{trains}-eps{eps:g}": (objective, trains == "lora", eps)
       for objective in ("prompt", "head") for trains in ("full", "lora") for eps in (3.0, 8.0)},
    **{f"{objective}-{trains}-nonprivate": (objective, trains == "lora", None)
       for objective in ("prompt", "head") for trains in ("full", "lora")},
}
LORA_RANK = 8


def _config(args, name: str, train: str | None, test: str | None, seed: int,
            learning_rate: float | None, output_dir: str):
    from tf_megadp.jobs.finetune.config import FinetuneConfig

    from tf_megadp.jobs.finetune.run import DEFAULT_TASK_PROMPT

    objective, lora, epsilon = CONDITIONS[name]
    prompt = {}
    if args.train is None and train is not None:
        # The default task's validation split, as files: its own prompt.
        words = DEFAULT_TASK_PROMPT["words"]
        prompt = dict(labels=list(words), label_words=list(words.values()),
                      template=DEFAULT_TASK_PROMPT["template"])
    return FinetuneConfig(
        **prompt,
        train=train, test=test, init_from=args.init_from, objective=objective,
        lora_rank=LORA_RANK if lora else None, target_epsilon=epsilon,
        non_private=epsilon is None, learning_rate=learning_rate, seed=seed,
        **_epochs(args), output_dir=output_dir, verbose=0, checkpoint_minutes=0,
        eval_every=args.eval_every)


def _epochs(args) -> dict:
    """`epochs` for FinetuneConfig: the flag's, or none (the job's default)."""
    return {} if args.epochs is None else {"epochs": args.epochs}


def _done(path: str) -> set[str]:
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as handle:
        return {json.loads(line)["run"] for line in handle if line.strip()}


def _run(args, run: str, config, results: str) -> dict:
    import contextlib
    import fcntl

    from tf_megadp.jobs.finetune.run import run_finetuning

    with contextlib.ExitStack() as stack:
        if args.lock:
            # Other jobs on a shared machine take the same lock between runs.
            handle = stack.enter_context(open(args.lock, "a"))
            fcntl.flock(handle, fcntl.LOCK_EX)
        started = time.time()
        report = run_finetuning(config, log=lambda *_: None)
    row = {"run": run, "test_accuracy": report["test_accuracy"],
           "majority_class_accuracy": report["majority_class_accuracy"],
           "learned": report["learned"], "epsilon": report["epsilon"],
           "learning_rate": report["learning_rate"], "steps": report["logical_steps"],
           "batch": report["schedule"]["phases"][0]["batch_size"],
           "trainable_parameters": report["trainable_parameters"],
           "seconds": time.time() - started, "load": os.getloadavg()[0],
           "history": [h["test_accuracy"] for h in report["history"]]}
    with open(results, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "history"}), flush=True)
    return row


def _validation_files(args) -> tuple[str, str]:
    """The training split of the task, split again 80/20 into train and validation JSONL."""
    from tf_megadp.jobs.finetune import data

    folder = os.path.join(args.output_dir, "validation")
    os.makedirs(folder, exist_ok=True)
    paths = os.path.join(folder, "train.jsonl"), os.path.join(folder, "validation.jsonl")
    if all(os.path.exists(path) for path in paths):
        return paths
    task = (data.default_task() if args.train is None else
            data.task_from_files(args.train, args.test))
    rng = np.random.default_rng(12345)
    order = rng.permutation(len(task.train_texts))
    cut = int(0.8 * len(order))
    for path, rows in zip(paths, (order[:cut], order[cut:])):
        with open(path, "w", encoding="utf-8") as handle:
            for i in rows:
                handle.write(json.dumps({"text": task.train_texts[i],
                                         "label": task.labels[task.train_labels[i]]}) + "\n")
    return paths


def sweep(args) -> None:
    """Learning rates of each condition on the validation split."""
    train, validation = _validation_files(args)
    results = os.path.join(args.output_dir, "sweep.jsonl")
    done = _done(results)
    for name in args.conditions:
        for rate in args.learning_rates:
            run = f"{name}@lr{rate:g}"
            if run in done:
                continue
            config = _config(args, name, train, validation, 0, rate,
                             os.path.join(args.output_dir, "runs", "sweep", run))
            _run(args, run, config, results)


def grid(args) -> None:
    """Every condition on the test split, `repeats` times, at its chosen learning rate."""
    results = os.path.join(args.output_dir, "results.jsonl")
    done = _done(results)
    rates = _chosen_rates(args)
    for repeat in range(args.repeats):
        for name in args.conditions:
            run = f"{name}#{repeat}"
            if run in done:
                continue
            config = _config(args, name, args.train, args.test, repeat, rates.get(name),
                             os.path.join(args.output_dir, "runs", "grid", run))
            _run(args, run, config, results)


def _chosen_rates(args) -> dict[str, float]:
    """The best validation learning rate of each condition (sweep.jsonl), if a sweep ran."""
    path = os.path.join(args.output_dir, "sweep.jsonl")
    best: dict[str, tuple[float, float]] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                name, rate = row["run"].split("@lr")
                if name not in best or row["test_accuracy"] > best[name][0]:
                    best[name] = (row["test_accuracy"], float(rate))
    return {name: rate for name, (_, rate) in best.items()}


def diagnose(args) -> None:
    """Clipping alone against noise, per objective; what each model's predictions look like."""
    import keras

    from tf_megadp.jobs.finetune import data
    from tf_megadp.jobs.finetune.config import FinetuneConfig

    results = os.path.join(args.output_dir, "diagnose.jsonl")
    done = _done(results)
    task = data.default_task() if args.train is None else data.task_from_files(args.train,
                                                                               args.test)
    rates = _chosen_rates(args)
    for objective in ("head", "prompt"):
        for kind, settings in (("nonprivate", dict(non_private=True, target_epsilon=None)),
                               # sigma 0.1: noise of 1e-5 C per coordinate of the
                               # mean at B = 1,000, and a PLD grid the accountant
                               # builds (at 1e-3 it refuses one of 5e9 points).
                               ("clipping-only", dict(noise_multiplier=0.1,
                                                      target_epsilon=None)),
                               ("eps8", dict(target_epsilon=8.0))):
            run = f"{objective}-{kind}"
            if run in done:
                continue
            folder = os.path.join(args.output_dir, "runs", "diagnose", run)
            rate = rates.get(f"{objective}-full-{'nonprivate' if kind == 'nonprivate' else 'eps8'}")
            config = FinetuneConfig(train=args.train, test=args.test, init_from=args.init_from,
                                    objective=objective, learning_rate=rate, **_epochs(args),
                                    output_dir=folder, verbose=0, checkpoint_minutes=0,
                                    eval_every=args.eval_every, **settings)
            row = _run(args, run, config, results)
            model = keras.models.load_model(os.path.join(folder, "model.keras"))
            x = _test_inputs(folder, task, objective)
            logits = keras.ops.convert_to_numpy(model.predict(x, batch_size=64, verbose=0))
            predicted = np.argmax(logits, axis=1)
            share = float(np.bincount(predicted, minlength=len(task.labels)).max() / len(predicted))
            spread = float(np.mean(np.std(logits - logits.mean(axis=1, keepdims=True), axis=0)))
            print(json.dumps({"run": run, "test_accuracy": row["test_accuracy"],
                              "most_predicted_class_share": share,
                              "logit_spread_across_examples": spread}), flush=True)
            with open(os.path.join(args.output_dir, "diagnose_predictions.jsonl"), "a",
                      encoding="utf-8") as handle:
                handle.write(json.dumps({"run": run, "share": share, "spread": spread}) + "\n")


def _test_inputs(folder: str, task, objective: str):
    """The test split as the run in `folder` fed it (its report's prompt, its vocabulary)."""
    import keras_hub

    import tf_megadp
    from tf_megadp.jobs.bert import text

    report = json.load(open(os.path.join(folder, "report.json"), encoding="utf-8"))
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=text.read_vocabulary_file(os.path.join(folder, "vocab.txt")), lowercase=True)
    length = report["config"]["sequence_length"]
    if objective == "prompt":
        return tf_megadp.PromptTemplate(report["prompt"]["template"]).encode(
            task.test_texts, tokenizer, length)
    from tf_megadp.jobs.finetune.run import classifier_inputs

    return classifier_inputs(task.test_texts, tokenizer, length)


def table(args) -> None:
    """Mean and standard error of each condition, with the baselines; optionally the plot."""
    rows: dict[str, list[dict]] = {}
    with open(os.path.join(args.output_dir, "results.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            rows.setdefault(row["run"].split("#")[0], []).append(row)
    print(f"{'condition':<28}{'n':>3}{'test accuracy':>22}{'epsilon':>9}{'lr':>9}{'steps':>7}"
          f"{'B':>6}{'s/run':>8}{'load':>6}")
    summary = {}
    for name in CONDITIONS:
        if name not in rows:
            continue
        accuracies = np.array([row["test_accuracy"] for row in rows[name]])
        error = accuracies.std(ddof=1) / np.sqrt(len(accuracies)) if len(accuracies) > 1 else 0.0
        first = rows[name][0]
        summary[name] = (float(accuracies.mean()), float(error))
        epsilon = "-" if first["epsilon"] is None else f"{first['epsilon']:.2f}"
        print(f"{name:<28}{len(accuracies):>3}{accuracies.mean():>14.4f} +- {error:.4f}"
              f"{epsilon:>9}{first['learning_rate']:>9.0e}{first['steps']:>7}{first['batch']:>6}"
              f"{np.mean([r['seconds'] for r in rows[name]]):>8.0f}"
              f"{np.mean([r['load'] for r in rows[name]]):>6.1f}")
    majority = next(iter(rows.values()))[0]["majority_class_accuracy"]
    print(f"\nmajority class {majority:.4f}; bag of words (TF-IDF + logistic regression, "
          f"not private) {_bag_of_words(args):.4f}")
    for objective in ("prompt", "head"):
        for trains in ("full", "lora"):
            base = summary.get(f"{objective}-{trains}-nonprivate")
            for eps in (3, 8):
                private = summary.get(f"{objective}-{trains}-eps{eps}")
                if base and private:
                    print(f"{objective}-{trains}: DP at epsilon {eps} / non-private = "
                          f"{private[0] / base[0]:.3f}")
    if args.plot:
        _plot(summary, majority, args.plot)


def _bag_of_words(args) -> float:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from tf_megadp.jobs.finetune import data

    task = (data.default_task() if args.train is None else
            data.task_from_files(args.train, args.test))
    vectorizer = TfidfVectorizer(min_df=2)
    train = vectorizer.fit_transform(task.train_texts)
    model = LogisticRegression(max_iter=3000, C=10).fit(train, task.train_labels)
    return float(np.mean(model.predict(vectorizer.transform(task.test_texts))
                         == task.test_labels))


def _plot(summary, majority: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    means = [summary[name][0] for name in names]
    errors = [summary[name][1] for name in names]
    colors = ["tab:blue" if "prompt" in name else "tab:orange" for name in names]
    figure, axis = plt.subplots(figsize=(9, 4))
    axis.bar(range(len(names)), means, yerr=errors, color=colors, capsize=3)
    axis.axhline(majority, color="gray", linestyle="--", label="majority class")
    axis.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    axis.set_ylabel("test accuracy")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["sweep", "grid", "diagnose", "table"])
    parser.add_argument("--init-from", help="the public start's model.keras")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train", help="labelled JSONL/CSV (default: the default task)")
    parser.add_argument("--test")
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS),
                        choices=list(CONDITIONS))
    parser.add_argument("--learning-rates", nargs="+", type=float,
                        default=[3e-4, 1e-3, 3e-3, 1e-2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=float, help="passes over the data (default: the job's)")
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--plot", help="write the bar chart to this PNG")
    parser.add_argument("--lock", help="hold an exclusive flock on this file while each run "
                                       "trains (to share a machine with other jobs)")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.command != "table" and not args.init_from:
        parser.error("--init-from is required for sweep and grid")
    {"sweep": sweep, "grid": grid, "diagnose": diagnose, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
