"""Where the per-example pass spends its time: XLA's own profile, operation by operation.

Runs the computations of `per_example_pass.py` (the non-private XLA gradient
and each clipping strategy's `clip_and_sum`, one model, one micro-batch),
first untraced for wall times (interleaved rounds, medians), then each one
alone under the TensorFlow profiler with XLA's per-operation trace events on
(`--xla_cpu_enable_xprof_traceme`) and its optimized HLO dumped
(`--xla_dump_to`). It prints, per computation and per call:

- `wall`: the untraced median;
- `ops`: the summed durations of its XLA operations, over both threads of
  the 2-core machine, so it can exceed the wall time;
- that sum by kind: matrix products (`dot`, and loop fusions XLA built
  around one), random bits (dropout masks: XLA's Philox output, u32),
  reductions, and all other fusions (elementwise work, copies, selects);
- the costliest operations with their HLO result shapes and, for products,
  the multiply-adds and the rate they ran at.

Operation durations come from XLA's trace events and are thread time, not a
share of the wall time; the two orders agree when both threads are busy.
Tracing adds a little overhead per operation. Run:

    python benchmarks/pass_profile.py --size tiny --micro-batch 32 --clipping auto
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import shutil
import sys
import tempfile

_DUMP = tempfile.mkdtemp(prefix="pass_profile_hlo_")
# Read by XLA when TensorFlow loads, so set before the imports below.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true",
    f"--xla_dump_to={_DUMP}", "--xla_dump_hlo_as_text"]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

from per_example_pass import (add_arguments, describe, interleaved_times, pass_calls,  # noqa: E402
                              run_to_completion)

# `%name = f32[32,20,20]{2,1,0} dot(%a, %b), lhs_contracting_dims={2}, ...`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*)$")
_CONTAINERS = {"call", "while", "conditional", "async-start", "async-done"}


class Instruction:
    """One instruction of an optimized HLO module, as the profile needs it."""

    def __init__(self, match):
        self.name, self.dtype, dims, self.opcode, rest = match.groups()
        self.shape = [int(d) for d in dims.split(",") if d]
        self.operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        self.attributes = rest

    def kind(self) -> str:
        if self.opcode == "dot" or (self.opcode == "fusion" and "dot" in self.name):
            return "products"
        if self.dtype in ("u32", "u64"):
            return "random bits"
        if "reduce" in self.opcode or "reduce" in self.name:
            return "reductions"
        return "other"

    def multiply_adds(self, module) -> int | None:
        """Output elements x contraction length, for a dot whose left operand is known."""
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", self.attributes)
        left = module.get(self.operands[0]) if self.operands else None
        if self.opcode != "dot" or not found or left is None:
            return None
        contraction = math.prod(left.shape[int(d)] for d in found.group(1).split(",") if d)
        return math.prod(self.shape) * contraction


def read_modules(directory: str) -> list[dict]:
    """Every optimized module dumped so far, as {instruction name: Instruction}."""
    modules = []
    for path in glob.glob(os.path.join(directory, "*after_optimizations.txt")):
        with open(path) as handle:
            matches = (_INSTRUCTION.match(line) for line in handle)
            modules.append({m.group(1): Instruction(m) for m in matches if m})
    return modules


def traced_durations(logdir: str, calls: int) -> collections.Counter:
    """Event name -> milliseconds per call, summed over the host threads of one trace."""
    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as handle:
        space.ParseFromString(handle.read())
    totals = collections.Counter()
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                totals[names.get(event.metadata_id, "")] += event.duration_ps / 1e9 / calls
    return totals


def profile(call, calls: int, modules: list[dict]) -> tuple[dict, collections.Counter]:
    """The module `call` runs (one of `modules`) and its operations' milliseconds per call."""
    logdir = tempfile.mkdtemp(prefix="pass_profile_trace_")
    try:
        tf.profiler.experimental.start(logdir)
        for _ in range(calls):
            run_to_completion(call)
        tf.profiler.experimental.stop()
        durations = traced_durations(logdir, calls)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    # The module whose instruction names the trace hit most is the one that ran.
    module = max(modules, key=lambda m: sum(name in m for name in durations))
    leaves = collections.Counter({
        name: ms for name, ms in durations.items()
        if name in module and module[name].opcode not in _CONTAINERS})
    return module, leaves


def report(name: str, wall_ms: float, module: dict, leaves: collections.Counter,
           top: int) -> dict:
    by_kind = collections.Counter()
    for op, ms in leaves.items():
        by_kind[module[op].kind()] += ms
    total = sum(leaves.values())
    print(f"\n{name}: wall {wall_ms:.1f} ms per call, ops {total:.1f} ms per call "
          f"(summed over threads)")
    for kind in ("products", "random bits", "reductions", "other"):
        print(f"  {kind:12} {by_kind[kind]:8.1f} ms  {by_kind[kind] / total:5.1%}")
    print(f"  costliest {top}:      ms  GMAC/s  operation")
    for op, ms in leaves.most_common(top):
        instruction = module[op]
        macs = instruction.multiply_adds(module)
        rate = f"{macs / ms / 1e6:7.1f}" if macs else "       "
        shape = f"{instruction.dtype}{instruction.shape}"
        print(f"  {ms:20.2f} {rate}  {op} {shape}")
    return {"ops": total, **by_kind}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(clipping="auto")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--traced-calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    calls = pass_calls(args)
    walls = interleaved_times(calls, args.warmup, args.repeats)
    # Every computation has compiled by now: the dump holds all their modules.
    modules = read_modules(_DUMP)
    shutil.rmtree(_DUMP, ignore_errors=True)
    print(f"{describe(args)} warmup={args.warmup} repeats={args.repeats} "
          f"traced calls={args.traced_calls}")
    summaries = {}
    for name, call in calls.items():
        module, leaves = profile(call, args.traced_calls, modules)
        summaries[name] = report(name, walls[name] * 1e3, module, leaves, args.top)
    base_name = next(iter(calls))
    base = summaries[base_name]
    print(f"\nDifference to {base_name}, ms of operations per call:")
    for name, summary in list(summaries.items())[1:]:
        parts = ", ".join(f"{kind} {summary.get(kind, 0.0) - base.get(kind, 0.0):+.1f}"
                          for kind in ("products", "random bits", "reductions", "other"))
        print(f"  {name}: total {summary['ops'] - base['ops']:+.1f} ({parts}); "
              f"wall {1e3 * (walls[name] - walls[base_name]):+.1f}")


if __name__ == "__main__":
    main()
