"""Specification of the `tf-megadp` command line (epsilon, calibrate)."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys

import dp_accounting
import pytest
import yaml
from dp_accounting import rdp

from tf_megadp import BatchSizeSchedule, cli, compute_epsilon

RUN = ["--num-examples", "60000", "--batch-size", "256", "--steps", "1000", "--delta", "1e-5"]


def run(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def rdp_epsilon(events, delta):
    return rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)


def poisson(steps, q, sigma):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)


def test_epsilon_json_matches_dp_accounting(capsys):
    status, out, err = run(capsys, "epsilon", *RUN, "--noise-multiplier", "1.1",
                           "--accountant", "rdp", "--json")
    assert status == 0 and err == ""
    report = json.loads(out)
    assert report["epsilon"] == pytest.approx(
        rdp_epsilon([poisson(1000, 256 / 60000, 1.1)], 1e-5), rel=1e-12)
    assert (report["delta"], report["steps"], report["accountant"]) == (1e-5, 1000, "rdp")
    assert report["privacy_unit"] == "example"


def test_epsilon_of_bandmf_with_cycles_matches_the_amplified_event(capsys):
    from tf_megadp.accounting import matrix_factorization as mf

    status, out, err = run(capsys, "epsilon", *RUN, "--noise-multiplier", "1.1",
                           "--accountant", "rdp", "--noise", "bandmf", "--bands", "4",
                           "--cycle-length", "4", "--json")
    assert status == 0 and err == ""
    report = json.loads(out)
    assert report["epsilon"] == pytest.approx(rdp_epsilon([mf.cyclic_poisson_event(
        1.1, num_examples=60000, batch_size=256, steps=1000, cycle_length=4, num_bands=4)],
        1e-5), rel=1e-12)
    [entry] = report["ledger"]
    # The noise record: BandMF's kind, its bands and the hash of its strategy.
    record = json.loads(entry["noise"])
    assert (record["kind"], record["num_bands"], entry["cycle_length"],
            entry["segment_start"]) == ("bandmf", 4, 4, True)
    status, out, _ = run(capsys, "epsilon", *RUN, "--noise-multiplier", "1.1",
                         "--accountant", "rdp", "--noise", "bandmf", "--bands", "4",
                         "--cycle-length", "4")
    assert ("(B = 256), sigma = 1.1, BandMF correlated noise (4 bands)" in out
            and f"strategy {record['strategy']}" in out and "cycle 4" in out)


def test_epsilon_prints_a_privacy_statement(capsys):
    status, out, _ = run(capsys, "epsilon", *RUN, "--noise-multiplier", "1.1",
                         "--accountant", "rdp")
    epsilon = compute_epsilon(num_examples=60000, batch_size=256, steps=1000,
                              noise_multiplier=1.1, delta=1e-5, accountant="rdp")
    assert status == 0
    rounded_up = f"{epsilon:.4f}" if round(epsilon, 4) >= epsilon else f"{epsilon + 5e-5:.4f}"
    assert out.startswith(f"This training run is ({rounded_up}, 1e-05)-differentially private.")
    assert "one training example" in out and "RDP" in out and "sigma = 1.1" in out


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_schedule_file_in_json_or_yaml(capsys, tmp_path, suffix):
    schedule = BatchSizeSchedule.for_poisson(
        [(100, 1_000), (200, 4_000), (50, 16_000)], num_examples=1_000_000,
        micro_batch_size=1_024, noise_multipliers=[None, None, 1.6])
    path = tmp_path / f"schedule{suffix}"
    dump = json.dumps if suffix == ".json" else yaml.safe_dump
    path.write_text(dump(schedule.to_dict()))
    status, out, _ = run(capsys, "epsilon", "--schedule", str(path), "--noise-multiplier", "1.0",
                         "--delta", "1e-7", "--accountant", "rdp", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["epsilon"] == compute_epsilon(schedule=schedule, noise_multiplier=1.0,
                                                delta=1e-7, accountant="rdp")
    assert [entry["steps"] for entry in report["ledger"]] == [100, 200, 50]
    assert report["sampling"]["accounted_as"] == "truncated_poisson"


def test_calibrate_finds_the_smallest_sigma_within_one_percent(capsys):
    status, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", *RUN,
                         "--accountant", "rdp", "--json")
    assert status == 0
    report = json.loads(out)
    sigma = report["noise_multiplier"]
    epsilon = rdp_epsilon([poisson(1000, 256 / 60000, sigma)], 1e-5)
    assert 0.99 * 2 <= epsilon <= 2
    assert report["epsilon"] == pytest.approx(epsilon, rel=1e-12)
    status, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", *RUN, "--accountant", "rdp")
    assert out.startswith(f"noise multiplier: {sigma:.6g}")


def test_epochs_instead_of_steps_match_dp_accounting(capsys):
    # 3 epochs of N = 60000 at B = 256: ceil(3 * 60000 / 256) = 704 steps.
    run_args = ["--num-examples", "60000", "--batch-size", "256", "--epochs", "3",
                "--delta", "1e-5", "--accountant", "rdp", "--json"]
    status, out, err = run(capsys, "epsilon", *run_args, "--noise-multiplier", "1.1")
    assert status == 0 and err == ""
    report = json.loads(out)
    assert report["steps"] == 704
    assert report["epsilon"] == pytest.approx(
        rdp_epsilon([poisson(704, 256 / 60000, 1.1)], 1e-5), rel=1e-12)
    status, out, err = run(capsys, "calibrate", "--target-epsilon", "2", *run_args)
    assert status == 0 and err == ""
    sigma = json.loads(out)["noise_multiplier"]
    assert 0.99 * 2 <= rdp_epsilon([poisson(704, 256 / 60000, sigma)], 1e-5) <= 2


def test_calibrate_prints_no_absl_warnings(capsys):
    # q = 0.1 near sigma 1: dp_accounting logs one "failed to converge"
    # warning per excluded RDP order unless tf_megadp drops them.
    status, out, err = run(capsys, "calibrate", "--target-epsilon", "2", "--num-examples",
                           "1000", "--batch-size", "100", "--steps", "50", "--delta", "1e-5",
                           "--accountant", "rdp")
    assert status == 0 and "converge" not in err and "converge" not in out


def test_main_leaves_the_absl_logger_as_it_found_it(capsys):
    # The unconverged-order records are dropped by the accounting's own filter
    # while it runs; main must not change the level of a logger the host owns.
    logger = logging.getLogger("absl")
    level, filters = logger.level, list(logger.filters)
    status, _, _ = run(capsys, "epsilon", *RUN, "--noise-multiplier", "1.1",
                       "--accountant", "rdp")
    assert status == 0
    assert (logger.level, logger.filters) == (level, filters)


def test_shuffle_is_reported_with_the_warning_on_stderr(capsys):
    status, out, err = run(capsys, "epsilon", *RUN, "--noise-multiplier", "1.1",
                           "--accountant", "rdp", "--sampling", "shuffle")
    assert status == 0
    assert "UNDERSTATES" in out
    assert err.startswith("tf-megadp: warning: Shuffled fixed-size batches")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["epsilon", *RUN], "--noise-multiplier is required"),
        (["epsilon", "--num-examples", "100", "--batch-size", "10", "--steps", "5",
          "--noise-multiplier", "1"], "--delta"),
        (["epsilon", *RUN[:-1], "1.5", "--noise-multiplier", "1"], r"delta must be in \(0, 1\)"),
        (["epsilon", *RUN, "--noise-multiplier", "0"], "not differentially private"),
        (["epsilon", "--num-examples", "10", "--batch-size", "20", "--steps", "5", "--delta",
          "1e-3", "--noise-multiplier", "1"], "larger than num_examples"),
        (["epsilon", *RUN[:4], "--steps", "-3", "--delta", "1e-5", "--noise-multiplier", "1"],
         "steps must be >= 0"),
        (["epsilon", *RUN, "--noise-multiplier", "1", "--accountant", "gdp"], "invalid choice"),
        (["epsilon", "--schedule", "/nonexistent.json", "--delta", "1e-5",
          "--noise-multiplier", "1"], "cannot read schedule"),
        (["calibrate", *RUN], "--target-epsilon"),
        (["epsilon", *RUN, "--epochs", "2", "--noise-multiplier", "1"], "not both"),
        (["epsilon", *RUN[:4], "--delta", "1e-5", "--noise-multiplier", "1"],
         "--steps or --epochs is required"),
        (["epsilon", *RUN[:4], "--epochs", "0", "--delta", "1e-5", "--noise-multiplier", "1"],
         "epochs must be a finite number > 0"),
        (["calibrate", "--target-epsilon", "1", "--schedule", "SCHEDULE", "--epochs", "2",
          "--delta", "1e-5"], "BatchSizeSchedule sets the steps"),
        (["calibrate", "--target-epsilon", "-1", *RUN], "target_epsilon must be"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
        (["epsilon", *RUN, "--noise-multiplier", "1", "--bands", "4"], "--bands needs --noise"),
        (["epsilon", *RUN, "--noise-multiplier", "1", "--noise", "bandmf"], "needs --bands"),
        (["epsilon", *RUN, "--noise-multiplier", "1", "--noise", "bandmf", "--bands", "4"],
         "Poisson sampling without cycles under BandMF.*cycle_length >= 4"),
        (["calibrate", "--target-epsilon", "2", *RUN, "--noise", "blt", "--bands", "2",
          "--cycle-length", "4"], "BLT.*no privacy proof"),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(capsys, tmp_path, argv, message):
    if "SCHEDULE" in argv:
        path = tmp_path / "schedule.json"
        path.write_text(json.dumps(BatchSizeSchedule.constant(
            10, 100, num_examples=1000, micro_batch_size=100).to_dict()))
        argv = [str(path) if a == "SCHEDULE" else a for a in argv]
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    errors = [line for line in err.splitlines() if not line.startswith("tf-megadp: warning:")]
    assert len(errors) == 1 and errors[0].startswith("tf-megadp: error: ")
    assert re.search(message, errors[0])


def test_bad_schedule_file_is_one_clear_error(capsys, tmp_path):
    path = tmp_path / "schedule.json"
    path.write_text("{not json")
    status, _, err = run(capsys, "epsilon", "--schedule", str(path), "--delta", "1e-5",
                         "--noise-multiplier", "1")
    assert status == 2 and "is not valid JSON" in err
    path.write_text(json.dumps({"phases": []}))
    status, _, err = run(capsys, "epsilon", "--schedule", str(path), "--delta", "1e-5",
                         "--noise-multiplier", "1")
    assert status == 2 and "needs num_examples" in err


def test_the_command_runs_as_a_program():
    # Fresh interpreter: what the `tf-megadp` console script does.
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from tf_megadp.cli import main; sys.exit(main())",
         "epsilon", *RUN, "--noise-multiplier", "1.1", "--delta", "0"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tf-megadp: error: delta must be in (0, 1), got 0.0.")


def test_audit_one_run_options_parse_and_refuse_a_run_dir():
    from tf_megadp.cli import build_parser

    args = build_parser().parse_args(
        ["audit", "--one-run", "--num-canaries", "100", "--steps", "50",
         "--sampling-rate", "0.05", "--output", "audit.json"])
    assert args.one_run and args.run_dir is None
    from tf_megadp.cli import UsageError

    args = build_parser().parse_args(["audit", "runs/x", "--one-run"])
    with pytest.raises(UsageError, match="do not give RUN_DIR"):
        args.handler(args)


# Issue 43: the accounting commands answer without TensorFlow (5-10 s to
# import). What the console script runs, in a fresh interpreter, then which
# modules it loaded.
_NO_TENSORFLOW_PROBE = """
import contextlib, io, sys
import tf_megadp_cli
with contextlib.redirect_stdout(io.StringIO()):
    try:
        status = tf_megadp_cli.main(sys.argv[1:])
    except SystemExit as exit:  # --help
        status = exit.code
