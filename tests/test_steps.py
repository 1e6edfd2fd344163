"""Specification of tf_megadp.steps: one schedule, read alike by sampler, optimizer, accountant."""

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from tf_megadp.steps import BatchSizeSchedule, Phase


def exact_tail(n, q, capacity):
    """P[Binomial(n, q) > capacity] in exact rational arithmetic (independent of scipy)."""
    q = Fraction(q).limit_denominator(10**12)
    return float(sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(capacity + 1, n + 1)))


class TestPhase:
    @pytest.mark.parametrize("field", ["steps", "batch_size", "accumulation_steps"])
    @pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
    def test_counts_must_be_positive_integers(self, field, value):
        kwargs = {"steps": 1, "batch_size": 1, "accumulation_steps": 1, field: value}
        with pytest.raises(ValueError, match=f"Phase.{field}"):
            Phase(**kwargs)

    @pytest.mark.parametrize("sigma", [-0.1, float("nan"), float("inf")])
    def test_noise_multiplier_must_be_finite_and_non_negative(self, sigma):
        with pytest.raises(ValueError, match="noise_multiplier"):
            Phase(1, 1, 1, sigma)


class TestConstruction:
    def test_capacity_below_the_expected_batch_is_refused_with_the_fix(self):
        with pytest.raises(ValueError, match="Raise accumulation_steps to at least 4"):
            BatchSizeSchedule([Phase(10, 100, 3)], num_examples=1000, micro_batch_size=32)

    def test_batch_larger_than_the_corpus_is_refused(self):
        with pytest.raises(ValueError, match="sampling rate would exceed 1"):
            BatchSizeSchedule([Phase(10, 2000, 100)], num_examples=1000, micro_batch_size=32)

    @pytest.mark.parametrize("name", ["num_examples", "micro_batch_size", "num_replicas"])
    def test_sizes_must_be_positive_integers(self, name):
        kwargs = {"num_examples": 1000, "micro_batch_size": 8, "num_replicas": 1, name: 0}
        with pytest.raises(ValueError, match=name):
            BatchSizeSchedule([Phase(1, 8, 1)], **kwargs)

    def test_needs_phases(self):
        with pytest.raises(ValueError, match="at least one Phase"):
            BatchSizeSchedule([], num_examples=10, micro_batch_size=1)
        with pytest.raises(TypeError, match="not a Phase"):
            BatchSizeSchedule([(1, 1, 1)], num_examples=10, micro_batch_size=1)


class TestForPoisson:
    @pytest.mark.parametrize(
        "n, batch, m, replicas, bound",
        [(1000, 100, 8, 1, 1e-9), (500, 50, 4, 2, 1e-3), (800, 64, 16, 1, 1e-6), (300, 299, 7, 1, 1e-9)],
    )
    def test_k_is_the_smallest_whose_capacity_meets_the_bound(self, n, batch, m, replicas, bound):
        schedule = BatchSizeSchedule.for_poisson(
            [(5, batch)], num_examples=n, micro_batch_size=m, num_replicas=replicas, truncation_probability=bound
        )
        phase = schedule.phases[0]
        k = phase.accumulation_steps
        slots = m * replicas
        assert schedule.capacity(phase) == k * slots
        assert exact_tail(n, batch / n, k * slots) <= bound * (1 + 1e-9)
        if k > 1 and (k - 1) * slots >= batch:
            assert exact_tail(n, batch / n, (k - 1) * slots) > bound

    def test_truncation_probability_is_the_exact_binomial_tail(self):
        schedule = BatchSizeSchedule([Phase(10, 100, 11)], num_examples=1000, micro_batch_size=10)
        phase = schedule.phases[0]
        assert schedule.truncation_probability(phase) == pytest.approx(exact_tail(1000, 0.1, 110), rel=1e-9)

    def test_noise_multipliers_per_phase(self):
        schedule = BatchSizeSchedule.for_poisson(
            [(2, 10), (3, 40)], num_examples=1000, micro_batch_size=8, noise_multipliers=[1.0, 2.5]
        )
        assert [p.noise_multiplier for p in schedule.phases] == [1.0, 2.5]
        with pytest.raises(ValueError, match="one entry per phase"):
            BatchSizeSchedule.for_poisson([(2, 10)], num_examples=1000, micro_batch_size=8, noise_multipliers=[1.0, 2.0])

    def test_bound_must_be_a_probability(self):
        with pytest.raises(ValueError, match="truncation_probability"):
            BatchSizeSchedule.constant(1, 10, num_examples=100, micro_batch_size=4, truncation_probability=0)


