"""The one-run audit table of docs/audit.md: lower bounds beside the accountant's epsilon.

For epsilon 2 and 8 (delta 1e-6), trains the tiny audit run of
`tf_megadp.audit.audit_run` (a linear model, q = 0.005, T = 1000 steps,
m = 5000 canaries) with the correct DP step and with each planted bug,
once with white-box gradient canaries and once with input canaries (scored
white-box and black-box), plus a noise-free run for the ceiling that m
canaries allow. Every run draws its coins, noise and sampling from OS
entropy, as a real audit does; each configuration is repeated `--repeats`
times with fresh randomness. Results go to RUNS_DIR/results.json (runs
already there are not redone) and the markdown table is printed.

    python benchmarks/one_run_audit_study.py                 # ~10 min on 2 cores
    python benchmarks/one_run_audit_study.py --table-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

EPSILONS = (2.0, 8.0)
STEPS = (None, "halved-noise", "double-counted", "unclipped-example")
KINDS = ("gradient", "input")
SETTINGS = dict(delta=1e-6, num_canaries=5000, steps=1000, sampling_rate=0.005)


def _key(epsilon, kind, bug, repeat):
    return f"eps{epsilon:g}/{kind}/{bug or 'correct'}/{repeat}"


def run_all(path: str, repeats: int) -> dict:
    from tf_megadp.audit.audit_run import one_run_audit_run
    from tf_megadp.files import write_json_atomically

    results = {}
    if os.path.exists(path):
        with open(path) as handle:
            results = json.load(handle)
    sigmas: dict = {}
    for repeat in range(repeats):
        for epsilon in EPSILONS:
            for kind in KINDS:
                for bug in STEPS:
                    key = _key(epsilon, kind, bug, repeat)
                    if key in results:
                        sigmas.setdefault((epsilon, kind), results[key]["noise_multiplier"])
                        continue
                    print(f"$ {key}", flush=True)
                    report = one_run_audit_run(
                        target_epsilon=epsilon, canaries=kind, planted_bug=bug,
                        noise_multiplier=sigmas.get((epsilon, kind)), log=lambda line: None,
                        **SETTINGS)
                    sigmas.setdefault((epsilon, kind), report["noise_multiplier"])
                    results[key] = report
                    write_json_atomically(path, results)
        for kind in KINDS:
            key = f"nonprivate/{kind}/correct/{repeat}"
            if key not in results:
                print(f"$ {key}", flush=True)
                results[key] = one_run_audit_run(canaries=kind, noise_multiplier=0.0,
                                                 log=lambda line: None, **SETTINGS)
                write_json_atomically(path, results)
    return results


def _cell(values):
    if not values:
        return "-"
    values = sorted(values)
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{sum(values) / len(values):.2f} [{values[0]:.2f}, {values[-1]:.2f}]"


def table(results: dict) -> str:
    def bounds(prefix, kind, bug, attack):
        return [report[attack]["epsilon_lower_bound"]
                for key, report in results.items()
                if key.startswith(f"{prefix}/{kind}/{bug or 'correct'}/") and attack in report]

    labels = {None: "correct step", "halved-noise": "bug: noise multiplier halved",
              "double-counted": "bug: every example twice in one noisy sum",
              "unclipped-example": "bug: first example of each micro-batch unclipped"}
    lines = [
        "| DP step | theoretical eps | white-box, gradient canaries | white-box, input canaries "
        "| black-box, input canaries | runs |",
        "|---|---|---|---|---|---|",
    ]
    for epsilon in EPSILONS:
        prefix = f"eps{epsilon:g}"
        for bug in STEPS:
            claimed = [report["theoretical_epsilon"] for key, report in results.items()
                       if key.startswith(f"{prefix}/") and f"/{bug or 'correct'}/" in key]
            if not claimed:
                continue
            runs = len(bounds(prefix, "gradient", bug, "white_box"))
            lines.append(
                f"| {labels[bug]} | {sum(claimed) / len(claimed):.2f} "
                f"| {_cell(bounds(prefix, 'gradient', bug, 'white_box'))} "
                f"| {_cell(bounds(prefix, 'input', bug, 'white_box'))} "
                f"| {_cell(bounds(prefix, 'input', bug, 'black_box'))} | {runs} |")
    if any(key.startswith("nonprivate/") for key in results):
        lines.append(
            f"| no noise (sigma = 0) | inf "
            f"| {_cell(bounds('nonprivate', 'gradient', None, 'white_box'))} "
            f"| {_cell(bounds('nonprivate', 'input', None, 'white_box'))} "
            f"| {_cell(bounds('nonprivate', 'input', None, 'black_box'))} "
            f"| {len(bounds('nonprivate', 'gradient', None, 'white_box'))} |")
    return "\n".join(lines)


def ceilings() -> str:
    """What m canaries can certify at most (all guesses of the best rule right)."""
    from tf_megadp.audit.one_run import default_guesses, one_run_epsilon_lower_bound

    m, delta = SETTINGS["num_canaries"], SETTINGS["delta"]
    rules = default_guesses(m)
    parts = []
    for attacks in (1, 2):
        confidence = 1 - 0.05 / (len(rules) * attacks)
        best = max(one_run_epsilon_lower_bound(m, k, k, delta=delta, confidence=confidence)
                   for k, _ in rules)
        parts.append(f"{best:.2f} with {attacks} attack(s)")
    return f"ceiling for m = {m}: " + ", ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", default="runs/one_run_audit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    path = os.path.join(args.runs_dir, "results.json")
    if args.table_only:
        with open(path) as handle:
            results = json.load(handle)
    else:
        os.makedirs(args.runs_dir, exist_ok=True)
        results = run_all(path, args.repeats)
    print(table(results))
    print(ceilings())
    seconds = [r["seconds"] for r in results.values() if math.isfinite(r.get("seconds", math.nan))]
    print(f"{len(seconds)} runs, {sum(seconds) / max(len(seconds), 1):.1f} s each on average")
    return 0


if __name__ == "__main__":
    sys.exit(main())
