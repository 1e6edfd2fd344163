"""Specification of tf_megadp.sampling: what the accountant assumes is what happens.

Statistical checks use fixed seeds and significance level 1e-3; each is paired
with a negative control showing that the same check rejects a sampler that
breaks the property.
"""

import json
import os
import warnings

import numpy as np
import pytest
from scipy import stats

from tf_megadp.accounting import ledger_from_schedule
from tf_megadp.sampling import (
    MANIFEST_NAME,
    PoissonSampler,
    ShuffleSampler,
    TokenShards,
    write_token_shards,
)
from tf_megadp.schedules import BatchSizeSchedule, Phase

ALPHA = 1e-3


def make_shards(directory, num_rows, length=4, vocabulary_size=1000, rows_per_shard=1 << 20):
    rows = (np.arange(num_rows * length, dtype=np.int64).reshape(num_rows, length)) % vocabulary_size
    write_token_shards(
        directory,
        [rows],
        sequence_length=length,
        vocabulary_size=vocabulary_size,
        checksum="test",
        rows_per_shard=rows_per_shard,
    )
    return TokenShards(directory), rows


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """200 rows of length 4 in three shards."""
    return make_shards(tmp_path_factory.mktemp("small"), 200, rows_per_shard=80)


def inclusion_matrix(sampler, steps):
    """[steps, N] 0/1 matrix: row t marks the examples of logical step t."""
    n = sampler.schedule.num_examples
    matrix = np.zeros((steps, n), np.int8)
    for step in range(steps):
        matrix[step, sampler.draw(step).indices] = 1
    return matrix


def chi_square_binomial_sizes(sizes, n, q):
    """P-value of a chi-square goodness-of-fit test of sizes against Binomial(n, q)."""
    observed = np.bincount(sizes, minlength=n + 1)
    expected = stats.binom.pmf(np.arange(n + 1), n, q) * len(sizes)
    # Merge adjacent values until every bin expects at least 5 counts.
    obs_bins, exp_bins, o, e = [], [], 0, 0.0
    for ob, ex in zip(observed, expected):
        o, e = o + ob, e + ex
        if e >= 5:
            obs_bins.append(o)
            exp_bins.append(e)
            o, e = 0, 0.0
    obs_bins[-1] += o
    exp_bins[-1] += e
    exp_bins = np.array(exp_bins) * len(sizes) / np.sum(exp_bins)
    return stats.chisquare(obs_bins, exp_bins).pvalue


class TestShardStore:
    def test_rows_round_trip_across_shards(self, small):
        shards, rows = small
        assert len(shards) == 200 and shards.sequence_length == 4
        assert [s["rows"] for s in shards.manifest["shards"]] == [80, 80, 40]
        picked = np.array([0, 79, 80, 81, 159, 160, 199])
        np.testing.assert_array_equal(shards.read(picked), rows[picked])

    def test_narrowest_dtype_matches_vocabulary(self, tmp_path):
        small_vocab, _ = make_shards(tmp_path / "a", 3, vocabulary_size=65536)
        large_vocab, _ = make_shards(tmp_path / "b", 3, vocabulary_size=70000)
        assert small_vocab.dtype == np.uint16
        assert large_vocab.dtype == np.int32

    def test_manifest_is_json_with_counts_and_checksums(self, small):
        shards, _ = small
        with open(os.path.join(shards.directory, MANIFEST_NAME)) as handle:
            manifest = json.load(handle)
        assert manifest["num_sequences"] == 200
        assert manifest["sequence_length"] == 4
        assert all(len(entry["sha256"]) == 64 for entry in manifest["shards"])
        TokenShards(shards.directory, verify=True)

    def test_corrupt_shard_is_detected_when_verifying(self, tmp_path):
        shards, _ = make_shards(tmp_path, 10)
        path = os.path.join(shards.directory, "shard-00000.npy")
        with open(path, "r+b") as handle:
            handle.seek(-1, os.SEEK_END)
            handle.write(b"\x07")
        with pytest.raises(ValueError, match="SHA-256"):
            TokenShards(shards.directory, verify=True)

    def test_missing_manifest_or_shard_is_a_clear_error(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="manifest.json"):
            TokenShards(tmp_path)
        shards, _ = make_shards(tmp_path / "c", 10)
        os.unlink(os.path.join(shards.directory, "shard-00000.npy"))
        with pytest.raises(FileNotFoundError, match="missing"):
            TokenShards(shards.directory)

    def test_out_of_vocabulary_ids_are_rejected(self, tmp_path):
        with pytest.raises(ValueError, match=r"\[0, 10\)"):
            write_token_shards(tmp_path, [np.full((2, 4), 10)], sequence_length=4, vocabulary_size=10, checksum="x")


