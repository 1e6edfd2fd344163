"""The measurements of docs/results.md: batch size at a fixed privacy budget, and the recipe.

Three studies, each a list of `tf-megadp pretrain` runs on the same corpus
(the offline default corpus), model (BERT-nano, L = 64) and target
(epsilon, delta) = (5.36, 1/N^1.1):

- ``examples``: a fixed number of examples processed (76,800), B from 128 to
  1024 and a growing schedule (the 2026-11-29 table).
- ``steps``: the seed paper's comparison, a fixed number of logical steps
  with B from 128 to 2048 (compute grows with B), the same learning-rate
  rule for every row, and a growing schedule.
- ``recipe``: the main job with one change at a time (weight averaging,
  automatic clipping, learning rate, clip norm), the best combination, and
  the non-private baseline with the same care.
- ``adaptive``: the job's defaults with the fixed clip norm C = 1 against
  adaptive clipping (Andrew et al. 2021, target quantile 0.5) started at
  C = 1 and at C = 0.1, at the same epsilon; the table adds C at every
  evaluation (docs/benchmarks.md, "Adaptive clipping").
- ``nonprivate-lr``: the job's non-private baseline at several learning
  rates, from which its default is chosen (docs/benchmarks.md, "The
  non-private baseline's learning rate").

A "/ non-private" ratio is printed only against a baseline run that
learned (report.json's `learned`, tf_megadp.jobs.bert.baselines): a
baseline stuck at the unigram plateau would flatter every DP row.

Each run writes its own folder under --runs-dir/<study>/<row>; a row whose
report.json exists is not run again. Then the markdown tables of
docs/results.md are printed and the plot written.

    python benchmarks/batch_size_study.py --study recipe            # run, then print
    python benchmarks/batch_size_study.py --study steps --only b256 # one row
    python benchmarks/batch_size_study.py --table-only              # tables from existing runs
    python benchmarks/batch_size_study.py --study recipe --jobs 2   # two runs at a time
    python benchmarks/batch_size_study.py --study adaptive --plot runs/adaptive.png

With --jobs 2 two runs share the 2 cores: their wall times are then not
the time of one run alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

from tf_megadp.jobs.bert.baselines import BaselineDidNotLearnError, accuracy_ratio

EPSILON = 5.36


def _row(label: str, schedule: str, private: bool = True, **flags) -> dict:
    return {"label": label, "schedule": schedule, "private": private, "flags": flags}


def _old_default(steps: int) -> dict:
    """The flags of the 2026-11-29 default (lr 2e-3, warmup and evaluations at 1/12)."""
    return {"learning_rate": 0.002, "warmup_steps": max(1, steps // 12),
            "eval_every": max(1, steps // 12), "ema_momentum": "none",
            "per_example_scaling": "clip", "learning_rate_scaling": "none", "l2_norm_clip": 1.0}


STUDIES = {
    "examples": {
        "nonprivate": _row("non-private, B=256", "300x256", False, **_old_default(300)),
        "dp-b128": _row("DP, B=128", "600x128", **_old_default(600)),
        "dp-b256": _row("DP, B=256", "300x256", **_old_default(300)),
        "dp-b512": _row("DP, B=512", "150x512", **_old_default(150)),
        "dp-b1024": _row("DP, B=1024", "75x1024", **_old_default(75)),
        "dp-growing": _row("DP, growing 128 -> 512", "150x128,75x512", **_old_default(225)),
        "nonprivate-b1024": _row("non-private, B=1024", "75x1024", False, **_old_default(75)),
    },
    # lr 2e-3 (the old default) first; then lr 4e-3, the ablation's better rate.
    "steps": {
        f"{prefix}b{batch}": _row(f"DP, B={batch}, lr {rate:g}", f"100x{batch}",
                                  **{**_old_default(100), "eval_every": 10, "warmup_steps": 8,
                                     "learning_rate": rate})
        for prefix, rate in (("", 0.002), ("lr4-", 0.004))
        for batch in (128, 256, 512, 1024, 2048)
    } | {
        f"{prefix}growing": _row(f"DP, growing 256 -> 1024, lr {rate:g}", "50x256,50x1024",
                                 **{**_old_default(100), "eval_every": 10, "warmup_steps": 8,
                                    "learning_rate": rate})
        for prefix, rate in (("", 0.002), ("lr4-", 0.004))
    },
    "recipe": {
        "baseline": _row("old default (lr 2e-3, C = 1, flat clipping, no EMA)", "300x256",
                         **_old_default(300) | {"warmup_steps": 25, "eval_every": 25}),
        "ema": _row("+ EMA of the weights (momentum 0.98)", "300x256",
                    **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                           "ema_momentum": 0.98}),
        "automatic": _row("+ automatic clipping (gamma 0.01)", "300x256",
                          **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                                 "per_example_scaling": "automatic"}),
        "lr-linear": _row("+ learning rate linear in B (2e-3 at B = 128: 4e-3)", "300x256",
                          **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                                 "learning_rate_scaling": "linear",
                                                 "reference_batch_size": 128}),
        "clip-0.1": _row("+ clip norm C = 0.1", "300x256",
                         **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                                "l2_norm_clip": 0.1}),
        "lr-8e-3": _row("+ learning rate 8e-3 (the new default)", "300x256",
                        **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                               "learning_rate": 0.008}),
        "ema-0.9": _row("+ EMA of the weights (momentum 0.9)", "300x256",
                        **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                               "ema_momentum": 0.9}),
        # The defaults as shipped: a replicate of lr-8e-3 with fresh draws and noise.
        "default": _row("the new default again (no recipe flags; fresh draws and noise)",
                        "300x256"),
        "lr-4e-3-ema-0.9": _row("learning rate 4e-3 + EMA 0.9", "300x256",
                                **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                                       "learning_rate": 0.004,
                                                       "ema_momentum": 0.9}),
        "nonprivate-old": _row("non-private, old default", "300x256", False,
                               **_old_default(300) | {"warmup_steps": 25, "eval_every": 25}),
        "nonprivate-lr-4e-3": _row("non-private, learning rate 4e-3", "300x256", False,
                                   **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                                          "learning_rate": 0.004}),
        "nonprivate-lr-8e-3": _row("non-private, learning rate 8e-3", "300x256", False,
                                   **_old_default(300) | {"warmup_steps": 25, "eval_every": 25,
                                                          "learning_rate": 0.008}),
    },
    # The non-private baseline's own default (issue 41): the job's defaults
    # (300 x 256, warmup 25, evaluations every 25) at several learning rates.
    "nonprivate-lr": {
        f"lr-{rate:g}": _row(f"non-private, learning rate {rate:g}", "300x256", False,
                             learning_rate=rate)
        for rate in (0.002, 0.003, 0.004, 0.006)
    },
    # The shipped defaults (lr 8e-3, 300 x 256, epsilon 5.36) with C fixed or adaptive.
    "adaptive": {
        "fixed-c1": _row("C = 1 fixed (the default)", "300x256"),
        "adaptive-c1": _row("adaptive, C0 = 1, quantile 0.5", "300x256",
                            adaptive_clipping_quantile=0.5),
        "adaptive-c0.1": _row("adaptive, C0 = 0.1, quantile 0.5", "300x256",
                              adaptive_clipping_quantile=0.5, l2_norm_clip=0.1),
        "fixed-c0.1": _row("C = 0.1 fixed", "300x256", l2_norm_clip=0.1),
        # Replicates (the same seed 0, fresh Poisson draws and noise).
        "fixed-c1-again": _row("C = 1 fixed, again", "300x256"),
        "adaptive-c1-again": _row("adaptive, C0 = 1, quantile 0.5, again", "300x256",
                                  adaptive_clipping_quantile=0.5),
    },
}


def command(study: str, name: str, runs_dir: str) -> list[str]:
    """The `tf-megadp pretrain` command line of one row."""
    row = STUDIES[study][name]
    arguments = [sys.executable, "-m", "tf_megadp_cli", "pretrain",
                 "--output-dir", os.path.join(runs_dir, study, name)]
    arguments += ["--schedule", row["schedule"]]
    for flag, value in row["flags"].items():
        arguments += [f"--{flag.replace('_', '-')}", str(value)]
    arguments += ["--target-epsilon", str(EPSILON)] if row["private"] else ["--non-private"]
    return arguments


def load(runs_dir: str, study: str, name: str) -> dict | None:
    path = os.path.join(runs_dir, study, name, "report.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def examples_at(report: dict, step: int) -> float:
    """Expected examples processed after `step` logical steps of the run's schedule."""
    done, total = 0, 0.0
    for phase in report["schedule"]["phases"]:
        take = min(phase["steps"], max(step - done, 0))
        total += take * phase["batch_size"]
        done += phase["steps"]
    return total


