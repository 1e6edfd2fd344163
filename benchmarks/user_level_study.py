"""User level against sequence level: the main job on a corpus with skewed units.

The corpus is generated (`tf_megadp.jobs.bert.text.write_synthetic_corpus`,
no third-party text) and its documents are given to users with a skewed
distribution: a few prolific users write most of it, most users a handful of
documents. The JSONL corpus names each document's user in a `user` field.
Two `tf-megadp pretrain` runs (in this process) at the SAME noise
multiplier and number of logical steps:

- ``sequence``: the default unit, one sequence of L tokens; B sequences per
  step. Its epsilon bounds what one sequence risks; what one user of n
  training sequences risks follows by group privacy only: (n epsilon,
  n e^((n-1) epsilon) delta), given for the most prolific user.
- ``user``: `--privacy-unit user --examples-per-unit K`: B_u users per step,
  B_u chosen so that a step holds about as many sequences as the sequence
  run's (B_u = B / E[min(n_u, K)]); epsilon bounds what one user risks.

Both report held-out MLM accuracy (each on its own held-out split of the same
corpus: the user run packs no sequence across two users, the sequence run
packs the stream of all documents) and the unigram baseline. The markdown
table of docs/benchmarks.md is printed and written to --output as JSON.

    python benchmarks/user_level_study.py                     # both runs, then the table
    python benchmarks/user_level_study.py --steps 40 --model pico   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs-dir", default="runs/user_level_study")
    parser.add_argument("--output", default=None, help="default: RUNS_DIR/results.json")
    parser.add_argument("--corpus-bytes", type=int, default=1_500_000)
    parser.add_argument("--heavy-users", type=int, default=8,
                        help="prolific users, who share --heavy-share of the documents")
    parser.add_argument("--heavy-share", type=float, default=0.4)
    parser.add_argument("--model", default="nano")
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256, help="B of the sequence run")
    parser.add_argument("--micro-batch-size", type=int, default=64, help="rows")
    parser.add_argument("--examples-per-unit", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5, help="the same for both runs")
    parser.add_argument("--learning-rate", type=float, default=8e-3)
    parser.add_argument("--only", choices=("sequence", "user"), default=None)
    return parser.parse_args(argv)


def write_skewed_corpus(folder: str, size_bytes: int, heavy_users: int, heavy_share: float,
                        seed: int = 0) -> tuple[str, dict]:
    """A JSONL corpus whose documents are written by users of very unequal output.

    `heavy_share` of the documents go to `heavy_users` users (evenly); every
    other user writes 1 to 4 documents.

    Returns:
        (path of the JSONL file, {"documents", "users", "largest_user"}).
    """
    from tf_megadp.jobs.bert import text

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "skewed_users.jsonl")
    plain = os.path.join(folder, "documents.txt")
    text.write_synthetic_corpus(plain, size_bytes, separator="line", seed=seed)
    with open(plain, encoding="utf-8") as handle:
        documents = [line.strip() for line in handle if line.strip()]
    rng = np.random.default_rng(seed)
    heavy = int(len(documents) * heavy_share)
    users = list(rng.integers(0, heavy_users, heavy))
    next_user = heavy_users
    while len(users) < len(documents):
        users.extend([next_user] * int(rng.integers(1, 5)))
        next_user += 1
    users = np.array(users[:len(documents)])
    rng.shuffle(users)
    with open(path, "w", encoding="utf-8") as handle:
        for document, user in zip(documents, users):
            handle.write(json.dumps({"text": document, "user": f"u{user:06d}"}) + "\n")
    counts = np.bincount(users)
    return path, {"documents": len(documents), "users": int(np.count_nonzero(counts)),
                  "largest_user_documents": int(counts.max())}


def run(name: str, args, corpus: str, **overrides) -> dict:
    from tf_megadp.jobs.bert.pretraining import PretrainConfig, run_pretraining

    output = os.path.join(args.runs_dir, name)
    report_path = os.path.join(output, "report.json")
    if os.path.isfile(report_path):
        with open(report_path, encoding="utf-8") as handle:
            return json.load(handle)
    settings = dict(
        corpus=[corpus], output_dir=output, cache_dir=os.path.join(args.runs_dir, "cache"),
        model=args.model, sequence_length=args.sequence_length,
        micro_batch_size=args.micro_batch_size, batch_size=args.batch_size, steps=args.steps,
        noise_multiplier=args.noise_multiplier, target_epsilon=None, delta=args.delta,
        learning_rate=args.learning_rate, eval_every=max(1, args.steps // 3), verbose=0)
    settings.update(overrides)
    started = time.time()
    report = run_pretraining(PretrainConfig(**settings), log=print)
    print(f"{name}: {time.time() - started:.0f} s")
    return report


def group_privacy(epsilon: float, delta: float, n: int) -> tuple[float, float]:
    """(epsilon, delta) for a group of n units of an (epsilon, delta)-DP mechanism."""
    exponent = (n - 1) * epsilon + math.log(n * delta)
    return n * epsilon, math.exp(exponent) if exponent < 700 else math.inf


def main(argv=None) -> dict:
    args = parse_args(argv)
    corpus, stats = write_skewed_corpus(os.path.join(args.runs_dir, "corpus"),
                                        args.corpus_bytes, args.heavy_users, args.heavy_share)
    print(f"corpus: {stats}")
    k = args.examples_per_unit
    results = {"corpus": stats, "settings": vars(args)}

    # The user run's corpus first: its units say how many sequences each user wrote.
    from tf_megadp.jobs.bert.units import load_unit_ids
    from tf_megadp.jobs.bert.pretraining import PretrainConfig, prepare_data

    user_settings = dict(corpus=[corpus], cache_dir=os.path.join(args.runs_dir, "cache"),
                         sequence_length=args.sequence_length, privacy_unit="user",
                         examples_per_unit=k)
    _, train, _ = prepare_data(PretrainConfig(**user_settings))
    sizes = np.bincount(load_unit_ids(train))
    sizes = sizes[sizes > 0]
    rows_per_user = float(np.mean(np.minimum(sizes, k)))
    user_batch = max(1, round(args.batch_size / rows_per_user))
    results["user_sequences"] = {"users": int(sizes.size), "sequences": int(sizes.sum()),
                                 "largest_user_sequences": int(sizes.max()),
                                 "mean_rows_per_sampled_user": rows_per_user}

    if args.only in (None, "sequence"):
        results["sequence"] = run("sequence", args, corpus)
    if args.only in (None, "user"):
        results["user"] = run(
            "user", args, corpus, privacy_unit="user", examples_per_unit=k,
            batch_size=user_batch, micro_batch_size=max(1, args.micro_batch_size // k))
    output = args.output or os.path.join(args.runs_dir, "results.json")
    with open(output, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2, default=str)
    print(table(results))
    return results


def table(results: dict) -> str:
    largest = results["user_sequences"]["largest_user_sequences"]
    lines = [
        "| unit | N (units) | B per step | sigma | steps | epsilon per own unit | "
        "epsilon per user | held-out MLM accuracy | unigram baseline | train time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("sequence", "user"):
        report = results.get(name)
        if report is None:
            continue
        epsilon, delta = report["epsilon"], report["delta"]
        if name == "sequence":
            group_epsilon, group_delta = group_privacy(epsilon, delta, largest)
            bound = f"delta {group_delta:.2g}" if group_delta < 1 else "delta > 1: vacuous"
            per_user = (f"{group_epsilon:.1f} at {bound} (group privacy over the "
                        f"{largest} sequences of the most prolific user)")
        else:
            per_user = f"{epsilon:.2f} at delta {delta:.2g}"
        batch = report["schedule"]["phases"][0]["batch_size"]
        lines.append(
            f"| {report.get('privacy_unit', 'sequence')} | {report['num_examples']:,} | "
            f"{batch} | {report['noise_multiplier']:.3g} | {report['logical_steps']} | "
            f"{epsilon:.2f} | {per_user} | {report['heldout_mlm_accuracy']:.4f} | "
            f"{report['unigram_baseline_accuracy']:.4f} | {report['train_time_s']:.0f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
