"""Causal-LM pretraining with the user as the privacy unit, against the packed sequence.

The offline default corpus of `tf-megadp causal-lm` (docstrings of the
installed packages, read at run time: no text is stored in this
repository) is written as JSONL with pseudo-users assigned round-robin,
document i to user i mod `--users`. The script then runs `tf-megadp
causal-lm` at its defaults on that file three times, each in its own
process: sequence-level (one packed sequence the unit), user-level
(`--privacy-unit user`, N = the users, delta the job's default 1 / N^1.1),
and user-level at the sequence-level run's delta. It prints each report's
held-out next-token accuracy and perplexity beside the unigram baseline,
with N, sigma, epsilon and delta.

Run:

    python benchmarks/causal_lm_privacy_unit.py --output-dir runs/causal-lm-units
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Build the corpus without TensorFlow: this process only writes text and
# starts the runs (each run is its own TensorFlow process).
import tf_megadp_cli  # noqa: F401 (sets DEFER_LIBRARY_IMPORT before tf_megadp is imported)


def write_user_corpus(path: str, users: int) -> tuple[int, int]:
    """Writes the default corpus as JSONL {"text", "user"}, document i by user i mod `users`.

    Args:
        path: the JSONL file to write.
        users: the number of pseudo-users.

    Returns:
        (documents, characters) written.
    """
    from tf_megadp.jobs.bert.corpus import default_corpus_documents
    from tf_megadp.jobs.causal_lm.config import CausalLMConfig

    documents = default_corpus_documents(CausalLMConfig().max_characters)
    with open(path, "w", encoding="utf-8") as handle:
        for index, text in enumerate(documents):
            handle.write(json.dumps({"text": text, "user": f"u{index % users:05d}"}) + "\n")
    return len(documents), sum(len(text) for text in documents)


def run(folder: str, flags: list[str]) -> dict:
    """The report of `tf-megadp causal-lm FLAGS --output-dir folder` (run unless it exists)."""
    if not os.path.exists(os.path.join(folder, "report.json")):
        subprocess.run([sys.executable, "-m", "tf_megadp_cli", "causal-lm", *flags,
                        "--output-dir", folder, "--verbose", "0"], check=True)
    with open(os.path.join(folder, "report.json"), encoding="utf-8") as handle:
        return json.load(handle)


def main(argv=None) -> dict[str, dict]:
    """Writes the corpus, runs the three settings, prints the table; returns the reports."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/causal-lm-units")
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--cache-dir", default=None,
                        help="the prepared corpora's cache (default ~/.cache/tf_megadp)")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    corpus = os.path.join(args.output_dir, f"users{args.users}.jsonl")
    documents, characters = write_user_corpus(corpus, args.users)
    print(f"{documents:,} documents ({characters:,} characters), {args.users:,} pseudo-users",
          flush=True)
    common = ["--corpus", corpus] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    reports = {"sequence": run(os.path.join(args.output_dir, "sequence"), common)}
    user = common + ["--privacy-unit", "user"]
    reports["user"] = run(os.path.join(args.output_dir, "user"), user)
    reports["user, sequence run's delta"] = run(
        os.path.join(args.output_dir, "user-same-delta"),
        user + ["--delta", repr(reports["sequence"]["delta"])])
    print("| unit | N | held-out accuracy | perplexity | unigram accuracy | sigma | epsilon "
          "| delta |")
    print("|---|---|---|---|---|---|---|---|")
    for name, report in reports.items():
        print(f"| {name} | {report['num_examples']:,} | {report['heldout_accuracy']:.4f} | "
              f"{report['heldout_perplexity']:.1f} | {report['unigram_baseline_accuracy']:.4f} "
              f"| {report['noise_multiplier']:.4f} | {report['epsilon']:.3f} | "
              f"{report['delta']:.3g} |")
    return reports


if __name__ == "__main__":
    main()