def rss_file_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_reading_leaves_no_shard_pages_in_the_resident_set(tmp_path):
    # 32 MiB of rows, all read at random.
    shards, rows = make_shards(tmp_path, 32_768, length=512, vocabulary_size=60_000)
    order = np.random.default_rng(0).permutation(len(shards))
    before = rss_file_kib()
    np.testing.assert_array_equal(shards.read(order[:100]), rows[order[:100]])
    assert shards.read(order).shape == (32_768, 512)
    assert rss_file_kib() - before < 4 * 1024
    # Control: a plain memory map of the same shard keeps what it touched.
    plain = np.load(os.path.join(shards.directory, "shard-00000.npy"), mmap_mode="r")
    assert int(plain[order].sum()) > 0
    assert rss_file_kib() - before > 24 * 1024


class TestPoissonDistribution:
    N, B, STEPS = 200, 20, 3000  # q = 0.1

    @pytest.fixture(scope="class")
    def inclusions(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule.constant(self.STEPS, self.B, num_examples=self.N, micro_batch_size=8)
        sampler = PoissonSampler(shards, schedule, seed=1234)
        return inclusion_matrix(sampler, self.STEPS)

    def test_each_example_is_included_at_rate_q(self, inclusions):
        q = self.B / self.N
        counts = inclusions.sum(axis=0)
        # Under Poisson sampling, each count is Binomial(STEPS, q), independently.
        statistic = ((counts - self.STEPS * q) ** 2 / (self.STEPS * q * (1 - q))).sum()
        assert stats.chi2.sf(statistic, df=self.N) > ALPHA
        assert abs(counts.mean() / self.STEPS - q) < 0.005

    def test_step_size_is_binomial(self, inclusions):
        sizes = inclusions.sum(axis=1)
        assert chi_square_binomial_sizes(sizes, self.N, self.B / self.N) > ALPHA

    def test_fixed_size_steps_fail_the_binomial_test(self):
        # Negative control: the test above rejects fixed-size batches.
        assert chi_square_binomial_sizes(np.full(self.STEPS, self.B), self.N, self.B / self.N) < ALPHA

    def test_inclusions_are_independent_across_steps(self, inclusions):
        # Non-overlapping pairs (step 2s, step 2s+1) of the same example.
        first, second = inclusions[0::2].ravel(), inclusions[1::2].ravel()
        table = np.histogram2d(first, second, bins=2)[0]
        assert stats.chi2_contingency(table).pvalue > ALPHA

    def test_inclusions_are_independent_across_examples(self, inclusions):
        first, second = inclusions[:, 0::2].ravel(), inclusions[:, 1::2].ravel()
        table = np.histogram2d(first, second, bins=2)[0]
        assert stats.chi2_contingency(table).pvalue > ALPHA

    def test_shuffled_epochs_fail_the_independence_test(self, small):
        # Negative control: with epochs of 10 steps, an example drawn in step 2s
        # is much less likely to appear in step 2s + 1.
        shards, _ = small
        schedule = BatchSizeSchedule([Phase(600, self.B, 3)], num_examples=self.N, micro_batch_size=8)
        with pytest.warns(UserWarning, match="Chua"):
            sampler = ShuffleSampler(shards, schedule, seed=0)
        inclusions = inclusion_matrix(sampler, 600)
        table = np.histogram2d(inclusions[0::2].ravel(), inclusions[1::2].ravel(), bins=2)[0]
        assert stats.chi2_contingency(table).pvalue < ALPHA


class TestLargeCorpus:
    def test_blockwise_subsets_are_uniform_over_millions_of_rows(self, tmp_path):
        # 3.2M rows span four 2**20-row blocks of the exact subset sampler.
        n = 3 * (1 << 20) + 200_000
        shards, _ = make_shards(tmp_path, n, length=1, vocabulary_size=7)
        schedule = BatchSizeSchedule.constant(100, 4000, num_examples=n, micro_batch_size=1000)
        sampler = PoissonSampler(shards, schedule, seed=7)
        draws = [sampler.draw(step) for step in range(100)]
        sizes = np.array([d.sampled_size for d in draws])
        assert stats.binomtest(int(sizes.sum()), n * 100, 4000 / n).pvalue > ALPHA
        every = np.concatenate([d.indices for d in draws])
        assert all(len(np.unique(d.indices)) == len(d.indices) for d in draws)
        # Inclusions per tenth of the corpus are uniform.
        observed = np.bincount(every * 10 // n, minlength=10)
        assert stats.chisquare(observed).pvalue > ALPHA


class TestStaticMicroBatches:
    def test_step_is_k_micro_batches_with_zero_weight_padding(self, small):
        shards, rows = small
        schedule = BatchSizeSchedule.constant(3, 20, num_examples=200, micro_batch_size=8)
        k = schedule.phases[0].accumulation_steps
        sampler = PoissonSampler(shards, schedule, seed=3)
        batches = list(sampler.micro_batches())
        assert len(batches) == 3 * k == sampler.total_micro_steps
        for step in range(3):
            draw = sampler.draw(step)
            step_rows = np.concatenate([b[0] for b in batches[step * k : (step + 1) * k]])
            step_weights = np.concatenate([b[1] for b in batches[step * k : (step + 1) * k]])
            assert step_rows.shape == (schedule.capacity(schedule.phases[0]), 4)
            assert step_weights.sum() == len(draw.indices)
            np.testing.assert_array_equal(step_rows[step_weights == 1], rows[draw.indices])
            assert np.all(step_rows[step_weights == 0] == 0)

    def test_dataset_has_static_shapes_and_known_length(self, small):
        import tensorflow as tf

        shards, _ = small
        schedule = BatchSizeSchedule([Phase(2, 20, 3), Phase(2, 40, 6)], num_examples=200, micro_batch_size=8, num_replicas=2)
        sampler = PoissonSampler(shards, schedule, seed=3)
        dataset = sampler.as_dataset()
        assert dataset.element_spec[0].shape == (16, 4)
        assert int(dataset.cardinality()) == 2 * 3 + 2 * 6
        elements = list(dataset)
        assert len(elements) == 18
        assert all(r.dtype == tf.int32 and w.dtype == tf.float32 for r, w in elements)

    def test_a_sampler_cannot_be_replayed(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule.constant(1, 20, num_examples=200, micro_batch_size=8)
        sampler = PoissonSampler(shards, schedule, seed=3)
        list(sampler.micro_batches())
        with pytest.raises(RuntimeError, match="start_step"):
            list(sampler.micro_batches())

    def test_resuming_reproduces_the_uninterrupted_draws(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule([Phase(3, 20, 3), Phase(3, 40, 6)], num_examples=200, micro_batch_size=8)
        full = list(PoissonSampler(shards, schedule, seed=11).micro_batches())
        # Resume at logical step 2, one micro-batch into it (k = 3 in phase 0).
        resumed = list(PoissonSampler(shards, schedule, seed=11, start_step=2, start_micro_step=1).micro_batches())
        assert len(resumed) == len(full) - 7
        for (a, wa), (b, wb) in zip(full[7:], resumed):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(wa, wb)

    def test_different_seeds_give_different_draws(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule.constant(1, 20, num_examples=200, micro_batch_size=8)
        a = PoissonSampler(shards, schedule, seed=1).draw(0).indices
        b = PoissonSampler(shards, schedule, seed=2).draw(0).indices
        assert not np.array_equal(a, b)

    def test_schedule_must_describe_this_corpus(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule.constant(1, 20, num_examples=201, micro_batch_size=8)
        with pytest.raises(ValueError, match="num_examples=len"):
            PoissonSampler(shards, schedule, seed=0)


class TestTruncation:
    # Capacity 22 for an expected batch of 20 of 200: P[Bin(200, 0.1) > 22] ~ 0.27.
    SCHEDULE = BatchSizeSchedule([Phase(1500, 20, 11)], num_examples=200, micro_batch_size=2)

    def test_observed_truncation_rate_is_within_the_accounted_bound(self, small):
        shards, _ = small
        phase = self.SCHEDULE.phases[0]
        bound = self.SCHEDULE.truncation_probability(phase)
        sampler = PoissonSampler(shards, self.SCHEDULE, seed=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            draws = [sampler.draw(step) for step in range(phase.steps)]
        truncated = sum(d.truncated for d in draws)
        assert truncated == sampler.truncated_steps > 0
        assert len([w for w in caught if "capacity" in str(w.message)]) == truncated
        # One-sided: the observed count is not significantly above the bound.
        assert stats.binomtest(truncated, phase.steps, bound, alternative="greater").pvalue > ALPHA
        assert all(len(d.indices) == min(d.sampled_size, 22) for d in draws)
        assert sampler.truncated_examples == sum(max(0, d.sampled_size - 22) for d in draws)

    def test_a_higher_truncation_rate_would_be_caught(self):
        # Negative control: twice the bound's rate is rejected by the same test.
        bound = self.SCHEDULE.truncation_probability(self.SCHEDULE.phases[0])
        assert stats.binomtest(int(2 * bound * 1500), 1500, bound, alternative="greater").pvalue < ALPHA

    def test_truncated_steps_keep_a_uniform_subset(self, small):
        shards, _ = small
        sampler = PoissonSampler(shards, self.SCHEDULE, seed=6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counts = inclusion_matrix(sampler, 1500).sum(axis=0)
        assert stats.chisquare(counts).pvalue > ALPHA

    def test_accountant_truncates_at_the_sampler_capacity(self):
        ledger = ledger_from_schedule(self.SCHEDULE, noise_multiplier=1.0)
        assert ledger.entries[0].max_batch_size == self.SCHEDULE.capacity(self.SCHEDULE.phases[0]) == 22


class TestShuffleSampler:
    def test_fixed_batches_cover_each_example_once_per_epoch(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule([Phase(20, 40, 5)], num_examples=200, micro_batch_size=8)
        with pytest.warns(UserWarning, match="understates"):
            sampler = ShuffleSampler(shards, schedule, seed=0)
        assert sampler.sampling_kind == "shuffle"
        draws = [sampler.draw(step) for step in range(10)]
        assert all(len(d.indices) == 40 and not d.truncated for d in draws)
        for epoch in range(2):
            seen = np.concatenate([d.indices for d in draws[5 * epoch : 5 * epoch + 5]])
            np.testing.assert_array_equal(np.sort(seen), np.arange(200))

    def test_steps_never_straddle_epochs(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule([Phase(6, 60, 8)], num_examples=200, micro_batch_size=8)
        with pytest.warns(UserWarning):
            sampler = ShuffleSampler(shards, schedule, seed=0)
        draws = [sampler.draw(step) for step in range(6)]
        # 3 steps of 60 per epoch of 200; 20 rows are left out each epoch.
        assert len(np.unique(np.concatenate([d.indices for d in draws[:3]]))) == 180
        assert all(len(np.unique(d.indices)) == 60 for d in draws)

    def test_poisson_kind_is_labelled(self, small):
        shards, _ = small
        schedule = BatchSizeSchedule.constant(1, 20, num_examples=200, micro_batch_size=8)
        assert PoissonSampler(shards, schedule, seed=0).sampling_kind == "poisson"
