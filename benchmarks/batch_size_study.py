"""The seed paper's claim at CPU scale: at one (epsilon, delta) and one budget of
examples processed, does a larger logical batch give better MLM accuracy, and
does a growing batch get there cheaper?

Runs `tf-megadp pretrain` once per row (non-private; DP at several constant
batch sizes; DP with a growing schedule), every row on the same corpus,
model, optimizer, learning rate, target epsilon and delta, and with the same
expected number of examples processed. Each run writes its own folder under
--runs-dir; a row whose report.json exists is not run again. Then prints the
markdown table of docs/results.md and writes the plot.

    python benchmarks/batch_size_study.py                 # all rows, ~35 min on 2 cores
    python benchmarks/batch_size_study.py --only dp-b256  # one row
    python benchmarks/batch_size_study.py --table-only    # table from existing runs

Runs one job at a time on purpose: wall time is a column of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

EXAMPLES = 76_800  # the default run's budget: 300 steps of B = 256
EPSILON = 5.36
LEARNING_RATE = 2e-3

# name -> (label, phases [(steps, batch)], private)
ROWS = {
    "nonprivate": ("non-private, B=256", [(300, 256)], False),
    "dp-b128": ("DP, B=128", [(600, 128)], True),
    "dp-b256": ("DP, B=256", [(300, 256)], True),
    "dp-b512": ("DP, B=512", [(150, 512)], True),
    "dp-b1024": ("DP, B=1024", [(75, 1024)], True),
    "dp-growing": ("DP, growing 128 -> 512", [(150, 128), (75, 512)], True),
    # Control: is a large batch's handicap privacy, or too few optimizer steps?
    "nonprivate-b1024": ("non-private, B=1024", [(75, 1024)], False),
}


def command(name: str, runs_dir: str) -> list[str]:
    _, phases, private = ROWS[name]
    steps = sum(s for s, _ in phases)
    arguments = [
        sys.executable, "-m", "tf_megadp_cli", "pretrain",
        "--output-dir", os.path.join(runs_dir, name),
        "--learning-rate", str(LEARNING_RATE),
        # Warmup is the same share (1/12) of every run.
        "--warmup-steps", str(max(1, steps // 12)),
        "--eval-every", str(max(1, steps // 12)),
    ]
    if len(phases) == 1:
        arguments += ["--steps", str(phases[0][0]), "--batch-size", str(phases[0][1])]
    else:
        arguments += ["--schedule", ",".join(f"{s}x{b}" for s, b in phases)]
    arguments += ["--non-private"] if not private else ["--target-epsilon", str(EPSILON)]
    return arguments


def load(runs_dir: str, name: str) -> dict | None:
    path = os.path.join(runs_dir, name, "report.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def table(runs_dir: str) -> str:
    reports = {name: load(runs_dir, name) for name in ROWS}
    baseline = reports.get("nonprivate")  # the private/non-private ratio is against B=256
    lines = [
        "| run | schedule | held-out MLM acc. | / non-private | epsilon | delta | sigma "
        "| examples processed | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (label, phases, _) in ROWS.items():
        report = reports[name]
        if report is None:
            continue
        accuracy = report["heldout_mlm_accuracy"]
        ratio = accuracy / baseline["heldout_mlm_accuracy"] if baseline else float("nan")
        schedule = " + ".join(f"{s}x{b}" for s, b in phases)
        epsilon = f"{report['epsilon']:.3f}" if report["private"] else "inf"
        delta = f"{report['delta']:.3g}" if report["private"] else "-"
        sigma = f"{report['noise_multiplier']:.3f}" if report["private"] else "0"
        lines.append(
            f"| {label} | {schedule} | {accuracy:.4f} | {ratio:.2f} | {epsilon} | {delta} "
            f"| {sigma} | {report['examples_processed_expected']:,.0f} | {report['wall_time_s']:.0f} |"
        )
    unigram = next((r["unigram_baseline_accuracy"] for r in reports.values() if r), None)
    if unigram is not None:
        lines.append(f"\nUnigram baseline (always the most frequent token): {unigram:.4f}.")
    return "\n".join(lines)


def plot(runs_dir: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for name, (label, _, _) in ROWS.items():
        report = load(runs_dir, name)
        if report is None:
            continue
        history = report["history"]
        # Examples processed so far: the schedule's expected batch summed over steps.
        phases = report["schedule"]["phases"]
        def examples_at(step):
            done, total = 0, 0.0
            for phase in phases:
                take = min(phase["steps"], max(step - done, 0))
                total += take * phase["batch_size"]
                done += phase["steps"]
            return total
        axis.plot([examples_at(h["step"]) for h in history],
                  [h["heldout_mlm_accuracy"] for h in history], "o-", ms=3, label=label)
    unigram = next((load(runs_dir, n)["unigram_baseline_accuracy"] for n in ROWS if load(runs_dir, n)), None)
    if unigram is not None:
        axis.axhline(unigram, color="gray", ls=":", label="unigram baseline")
    axis.set_xlabel("examples processed")
    axis.set_ylabel("held-out MLM accuracy")
    axis.set_title(f"BERT-nano, default corpus; DP rows at epsilon = {EPSILON}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", default="runs/batch_size_study")
    parser.add_argument("--only", nargs="+", choices=list(ROWS))
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--plot", default="docs/results.png")
    args = parser.parse_args()
    if not args.table_only:
        for name in args.only or ROWS:
            if load(args.runs_dir, name) is not None:
                continue
            arguments = command(name, args.runs_dir)
            print("$", " ".join(arguments[1:]), flush=True)
            subprocess.run(arguments, check=True, stdout=subprocess.DEVNULL)
    print(table(args.runs_dir))
    plot(args.runs_dir, args.plot)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
