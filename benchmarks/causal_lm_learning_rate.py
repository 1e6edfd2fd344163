"""The causal-LM job's peak learning rate, DP and non-private, for GPT-2 and Llama.

`tf-megadp causal-lm` at its defaults (nano, the offline default corpus,
300 Poisson steps of B = 256, epsilon 5.36 for the DP runs) with
`--learning-rate` taken from a grid, each run in its own process, one after
the other. The job's defaults are the masked-LM job's rates (DP 8e-3,
non-private 2e-3); this asks whether they hold for decoders, so that the
DP / non-private ratio is taken against a non-private twin at its own best
rate, not a weak one. It prints, per family and kind, each rate's held-out
next-token accuracy and perplexity beside the unigram baseline, epsilon,
and the 1-minute load before and after the run.

Run:

    python benchmarks/causal_lm_learning_rate.py --output-dir runs/causal-lm-lr
    python benchmarks/causal_lm_learning_rate.py --output-dir runs/causal-lm-lr --family llama \\
        --dp-rates 4e-3 8e-3 1.6e-2 --non-private-rates 2e-3 8e-3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def run(folder: str, flags: list[str]) -> tuple[dict, tuple[float, float]]:
    """(report, (load before, load after)) of `tf-megadp causal-lm FLAGS` in `folder`.

    A folder that holds a report is read, not run again (load: NaN).
    """
    report_path = os.path.join(folder, "report.json")
    loads = (float("nan"), float("nan"))
    if not os.path.exists(report_path):
        before = os.getloadavg()[0]
        subprocess.run([sys.executable, "-m", "tf_megadp_cli", "causal-lm", *flags,
                        "--output-dir", folder, "--verbose", "0"], check=True)
        loads = (before, os.getloadavg()[0])
    with open(report_path, encoding="utf-8") as handle:
        return json.load(handle), loads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--family", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--dp-rates", nargs="+", default=["4e-3", "8e-3", "1.6e-2"])
    parser.add_argument("--non-private-rates", nargs="+", default=["2e-3", "8e-3"])
    args = parser.parse_args()
    rows = []
    for family in args.family:
        for private, rates in ((True, args.dp_rates), (False, args.non_private_rates)):
            for rate in rates:
                kind = "dp" if private else "np"
                folder = os.path.join(args.output_dir, f"{family}-{kind}-{rate}")
                flags = ["--family", family, "--learning-rate", rate]
                report, loads = run(folder, flags + ([] if private else ["--non-private"]))
                rows.append((family, kind, rate, report, loads))
                print(f"{family} {kind} {rate}: {report['heldout_accuracy']:.4f}", flush=True)
    print("\n| family | run | learning rate | held-out accuracy | perplexity | unigram | "
          "epsilon | load before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for family, kind, rate, report, (before, after) in rows:
        epsilon = f"{report['epsilon']:.3f}" if report["epsilon"] is not None else "-"
        print(f"| {family} | {'DP' if kind == 'dp' else 'non-private'} | {rate} | "
              f"{report['heldout_accuracy']:.4f} | {report['heldout_perplexity']:.1f} | "
              f"{report['unigram_baseline_accuracy']:.4f} | {epsilon} | "
              f"{before:.2f} / {after:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
