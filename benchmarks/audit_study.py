"""The audit table of docs/audit.md: what attackers learn, non-private vs DP.

Trains the default `tf-megadp pretrain` job with 10 canaries per repetition
count (r = 1, 4, 16; plus 10 never-inserted controls) in its training split:
non-private, and DP at two target epsilons; then the same job on a 10x
smaller corpus, non-private and DP. Then runs
`tf-megadp audit` on each and prints the markdown table. Runs whose
report.json / audit.json exist are not redone.

    python benchmarks/audit_study.py               # ~40 min on 2 cores
    python benchmarks/audit_study.py --table-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

CANARIES = 10
# name -> (label, extra pretrain arguments)
ROWS = {
    "nonprivate": ("non-private", ["--non-private"]),
    "dp-eps5.36": ("DP, epsilon 5.36", ["--target-epsilon", "5.36"]),
    "dp-eps1": ("DP, epsilon 1", ["--target-epsilon", "1"]),
    # The same job on a 10x smaller corpus: ~35 passes over the data, so a
    # non-private model memorizes; does DP stop it?
    "nonprivate-small": ("non-private, small corpus", ["--non-private", "--max-characters", "300000"]),
    "dp-eps5.36-small": ("DP, epsilon 5.36, small corpus",
                         ["--target-epsilon", "5.36", "--max-characters", "300000"]),
}


def run(runs_dir: str, name: str) -> None:
    folder = os.path.join(runs_dir, name)
    cli = [sys.executable, "-m", "tf_megadp_cli"]
    if not os.path.exists(os.path.join(folder, "report.json")):
        arguments = cli + ["pretrain", "--canaries", str(CANARIES), "--output-dir", folder,
                           *ROWS[name][1]]
        print("$", " ".join(arguments[1:]), flush=True)
        subprocess.run(arguments, check=True, stdout=subprocess.DEVNULL)
    if not os.path.exists(os.path.join(folder, "audit.json")):
        arguments = cli + ["audit", folder]
        print("$", " ".join(arguments[1:]), flush=True)
        subprocess.run(arguments, check=True, stdout=subprocess.DEVNULL)


def table(runs_dir: str) -> str:
    lines = [
        "| run | N | held-out MLM acc. | exposure r=1 | r=4 | r=16 | controls | MIA AUC "
        "| TPR @ 1% FPR | TPR @ 0.1% FPR | empirical eps (LB, MIA) | canary eps LB r=16 "
        "| theoretical eps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (label, _) in ROWS.items():
        path = os.path.join(runs_dir, name, "audit.json")
        if not os.path.exists(path):
            continue
        with open(path) as handle:
            audit = json.load(handle)
        with open(os.path.join(runs_dir, name, "report.json")) as handle:
            num_examples = json.load(handle)["num_examples"]
        epsilon = audit["theoretical_epsilon"]
        epsilon = "inf" if epsilon is None or math.isinf(float(epsilon)) else f"{float(epsilon):.2f}"
        lines.append(
            f"| {label} | {num_examples:,} | {audit['heldout_mlm_accuracy']:.4f} "
            + " ".join(f"| {audit[f'exposure_r{r}_mean']:.2f}" for r in (1, 4, 16, 0))
            + f" | {audit['mia_auc']:.3f} | {audit['mia_tpr_at_fpr_0.01']:.3f} "
            f"| {audit['mia_tpr_at_fpr_0.001']:.3f} | {audit.get('mia_eps_lower_bound', float('nan')):.2f} "
            f"| {audit.get('canary_eps_lower_bound_r16', float('nan')):.2f} | {epsilon} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", default="runs/audit_study")
    parser.add_argument("--only", nargs="+", choices=list(ROWS))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if not args.table_only:
        for name in args.only or ROWS:
            run(args.runs_dir, name)
    print(table(args.runs_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
