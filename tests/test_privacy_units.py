"""Specification of user-level privacy: `PrivacyUnitSampler` and a private fit over units.

The sampler Poisson-samples UNITS (not examples), takes at most k examples
of each (a secret uniform choice when a unit has more), and lays every unit
out in its own slot of k rows. A `DPOptimizer(examples_per_unit=k)` clips
each slot's summed gradient, and the accountant composes over the U units:
the report's epsilon equals dp_accounting's for Poisson sampling of units,
and the report names the unit. An optimizer and data that disagree on the
unit are refused before any step. The BERT job at user level (`--privacy-unit
FIELD`) runs end to end in a slow test (`pytest -m slow`); its corpus
preparation is checked in the default run.
"""

import json
import math
import pickle
import re
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import rdp

import tf_megadp
from tests import reference
from tf_megadp import PrivacyConfigurationError, PrivacyUnitSampler

pytestmark = [
    pytest.mark.filterwarnings("ignore:An explicit sampling seed"),
    pytest.mark.filterwarnings("ignore:DPOptimizer\\(seed="),
    pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0"),
]

K = 3
DELTA = 1e-5
# Skewed units: unit 0 wrote 10 examples, the others 1 to 3.
SIZES = [10, 1, 2, 3, 1, 2, 3, 1]


