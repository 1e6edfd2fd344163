"""Prefix-sum RMSE of optimized BandMF and BLT strategies and DP-lambda-CGD against independent noise.

The error of a correlated-noise mechanism on the model is the error of the
noisy prefix sums of the updates (tf_megadp.accounting.matrix_factorization,
"Conventions"). For each run length n and participation (k epochs of
s = n / k steps, fixed order), this prints the RMSE of the n prefix sums per
unit noise multiplier, sqrt(sens^2 * ||A C^{-1}||_F^2 / n), for

- independent noise (DP-SGD's, C = I: sens = sqrt(k));
- BandMF with b bands: the optimized strategy, and the truncated sqrt
  coefficients it starts from (Fichtenberger et al. 2023);
- BLT with d buffers, optimized for the participation;
- DP-lambda-CGD (Kalinin et al., arXiv 2601.22334; no buffer) for each
  --lambdas, and at the lambda of least RMSE for the participation (a
  bounded scalar search); its error is also written in closed form
  (prefix sums of C^{-1}'s column (1, -lambda) / sqrt(1 - lambda^2)) and
  the two must agree;
- with --full-reference, the full Toeplitz strategies (b = n): the sqrt
  factorization C = A^(1/2) and the optimized n-band strategy, the
  references the BLT papers compare to;
- with --amplified N B EPSILON DELTA, BandMF with cyclic Poisson sampling
  (amplified, cycle = b) against DP-SGD at equal epsilon: the RMSE of the
  prefix sums in units of C_clip, sigma_b * sqrt(E_b).

Equal RMSE here is equal error at equal privacy: every mechanism's noise is
scaled to its own sensitivity. It also times the optimizers at --timing-steps
(cold: the first call of each size in this process). NumPy and SciPy only.
Run:

    python benchmarks/matrix_factorization_error.py --steps 1000 10000 --epochs 1 4 \
        --full-reference 1000 --timing-steps 100000
    python benchmarks/matrix_factorization_error.py --steps 1000 10000 \
        --epochs --amplified 1000000 1000 2 1e-6
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The accounting needs no TensorFlow: as the `tf-megadp` launcher does, ask
# the package to import its TensorFlow exports on first use only.
import tf_megadp_cli  # noqa: E402,F401
import dp_accounting  # noqa: E402
import numpy as np  # noqa: E402
from scipy import optimize  # noqa: E402

from tf_megadp.accounting import calibrate_noise_multiplier  # noqa: E402
from tf_megadp.accounting import matrix_factorization as mf  # noqa: E402
from tf_megadp.accounting.noise import LambdaCGD  # noqa: E402


def rmse(strategy, noise, steps, epochs):
    """sqrt(sens^2 E) and whether sens is exact, for the column c and C^{-1}'s column r."""
    separation = -(-steps // epochs)
    sens = mf.minsep_sensitivity(strategy, steps, min_separation=separation,
                                 max_participations=epochs)
    return sens.value * math.sqrt(mf.prefix_sum_mse(noise)), sens.exact


def lambda_cgd_rmse(lam, steps, epochs):
    """(RMSE per unit sigma, exact) of DP-lambda-CGD: the library's strategy, C^{-1} in closed form."""
    strategy = LambdaCGD(lam).resolve(steps).column(steps)
    noise = np.zeros(steps)
    noise[0] = 1.0
    if steps > 1:
        noise[1] = -lam
    return rmse(strategy, noise / math.sqrt(1.0 - lam ** 2), steps, epochs)


def lambda_cgd_closed_form(lam, steps):
    """sqrt(sens^2 E) of lambda-CGD for one pass (k = 1), written out.

    Prefix sums of C^{-1}'s column: 1 / s at t = 0, (1 - lam) / s after,
    s = sqrt(1 - lam^2); E = (n + (1 - lam)^2 n (n - 1) / 2) / (n s^2);
    sens^2 = sum_{k<n} (1 - lam^2) lam^(2k) = 1 - lam^(2n).
    """
    error = (steps + (1 - lam) ** 2 * steps * (steps - 1) / 2) / (steps * (1 - lam ** 2))
    return math.sqrt((1 - lam ** (2 * steps)) * error)


def best_lambda(steps, epochs):
    """The lambda in [0, 0.9999] of least RMSE for the participation (bounded scalar search)."""
    result = optimize.minimize_scalar(lambda lam: lambda_cgd_rmse(lam, steps, epochs)[0],
                                      bounds=(0.0, 0.9999), method="bounded",
                                      options={"xatol": 1e-6})
    return float(result.x)


def rows(steps, epochs, bands, buffers, full_reference, lambdas=()):
    """(mechanism, memory in model copies, RMSE, exact sensitivity, seconds) for one setting."""
    separation = -(-steps // epochs)
    out = [("independent noise", 0, math.sqrt(epochs * (steps + 1) / 2), True, 0.0)]
    began = time.perf_counter()
    chosen = best_lambda(steps, epochs)
    search = time.perf_counter() - began
    for lam in list(lambdas) + [chosen]:
        value, exact = lambda_cgd_rmse(lam, steps, epochs)
        if epochs == 1:
            # The library's strategy against the closed form, one pass.
            assert math.isclose(value, lambda_cgd_closed_form(lam, steps), rel_tol=1e-9), lam
        name = (f"lambda-CGD, best lambda = {lam:.4f}" if lam is chosen
                else f"lambda-CGD, lambda = {lam:g}")
        out.append((name, 0, value, exact, search if lam is chosen else 0.0))
    for b in bands:
        if b > steps:
            continue
        start = mf.unit_norm(mf.sqrt_coefficients(b))
        value, exact = rmse(start, mf.inverse_coefficients(start, steps), steps, epochs)
        if b > 1:
            out.append((f"sqrt coefficients, b = {b}", b - 1, value, exact, 0.0))
        began = time.perf_counter()
        optimized = mf.optimal_band_coefficients(steps, b)
        seconds = time.perf_counter() - began
        value, exact = rmse(optimized, mf.inverse_coefficients(optimized, steps), steps, epochs)
        out.append((f"BandMF, b = {b}", b - 1, value, exact, seconds))
    for d in buffers:
        began = time.perf_counter()
        theta, omega = mf.optimal_blt_parameters(steps, d, min_separation=separation,
                                                 max_participations=epochs)
        seconds = time.perf_counter() - began
        strategy = mf.blt_coefficients(theta, omega, steps)
        value, exact = rmse(strategy, mf.blt_inverse_coefficients(theta, omega, steps), steps,
                            epochs)
        out.append((f"BLT, d = {d}", d, value, exact, seconds))
    if steps <= full_reference:
        full = mf.unit_norm(mf.sqrt_coefficients(steps))
        value, exact = rmse(full, mf.inverse_coefficients(full, steps), steps, epochs)
        out.append((f"sqrt factorization, b = n", steps - 1, value, exact, 0.0))
        began = time.perf_counter()
        optimized = mf.optimal_band_coefficients(steps, steps)
        seconds = time.perf_counter() - began
        value, exact = rmse(optimized, mf.inverse_coefficients(optimized, steps), steps, epochs)
        out.append((f"BandMF, b = n", steps - 1, value, exact, seconds))
    return out


def amplified(step_counts, bands, num_examples, batch_size, epsilon, delta):
    """BandMF with cyclic Poisson sampling (cycle b) at equal epsilon: sigma_b * sqrt(E_b).

    b = 1 is DP-SGD with Poisson sampling. sigma_b is calibrated (RDP) on the
    run's event, which is DP-SGD's on one of the b groups: q = B b / N over
    ceil(T / b) steps; the last column re-checks epsilon on the event that
    `cyclic_poisson_event` builds.
    """
    num_examples, batch_size = int(num_examples), int(batch_size)
    for steps in step_counts:
        print(f"\n### Amplified: N = {num_examples}, B = {batch_size}, T = {steps}, "
              f"epsilon = {epsilon:g}, delta = {delta:g} (cyclic Poisson, cycle = b; RDP)\n")
        print("| mechanism | q | rounds | sigma | RMSE per C_clip | vs DP-SGD | epsilon of the event |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        baseline = None
        for b in bands:
            if b * batch_size > num_examples or b > steps:
                continue
            rounds = -(-steps // b)
            sigma = calibrate_noise_multiplier(
                epsilon, delta, num_examples=num_examples, batch_size=batch_size * b,
                steps=rounds, accountant="rdp")
            event = mf.cyclic_poisson_event(sigma, num_examples=num_examples,
                                            batch_size=batch_size, steps=steps, cycle_length=b,
                                            num_bands=b)
            check = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
            strategy = mf.optimal_band_coefficients(steps, b)
            value = sigma * math.sqrt(mf.prefix_sum_mse(mf.inverse_coefficients(strategy, steps)))
            baseline = baseline or value
            name = "DP-SGD (Poisson)" if b == 1 else f"BandMF, b = {b}"
            print(f"| {name} | {batch_size * b / num_examples:.4g} | {rounds} | {sigma:.4f} | "
                  f"{value:.3f} | {value / baseline:.4f} | {check:.4f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--epochs", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--bands", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--buffers", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--lambdas", type=float, nargs="*", default=[0.5, 0.9, 0.99],
                        help="DP-lambda-CGD's lambdas (the best one is added)")
    parser.add_argument("--full-reference", type=int, default=1000,
                        help="also the full (b = n) strategies for n up to this")
    parser.add_argument("--timing-steps", type=int, default=0,
                        help="time the optimizers at this n (0: skip)")
    parser.add_argument("--amplified", type=float, nargs=4, default=None,
                        metavar=("N", "B", "EPSILON", "DELTA"),
                        help="also BandMF with cyclic Poisson sampling at equal epsilon")
    args = parser.parse_args()

    print("command: python benchmarks/matrix_factorization_error.py " + " ".join(sys.argv[1:]))
    for epochs in args.epochs:
        for steps in args.steps:
            print(f"\n### n = {steps}, {epochs} epoch(s) of {-(-steps // epochs)} steps "
                  "(fixed order)\n")
            print("| mechanism | buffers (model copies) | RMSE per unit sigma | vs independent "
                  "| sensitivity | optimizer s |")
            print("|---|---:|---:|---:|---|---:|")
            table = rows(steps, epochs, args.bands, args.buffers, args.full_reference,
                         args.lambdas)
            independent = table[0][2]
            for name, memory, value, exact, seconds in table:
                print(f"| {name} | {memory} | {value:.4f} | {value / independent:.4f} | "
                      f"{'exact' if exact else 'bound'} | {seconds:.2f} |")
    if args.amplified:
        amplified(args.steps, args.bands, *args.amplified)
    if args.timing_steps:
        n = args.timing_steps
        print(f"\n### Optimizer time at n = {n} (cold, one call each)\n")
        print("| strategy | seconds | RMSE per unit sigma (1 epoch) |")
        print("|---|---:|---:|")
        for b in args.bands:
            began = time.perf_counter()
            c = mf.optimal_band_coefficients(n, b)
            seconds = time.perf_counter() - began
            value = math.sqrt(mf.prefix_sum_mse(mf.inverse_coefficients(c, n)))
            print(f"| BandMF, b = {b} | {seconds:.2f} | {value:.4f} |")
        for d in args.buffers:
            began = time.perf_counter()
            theta, omega = mf.optimal_blt_parameters(n, d)
            seconds = time.perf_counter() - began
            value, _ = rmse(mf.blt_coefficients(theta, omega, n),
                            mf.blt_inverse_coefficients(theta, omega, n), n, 1)
            print(f"| BLT, d = {d} | {seconds:.2f} | {value:.4f} |")


if __name__ == "__main__":
    main()
