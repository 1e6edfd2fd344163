"""Ways to take the norms and clipped sum of a materialised vocabulary-head record: time and exactness.

The ghost step materialises the per-example gradient of a vocabulary head
at shapes like GPT-2's benchmark (m 32, T 128, V 8000, D 128: p d <= T (p +
d)), and XLA on CPU then also writes its square before the row sums: two
[m, V D] float32 buffers the non-private step does not have. This script
times, in one process and compiled with XLA, the library's form and the
alternatives that could avoid the square's buffer, on the same records
(the logit gradient G [m, T, V] and the hidden states H [m, T, D]):

- `square_and_sum`: `tf_megadp.clipping.terms.Outer`'s materialised form
  (einsum, square, one flattened row sum; the clipped sum from the same
  per-example gradients);
- `row_dot`: the squared norms as a row dot product, `einsum("mk,mk->m")`;
- `vocabulary_chunks_N`: the per-example gradient in N chunks of the
  vocabulary, each chunk's square summed, the clipped sum per chunk;
- `example_chunks_N`: the same in N chunks of the examples.

For each it prints the median time of a call, the largest relative error
of its squared norms against float64 arithmetic, and whether XLA's
optimized program still writes a buffer as large as the per-example
gradients besides them (`square buffer`). Run:

    python benchmarks/head_norm_forms.py --shape 32x128x8000x128
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import tensorflow as tf  # noqa: E402

from _measure import time_per_call  # noqa: E402
from tf_megadp.clipping.terms import Outer  # noqa: E402


class _Materialised(Outer):
    materialised = True


def _clip_factors(squared):
    return 1.0 / tf.maximum(1.0, tf.sqrt(squared))


def forms(m, vocabulary, chunks):
    """name -> f(G, H) returning (squared norms [m], clipped sum [V, D])."""
    keep = tf.ones([m], tf.bool)

    def square_and_sum(g, h):
        term = _Materialised(g, h, [g.shape[-1], h.shape[-1]])
        squared = term.squared_norms()
        return squared, term.clipped_sum(_clip_factors(squared), keep)

    def row_dot(g, h):
        per_example = tf.reshape(tf.einsum("mtp,mtd->mpd", g, h), [m, -1])
        squared = tf.einsum("mk,mk->m", per_example, per_example)
        total = tf.reduce_sum(per_example * _clip_factors(squared)[:, None], 0)
        return squared, tf.reshape(total, [g.shape[-1], h.shape[-1]])

    def by_vocabulary(n):
        def run(g, h):
            size = vocabulary // n
            parts = [tf.einsum("mtp,mtd->mpd", g[:, :, k * size:(k + 1) * size], h)
                     for k in range(n)]
            squared = tf.add_n([tf.reduce_sum(tf.square(tf.reshape(p, [m, -1])), 1)
                                for p in parts])
            factors = _clip_factors(squared)[:, None, None]
            return squared, tf.concat([tf.reduce_sum(p * factors, 0) for p in parts], 0)
        return run

    def by_examples(n):
        def run(g, h):
            size = m // n
            parts = [tf.einsum("mtp,mtd->mpd", g[k * size:(k + 1) * size],
                               h[k * size:(k + 1) * size]) for k in range(n)]
            squared = tf.concat([tf.reduce_sum(tf.square(tf.reshape(p, [size, -1])), 1)
                                 for p in parts], 0)
            factors = _clip_factors(squared)
            return squared, tf.add_n([tf.reduce_sum(p * factors[k * size:(k + 1) * size,
                                                                  None, None], 0)
                                      for k, p in enumerate(parts)])
        return run

    named = {"square_and_sum": square_and_sum, "row_dot": row_dot}
    for n in chunks:
        named[f"vocabulary_chunks_{n}"] = by_vocabulary(n)
        if m % n == 0:
            named[f"example_chunks_{n}"] = by_examples(n)
    return {name: tf.function(f, jit_compile=True) for name, f in named.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="32x128x8000x128", help="m x T x V x D")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    m, tokens, vocabulary, hidden = (int(v) for v in args.shape.split("x"))
    rng = tf.random.Generator.from_seed(0)
    g, h = rng.normal([m, tokens, vocabulary]), rng.normal([m, tokens, hidden])
    exact = tf.reduce_sum(tf.square(tf.reshape(tf.einsum(
        "mtp,mtd->mpd", tf.cast(g, tf.float64), tf.cast(h, tf.float64)), [m, -1])), 1)
    big = re.compile(rf"= f32\[({m},{vocabulary * hidden}|{m},{vocabulary},{hidden})\]"
                     r"\{[0-9,]*\} fusion")
    print(f"shape m={m} T={tokens} V={vocabulary} D={hidden}; load {os.getloadavg()}")
    for name, function in forms(m, vocabulary, args.chunks).items():
        squared, _ = function(g, h)
        error = float(tf.reduce_max(tf.abs(tf.cast(squared, tf.float64) - exact) / exact))
        program = function.experimental_get_compiler_ir(g, h)(stage="optimized_hlo")
        square_buffer = any(big.search(line) and "Square" in line
                            for line in program.splitlines())
        seconds = time_per_call(lambda f=function: [t.numpy() for t in f(g, h)],
                                args.warmup, args.repeats)
        print(f"{name:22s} {seconds * 1e3:7.1f} ms   squared norms off float64 by "
              f"{error:.1e}   square buffer: {'yes' if square_buffer else 'no'}", flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
