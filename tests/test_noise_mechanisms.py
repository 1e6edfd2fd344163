"""Specification of the noise-mechanism registry (tf_megadp.accounting.noise): one row per mechanism.

Each registered mechanism must have a row in `MECHANISM_ROWS`, and
`test_every_registered_mechanism_has_a_row` fails until it does. A row
gives the mechanism at small parameters, the first column of its
unit-norm strategy C written out independently of the library (the
paper's definition), the samplings it has a proof for, and the buffers its
noise keeps. From it each test checks, without TensorFlow:

* the noise it streams is C^{-1} z, step after step (its `stream` run on
  NumPy operations against a dense solve);
* its description and its ledger record round-trip, and the record is
  read back by its own mechanism;
* it refuses every sampling without a proof, and accepts the others;
* its fixed-order epsilon is the one dp_accounting computes directly for
  the Gaussian mechanism of the dense C's worst column sum.
"""

import ast
import json
import math
import os

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld
from scipy import linalg

from tf_megadp.accounting import compute_epsilon, events, sampling_kinds
from tf_megadp.accounting.noise import (
    BLT,
    BandMF,
    Independent,
    LambdaCGD,
    mechanism_from_dict,
    noise_kinds,
    read_noise_record,
    register_noise,
)
from tf_megadp.errors import PrivacyConfigurationError

N = 24  # Steps of the rows' runs.


def _unit(column):
    column = np.asarray(column, np.float64)
    return column / np.linalg.norm(column)


def _bandmf_column(n):
    # BandMF with given coefficients: c / ||c||, zero past the bands.
    column = np.zeros(n)
    column[:3] = _unit([1.0, 0.5, 0.25])
    return column


def _blt_column(n):
    # c_0 = 1, c_t = sum_i omega_i theta_i^(t-1), then unit norm over the n steps.
    t = np.arange(1, n)
    column = np.concatenate([[1.0], 0.2 * 0.9 ** (t - 1) + 0.3 * 0.5 ** (t - 1)])
    return _unit(column)


def _lambda_cgd_column(n, lam=0.6):
    # Noise (z_t - lam z_(t-1)) / sqrt(1 - lam^2): C^{-1} = (I - lam S) / sqrt(1 - lam^2),
    # so C's column is sqrt(1 - lam^2) lam^k (Kalinin et al., arXiv 2601.22334).
    return math.sqrt(1 - lam ** 2) * lam ** np.arange(n)


MECHANISM_ROWS = {
    # kind: (mechanism, C's first column over n steps, samplings with a proof
    #        (cycle_length 4 for cyclic Poisson), noise buffers)
    "independent": (Independent(), lambda n: np.eye(n)[0],
                    {"poisson", "shuffle", "cyclic_poisson", "fixed_order"}, 0),
    "bandmf": (BandMF(3, coefficients=(1.0, 0.5, 0.25)), _bandmf_column,
               {"cyclic_poisson", "fixed_order"}, 2),
    "blt": (BLT(2, buffer_decays=(0.9, 0.5), output_scales=(0.2, 0.3)), _blt_column,
            {"fixed_order"}, 2),
    "lambda_cgd": (LambdaCGD(0.6), _lambda_cgd_column, {"fixed_order"}, 0),
}


def test_every_registered_mechanism_has_a_row():
    assert set(noise_kinds()) == set(MECHANISM_ROWS)


def test_the_registry_refuses_a_second_mechanism_of_a_kind():
    class Impostor(Independent):
        pass

    with pytest.raises(ValueError, match="registered already"):
        register_noise(Impostor)


class _Buffer:
    def __init__(self, shape):
        self.value = np.zeros(shape)


class NumpyStreamOps:
    """The `StreamOps` of one step on NumPy: what the optimizer's noise stage gives on TensorFlow."""

    def __init__(self, draws, buffers, step):
        self._draws = draws
        self.draw = draws[step]
        self.buffers = buffers
        self.step = step

    def previous_draw(self, lag):
        # The segment starts at step 0: no draw before it.
        past = self.step - lag
        return self._draws[past] if past >= 0 else np.zeros_like(self.draw)

    def read(self, buffer):
        return buffer.value

    def write(self, buffer, value):
        buffer.value = value

    def weighted_sum(self, weights, buffers):
        return sum(w * b.value for w, b in zip(weights, buffers))

    def ring_weights(self, coefficients):
        slots = len(self.buffers)
        return [coefficients[(self.step - 1 - slot) % slots] for slot in range(slots)]

    def ring_write(self, value):
        self.buffers[self.step % len(self.buffers)].value = value


def _streamed(strategy, draws):
    buffers = [_Buffer(draws.shape[1:]) for _ in range(strategy.noise_buffers)]
    return np.stack([strategy.stream(NumpyStreamOps(draws, buffers, t))
                     for t in range(draws.shape[0])])


@pytest.mark.parametrize("kind", sorted(MECHANISM_ROWS))
def test_each_mechanism_streams_the_inverse_of_its_strategy(kind):
    mechanism, column, _, buffers = MECHANISM_ROWS[kind]
    strategy = mechanism.resolve(N, steps_per_epoch=N)
    assert strategy.noise_buffers == buffers
    np.testing.assert_allclose(strategy.column(N), column(N), rtol=1e-12, atol=1e-15)
    draws = np.random.default_rng(3).standard_normal((N, 5))
    dense = linalg.toeplitz(column(N), np.zeros(N))
    np.testing.assert_allclose(_streamed(strategy, draws), np.linalg.solve(dense, draws),
                               rtol=1e-9, atol=1e-9)


