"""DP fine-tuning of a causal-LM release on prompt/completion pairs, against its non-private twin.

The pairs come from text no public pretraining corpus of this project
reads: the fine-tuning job's default task (first paragraphs of scipy,
scikit-learn and matplotlib docstrings, anonymised;
`tf_megadp.jobs.finetune.data.default_task`). Each text gives one pair:
its first `--prompt-words` words are the prompt, the next
`--completion-words` the completion. The script writes the pairs, runs
`tf-megadp causal-lm --init-from RELEASE --train PAIRS` privately (the
release's ledger composed: `--target-epsilon` bounds the whole) and with
`--non-private`, each in its own process, and prints both reports' held-out
completion-token accuracy and perplexity beside the unigram baseline. With
`--lora-rank R` it runs both again with LoRA factors of rank R (every other
weight of the release frozen).

Run (RELEASE: the model.keras of a `tf-megadp causal-lm` run):

    python benchmarks/causal_lm_finetune.py --init-from runs/causal-lm-dp/model.keras \\
        --output-dir runs/causal-lm-finetune [--lora-rank 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def write_pairs(path: str, prompt_words: int, completion_words: int) -> tuple[int, int]:
    """Writes train.jsonl and test.jsonl of the default task's texts; their pair counts."""
    from tf_megadp.jobs.finetune.data import default_task

    task = default_task()
    counts = []
    for name, texts in (("train", task.train_texts), ("test", task.test_texts)):
        lines = []
        for text in texts:
            words = text.split()
            if len(words) < prompt_words + 1:
                continue
            lines.append(json.dumps({
                "prompt": " ".join(words[:prompt_words]),
                "completion": " ".join(words[prompt_words:prompt_words + completion_words])}))
        with open(os.path.join(path, f"{name}.jsonl"), "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        counts.append(len(lines))
    return counts[0], counts[1]


def main(argv=None) -> None:
    """Writes the pairs, runs the private and the non-private fine-tuning, prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init-from", required=True)
    parser.add_argument("--output-dir", default="runs/causal-lm-finetune")
    parser.add_argument("--prompt-words", type=int, default=6)
    parser.add_argument("--completion-words", type=int, default=6)
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="also run both with LoRA factors of this rank")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    train, test = write_pairs(args.output_dir, args.prompt_words, args.completion_words)
    print(f"{train} training and {test} test pairs", flush=True)
    common = ["--init-from", args.init_from,
              "--train", os.path.join(args.output_dir, "train.jsonl"),
              "--test", os.path.join(args.output_dir, "test.jsonl"),
              "--sequence-length", "32", "--steps", str(args.steps),
              "--batch-size", str(args.batch_size), "--eval-every", str(args.steps),
              "--verbose", "0"]
    runs = {"DP": ["--target-epsilon", str(args.target_epsilon)], "non-private": ["--non-private"]}
    if args.lora_rank:
        lora = ["--lora-rank", str(args.lora_rank)]
        runs.update({f"DP LoRA {args.lora_rank}": runs["DP"] + lora,
                     f"non-private LoRA {args.lora_rank}": runs["non-private"] + lora})
    reports = {}
    for name, flags in runs.items():
        folder = os.path.join(args.output_dir, name.replace(" ", "-"))
        if not os.path.exists(os.path.join(folder, "report.json")):
            subprocess.run([sys.executable, "-m", "tf_megadp_cli", "causal-lm", *common, *flags,
                            "--output-dir", folder], check=True)
        with open(os.path.join(folder, "report.json"), encoding="utf-8") as handle:
            reports[name] = json.load(handle)
    print("| run | trains (parameters) | completion-token accuracy | perplexity | epsilon | "
          "unigram accuracy | train time |")
    print("|---|---|---|---|---|---|---|")
    for name, report in reports.items():
        epsilon = f"{report['epsilon']:.3f}" if report["epsilon"] is not None else "-"
        print(f"| {name} | {report['trains']} ({report['trainable_parameters']:,}) | "
              f"{report['heldout_accuracy']:.4f} | {report['heldout_perplexity']:.1f} | "
              f"{epsilon} | {report['unigram_baseline_accuracy']:.4f} | "
              f"{report['train_time_s']:.1f} s |")


if __name__ == "__main__":
    main()