loaded = sorted({name.split(".")[0] for name in sys.modules} & {"tensorflow", "keras", "keras_hub"})
print(status, ",".join(loaded))
"""


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["epsilon", *RUN, "--noise-multiplier", "1.1", "--accountant", "rdp", "--sampling",
     "shuffle", "--count-stddev", "10"],
    ["calibrate", "--target-epsilon", "2", *RUN, "--accountant", "rdp", "--noise", "bandmf",
     "--bands", "4", "--cycle-length", "4"],
    ["plan", str(pathlib.Path(__file__).parents[1] / "tpu_configs" / "bert_base_v3_8.yaml"),
     "--accountant", "pld"],
    ["causal-lm", "--help"],
], ids=["help", "epsilon", "calibrate", "plan", "causal-lm-help"])
def test_the_accounting_commands_do_not_import_tensorflow(argv):
    result = subprocess.run(
        [sys.executable, "-c", _NO_TENSORFLOW_PROBE, *argv], capture_output=True, text=True,
        timeout=300, cwd=pathlib.Path(__file__).parents[1],
        env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1])})
    assert result.returncode == 0, result.stderr[-2000:]
    status, _, loaded = result.stdout.strip().splitlines()[-1].partition(" ")
    assert (status, loaded) == ("0", ""), result.stdout


def test_a_bare_import_registers_the_optimizer_and_the_probe_sees_tensorflow():
    # Only the launcher defers the library: after `import tf_megadp`,
    # keras.models.load_model of a private run finds DPOptimizer. And the
    # probe above can fail: here it sees TensorFlow.
    code = ("import tf_megadp, keras\n"
            "print(keras.saving.get_registered_object('tf_megadp>DPOptimizer') is not None)\n"
            + _NO_TENSORFLOW_PROBE.replace("import tf_megadp_cli", "import tf_megadp_cli  # late"))
    result = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1]),
             "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = result.stdout.strip().splitlines()
    assert lines[-2:] == ["True", "0 keras,tensorflow"], result.stderr[-2000:]