def test_the_stream_check_can_fail():
    # A planted error: lambda-CGD's noise read as z_t - lam z_(t-2).
    strategy = LambdaCGD(0.6).resolve(N)
    draws = np.random.default_rng(3).standard_normal((N, 5))

    class Lag2(NumpyStreamOps):
        def previous_draw(self, lag):
            return super().previous_draw(lag + 1)

    wrong = np.stack([strategy.stream(Lag2(draws, [], t)) for t in range(N)])
    dense = linalg.toeplitz(_lambda_cgd_column(N), np.zeros(N))
    assert not np.allclose(wrong, np.linalg.solve(dense, draws), atol=1e-6)


@pytest.mark.parametrize("kind", sorted(MECHANISM_ROWS))
def test_each_mechanism_round_trips_its_description_and_reads_back_its_record(kind):
    mechanism, _, _, _ = MECHANISM_ROWS[kind]
    assert mechanism_from_dict(json.loads(json.dumps(mechanism.to_dict()))) == mechanism
    strategy = mechanism.resolve(N, steps_per_epoch=N)
    record = strategy.record()
    assert json.loads(record)["kind"] == kind
    read, strategy_hash = read_noise_record(record)
    # The record keeps the mechanism's sizes and the strategy's hash, not its numbers.
    assert read.identity() == mechanism.identity() and type(read) is type(mechanism)
    assert strategy_hash == (strategy.strategy_hash if mechanism.has_strategy else None)
    assert strategy.describe()["record"] == record


@pytest.mark.parametrize("kind", sorted(MECHANISM_ROWS))
def test_each_mechanism_accepts_exactly_the_samplings_it_has_a_proof_for(kind):
    mechanism, _, proven, _ = MECHANISM_ROWS[kind]
    assert set(sampling_kinds()) == {"poisson", "shuffle", "cyclic_poisson", "fixed_order"}
    for sampling in sampling_kinds():
        cycle = 4 if sampling == "cyclic_poisson" else 1
        if sampling in proven:
            mechanism.check_sampling(sampling, cycle)
        else:
            with pytest.raises(PrivacyConfigurationError, match="no privacy proof|accounted"):
                mechanism.check_sampling(sampling, cycle)
    # Its own job sampling is one of them.
    accounted = mechanism.accounted_sampling()
    sampling = accounted.get("sampling", "cyclic_poisson" if accounted.get("cycle_length")
                             else "poisson")
    assert sampling in proven


def _direct_fixed_order_sensitivity(column, n, steps_per_epoch):
    """max over an example's slot j of ||sum of C's columns j, j + s, ...||: the dense worst case."""
    dense = linalg.toeplitz(column, np.zeros(n))
    return max(np.linalg.norm(dense[:, slot::steps_per_epoch].sum(axis=1))
               for slot in range(steps_per_epoch))


@pytest.mark.parametrize("kind", sorted(MECHANISM_ROWS))
@pytest.mark.parametrize("steps_per_epoch", [N, 6])
def test_each_fixed_order_epsilon_is_dp_accountings_for_the_dense_strategy(kind, steps_per_epoch):
    mechanism, column, _, _ = MECHANISM_ROWS[kind]
    sens = _direct_fixed_order_sensitivity(column(N), N, steps_per_epoch)
    sigma, delta = 3.0, 1e-5
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(sigma / sens))
    direct = accountant.get_epsilon(delta)
    got = compute_epsilon(num_examples=600, batch_size=600 // steps_per_epoch, steps=N,
                          noise_multiplier=sigma, delta=delta, sampling="fixed_order",
                          noise=None if kind == "independent" else mechanism, accountant="pld")
    assert got == pytest.approx(direct, rel=1e-3)


def test_lambda_cgd_is_refused_outside_zero_to_one():
    for lam in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(PrivacyConfigurationError, match="lam must lie in"):
            LambdaCGD(lam)
    assert LambdaCGD(0.0).resolve(N).column(4).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_the_ledger_checks_a_segments_noise_through_its_mechanism():
    record = LambdaCGD(0.6).resolve(N).record()
    entry = events.sampling_kind("fixed_order")
    assert entry.segment_event is not None
    from tf_megadp.accounting import LedgerEntry

    fixed = LedgerEntry(5, 0.1, 1.0, sampling="fixed_order", noise=record, steps_per_epoch=10,
                        participations=1, sensitivity=1.0, segment_start=True)
    assert fixed.mechanism == LambdaCGD(0.6)
    with pytest.raises(PrivacyConfigurationError, match="only with fixed-order"):
        LedgerEntry(5, 0.1, 1.0, sampling="poisson", noise=record)


def test_accounting_has_no_import_circle_even_through_function_level_imports():
    """Issue 50: accountant -> calibration -> run_description -> BandMF.for_run -> calibration was one.

    Every `import` of a tf_megadp.accounting module counts, at module level
    or inside a function, except those under `if TYPE_CHECKING:` (never run).
    """
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tf_megadp", "accounting")
    modules = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, os.path.dirname(os.path.dirname(root)))
                module = relative[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules[module] = ast.parse(open(path, encoding="utf-8").read())

    def imports(tree):
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.dump(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.module:
                # `from package import module` needs the module; other names, the package.
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                         else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            yield from (name for name in names if name in modules)

    graph = {module: set(imports(tree)) for module, tree in modules.items()}
    for module in graph:
        graph[module].discard(module)
    visiting, done = [], set()

    def visit(module):
        if module in done:
            return
        assert module not in visiting, " -> ".join(visiting[visiting.index(module):] + [module])
        visiting.append(module)
        for name in sorted(graph[module]):
            visit(name)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
