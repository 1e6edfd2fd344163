"""Time of the two forms of an `Outer` record against the non-private weight gradient.

For each shape m x T x p x d (micro-batch, tokens, inputs, outputs), in ONE
process and compiled with XLA, three functions of the same records A [m, T, p]
and G [m, T, d]:

- non-private: the weight gradient A^T G, one [p, m T] x [m T, d] product;
- materialised: per-example A_i^T G_i, their squared norms and clipped sum;
- Gram: the norms from A_i A_i^T and G_i G_i^T, the clipped sum as one product.

It prints each form's median time, its ratio to the non-private product,
and the form `outer_is_materialised` picks (docs/clipping.md, "The per-layer
form"). Run:

    python benchmarks/outer_forms.py 32x128x128x8000 32x20x128x8000 32x128x128x512
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import tensorflow as tf  # noqa: E402

from _measure import time_per_call  # noqa: E402
from tf_megadp.clipping.terms import Outer, outer_is_materialised  # noqa: E402


class _Materialised(Outer):
    materialised = True


class _Gram(Outer):
    materialised = False


def form_times(m, tokens, p, d, warmup, repeats):
    """(non-private, materialised, Gram) median seconds for one shape."""
    rng = tf.random.Generator.from_seed(0)
    left, right = rng.normal([m, tokens, p]), rng.normal([m, tokens, d])
    factors, keep = tf.fill([m], 0.5), tf.ones([m], tf.bool)

    @tf.function(jit_compile=True)
    def non_private(left, right):
        return tf.matmul(tf.reshape(left, [-1, p]), tf.reshape(right, [-1, d]), transpose_a=True)

    def clipped(kind):
        @tf.function(jit_compile=True)
        def run(left, right):
            term = kind(left, right, [p, d])
            return term.squared_norms(), term.clipped_sum(factors, keep)
        return run

    times = []
    for function in (non_private, clipped(_Materialised), clipped(_Gram)):
        times.append(time_per_call(
            lambda f=function: [t.numpy() for t in tf.nest.flatten(f(left, right))],
            warmup, repeats))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="m x T x p x d, e.g. 32x128x128x8000")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"{'m':>4} {'T':>4} {'p':>5} {'d':>5} {'p d':>9} {'T(p+d)':>9} {'2T^2':>7} "
          f"{'non-private':>11} {'materialised':>15} {'Gram':>15}  picked")
    for shape in args.shapes:
        m, tokens, p, d = (int(value) for value in shape.split("x"))
        base, materialised, gram = form_times(m, tokens, p, d, args.warmup, args.repeats)
        picked = "materialised" if outer_is_materialised(tokens, p, d) else "Gram"
        print(f"{m:4d} {tokens:4d} {p:5d} {d:5d} {p * d:9d} {tokens * (p + d):9d} "
              f"{2 * tokens ** 2:7d} {base * 1e3:8.1f} ms {materialised * 1e3:8.1f} ms "
              f"{materialised / base:4.2f}x {gram * 1e3:8.1f} ms {gram / base:4.2f}x  {picked}",
              flush=True)


if __name__ == "__main__":
    main()