class TestExtended:
    def test_the_old_phases_stay_and_the_new_ones_are_sized_as_for_poisson(self):
        schedule = BatchSizeSchedule.for_poisson([(5, 50)], num_examples=500, micro_batch_size=4,
                                                 num_replicas=2)
        longer = schedule.extended([(3, 100), Phase(2, 20, 5, noise_multiplier=2.0)],
                                   truncation_probability=1e-6)
        fresh = BatchSizeSchedule.for_poisson([(3, 100)], num_examples=500, micro_batch_size=4,
                                              num_replicas=2, truncation_probability=1e-6)
        assert longer.phases == (schedule.phases[0], fresh.phases[0], Phase(2, 20, 5, 2.0))
        assert (longer.num_examples, longer.micro_batch_size, longer.num_replicas) == (500, 4, 2)
        assert longer.phase_ends == [5, 8, 10]

    def test_nothing_to_add_is_refused(self):
        schedule = BatchSizeSchedule.constant(5, 50, num_examples=500, micro_batch_size=4)
        with pytest.raises(ValueError, match="at least one phase"):
            schedule.extended([])


class TestLookups:
    SCHEDULE = BatchSizeSchedule([Phase(3, 10, 2, 1.0), Phase(2, 40, 6), Phase(4, 80, 11, 3.0)], num_examples=100, micro_batch_size=8)

    def test_phase_of_each_step(self):
        indices = [self.SCHEDULE.phase_index(step) for step in range(12)]
        assert indices == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2]  # steps past the end stay in the last phase
        assert self.SCHEDULE.phase_ends == [3, 5, 9]
        assert self.SCHEDULE.total_steps == 9
        with pytest.raises(ValueError, match="step must be >= 0"):
            self.SCHEDULE.phase_index(-1)

    def test_sampling_rate_is_batch_over_corpus(self):
        assert [self.SCHEDULE.sampling_rate(s) for s in (0, 3, 8)] == [0.1, 0.4, 0.8]

    def test_expected_examples(self):
        assert self.SCHEDULE.examples_processed() == 3 * 10 + 2 * 40 + 4 * 80

    def test_round_trips_through_json(self):
        again = BatchSizeSchedule.from_json(self.SCHEDULE.to_json())
        assert again == self.SCHEDULE and again.phases == self.SCHEDULE.phases
        assert BatchSizeSchedule.from_dict(self.SCHEDULE.to_dict()) == self.SCHEDULE
        with pytest.raises(ValueError, match="needs num_examples"):
            BatchSizeSchedule.from_dict({"phases": []})


