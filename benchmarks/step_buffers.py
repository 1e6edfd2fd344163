"""The memory XLA plans for the DP step's compiled functions, beside the non-private step's.

`step_memory.py` measures the process's resident memory, which holds
compilation, the allocator's pools and every compiled function at once,
so it cannot say which buffer the DP step adds. This script asks XLA: it
trains one model for two micro-batches (`fit` on arrays, one logical step
each; or two logical steps of a `PoissonSampler`'s dataset with `--path
fit_poisson`) with `--xla_dump_to`, then reads the buffer assignment XLA wrote for
every function it compiled (`*buffer-assignment.txt`) and prints, per
function:

- `total`: the bytes XLA assigns to one call (parameters, outputs and the
  preallocated temporaries);
- `temp`: the preallocated temporary block alone (the values live inside
  the call, packed by liveness: two values at the same offset are never
  live together);
- the largest values of that block, with their offset, shape and the
  TensorFlow op they come from (`op_name` of the HLO metadata), so that a
  buffer can be traced to the code that makes it.

The non-private model is compiled whole (`jit_compile=True`: one function,
the whole training step). The private model runs ghost clipping's three
compiled functions: `clip_and_sum` (the step's recorded pass, norms and
clipped sums), and, on the first call of a fit, `check` and
`check_gradients` (the independence checks, run before the step and
finished when it starts). Its noise, accumulation and optimizer run in
graph mode outside them (small: a few copies of the parameters).

Run (one process per model; nothing is timed, load does not matter):

    python benchmarks/step_buffers.py --size gpt2 --micro-batch 32
    python benchmarks/step_buffers.py --size tiny --micro-batch 32 --largest 5

Nothing in the library or the tests imports this file.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_OP_NAME = re.compile(r'%(\S+) = .*?op_name="([^"]+)"')


def _child(args) -> None:
    """Trains the model for two micro-batches; XLA_FLAGS (set by the parent) dumps what it compiles."""
    import warnings

    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_overhead

    warnings.filterwarnings("ignore")
    m = args.micro_batch
    args.dp_jit_compile = False
    x, y, w = step_overhead.make_data(4 * m, args, np.random.default_rng(0), args.size)
    private = args.child == "dp"
    if args.path == "fit_poisson":
        sampler = step_overhead.poisson_sampler(
            x, y, w, m, argparse.Namespace(steps=1, warmup=0, repeats=2))
        model = step_overhead.new_model(args.size, args, args.clipping if private else None,
                                        not private, sampler.schedule)
        model.fit(sampler.as_dataset(), epochs=2,
                  steps_per_epoch=sampler.schedule.phases[0].accumulation_steps, verbose=0)
        return
    model = step_overhead.new_model(args.size, args, args.clipping if private else None,
                                    not private)
    model.fit(step_overhead.head(x, 2 * m), y[:2 * m], sample_weight=w[:2 * m], batch_size=m,
              epochs=1, shuffle=False, verbose=0)


def read_buffer_assignment(path: str) -> dict:
    """(total bytes, temp bytes, temp values [(size, offset, shape, HLO name)]) of one dump file."""
    total, temp_allocation, temp_size, values = 0, None, 0, {}
    current = None
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            allocation = _ALLOCATION.match(line)
            if allocation:
                current = int(allocation.group(1))
                if "preallocated-temp" in allocation.group(3):
                    temp_allocation, temp_size = current, int(allocation.group(2))
                continue
            if line.startswith("Total bytes used:"):
                total = int(line.split(":")[1].split()[0])
            value = _VALUE.search(line)
            if value and current is not None:
                name, size, offset, shape = value.groups()
                values.setdefault(current, []).append((int(size), int(offset), shape, name))
    return {"total": total, "temp": temp_size,
            "values": sorted(values.get(temp_allocation, []), reverse=True)}


def op_names(hlo_path: str) -> dict[str, str]:
    """HLO instruction name -> the TensorFlow op_name it carries."""
    names = {}
    with open(hlo_path, encoding="utf-8") as handle:
        for line in handle:
            found = _OP_NAME.search(line)
            if found:
                names.setdefault(found.group(1), found.group(2))
    return names


def _function_name(path: str) -> str:
    base = os.path.basename(path)
    found = re.search(r"a_inference_(.+?)_\d+__", base)
    return found.group(1) if found else base


def report(dump: str, largest: int) -> int:
    """Prints every compiled function of a dump; returns the largest total."""
    biggest = 0
    for path in sorted(glob.glob(os.path.join(dump, "*buffer-assignment.txt"))):
        assignment = read_buffer_assignment(path)
        hlo = path.replace("-buffer-assignment.txt", ".txt")
        names = op_names(hlo) if os.path.exists(hlo) else {}
        biggest = max(biggest, assignment["total"])
        print(f"  {_function_name(path):24} total {assignment['total'] / 2**20:8.1f} MiB   "
              f"temp {assignment['temp'] / 2**20:8.1f} MiB")
        for size, offset, shape, name in assignment["values"][:largest]:
            print(f"      {size / 2**20:7.1f} MiB @ {offset / 2**20:7.1f}  {shape:28} "
                  f"{names.get(name, name)[-90:]}")
    return biggest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpt2")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--clipping", default="auto")
    parser.add_argument("--path", choices=("fit_arrays", "fit_poisson"), default="fit_arrays",
                        help="fit on arrays (a dynamic batch axis: the last batch may be "
                             "short) or on a PoissonSampler's dataset (static micro-batches)")
    parser.add_argument("--largest", type=int, default=12,
                        help="values of each temporary block to list")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_overhead import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--child", choices=("dp", "non-private"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return
    print(f"{args.size} m={args.micro_batch} seq={args.seq} vocab={args.vocab} "
          f"dropout={args.dropout} clipping={args.clipping} {args.path}: XLA's buffer "
          "assignment per "
          "compiled function")
    totals = {}
    for kind in ("non-private", "dp"):
        with tempfile.TemporaryDirectory() as dump:
            command = [sys.executable, os.path.abspath(__file__), "--child", kind,
                       *[token for token in (argv if argv is not None else sys.argv[1:])]]
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                       XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{kind} child failed:\n{done.stderr[-3000:]}")
            print(f"\n{kind}:")
            totals[kind] = report(dump, args.largest)
    print(f"\nlargest DP function / the non-private step: "
          f"{totals['dp'] / max(totals['non-private'], 1):.2f}x")


if __name__ == "__main__":
    main()
