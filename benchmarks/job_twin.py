"""The main job's train time beside its non-private twin's (issue 49, item 5).

Runs `tf-megadp pretrain` and `tf-megadp pretrain --non-private` one after
the other (never at once: each uses both cores), with the same extra flags,
each into its own folder, and prints what each run's report.json says:
its train time, the part of it in `fit` (the steps) and in each of the
job's callbacks (evaluation with its checkpoints, the privacy report, the
logs: `train_time_parts_s`), examples/s, held-out MLM accuracy and epsilon,
then the DP / non-private ratios. The 1-minute load is printed before and
after each run: take the figures only from a machine with nothing else
running. Run:

    python benchmarks/job_twin.py                       # the defaults
    python benchmarks/job_twin.py --output-dir /tmp/twin -- --model tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def load_average() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def run_job(output_dir: str, extra: list[str]) -> dict:
    """One `tf-megadp pretrain` run in a new process; its report.json."""
    command = [sys.executable, "-m", "tf_megadp_cli", "pretrain", "--output-dir", output_dir,
               *extra]
    print(f"$ {' '.join(command[2:])}   (load {load_average()})", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    print(f"  {time.perf_counter() - started:.0f} s (load {load_average()})", flush=True)
    with open(os.path.join(output_dir, "report.json")) as handle:
        return json.load(handle)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=None,
                        help="parent of the two runs' folders (default: a new temporary one)")
    parser.add_argument("extra", nargs="*", help="flags for both runs, after --")
    args = parser.parse_args(argv)
    parent = args.output_dir or tempfile.mkdtemp(prefix="job_twin_")
    reports = {"DP": run_job(os.path.join(parent, "dp"), args.extra),
               "non-private": run_job(os.path.join(parent, "np"),
                                      ["--non-private", *args.extra])}
    names = sorted({name for report in reports.values()
                    for name in report["train_time_parts_s"]} - {"fit"})
    rows = [("train time (s)", lambda r: r["train_time_s"]),
            ("  in fit (the steps)", lambda r: r["train_time_parts_s"]["fit"])]
    rows += [(f"  in {name}", lambda r, name=name: r["train_time_parts_s"].get(name, 0.0))
             for name in names]
    rows += [("examples/s", lambda r: r["examples_per_s"]),
             ("held-out MLM accuracy", lambda r: r["heldout_mlm_accuracy"]),
             ("epsilon", lambda r: r["epsilon"] if r["epsilon"] is not None else float("inf"))]
    print(f"\n{'':28} {'DP':>12} {'non-private':>12} {'DP / NP':>8}")
    for label, value in rows:
        dp, twin = value(reports["DP"]), value(reports["non-private"])
        ratio = f"{dp / twin:8.2f}" if twin and twin != float("inf") else ""
        print(f"{label:28} {dp:12.4g} {twin:12.4g} {ratio}")
    print(f"\nreports: {parent}/dp/report.json, {parent}/np/report.json")


if __name__ == "__main__":
    main()