class TestOneSourceOfTruth:
    """The sampler, the optimizer and the accountant agree on every logical step."""

    @pytest.fixture(scope="class")
    def setup(self, tmp_path_factory):
        from tf_megadp.data import PoissonSampler, TokenShards, write_token_shards

        directory = tmp_path_factory.mktemp("shards")
        write_token_shards(directory, [np.ones((400, 4), np.int64)], sequence_length=4, vocabulary_size=8, checksum="t")
        schedule = BatchSizeSchedule.for_poisson(
            [(3, 16), (2, 48), (2, 96)], num_examples=400, micro_batch_size=8, noise_multipliers=[1.0, None, 2.0]
        )
        return schedule, PoissonSampler(TokenShards(directory), schedule, seed=0)

    def test_sampler_optimizer_and_ledger_read_the_same_phases(self, setup):
        import keras

        from tf_megadp.accounting import ledger_from_schedule
        from tf_megadp.optimizer import DPOptimizer

        schedule, sampler = setup
        optimizer = DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.5, schedule=schedule)
        ledger = ledger_from_schedule(schedule, noise_multiplier=1.5)
        assert [e.steps for e in ledger.entries] == [p.steps for p in schedule.phases]
        for step in range(schedule.total_steps):
            phase = schedule.phase_at(step)
            entry = ledger.entries[schedule.phase_index(step)]
            assert sampler.draw(step).capacity == schedule.capacity(phase) == entry.max_batch_size
            assert optimizer.accumulation_steps_at(step) * schedule.micro_batch_size == schedule.capacity(phase)
            assert optimizer.batch_size_at(step) == phase.batch_size
            assert entry.sampling_rate == sampler.schedule.sampling_rate(step) == phase.batch_size / 400
            assert optimizer.noise_multiplier_at(step) == entry.noise_multiplier
        assert ledger.entries[1].noise_multiplier == 1.5  # the phase without its own sigma

    def test_sampled_step_sizes_follow_each_phase(self, setup):
        from tf_megadp.data import PoissonSampler

        schedule, sampler = setup
        for index, phase in enumerate(schedule.phases):
            start = schedule.phase_ends[index] - phase.steps
            # 300 independent draws of one step of the phase (distinct seeds).
            sizes = [PoissonSampler(sampler.shards, schedule, seed=s).draw(start).sampled_size for s in range(300)]
            assert stats.binomtest(int(np.sum(sizes)), 300 * 400, phase.batch_size / 400).pvalue > 1e-3

    def test_private_training_steps_in_lockstep_with_the_sampler(self, setup, tmp_path):
        """Logical steps completed after each micro-batch match the sampler's k_t."""
        import keras

        from tf_megadp.optimizer import DPOptimizer
        from tf_megadp.data import PoissonSampler
        from tf_megadp.training import make_private

        schedule, sampler = setup
        fresh = PoissonSampler(sampler.shards, schedule, seed=1)
        dataset = fresh.as_dataset(
            lambda rows, weights: (keras.ops.cast(rows, "float32"), keras.ops.zeros((8, 1)), weights)
        )
        model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
        make_private(model)
        model.compile(
            optimizer=DPOptimizer(keras.optimizers.SGD(0.01), l2_norm_clip=1.0, noise_multiplier=1.0, schedule=schedule, seed=0),
            loss="mse",
        )
        seen = []

        class Record(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen.append(int(self.model.optimizer.iterations.numpy()))

        model.fit(dataset, epochs=1, verbose=0, callbacks=[Record()])
        ks = [schedule.phase_at(step).accumulation_steps for step in range(schedule.total_steps)]
        expected = [step + 1 if micro == k - 1 else step for step, k in enumerate(ks) for micro in range(k)]
        assert seen == expected


class TestOneNumberForEachQuantity:
    """Acceptance of issue 29: the sampler, `compute_epsilon`, the CLI and the accountant
    derive a run's steps from epochs in one function, so they count the same steps and
    report the same epsilon. Before, the sampler rounded `epochs * N / B` in binary
    floating point and the accountant in decimals: epochs 1.1 of N = 100, B = 10 drew
    12 steps and accounted 11."""

    @staticmethod
    def sampler(kind, epochs, num_examples, batch_size, micro_batch_size, num_replicas):
        import tf_megadp

        cls = {"poisson": tf_megadp.PoissonSampler, "shuffle": tf_megadp.ShuffleSampler}[kind]
        x = np.zeros((num_examples, 1), np.float32)
        return cls.from_arrays(
            x, np.zeros(num_examples), batch_size=batch_size, epochs=epochs,
            micro_batch_size=micro_batch_size, num_replicas=num_replicas, shared_secret=2**64 + 1)

    @staticmethod
    def draws(count, seed):
        rng = np.random.default_rng(seed)
        for _ in range(count):
            num_examples = int(rng.integers(10, 2_000))
            batch_size = int(rng.integers(1, num_examples // 2 + 1))
            # Decimal epochs as users type them (1.1, 0.35, 2.7): where binary round-off bites.
            epochs = round(float(rng.uniform(0.05, 3.0)), int(rng.integers(1, 3)))
            yield epochs, num_examples, batch_size, int(rng.integers(1, 33)), int(rng.integers(1, 3))

    @pytest.mark.parametrize("kind", ["poisson", "shuffle"])
    def test_sampler_and_accountant_count_the_same_steps(self, kind, recwarn):
        from tf_megadp.accounting import PrivacyAccountant

        cases = [(1.1, 100, 10, 4, 1), (1.15, 400, 20, 8, 2), *self.draws(300, seed=29)]
        for epochs, num_examples, batch_size, m, replicas in cases:
            if kind == "shuffle" and epochs * (num_examples // batch_size) < 1:
                continue
            sampler = self.sampler(kind, epochs, num_examples, batch_size, m, replicas)
            planned = PrivacyAccountant.for_run(
                1e-6, num_examples=num_examples, batch_size=batch_size, epochs=epochs,
                noise_multiplier=1.0, sampling=kind, accountant="rdp")
            assert sampler.schedule.total_steps == planned.steps, (epochs, num_examples, batch_size)

    @pytest.mark.parametrize("kind", ["poisson", "shuffle"])
    def test_sampler_compute_epsilon_cli_and_accountant_agree(self, kind, capsys, recwarn):
        import json

        from tf_megadp import cli
        from tf_megadp.accounting import PrivacyAccountant, compute_epsilon, ledger_from_schedule

        cases = [(1.1, 100, 10, 4, 1), *self.draws(4, seed=2029)]
        for epochs, num_examples, batch_size, m, replicas in cases:
            if kind == "shuffle" and epochs * (num_examples // batch_size) < 1:
                continue
            sampler = self.sampler(kind, epochs, num_examples, batch_size, m, replicas)
            schedule = sampler.schedule
            delta = 0.5 / num_examples
            truncation = schedule.capacity(schedule.phases[0]) if kind == "poisson" else None
            # What the run will record, phase by phase, from the sampler's own schedule.
            ledger = ledger_from_schedule(schedule, 1.3, sampling=kind)
            spent = PrivacyAccountant(num_examples, delta, accountant="rdp", ledger=ledger)
            run = dict(num_examples=num_examples, batch_size=batch_size, epochs=epochs,
                       noise_multiplier=1.3, sampling=kind, max_batch_size=truncation,
                       accountant="rdp")
            planned = compute_epsilon(delta=delta, **run)
            assert PrivacyAccountant.for_run(delta, **run).ledger == ledger
            flags = ["epsilon", "--num-examples", str(num_examples), "--batch-size",
                     str(batch_size), "--epochs", repr(epochs), "--noise-multiplier", "1.3",
                     "--delta", repr(delta), "--sampling", kind, "--accountant", "rdp", "--json"]
            if truncation:
                flags += ["--max-batch-size", str(truncation)]
            assert cli.main(flags) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["steps"] == spent.steps == schedule.total_steps
            assert report["epsilon"] == planned == spent.epsilon(), (epochs, num_examples, batch_size)