def first_reaching(report: dict, accuracy: float) -> tuple[int, float] | None:
    """(step, examples processed) of the first evaluation at `accuracy` or above."""
    for record in report["history"]:
        if record["heldout_mlm_accuracy"] >= accuracy:
            return record["step"], examples_at(report, record["step"])
    return None


def _ratio(report: dict, baseline: dict | None) -> str:
    """The '/ non-private' cell: none without a baseline, or against one that did not learn."""
    if baseline is None:
        return "-"
    try:
        return f"{accuracy_ratio(report, baseline):.2f}"
    except BaselineDidNotLearnError:
        return "none (baseline did not learn)"


def table(runs_dir: str, study: str) -> str:
    """The markdown table of one study, from the runs' report.json files."""
    reports = {name: load(runs_dir, study, name) for name in STUDIES[study]}
    if study == "recipe":
        # The non-private baseline with the same care: the best of its learning rates.
        baseline = max((r for r in reports.values() if r and not r["private"]), default=None,
                       key=lambda r: r["heldout_mlm_accuracy"])
    else:
        baseline = reports.get("nonprivate") if study == "examples" else None
    lines = [
        "| run | schedule | held-out MLM acc. | / non-private | epsilon | delta | sigma "
        "| examples processed | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in STUDIES[study].items():
        report = reports[name]
        if report is None:
            continue
        accuracy = report["heldout_mlm_accuracy"]
        ratio = _ratio(report, baseline)
        schedule = " + ".join(row["schedule"].split(","))
        epsilon = f"{report['epsilon']:.3f}" if report["private"] else "inf"
        delta = f"{report['delta']:.3g}" if report["private"] else "-"
        sigma = f"{report['noise_multiplier']:.3f}" if report["private"] else "0"
        lines.append(
            f"| {row['label']} | {schedule} | {accuracy:.4f} | {ratio} | {epsilon} | {delta} "
            f"| {sigma} | {report['examples_processed_expected']:,.0f} | {report['wall_time_s']:.0f} |"
        )
    if study == "adaptive":
        lines.append("\nC at each evaluation (logical step: C), from report.json's history:")
        for name, report in reports.items():
            if report is not None and report.get("adaptive_clipping"):
                trajectory = ", ".join(f"{h['step']}: {h['clip_norm']:.3g}"
                                       for h in report["history"])
                lines.append(f"- {STUDIES[study][name]['label']}: {trajectory}")
    unigram = next((r["unigram_baseline_accuracy"] for r in reports.values() if r), None)
    if unigram is not None:
        lines.append(f"\nUnigram baseline (always the most frequent token): {unigram:.4f}.")
    if baseline is not None:
        try:
            accuracy_ratio(baseline, baseline)
        except BaselineDidNotLearnError as error:
            lines.append(f"\nNo ratio to the non-private baseline: {error}")
    if study == "steps" and reports.get("growing"):
        target = reports["growing"]["heldout_mlm_accuracy"]
        lines.append(f"\nFirst evaluation at or above the growing schedule's final accuracy "
                     f"({target:.4f}):")
        for name, report in reports.items():
            if report is None:
                continue
            reached = first_reaching(report, target)
            lines.append(f"- {STUDIES[study][name]['label']}: "
                         + (f"step {reached[0]}, {reached[1]:,.0f} examples processed"
                            if reached else "never"))
    return "\n".join(lines)


def plot(runs_dir: str, path: str) -> None:
    """Held-out accuracy against examples processed, one panel per study."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = [s for s in STUDIES if any(load(runs_dir, s, n) for n in STUDIES[s])]
    if not studies:
        return
    figure, axes = plt.subplots(1, len(studies), figsize=(6 * len(studies), 4.2), squeeze=False)
    for axis, study in zip(axes[0], studies):
        unigram = None
        for name, row in STUDIES[study].items():
            report = load(runs_dir, study, name)
            if report is None:
                continue
            unigram = report["unigram_baseline_accuracy"]
            history = report["history"]
            axis.plot([examples_at(report, h["step"]) for h in history],
                      [h["heldout_mlm_accuracy"] for h in history], "o-", ms=3,
                      label=row["label"] if len(row["label"]) < 40 else name)
        if unigram is not None:
            axis.axhline(unigram, color="gray", ls=":", label="unigram baseline")
        axis.set_xlabel("examples processed")
        axis.set_ylabel("held-out MLM accuracy")
        axis.set_title(f"study '{study}' (DP rows at epsilon = {EPSILON})", fontsize=10)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def _run(study: str, name: str, runs_dir: str) -> None:
    arguments = command(study, name, runs_dir)
    print("$", " ".join(arguments[1:]), flush=True)
    with open(os.path.join(runs_dir, study, f"{name}.log"), "w") as log:
        subprocess.run(arguments, check=True, stdout=log, stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", default="runs/batch_size_study")
    parser.add_argument("--study", choices=list(STUDIES), nargs="+", default=list(STUDIES))
    parser.add_argument("--only", nargs="+", help="row names of the chosen studies")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--plot", default="docs/results.png")
    args = parser.parse_args()
    if not args.table_only:
        todo = [(study, name) for study in args.study for name in STUDIES[study]
                if (not args.only or name in args.only) and load(args.runs_dir, study, name) is None]
        for study in args.study:
            os.makedirs(os.path.join(args.runs_dir, study), exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(_run, study, name, args.runs_dir) for study, name in todo]:
                future.result()
    for study in args.study:
        print(f"\n## {study}\n")
        print(table(args.runs_dir, study))
    plot(args.runs_dir, args.plot)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
