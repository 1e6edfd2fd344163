"""tf_megadp's adaptive clipping against tensorflow-privacy 0.9's QuantileAdaptiveClipSumQuery.

tensorflow-privacy cannot be imported on TensorFlow >= 2.16, so the check is
two runs in two environments, through one JSON file:

1. ``--tf-privacy OUT.json`` in a TensorFlow 2.15 environment with
   tensorflow-privacy 0.9.0 (and dp-accounting 0.4.3): draws per-example
   norms (numpy, fixed seed; their scale drifts 4x over the rounds), runs the
   query round by round on records of those norms with exact counts
   (clipped_count_stddev = 0, noise 0), and writes the norms, the query's
   clip norm after every round, and the DpEvent it reports for a round with
   noise.
2. ``--compare OUT.json`` in tf_megadp's environment: moves C by
   `tf_megadp.adaptive_clipping` (the functions `DPOptimizer` runs: the
   centred count at C_t, the update of C) on the same norms, and compares
   the trajectories and the DpEvents.

    python3.11 -m venv /tmp/tf215 && /tmp/tf215/bin/pip install tensorflow-cpu==2.15.1 \\
        dp-accounting==0.4.3 dm-tree absl-py && \\
        /tmp/tf215/bin/pip install --no-deps tensorflow-privacy==0.9.0
    /tmp/tf215/bin/python benchmarks/adaptive_clipping_tf_privacy.py --tf-privacy /tmp/tfp.json
    python benchmarks/adaptive_clipping_tf_privacy.py --compare /tmp/tfp.json
"""

from __future__ import annotations

import argparse
import json
import sys

ROUNDS, RECORDS = 40, 50
INITIAL_CLIP, TARGET_QUANTILE, LEARNING_RATE = 0.1, 0.5, 0.2
# The DpEvent check: a round with noise, sigma_grad and s as a user would set them.
GRADIENT_SIGMA, COUNT_STDDEV = 1.1, RECORDS / 20


def _norms():
    import numpy as np

    rng = np.random.default_rng(0)
    drift = np.linspace(1.0, 4.0, ROUNDS)[:, None]
    return rng.lognormal(0.0, 0.6, size=(ROUNDS, RECORDS)) * drift


def run_tf_privacy(path: str) -> None:
    sys.skip_tf_privacy_import = True  # The package's own switch: import the query alone.
    import tensorflow as tf
    from tensorflow_privacy.privacy.dp_query.quantile_adaptive_clip_sum_query import (
        QuantileAdaptiveClipSumQuery)

    def query(noise_multiplier, count_stddev):
        return QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip=INITIAL_CLIP, noise_multiplier=noise_multiplier,
            target_unclipped_quantile=TARGET_QUANTILE, learning_rate=LEARNING_RATE,
            clipped_count_stddev=count_stddev, expected_num_records=RECORDS,
            geometric_update=True)

    exact = query(0.0, 0.0)
    state = exact.initial_global_state()
    norms = _norms()
    clips = []
    for round_norms in norms:
        params = exact.derive_sample_params(state)
        sample = exact.initial_sample_state(tf.zeros([1]))
        for norm in round_norms:
            sample = exact.accumulate_record(params, sample, tf.constant([norm], tf.float32))
        _, state, _ = exact.get_noised_result(sample, state)
        clips.append(float(state.sum_state.l2_norm_clip))
    noisy = query(GRADIENT_SIGMA, COUNT_STDDEV)
    noisy_state = noisy.initial_global_state()
    sample = noisy.accumulate_record(noisy.derive_sample_params(noisy_state),
                                     noisy.initial_sample_state(tf.zeros([1])),
                                     tf.constant([1.0]))
    _, _, event = noisy.get_noised_result(sample, noisy_state)
    with open(path, "w") as handle:
        json.dump({"tensorflow": tf.__version__, "norms": norms.tolist(), "clips": clips,
                   "event": repr(event)}, handle)
    print(f"tensorflow {tf.__version__}: {ROUNDS} rounds, C {clips[0]:.4g} ... {clips[-1]:.4g}")
    print(f"event: {event!r}")


def compare(path: str) -> int:
    import numpy as np
    import tensorflow as tf

    from tf_megadp import AdaptiveClipping, adaptive_clipping
    from tf_megadp.accounting import mechanisms

    with open(path) as handle:
        saved = json.load(handle)
    config = AdaptiveClipping(TARGET_QUANTILE, LEARNING_RATE, count_stddev=0.0)
    clip, ours = tf.constant(INITIAL_CLIP, tf.float64), []
    for round_norms in np.asarray(saved["norms"]):
        norms = tf.constant(round_norms, tf.float32)
        count = adaptive_clipping.centred_count(norms, tf.ones_like(norms), clip)
        clip = adaptive_clipping.updated_clip_norm(config, clip, count, float(RECORDS))
        ours.append(float(clip))
    theirs = np.asarray(saved["clips"])
    difference = np.max(np.abs(np.asarray(ours) / theirs - 1))
    print(f"tensorflow-privacy 0.9 (TensorFlow {saved['tensorflow']}) against tf_megadp, "
          f"{ROUNDS} rounds of {RECORDS} records, C from {INITIAL_CLIP} to {theirs[-1]:.4g}: "
          f"largest relative difference of C {difference:.2e}")
    count_multiplier = COUNT_STDDEV / mechanisms.COUNT_SENSITIVITY
    print(f"tensorflow-privacy's DpEvent: {saved['event']}")
    print(f"tf_megadp's step mechanism:   "
          f"{mechanisms.step_mechanism(GRADIENT_SIGMA, count_multiplier)!r}")
    # float32 in tensorflow-privacy's state, float64 here.
    return 0 if difference < 1e-5 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--tf-privacy", metavar="OUT.json")
    mode.add_argument("--compare", metavar="OUT.json")
    args = parser.parse_args()
    if args.tf_privacy:
        run_tf_privacy(args.tf_privacy)
        return 0
    return compare(args.compare)


if __name__ == "__main__":
    sys.exit(main())
