"""Peak memory of the DP step versus the non-private step, one fresh process per configuration.

`benchmarks/step_overhead.py` measures the growth of resident memory during
timed calls, which misses what a compiled step allocates at its first call
and holds between calls. This script measures the process's high-water mark
instead: every configuration (non-private with `jit_compile=False` and
`jit_compile=True`, and DPOptimizer under each requested clipping strategy)
runs in its OWN child process, so that `getrusage(RUSAGE_SELF).ru_maxrss` of
that child belongs to that configuration alone.

The child builds BertMaskedLM and its optimizer exactly as step_overhead.py
does (`new_model`, `make_data`), collects garbage and hands freed heap back
to the OS, records its resident memory (RSS) before the first training call,
then runs `model.fit` on the path `--path` names, compilation included:

- `fit_arrays`: NumPy arrays, batch_size = m, `--steps` micro-batches, one
  logical step each;
- `fit_poisson`: `PoissonSampler.from_arrays(...).as_dataset()` as
  step_overhead.py builds it (N = 4m, expected batch m, k = 2 micro-batches
  of m per logical step, padding included; the non-private model is fed the
  same dataset), `--steps` logical steps, one fit epoch each;

and reports:

- peak: `ru_maxrss` of the whole child (imports, model, data, training);
- step: peak minus the RSS before training, i.e. what training adds,
  compilation and the buffers a compiled step holds included. These two
  answer "peak memory of the DP step";
- steps 2..n: the peak RSS sampled every millisecond during steps 2..n
  (on the Poisson path, logical steps)
  (`_measure.PeakRss`) minus the RSS just before step 2. It leaves
  compilation out, but also everything step 1 allocated and kept, so it
  understates what the step needs; it is printed beside the others to show
  how much of the step figure is first-call (compilation and held buffers);
- ms/mb 2..n: the median seconds per micro-batch of steps 2..n (compilation
  left out; on the Poisson path, of logical steps 2..n divided by k, and
  the row says how many of those micro-batches held only padding, whose
  per-example pass the DP step skips). The
  configurations run one after another in separate processes, not
  interleaved in one process as in step_overhead.py, so this is the time
  figure for cells whose models cannot share one process's memory (BERT-mini
  at m = 512: the XLA non-private step alone peaks at 18 GB of the
  machine's 23); it is only as good as the machine is idle;
- held: RSS before step 2 minus RSS before training, what the first step
  left resident.

The x columns are ratios to the lowest non-private figure of the same column
(the best of the two non-private configurations, chosen per column). Each row
also prints the 1-minute load average and MemAvailable when its child ended:
the machine may be shared (memory figures depend on load far less than
times do, but another process cannot raise this child's RSS).

Run:

    python benchmarks/step_memory.py                       # tiny m=32, mini m=256
    python benchmarks/step_memory.py --sizes mini --micro-batches 256 --steps 3
    python benchmarks/step_memory.py --sizes mini --micro-batches 512 --path fit_poisson

Vectorized clipping is skipped where its per-example gradients alone
(m x parameters x 4 bytes) would exceed `--memory-budget-gib`; the child
checks this after building the model and before training.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NON_PRIVATE = {"non-private": False, "non-private XLA": True}
PATHS = ("fit_arrays", "fit_poisson")
CLIPPINGS = ("vectorized", "ghost", "auto")
RESULT = "RESULT "


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_child(size: str, m: int, config: str, args: argparse.Namespace) -> dict:
    """Builds and trains one configuration in this (fresh) process.

    Args:
        size: a key of `step_overhead.SIZES`.
        m: micro-batch size (batch_size of `fit`).
        config: a key of `NON_PRIVATE` or a clipping strategy.
        args: the parsed command line (model shape, steps, budget).

    Returns:
        Byte counts (see the module docstring), or `{"skipped": reason}`.
    """
    import warnings

    import keras
    import numpy as np

    import step_overhead
    from _measure import PeakRss, _trim, rss_bytes

    warnings.simplefilter("ignore")  # fixed-size-batch and sigma notices
    poisson = args.path == "fit_poisson"
    x, y, w = step_overhead.make_data(max(args.steps, 4) * m, args, np.random.default_rng(0),
                                      size)
    # step_overhead's sampler holds steps * (warmup + repeats) logical steps;
    # it is seeded, so every sampler made here draws the same steps.
    new_sampler = lambda: step_overhead.poisson_sampler(
        x, y, w, m, argparse.Namespace(steps=1, warmup=0, repeats=args.steps))
    sampler = new_sampler() if poisson else None
    if config in NON_PRIVATE:
        model = step_overhead.new_model(size, args, None, NON_PRIVATE[config])
    else:
        model = step_overhead.new_model(size, args, config, False,
                                        sampler.schedule if poisson else None)
    parameters = sum(v.shape.num_elements() for v in model.trainable_variables)
    vectorized_bytes = 4 * m * parameters
    if config == "vectorized" and vectorized_bytes > args.memory_budget_gib * 2**30:
        return {"skipped": f"per-example gradients alone need "
                           f"{vectorized_bytes / 2**30:.1f} GiB > --memory-budget-gib"}

    class _AfterFirstStep(keras.callbacks.Callback):
        """Samples RSS from the start of step 2 to the end of training; times steps 2..n.

        A step is a batch of a fit on arrays, an epoch (one logical step of
        k micro-batches) of a fit on the Poisson dataset.
        """

        def __init__(self, micro_batches_per_step):
            super().__init__()
            self.micro_batches_per_step = micro_batches_per_step
            self.step_seconds = []

        def begin(self, step):
            if step == 1:
                self.sampler = PeakRss().__enter__()
            self.step_start = time.perf_counter()

        def end(self, step):
            if step >= 1:
                seconds = time.perf_counter() - self.step_start
                self.step_seconds.append(seconds / self.micro_batches_per_step)

        def on_train_end(self, logs=None):
            self.sampler.__exit__(None, None, None)
            self.before_second = self.sampler.start

    class _PerBatch(_AfterFirstStep):
        def on_train_batch_begin(self, batch, logs=None):
            self.begin(batch)

        def on_train_batch_end(self, batch, logs=None):
            self.end(batch)

    class _PerEpoch(_AfterFirstStep):
        def on_epoch_begin(self, epoch, logs=None):
            self.begin(epoch)

        def on_epoch_end(self, epoch, logs=None):
            self.end(epoch)

    if poisson:
        k = sampler.schedule.phases[0].accumulation_steps
        callback = _PerEpoch(k)
        train = lambda: model.fit(sampler.as_dataset(), epochs=args.steps, steps_per_epoch=k,
                                  verbose=0, callbacks=[callback])
    else:
        rows = args.steps * m
        callback = _PerBatch(1)
        train = lambda: model.fit(step_overhead.head(x, rows), y[:rows], sample_weight=w[:rows],
                                  batch_size=m, epochs=1, shuffle=False, verbose=0,
                                  callbacks=[callback])
    gc.collect()
    _trim()
    before = rss_bytes()
    peak_before = _peak_rss_bytes()
    start = time.perf_counter()
    train()
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    padding_only = None
    if poisson:
        # The DP step skips the per-example pass of a micro-batch that holds
        # only padding, so its time depends on how many the timed steps had.
        weights = [batch[2] for batch in new_sampler().as_dataset()]
        padding_only = sum(int(not np.any(weights_of_one.numpy()))
                           for weights_of_one in weights[k:])
    return {
        "parameters": parameters,
        "before": before,
        "peak_before": peak_before,
        "peak": peak,
        "step": peak - before,
        "held": callback.before_second - before,
        "later": callback.sampler.peak_increase,
        "after": rss_bytes(),
        "seconds": seconds,
        "step_seconds": step_overhead.median(callback.step_seconds),
        "padding_only": padding_only,
    }


def _machine_state() -> str:
    with open("/proc/loadavg") as handle:
        load = float(handle.read().split()[0])
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    available = int(fields["MemAvailable"].split()[0]) / 2**20
    return f"load {load:5.2f} avail {available:5.1f} GiB"


def run_child(size: str, m: int, config: str, args: argparse.Namespace) -> dict:
    """Runs `measure_child` in a fresh Python process and returns its result.

    Raises:
        RuntimeError: the child failed or printed no result; carries its stderr tail.
    """
    command = [sys.executable, os.path.abspath(__file__), "--child", f"{size},{m},{config}",
               "--steps", str(args.steps), "--path", args.path, "--seq", str(args.seq), "--vocab", str(args.vocab),
               "--masks", str(args.masks), "--dropout", str(args.dropout),
               "--memory-budget-gib", str(args.memory_budget_gib)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child {size} m={m} {config} exited {done.returncode} without a "
                           f"result; stderr tail:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def _mib(value: int) -> str:
    return f"{value / 2**20:9.1f}"


def run_cell(size: str, m: int, clippings: list[str], args: argparse.Namespace) -> None:
    """Prints one row per configuration of one (size, micro-batch) cell."""
    results = {}
    for config in list(NON_PRIVATE) + clippings:
        try:
            results[config] = run_child(size, m, config, args)
        except RuntimeError as error:  # e.g. out of memory: the row says so, the cell goes on
            results[config] = {"skipped": f"failed: {str(error).splitlines()[0]}"}
        results[config]["state"] = _machine_state()
    measured = {name: r for name, r in results.items() if "skipped" not in r}
    # Ratios are to the non-private configurations that ran (nan if none did).
    baselines = [name for name in NON_PRIVATE if name in measured]
    base = {key: min((measured[name][key] for name in baselines), default=0)
            for key in ("peak", "step", "later", "step_seconds")}
    for config, r in results.items():
        if "skipped" in r:
            print(f"{size:5} {m:4d} {config:15} skipped: {r['skipped']}", flush=True)
            continue
        ratios = {key: r[key] / base[key] if base[key] else float("nan") for key in base}
        print(f"{size:5} {m:4d} {config:15} {_mib(r['before'])} {_mib(r['peak'])} "
              f"{ratios['peak']:6.2f} {_mib(r['step'])} {ratios['step']:6.2f} "
              f"{_mib(r['held'])} {_mib(r['later'])} {ratios['later']:6.2f} "
              f"{_mib(r['after'])} {r['seconds']:7.1f} {1e3 * r['step_seconds']:9.1f} "
              f"{ratios['step_seconds']:6.2f}  {r['state']}"
              + (f"  padding-only micro-batches in steps 2..n: {r['padding_only']}"
                 if r.get("padding_only") is not None else "")
              + ("  (peak reached before training)" if r["peak"] == r["peak_before"] else ""),
              flush=True)


def main(argv: list[str] | None = None) -> None:
    """Parses the command line; runs the grid, or one configuration with --child.

    Args:
        argv: command-line arguments (default `sys.argv[1:]`).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,mini")
    parser.add_argument("--micro-batches", default=None,
                        help="comma-separated m, each run at every size (default: tiny 32, "
                             "mini 256, the issue's two cells)")
    parser.add_argument("--clipping", default=",".join(CLIPPINGS),
                        help="comma-separated strategies: vectorized, ghost, auto")
    parser.add_argument("--steps", type=int, default=3,
                        help="logical steps of the fit call (on arrays, micro-batches); "
                             "at least 2")
    parser.add_argument("--path", choices=PATHS, default="fit_arrays",
                        help="fit on NumPy arrays, or on the Poisson dataset")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--masks", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--memory-budget-gib", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds one configuration's child may run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    # step_overhead's model builders read these: no LoRA, and the DP step
    # compiled as `fit` compiles it (the per-example pass under XLA).
    parser.set_defaults(lora_rank=0, dp_jit_compile=False)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the steps 2..n figure needs a second step")
    clippings = [c for c in args.clipping.split(",") if c]
    unknown = sorted(set(clippings) - set(CLIPPINGS))
    if unknown:
        parser.error(f"unknown --clipping {unknown}; choose from {', '.join(CLIPPINGS)}")

    if args.child:
        size, m, config = args.child.split(",")
        print(RESULT + json.dumps(measure_child(size, int(m), config, args)), flush=True)
        return

    sizes = args.sizes.split(",")
    if args.micro_batches is None:
        defaults = {"tiny": 32, "mini": 256}
        missing = [s for s in sizes if s not in defaults]
        if missing:
            parser.error(f"no default micro-batch for {missing}: pass --micro-batches")
        cells = [(s, defaults[s]) for s in sizes]
    else:
        cells = [(s, int(m)) for s in sizes for m in args.micro_batches.split(",")]
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "log", "--oneline", "-1"], capture_output=True, text=True,
                            cwd=here).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=here).stdout.strip()
    print(f"commit: {commit}" + (" (working tree has uncommitted changes)" if dirty else ""))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
          f"{args.path}, steps={args.steps} seq={args.seq} vocab={args.vocab} "
          f"masks={args.masks} dropout={args.dropout}; one fresh process per row")
    print(f"{'model':5} {'m':>4} {'config':15} {'pre MiB':>9} {'peak MiB':>9} {'x':>6} "
          f"{'step MiB':>9} {'x':>6} {'held MiB':>9} {'2..n MiB':>9} {'x':>6} "
          f"{'after MiB':>9} {'fit s':>7} {'ms/mb 2..n':>9} {'x':>6}  "
          "(x: to the lowest non-private figure)")
    for size, m in cells:
        run_cell(size, m, clippings, args)


if __name__ == "__main__":
    main()
