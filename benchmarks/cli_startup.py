"""Wall-clock seconds of `tf-megadp` commands, each run as a fresh process (issue 43).

The accounting commands (`--help`, `epsilon`, `calibrate`, `plan`) answer a
question about numbers and must not wait for TensorFlow: targets `--help`
under 1 s and `epsilon` under 3 s. A refused `pretrain --resume` (a privacy
setting changed) must fail before the corpus is prepared. The console script
`tf-megadp` runs `tf_megadp_cli.main`; so does every command here, with this
checkout first on the path.

Each figure is the median of --repeats runs (the first run of a command also
warms the OS file cache; all are counted). The reference lines (`python -c
pass`, `import tensorflow`) say what the machine costs: on a 2-core machine
shared with other jobs every figure moves with the load, so compare them
with the reference lines of the same run. Before issue 43 the figures were
7.6 s (`--help`) and 10-17 s (`epsilon`), 11-32 s (`calibrate`), and 39 s
for the refused resume, which prepared the corpus first.

Usage: python benchmarks/cli_startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))
CONSOLE_SCRIPT = "import sys; from tf_megadp_cli import main; sys.exit(main())"
TARGETS_S = {"--help": 1.0, "epsilon": 3.0}

COMMANDS = {
    "--help": ["--help"],
    "epsilon": ["epsilon", "--num-examples", "60000", "--batch-size", "256",
                "--noise-multiplier", "1.1", "--steps", "10000", "--delta", "1e-5"],
    "epsilon --accountant rdp": ["epsilon", "--num-examples", "60000", "--batch-size", "256",
                                 "--noise-multiplier", "1.1", "--steps", "10000",
                                 "--delta", "1e-5", "--accountant", "rdp"],
    "calibrate": ["calibrate", "--target-epsilon", "3", "--num-examples", "60000",
                  "--batch-size", "256", "--epochs", "40", "--delta", "1e-5"],
    "plan": ["plan", str(REPOSITORY / "tpu_configs" / "bert_base_v3_8.yaml")],
}


def _environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPOSITORY)] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p])
    return environment


def seconds(argv: list[str], *, expect_status: int = 0, python: list[str] | None = None) -> float:
    """Wall-clock seconds of one process; its exit status must be `expect_status`."""
    command = [sys.executable, *(python or ["-c", CONSOLE_SCRIPT]), *argv]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPOSITORY, env=_environment(), capture_output=True,
                            text=True)
    elapsed = time.perf_counter() - started
    if result.returncode != expect_status:
        raise SystemExit(f"{' '.join(argv)} exited {result.returncode}, expected "
                         f"{expect_status}:\n{result.stderr[-2000:]}")
    return elapsed


def _refused_resume_argv(folder: str) -> list[str]:
    """`pretrain --resume` of a run folder whose checkpoint index says sigma 1.0, asked 2.0.

    The index is the one a run writes (settings in `extra.config`); the
    refusal needs nothing else, so no run is trained here.
    """
    import tf_megadp_cli  # noqa: F401 (first, as the launcher: this process loads no TensorFlow)
    from tf_megadp.jobs.bert.config import PretrainConfig
    from tf_megadp.jobs.common.run_folder import config_dict

    saved = PretrainConfig(output_dir=folder, noise_multiplier=1.0, target_epsilon=None)
    checkpoint = pathlib.Path(folder, "checkpoint")
    checkpoint.mkdir(parents=True)
    (checkpoint / "training_state.json").write_text(json.dumps(
        {"extra": {"logical_steps": 100, "config": config_dict(saved)}}))
    return ["pretrain", "--output-dir", folder, "--resume", "--noise-multiplier", "2.0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU cores: {os.cpu_count()} (shared with other jobs: figures move with the load); "
          f"load average {os.getloadavg()[0]:.2f}")
    rows = [("python -c pass (reference)", [], {"python": ["-c", "pass"]}),
            ("import tensorflow (reference)", [], {"python": ["-c", "import tensorflow"]})]
    rows += [(f"tf-megadp {name}", argv, {}) for name, argv in COMMANDS.items()]
    with tempfile.TemporaryDirectory() as folder:
        rows.append(("tf-megadp pretrain --resume, refused", _refused_resume_argv(folder),
                     {"expect_status": 2}))
        failed = []
        for name, argv, options in rows:
            figures = [seconds(argv, **options) for _ in range(args.repeats)]
            median = statistics.median(figures)
            target = TARGETS_S.get(name.removeprefix("tf-megadp "))
            verdict = ""
            if target is not None:
                verdict = f"   target < {target:g} s: {'met' if median < target else 'MISSED'}"
                if median >= target:
                    failed.append(name)
            print(f"{name:42s} {median:6.2f} s  (runs: "
                  + ", ".join(f"{f:.2f}" for f in figures) + f"){verdict}")
    if failed:
        print("targets missed: " + ", ".join(failed))


if __name__ == "__main__":
    main()