def skewed_data(sizes=SIZES, seed=0):
    """x [N, 4] whose first feature is the example's own row number, y, unit ids."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(len(sizes)) * 7 + 100, sizes)  # ids need not be 0..U-1
    rng.shuffle(ids)  # a unit's examples are scattered through the data
    n = ids.size
    x = np.concatenate([np.arange(n, dtype="float32")[:, None],
                        rng.normal(size=(n, 3)).astype("float32")], axis=1)
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y, ids


def drawn_steps(sampler):
    """Per logical step, the micro-batches as (example rows [slots, k], weights)."""
    steps = {}
    for step, (x, _, w) in sampler._micro_batches_by_step():
        rows = np.where(w > 0, x[:, 0], -1).astype(int).reshape(-1, sampler.examples_per_unit)
        steps.setdefault(step, []).append(rows)
    return {step: np.concatenate(parts) for step, parts in steps.items()}


class TestSampler:

    def test_every_slot_holds_at_most_k_examples_of_one_unit_and_no_example_twice(self):
        x, y, ids = skewed_data()
        sampler = PrivacyUnitSampler.from_arrays(
            x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=3,
            micro_batch_size=2, seed=0)
        assert sampler.num_units == len(SIZES) and sampler.schedule.num_examples == len(SIZES)
        assert sampler.micro_batch_rows == 2 * K
        for slots in drawn_steps(sampler).values():
            real = slots[slots >= 0]
            assert len(set(real)) == real.size  # no example twice in a noisy sum
            for slot in slots:
                members = slot[slot >= 0]
                assert len(members) <= K
                assert len(set(ids[members])) <= 1  # one unit per slot
                # The slot holds min(size, k) of its unit's examples, real rows first.
                if members.size:
                    assert members.size == min(K, int(np.sum(ids == ids[members[0]])))
                    assert np.all(slot[: members.size] >= 0)
        assert sampler.capped_examples > 0  # unit 0 was capped at k

    def test_units_are_sampled_with_q_whatever_their_size_and_capped_examples_uniformly(self):
        x, y, ids = skewed_data()
        steps = 3000
        schedule = tf_megadp.BatchSizeSchedule.for_poisson(
            [(steps, 2)], num_examples=len(SIZES), micro_batch_size=len(SIZES))
        sampler = PrivacyUnitSampler.from_arrays(
            x, y, unit_ids=ids, examples_per_unit=K, schedule=schedule, seed=1)
        q = 2 / len(SIZES)
        joined = np.zeros(len(SIZES))
        big = np.flatnonzero(ids == 100)  # the unit of 10 examples
        used = np.zeros(big.size)
        for step in range(steps):
            draw = sampler.draw(step)
            joined[draw.indices] += 1
            if 0 in draw.indices:
                chosen = sampler.unit_examples(step, 0)
                assert chosen.size == K and np.all(np.isin(chosen, big))
                used[np.searchsorted(big, chosen)] += 1
        # Binomial(3000, 0.25): sd 24; 5 sd either side.
        assert np.all(np.abs(joined - steps * q) < 5 * math.sqrt(steps * q * (1 - q)))
        # Given its unit, each of the 10 examples enters with probability 3/10.
        p = K / big.size
        times = joined[0]
        assert np.all(np.abs(used - times * p) < 5 * math.sqrt(times * p * (1 - p)))

    def test_the_example_choice_is_secret_and_depends_on_the_step_and_unit_alone(self):
        x, y, ids = skewed_data()
        secret = 1 << 100
        first, second = (PrivacyUnitSampler.from_arrays(
            x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=1,
            micro_batch_size=2, shared_secret=secret) for _ in range(2))
        assert np.array_equal(first.unit_examples(5, 0), second.unit_examples(5, 0))
        choices = {tuple(first.unit_examples(step, 0)) for step in range(20)}
        assert len(choices) > 5  # a fresh choice per step
        unseeded = PrivacyUnitSampler.from_arrays(
            x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=1,
            micro_batch_size=2)
        assert "secret" in repr(unseeded) and not unseeded.seeded
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(unseeded)
        with pytest.warns(UserWarning, match="explicit sampling seed"):
            PrivacyUnitSampler.from_arrays(x, y, unit_ids=ids, examples_per_unit=K,
                                           batch_size=4, epochs=1, micro_batch_size=2, seed=3)

    def test_a_resumed_sampler_draws_the_same_units_and_examples_from_its_step(self):
        x, y, ids = skewed_data()
        build = lambda **kw: PrivacyUnitSampler.from_arrays(  # noqa: E731
            x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=3,
            micro_batch_size=2, shared_secret=1 << 90, **kw)
        whole = drawn_steps(build())
        resumed = build()._continued_at(2)  # what a preemption backup restores
        again = drawn_steps(resumed)
        assert sorted(again) == [step for step in sorted(whole) if step >= 2]
        for step in again:
            np.testing.assert_array_equal(again[step], whole[step])
        assert resumed.source.examples_per_unit == K and resumed.source.start_step == 2

    def test_the_schedule_counts_units_and_the_source_names_the_unit(self):
        x, y, ids = skewed_data()
        examples = tf_megadp.BatchSizeSchedule.for_poisson(
            [(3, 4)], num_examples=len(ids), micro_batch_size=2)
        with pytest.raises(PrivacyConfigurationError, match="Build the schedule in units"):
            PrivacyUnitSampler.from_arrays(x, y, unit_ids=ids, examples_per_unit=K,
                                           schedule=examples)
        with pytest.raises(ValueError, match="one privacy-unit id per example"):
            PrivacyUnitSampler.from_arrays(x, y, unit_ids=ids[:-1], examples_per_unit=K,
                                           batch_size=4, epochs=1, micro_batch_size=2)
        sampler = PrivacyUnitSampler.from_arrays(
            x, y, unit_ids=ids.astype(str), examples_per_unit=K, privacy_unit="author",
            batch_size=4, epochs=1, micro_batch_size=2)
        source = sampler.source
        assert source.num_examples == len(SIZES)
        assert source.report()["privacy_unit"] == "author"
        assert source.report()["examples_per_unit"] == K
        assert "8 privacy units (author)" in source.description

    def test_ids_of_mixed_types_are_refused_naming_the_ids_that_clash(self):
        # Issue 37: np.asarray([1, "1", 2, 3]) is the strings ["1", "1", "2", "3"],
        # so the user 1 and the user "1" became one unit: U = 3 where there are 4.
        x, y = np.zeros((4, 4), "float32"), np.zeros((4, 2), "float32")
        settings = dict(examples_per_unit=1, batch_size=2, epochs=1, micro_batch_size=2)
        for ids, named in (([1, "1", 2, 3], "1 (int) and '1' (str)"),
                           ((7, 8, "a", b"b"), "7 (int), 'a' (str), b'b' (bytes)"),
                           ([True, 1, 2, 3], "True (bool)")):
            with pytest.raises(TypeError, match=re.escape(named)):
                PrivacyUnitSampler.from_arrays(x, y, unit_ids=ids, **settings)
        with pytest.raises(TypeError, match=re.escape("1 (int) and '1' (str)")):
            tf_megadp.data.privacy_units.units_of([1, "1", 2, 3], 4)
        # One type, as Python values or numpy ids: 4 units.
        for ids in ([1, 11, 2, 3], ["1", "11", "2", "3"], np.array([1, 11, 2, 3]),
                    [np.int64(1), 11, 2, 3]):
            sampler = PrivacyUnitSampler.from_arrays(x, y, unit_ids=ids, **settings)
            assert sampler.num_units == 4

    def test_records_and_token_shards(self, tmp_path):
        x, y, ids = skewed_data()
        records = PrivacyUnitSampler.from_records(
            list(zip(x, y)), unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=1,
            micro_batch_size=2, seed=0)
        element = next(iter(records.as_dataset()))
        assert element[0].shape == (2 * K, 4) and element[2].shape == (2 * K,)
        tf_megadp.write_token_shards(tmp_path, [np.arange(len(ids) * 3).reshape(-1, 3) % 50],
                                     sequence_length=3, vocabulary_size=50, checksum="t")
        shards = tf_megadp.TokenShards(tmp_path)
        schedule = tf_megadp.BatchSizeSchedule.for_poisson(
            [(2, 4)], num_examples=len(SIZES), micro_batch_size=2)
        sampler = PrivacyUnitSampler(shards, schedule, unit_ids=ids, examples_per_unit=K, seed=0)
        rows, weights = next(iter(sampler.as_dataset()))
        assert rows.shape == (2 * K, 3) and weights.shape == (2 * K,)
        assert sampler.shards is shards


# -- A private fit over units ------------------------------------------------------


def unit_model(examples_per_unit, schedule, noise_multiplier=1.0, learning_rate=0.1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(learning_rate), l2_norm_clip=1.0,
        noise_multiplier=noise_multiplier, schedule=schedule,
        examples_per_unit=examples_per_unit, clipping="vectorized", seed=1)
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_a_step_over_all_units_equals_the_naive_per_unit_update():
    # q = 1 and sigma = 0: every unit in the step, so the update is exactly
    # -(lr / U) sum_u clip(sum of the unit's examples' gradients).
    x, y, ids = skewed_data(sizes=[3, 1, 2, 3])
    x[:, 1:] *= 4.0  # large gradients: every unit is clipped
    sampler = PrivacyUnitSampler.from_arrays(
        x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=1,
        micro_batch_size=2, seed=0)
    assert sampler.schedule.total_steps == 1
    model = unit_model(K, sampler.schedule, noise_multiplier=0.0, learning_rate=1.0)
    before = reference.weights(model)
    grads = reference.naive_per_example_gradients(model, keras.losses.MeanSquaredError(), x, y)
    want = [np.zeros_like(w) for w in before]
    per_example = [np.zeros_like(w) for w in before]
    for unit in np.unique(ids):
        members = np.flatnonzero(ids == unit)
        total = [sum(grads[i][j] for i in members) for j in range(len(before))]
        norm = math.sqrt(sum(np.sum(g ** 2) for g in total))
        want = [w + g * min(1.0, 1.0 / norm) for w, g in zip(want, total)]
        for i in members:
            norm_i = math.sqrt(sum(np.sum(g ** 2) for g in grads[i]))
            per_example = [w + g * min(1.0, 1.0 / norm_i) for w, g in zip(per_example, grads[i])]
    model.fit(sampler.as_dataset(), verbose=0)
    moved = [a - b for a, b in zip(reference.weights(model), before)]
    for got, expected in zip(moved, want):
        np.testing.assert_allclose(got, -expected / 4, rtol=1e-5, atol=1e-7)
    assert not all(np.allclose(g, -e / 4, rtol=1e-3) for g, e in zip(moved, per_example))


def test_adaptive_clipping_counts_units_not_rows():
    # A unit's norm is repeated on its k rows: a count over rows would move by
    # up to k when one unit is added, while its noise is calibrated for 1/2.
    sizes = [1, 2, 2, 2]
    x, y, ids = skewed_data(sizes=sizes)
    sampler = PrivacyUnitSampler.from_arrays(
        x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=1,
        micro_batch_size=2, seed=0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    grads = reference.naive_per_example_gradients(model, keras.losses.MeanSquaredError(), x, y)
    norms = []
    for unit in np.unique(ids):
        members = np.flatnonzero(ids == unit)
        total = [sum(grads[i][j] for i in members) for j in range(len(grads[0]))]
        norms.append(math.sqrt(sum(np.sum(g ** 2) for g in total)))
    # One unit below C, three above: centred counts -1 over units, and -2.5 or
    # -1.5 over rows.
    order = sorted(norms)
    clip = 0.5 * (order[0] + order[1])
    gamma, eta = 0.5, 0.7
    optimizer = tf_megadp.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=clip, noise_multiplier=0.0,
        schedule=sampler.schedule, examples_per_unit=K, clipping="vectorized", seed=1,
        adaptive_clipping=tf_megadp.AdaptiveClipping(gamma, eta, count_stddev=0.0))
    tf_megadp.make_private(model)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(sampler.as_dataset(), verbose=0)
    per_unit = sum((1.0 if n <= clip else 0.0) - 0.5 for n in norms)
    want = clip * math.exp(-eta * (per_unit / 4 + 0.5 - gamma))
    assert float(optimizer.clip_norm.numpy()) == pytest.approx(want, rel=1e-6)
    per_row = sum(((1.0 if n <= clip else 0.0) - 0.5) * size for n, size in zip(norms, sizes))
    assert per_row != per_unit  # the rows' count would have moved C elsewhere


def test_epsilon_equals_dp_accounting_over_units_and_the_report_names_the_unit(tmp_path):
    sizes = [10, 8] + [1, 2, 3] * 9 + [1]
    x, y, ids = skewed_data(sizes)
    units = len(sizes)
    # A capacity of 24 units for an expected 2 of 30: a step truncates with
    # probability ~1e-24, below what delta = 1e-5 can resolve in float64, so
    # the run is exactly Poisson sampling of units with q = B / U.
    schedule = tf_megadp.BatchSizeSchedule(
        [tf_megadp.Phase(5, 2, 12)], num_examples=units, micro_batch_size=2)
    sampler = PrivacyUnitSampler.from_arrays(
        x, y, unit_ids=ids, examples_per_unit=K, privacy_unit="author", schedule=schedule,
        seed=0)
    model = unit_model(K, sampler.schedule)
    callback = tf_megadp.PrivacyCallback(DELTA, accountant="rdp",
                                         report_path=tmp_path / "report.json")
    model.fit(sampler.as_dataset(), callbacks=[callback], verbose=0)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(2 / units, dp_accounting.GaussianDpEvent(1.0)), 5)
    expected = rdp.RdpAccountant().compose(event).get_epsilon(DELTA)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert report["num_examples"] == units
    assert report["privacy_unit"] == "author"
    assert report["data"]["examples_per_unit"] == K
    assert report["settings"]["examples_per_unit"] == K
    # The sampler's own event: truncated Poisson sampling of the 30 units.
    assert sampler.dp_event(1.0) == dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=units, sampling_probability=2 / units, truncated_batch_size=24,
            noise_multiplier=1.0), 5)])
    # Counting sequences instead (q = B / N over 73 of them) reports less.
    per_sequence = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        2 / len(ids), dp_accounting.GaussianDpEvent(1.0)), 5)
    assert rdp.RdpAccountant().compose(per_sequence).get_epsilon(DELTA) < 0.7 * expected


def test_cyclic_unit_sampling_is_accounted_per_group_and_refuses_bands_beyond_its_cycle():
    sizes = [10, 8] + [1, 2, 3] * 9 + [1]
    x, y, ids = skewed_data(sizes)
    schedule = tf_megadp.BatchSizeSchedule(
        [tf_megadp.Phase(6, 2, 12)], num_examples=len(sizes), micro_batch_size=2)
    with pytest.warns(UserWarning, match="seed"):
        sampler = PrivacyUnitSampler.from_arrays(
            x, y, unit_ids=ids, examples_per_unit=K, privacy_unit="author",
            schedule=schedule, seed=0, cycle_length=2)
    # BandMF with b = L = 2: each unit joins every other step, as a unit of
    # one group of 15 sampled at q = B L / U; 3 rounds, truncated at 24 units.
    assert sampler.dp_event(1.0, noise=tf_megadp.BandMF(num_bands=2)) == (
        dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(
                dataset_size=15, sampling_probability=2 * 2 / 30, truncated_batch_size=24,
                noise_multiplier=1.0), 3)]))
    with pytest.raises(PrivacyConfigurationError, match="Raise cycle_length to at least 4"):
        sampler.dp_event(1.0, noise=tf_megadp.BandMF(num_bands=4))


def test_an_optimizer_that_clips_another_unit_than_the_data_lays_out_is_refused():
    x, y, ids = skewed_data()
    sampler = PrivacyUnitSampler.from_arrays(
        x, y, unit_ids=ids, examples_per_unit=K, batch_size=4, epochs=1,
        micro_batch_size=2, seed=0)
    # Per-example clipping of unit slots: one unit could move the sum by k C.
    model = unit_model(1, sampler.schedule)
    with pytest.raises(PrivacyConfigurationError, match="examples_per_unit=sampler.examples_per_unit"):
        model.fit(sampler.as_dataset(), verbose=0)
    # Unit clipping of data without units would group unrelated examples.
    plain = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=4, epochs=1,
                                                 micro_batch_size=2 * K, seed=0)
    model = unit_model(K, plain.schedule)
    with pytest.raises(PrivacyConfigurationError, match="clips units of examples_per_unit=3"):
        model.fit(plain.as_dataset(), verbose=0)


def test_examples_per_unit_is_a_frozen_saved_setting():
    optimizer = tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                      noise_multiplier=1.0, examples_per_unit=4)
    assert tf_megadp.DPOptimizer.from_config(optimizer.get_config()).examples_per_unit == 4
    with pytest.raises(PrivacyConfigurationError, match="cannot change"):
        optimizer.examples_per_unit = 1
    with pytest.raises(ValueError, match="examples_per_unit"):
        tf_megadp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                              noise_multiplier=1.0, examples_per_unit=0)


def test_the_cli_accounts_units_and_names_them(capsys):
    from tf_megadp import cli

    run = ["--num-examples", "5000", "--batch-size", "50", "--steps", "200",
           "--delta", "1e-5", "--accountant", "rdp", "--privacy-unit", "user", "--json"]
    assert cli.main(["epsilon", *run, "--noise-multiplier", "1.0"]) == 0
    report = json.loads(capsys.readouterr().out)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(50 / 5000, dp_accounting.GaussianDpEvent(1.0)), 200)
    assert report["epsilon"] == pytest.approx(
        rdp.RdpAccountant().compose(event).get_epsilon(1e-5), rel=1e-12)
    assert report["privacy_unit"] == "user" and report["num_examples"] == 5000
    assert cli.main(["calibrate", *run[:-1], "--target-epsilon", "2.0"]) == 0
    out = capsys.readouterr().out
    assert "privacy unit : user" in out and "units (N)    : 5000" in out


# -- The BERT job at user level -------------------------------------------------------

WORDS = ("the clinic note says patient reports mild pain after the visit and asks for "
         "a follow up call about the results of the test next week").split()


def write_user_corpus(path, sizes, seed=0):
    """Generated JSONL documents, `sizes[u]` of them by user u (no third-party text)."""
    rng = np.random.default_rng(seed)
    lines = []
    for user, size in enumerate(sizes):
        for _ in range(size):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(8, 20))))
            lines.append(json.dumps({"text": text, "author": f"user-{user:03d}"}))
    rng.shuffle(lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_a_corpus_with_units_packs_no_row_across_units_and_keeps_each_rows_unit(tmp_path):
    from tf_megadp.jobs.bert import text
    from tf_megadp.jobs.bert.units import load_unit_ids

    sizes = [12, 1, 3, 2]
    corpus = write_user_corpus(tmp_path / "notes.jsonl", sizes)
    vocabulary = list(text.SPECIAL_TOKENS) + sorted(set(WORDS))
    shards = text.prepare_corpus(tmp_path / "shards", [corpus], sequence_length=16,
                                 vocabulary=vocabulary, min_tokens=1, unit_field="author")
    units = load_unit_ids(shards)
    assert units.shape == (len(shards),) and shards.manifest["num_units"] == len(sizes)
    assert shards.manifest["unit_field"] == "author"
    assert "user-000" not in (tmp_path / "shards" / "manifest.json").read_text()  # no ids
    # Each unit's documents, tokenized on their own and packed as one stream,
    # are exactly that unit's rows: no row holds two units' text.
    documents, _, authors = text.read_documents([corpus], unit_field="author")
    tokens = text._tokenize(documents, vocabulary, True)
    for unit, name in enumerate(sorted(set(authors))):
        own = [t for t, author in zip(tokens, authors) if author == name]
        expected = text._pack(own, 16, "stream", 1)
        np.testing.assert_array_equal(shards.read(np.flatnonzero(units == unit)), expected)
    with pytest.raises(text.CorpusError, match="no string or integer field 'user'"):
        text.read_documents([corpus], unit_field="user")


def test_the_banners_name_n_in_units_and_the_sequences_apart():
    from tf_megadp.jobs.bert.units import describe_population

    # The run: 1,189 authors writing 33,503 sequences; N is the authors.
    assert describe_population("author", 1189, 33503) == (
        "N = 1,189 privacy units ('author'; 33,503 training sequences)")
    assert describe_population(None, 19886, 19886) == (
        "N = 19,886 training sequences (the privacy unit)")


@pytest.mark.slow  # a whole job (XLA compilations of a BERT): 30-60 s on the 2-core machine
def test_the_job_trains_at_user_level_and_its_report_accounts_units(tmp_path):
    from tf_megadp.jobs.bert import text
    from tf_megadp.jobs.bert.units import describe_population, load_unit_ids
    from tf_megadp.jobs.bert.pretraining import (PretrainConfig, PretrainError, prepare_data,
                                                 run_pretraining)

    sizes = [40, 30] + [2] * 38  # two prolific authors
    corpus = write_user_corpus(tmp_path / "notes.jsonl", sizes)
    vocabulary = tmp_path / "vocab.txt"  # public, given: nothing to learn
    vocabulary.write_text("\n".join(text.SPECIAL_TOKENS + tuple(sorted(set(WORDS)))) + "\n",
                          encoding="utf-8")
    settings = dict(vocabulary=str(vocabulary),
        corpus=[corpus], output_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
        model="pico", sequence_length=16, vocabulary_size=200, micro_batch_size=4,
        batch_size=8, steps=2, eval_every=2, target_epsilon=None, noise_multiplier=1.0,
        accountant="rdp", warmup_steps=1, verbose=0,
        privacy_unit="author", examples_per_unit=2)
    log = []
    report = run_pretraining(PretrainConfig(**settings), log=log.append)
    _, train, _ = prepare_data(PretrainConfig(**settings))
    units = load_unit_ids(train)
    # Issue 41: every banner and the summary count N in units, the sequences apart.
    population = describe_population("author", report["num_examples"], len(train))
    assert population.startswith(f"N = {report['num_examples']:,} privacy units ('author'")
    printed = "\n".join(log)
    assert f"Corpus: N = {report['num_examples']:,} privacy units ('author')" in printed
    assert f"Training BERT-pico (1 layers, hidden 32) on {population}" in printed
    assert f"trained on              {population}" in printed
    assert f"N={len(train)}" not in printed and f"N = {len(train):,}" not in printed
    assert report["privacy_unit"] == "author" and report["examples_per_unit"] == 2
    assert report["num_examples"] == np.unique(units).size <= len(sizes)
    assert report["training_sequences"] == len(train) > report["num_examples"]
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert privacy["privacy_unit"] == "author"
    q = 8 / report["num_examples"]
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), 2)
    assert report["epsilon"] == pytest.approx(
        rdp.RdpAccountant().compose(event).get_epsilon(report["delta"]), rel=1e-6)
    # A plain-text corpus has no field to read a unit from.
    plain = tmp_path / "notes.txt"
    plain.write_text("one document.\n\nanother one.", encoding="utf-8")
    with pytest.raises(PretrainError, match="is not JSONL"):
        run_pretraining(PretrainConfig(**{**settings, "corpus": [str(plain)],
                                          "output_dir": str(tmp_path / "plain")}),
                        log=lambda *_: None)


def test_the_user_level_example_runs_and_reports_per_user(capsys):
    example = __import__("runpy").run_path("examples/user_level.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = example["main"](["--users", "40", "--batch-size", "8",
                                  "--micro-batch-size", "8", "--epochs", "0.5"])
    assert result["report"]["privacy_unit"] == "user"
    assert result["report"]["num_examples"] == result["users"] == 40
    assert 0 < result["per_example_epsilon"] < result["epsilon"] < math.inf
    assert "epsilon per user" in capsys.readouterr().out


def test_make_private_with_epsilon_clips_the_samplers_units():
    sizes = [10, 8] + [1, 2, 3] * 9 + [1]
    x, y, ids = skewed_data(sizes)
    schedule = tf_megadp.BatchSizeSchedule(  # truncation ~1e-24 (see above)
        [tf_megadp.Phase(5, 2, 12)], num_examples=len(sizes), micro_batch_size=2)
    sampler = PrivacyUnitSampler.from_arrays(
        x, y, unit_ids=ids, examples_per_unit=K, schedule=schedule, seed=0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model = tf_megadp.make_private_with_epsilon(
        model, keras.optimizers.SGD(0.1), sampler, target_epsilon=3.0, delta=1e-2,
        l2_norm_clip=1.0, accountant="rdp", loss="mse")
    assert model.optimizer.examples_per_unit == K
