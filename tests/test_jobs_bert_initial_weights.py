"""Specification of `tf-megadp pretrain --init-from PATH` (`tf_megadp.jobs.bert.initial_weights`).

The model's shape and vocabulary come from PATH: a shape flag that
contradicts it, a vocabulary built from a private corpus, and weights whose
origin would escape epsilon (a DP release without its privacy.json, a
non-private model of user text) are refused with an error that names the
fix, before the corpus is read. A release's ledger is composed into the new
run's epsilon (exactly dp_accounting's composition of both runs' steps); a
public init adds nothing; `--init-data-disjoint` is the user's statement,
recorded. A public BERT vocabulary numbers its special tokens elsewhere:
its token table is reordered with it.

The published folders here are written as the job writes them (model.keras,
vocab.txt, report.json, privacy.json) from an untrained pico model, so that
these tests train nothing; tests/test_pretraining.py continues a real
release end to end (`TestContinuingARelease`).
"""

import json
import shutil

import dp_accounting
import numpy as np
import pytest
import yaml
from dp_accounting import rdp

from tf_megadp import accounting, cli
from tf_megadp.jobs.bert import initial_weights, training
from tf_megadp.jobs.bert.config import PretrainConfig, PretrainError
from tf_megadp.jobs.bert.corpus import SPECIAL_TOKENS
from tf_megadp.steps import BatchSizeSchedule

WORDS = [f"word{i}" for i in range(35)]
VOCABULARY = list(SPECIAL_TOKENS) + WORDS  # the job's order: special tokens 0-4
PICO = dict(model="pico", sequence_length=16, vocabulary_size=len(VOCABULARY))
# The release's steps: 30 Poisson steps of q = 1/64 at sigma 0.9.
RELEASE_STEPS, RELEASE_Q, RELEASE_SIGMA = 30, 1 / 64, 0.9


def release_ledger():
    ledger = accounting.PrivacyLedger()
    ledger.record(RELEASE_STEPS, sampling_rate=RELEASE_Q, noise_multiplier=RELEASE_SIGMA)
    return ledger


@pytest.fixture(scope="module")
def pico_file(tmp_path_factory):
    """An untrained pico BertMaskedLM of the job saved as model.keras, and its DP "release".

    The release is the same file with the record a DP run's file carries
    (the ledger of `release_ledger()` over every value), and the
    privacy.json that run writes beside it (its `weights_fingerprint` and
    `ledger_binding`), so that these tests train nothing.
    """
    import io
    import zipfile

    import h5py
    import keras

    from tf_megadp.run import provenance, weights_origin

    folder = tmp_path_factory.mktemp("pico")
    keras.utils.set_random_seed(0)
    model = training.build_model(PretrainConfig(**PICO), len(VOCABULARY))
    model.save(folder / "model.keras")
    # A DP run records its trained values, never constants (zero biases).
    record = provenance.Provenance(release_ledger(), frozenset(
        provenance.value_digest(value) for value in model.get_weights()
        if np.issubdtype(value.dtype, np.floating) and np.ptp(value) > 0))
    with zipfile.ZipFile(folder / "model.keras") as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    weights = io.BytesIO(members["model.weights.h5"])
    with h5py.File(weights, "a") as handle:
        provenance.write_provenance(handle, [record])
    members["model.weights.h5"] = weights.getvalue()
    with zipfile.ZipFile(folder / "release.keras", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    report = accounting.PrivacyAccountant(
        1920, 1e-4, accountant="rdp", ledger=release_ledger()).report({})
    report["weights_fingerprint"] = weights_origin.weights_fingerprint(model)
    report["ledger_binding"] = weights_origin.ledger_binding(report["weights_fingerprint"],
                                                             release_ledger())
    (folder / "privacy.json").write_text(json.dumps(report))
    return folder / "model.keras"


def publish(pico_file, folder, *, private=True, corpus=("private.txt",), privacy=True,
            vocabulary_public=True, record=True):
    """A run folder as `tf-megadp pretrain` leaves it; returns its model.keras.

    A private run's model.keras carries its ledger (`record`) and its
    privacy.json lies beside it (`privacy`).
    """
    folder.mkdir(parents=True, exist_ok=True)
    released = private and record
    shutil.copy(pico_file.with_name("release.keras") if released else pico_file,
                folder / "model.keras")
    (folder / "vocab.txt").write_text("".join(t + "\n" for t in VOCABULARY))
    (folder / "report.json").write_text(json.dumps({
        "private": private, "config": {"corpus": list(corpus) if corpus else None},
        "vocabulary": {"public": vocabulary_public}}))
    if private and privacy:
        shutil.copy(pico_file.with_name("privacy.json"), folder / "privacy.json")
    return str(folder / "model.keras")


def refused(capsys, *argv):
    """`tf-megadp pretrain ARGV`'s exit status and error (refused before any training)."""
    status = cli.main(["pretrain", *argv])
    return status, " ".join(capsys.readouterr().err.split())


class TestTheShapeComesFromTheInit:
    def test_the_shape_and_vocabulary_are_the_inits(self, pico_file, tmp_path):
        path = publish(pico_file, tmp_path / "run")
        config = initial_weights.configured(PretrainConfig(init_from=path))
        assert (config.model, config.vocabulary_size, config.sequence_length,
                config.max_sequence_length) == ("pico", len(VOCABULARY), 16, 16)
        assert config.vocabulary == str(tmp_path / "run" / "vocab.txt")
        # Idempotent, and a shorter sequence than the position table is kept.
        assert initial_weights.configured(config) == config
        shorter = initial_weights.configured(PretrainConfig(init_from=path, sequence_length=8))
        assert (shorter.sequence_length, shorter.max_sequence_length) == (8, 16)

    @pytest.mark.parametrize("flag, value", [("--model", "nano"), ("--vocabulary-size", "512"),
                                             ("--sequence-length", "32")])
    def test_a_shape_flag_that_contradicts_the_init_is_refused_by_name(
            self, pico_file, tmp_path, capsys, flag, value):
        path = publish(pico_file, tmp_path / "run")
        status, error = refused(capsys, "--init-from", path, flag, value,
                                "--output-dir", str(tmp_path / "out"))
        assert status == 2
        assert f"{flag} {value}" in error and f"{flag}" in error.split(":")[-1], error
        assert not (tmp_path / "out").exists()

    def test_a_shape_flag_equal_to_the_default_is_still_checked(self, pico_file, tmp_path,
                                                                 capsys):
        # --model nano is the default, but given: it contradicts the pico init.
        path = publish(pico_file, tmp_path / "run")
        status, error = refused(capsys, "--init-from", path, "--model", "nano")
        assert status == 2 and "drop --model" in error


class TestTheVocabularyIsThePublicOneOfTheInit:
    def test_a_vocabulary_learned_from_the_training_corpus_is_refused(self, pico_file,
                                                                      tmp_path, capsys):
        path = publish(pico_file, tmp_path / "run")
        status, error = refused(capsys, "--init-from", path, "--corpus", "x.txt",
                                "--vocabulary-from-training-corpus")
        assert status == 2 and "Drop --vocabulary-from-training-corpus" in error

    def test_an_init_whose_vocabulary_came_from_its_own_corpus_is_refused(self, pico_file,
                                                                          tmp_path, capsys):
        path = publish(pico_file, tmp_path / "run", vocabulary_public=False)
        status, error = refused(capsys, "--init-from", path)
        assert status == 2 and "public vocabulary" in error and "NOT private" in error

    def test_another_vocabulary_file_is_refused(self, pico_file, tmp_path, capsys):
        path = publish(pico_file, tmp_path / "run")
        other = tmp_path / "other.txt"
        other.write_text("".join(t + "\n" for t in reversed(VOCABULARY)))
        status, error = refused(capsys, "--init-from", path, "--vocabulary", str(other))
        assert status == 2 and "drop --vocabulary" in error


class TestWhereTheWeightsComeFrom:
    def test_a_release_carries_its_ledger_in_its_weights_file(self, pico_file, tmp_path):
        # Without its privacy.json, too: the weights file holds the ledger.
        path = publish(pico_file, tmp_path / "run", privacy=False)
        config = initial_weights.configured(PretrainConfig(init_from=path))
        init = initial_weights.read_initial_weights(path)
        assert init.origin(config) == "release"
        assert init.composed_ledger(config) == release_ledger()
        assert init.report(config)["epsilon"].startswith(f"its ledger ({RELEASE_STEPS} logical")

    def test_a_privacy_json_that_disagrees_with_the_weights_ledger_is_refused(
            self, pico_file, tmp_path, capsys):
        path = publish(pico_file, tmp_path / "run")
        report = json.loads((tmp_path / "run" / "privacy.json").read_text())
        report["ledger"][0]["steps"] = 3  # an edit that would claim a smaller epsilon
        (tmp_path / "run" / "privacy.json").write_text(json.dumps(report))
        status, error = refused(capsys, "--init-from", path)
        assert status == 2 and "edited or belongs to another run" in error

    def test_a_private_runs_output_without_any_ledger_is_refused(self, pico_file, tmp_path,
                                                                  capsys):
        path = publish(pico_file, tmp_path / "run", privacy=False, record=False)
        status, error = refused(capsys, "--init-from", path)
        assert status == 2
        assert "privacy.json" in error and "--init-data-disjoint" in error
        # The user's statement that the data are disjoint: nothing is composed.
        config = initial_weights.configured(PretrainConfig(init_from=path,
                                                           init_data_disjoint=True))
        init = initial_weights.read_initial_weights(path)
        assert init.origin(config) == "disjoint" and init.composed_ledger(config) is None
        declared = init.report(config)
        assert declared["data_disjoint_stated"] and declared["declared_by_user"]
        assert "--init-data-disjoint" in declared["epsilon"]
        # --init-public would call a DP run's output public: refused.
        status, error = refused(capsys, "--init-from", path, "--init-public")
        assert status == 2 and "not on public data only" in error

    def test_a_non_private_model_of_user_text_needs_the_statement(self, pico_file, tmp_path,
                                                                   capsys):
        path = publish(pico_file, tmp_path / "run", private=False)
        status, error = refused(capsys, "--init-from", path)
        assert status == 2 and "without DP" in error and "--init-data-disjoint" in error
        # ... and a model.keras alone, whose origin no file tells.
        (tmp_path / "run" / "report.json").unlink()
        status, error = refused(capsys, "--init-from", path)
        assert status == 2 and "unknown" in error

    def test_a_non_private_run_on_the_public_default_corpus_adds_nothing(self, pico_file,
                                                                        tmp_path):
        path = publish(pico_file, tmp_path / "run", private=False, corpus=None)
        config = initial_weights.configured(PretrainConfig(init_from=path))
        init = initial_weights.read_initial_weights(path)
        assert init.origin(config) == "public" and init.composed_ledger(config) is None
        assert init.report(config)["epsilon"].startswith("adds nothing to epsilon")
        # The content hash is the file's.
        from tf_megadp.files import sha256_of_file

        assert init.report(config)["sha256"] == sha256_of_file(path)

    def test_a_preset_no_file_describes_needs_a_statement_and_is_reported_as_one(
            self, tmp_path, capsys):
        # Before: a preset without a privacy.json was called public, so a
        # non-private model of the private corpus, or a DP release whose
        # privacy.json was left behind, added "nothing to epsilon".
        import keras
        import keras_hub

        keras.utils.set_random_seed(0)
        model = training.build_model(PretrainConfig(**PICO), len(VOCABULARY))
        model.preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
            keras_hub.models.BertTokenizer(vocabulary=VOCABULARY, lowercase=True),
            sequence_length=16)
        model.save_to_preset(str(tmp_path / "preset"))
        init = initial_weights.read_initial_weights(tmp_path / "preset")
        assert init.kind == "preset" and init.vocabulary.endswith("vocabulary.txt")
        status, error = refused(capsys, "--init-from", str(tmp_path / "preset"))
        assert status == 2 and "--init-public" in error and "--init-data-disjoint" in error
        config = initial_weights.configured(PretrainConfig(init_from=str(tmp_path / "preset"),
                                                           init_public=True))
        assert init.origin(config) == "public"
        declared = init.report(config)
        assert declared["declared_by_user"] and "the user declares (--init-public)" in declared[
            "epsilon"]
        (tmp_path / "preset" / "metadata.json").write_text("{}")
        assert initial_weights.read_initial_weights(tmp_path / "preset").sha256 != init.sha256

    def test_a_preset_saved_from_a_dp_release_is_a_release(self, pico_file, tmp_path):
        # save_to_preset of the loaded release writes its ledger into the
        # preset's weights: no privacy.json is needed to compose it.
        import keras
        import keras_hub

        release = keras.models.load_model(pico_file.with_name("release.keras"))
        release.preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
            keras_hub.models.BertTokenizer(vocabulary=VOCABULARY, lowercase=True),
            sequence_length=16)
        release.save_to_preset(str(tmp_path / "preset"))
        init = initial_weights.read_initial_weights(tmp_path / "preset")
        config = initial_weights.configured(PretrainConfig(init_from=str(tmp_path / "preset")))
        assert init.origin(config) == "release"
        assert init.composed_ledger(config) == release_ledger()

class TestTheReleasesLedgerIsComposed:
    """`tf-megadp plan` of a continuation: the epsilon the run will report, before it runs."""

    def planned(self, tmp_path, capsys, *flags):
        config = {
            "model": {"preset": "pico", "vocabulary_size": len(VOCABULARY),
                      "sequence_length": 16},
            "hardware": {"name": "cpu", "replicas": 1, "hbm_gib_per_replica": 1,
                         "peak_tflops_per_replica": 0.1},
            "training": {"num_examples": 2_000, "micro_batch_size": 16,
                         "noise_multiplier": 1.1, "delta": 1e-4, "target_epsilon": None,
                         "accountant": "rdp", "phases": [{"steps": 40, "batch_size": 64}]},
        }
        path = tmp_path / "plan.yaml"
        path.write_text(yaml.safe_dump(config))
        assert cli.main(["plan", str(path), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    def test_a_releases_ledger_is_composed_into_epsilon_as_dp_accounting_composes_both(
            self, pico_file, tmp_path, capsys):
        path = publish(pico_file, tmp_path / "run")
        alone = self.planned(tmp_path, capsys)
        continued = self.planned(tmp_path, capsys, "--init-from", path)
        # The 40 new steps are truncated at a capacity that overflows with
        # probability < 1e-9: the accountant's coupling bound moves delta by
        # about 1e-7 of itself.
        both = rdp.RdpAccountant().compose(dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(sigma)), steps)
            for steps, q, sigma in ((RELEASE_STEPS, RELEASE_Q, RELEASE_SIGMA),
                                    (40, 64 / 2_000, 1.1))])).get_epsilon(1e-4)
        assert continued["epsilon"] == pytest.approx(both, rel=1e-6)
        assert continued["epsilon"] > alone["epsilon"]
        assert continued["init"]["origin"] == "release"
        # Stated disjoint: the run's own steps only.
        disjoint = self.planned(tmp_path, capsys, "--init-from", path, "--init-data-disjoint")
        assert disjoint["epsilon"] == alone["epsilon"]

    def test_a_target_epsilon_bounds_the_composition(self, pico_file, tmp_path):
        path = publish(pico_file, tmp_path / "run")
        config = initial_weights.configured(PretrainConfig(init_from=path, target_epsilon=4.0,
                                                           accountant="rdp"))
        init = initial_weights.read_initial_weights(path)
        prior = init.composed_ledger(config)
        schedule = config.make_schedule(2_000, 1)
        from tf_megadp.jobs.common.privacy import plan_privacy

        sigma, delta, epsilon = plan_privacy(config, schedule, prior=prior)
        assert epsilon <= 4.0 and epsilon == pytest.approx(accounting.compute_epsilon(
            delta=delta, schedule=schedule, noise_multiplier=sigma, accountant="rdp",
            prior=release_ledger()), rel=1e-12)
        # The release's steps weigh: more noise than for this run's steps alone.
        assert sigma > accounting.calibrate_noise_multiplier(4.0, delta, schedule=schedule,
                                                             accountant="rdp")
        with pytest.raises(PretrainError, match="alone spends epsilon"):
            plan_privacy(initial_weights.configured(PretrainConfig(
                init_from=path, target_epsilon=0.01, accountant="rdp")), schedule, prior=prior)


def test_a_public_bert_vocabulary_order_is_followed_by_its_token_table(tmp_path):
    """BERT's vocab.txt has [PAD] at 0 and [UNK] [CLS] [SEP] [MASK] further on; the job's ids 0-4.

    The init's rows follow its file: the job reorders them with the ids, so
    that the continued model computes exactly what the init computed.
    """
    import keras
    import keras_hub

    bert_order = ["[PAD]"] + WORDS[:10] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS[10:]
    keras.utils.set_random_seed(1)
    public = training.build_model(PretrainConfig(**PICO), len(VOCABULARY))
    public.preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
        keras_hub.models.BertTokenizer(vocabulary=bert_order, lowercase=True),
        sequence_length=16)
    public.save_to_preset(str(tmp_path / "bert"))
    init = initial_weights.read_initial_weights(tmp_path / "bert")
    config = initial_weights.configured(PretrainConfig(init_from=str(tmp_path / "bert"),
                                                       init_public=True))
    order = initial_weights.token_order(init.vocabulary)
    assert order is not None and [bert_order[row] for row in order] == VOCABULARY
    continued = training.build_model(config, len(VOCABULARY))
    initial_weights.load_into(continued, init)
    job_ids = np.random.default_rng(0).integers(0, len(VOCABULARY), (2, 16)).astype("int32")
    inputs = {"segment_ids": np.zeros((2, 16), "int32"),
              "padding_mask": np.ones((2, 16), "int32"),
              "mask_positions": np.array([[1, 3], [0, 5]], "int32")}
    ours = continued({"token_ids": job_ids, **inputs})
    theirs = public({"token_ids": np.array(order, "int32")[job_ids], **inputs})
    np.testing.assert_allclose(keras.ops.convert_to_numpy(ours),
                               keras.ops.convert_to_numpy(theirs)[..., order], atol=1e-5)


# -- End to end (slow: three job runs; test_pretraining.py continues a release by default) --


@pytest.fixture(scope="module")
def job_workspace(tmp_path_factory):
    from tests.test_pretraining import write_corpus

    root = tmp_path_factory.mktemp("init-job")
    return root, write_corpus(root), root / "cache"


@pytest.mark.slow
def test_a_resumed_continuation_keeps_the_releases_ledger_and_its_record(job_workspace):
    from tests.test_pretraining import tiny_config
    from tf_megadp.jobs.bert.pretraining import run_pretraining

    root, corpus, cache = job_workspace
    quiet = dict(log=lambda *_: None)
    release = run_pretraining(tiny_config(corpus, cache, root / "release", steps=2), **quiet)
    settings = dict(init_from=str(root / "release" / "model.keras"), lora_rank=2, steps=2,
                    eval_every=1, vocabulary_size=release["model"]["vocabulary_size"])
    first = run_pretraining(tiny_config(corpus, cache, root / "continued", stop_after_steps=1,
                                        **settings), **quiet)
    # The init may be gone by then: the checkpoint holds the record of the start.
    (root / "release" / "model.keras").rename(root / "release" / "moved.keras")
    assert cli.main(["pretrain", "--resume", "--output-dir", str(root / "continued")]) == 0
    resumed = json.loads((root / "continued" / "report.json").read_text())
    assert first["init"] == resumed["init"] and resumed["init"]["origin"] == "release"
    assert resumed["resumed_from_step"] == 1 and resumed["logical_steps"] == 2
    privacy = json.loads((root / "continued" / "privacy.json").read_text())
    assert privacy["steps"] == 2 + 2
    released = json.loads((root / "release" / "privacy.json").read_text())
    expected = accounting.compute_epsilon(
        delta=resumed["delta"], schedule=BatchSizeSchedule.from_dict(resumed["schedule"]),
        noise_multiplier=1.0, accountant="rdp",
        prior=accounting.PrivacyLedger.from_list(released["ledger"]))
    assert resumed["epsilon"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_a_public_preset_with_frozen_embeddings_adds_nothing_and_keeps_its_tables(
        job_workspace):
    import keras
    import keras_hub

    from tests.test_pretraining import tiny_config
    from tf_megadp.jobs.bert import prepare
    from tf_megadp.jobs.bert.pretraining import run_pretraining

    root, corpus, cache = job_workspace
    config = tiny_config(corpus, cache, root / "unused")
    vocabulary = prepare._public_vocabulary(config)
    keras.utils.set_random_seed(3)
    public = training.build_model(config, len(vocabulary))
    public.preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
        keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True),
        sequence_length=16)
    public.save_to_preset(str(root / "preset"))
    report = run_pretraining(tiny_config(
        corpus, cache, root / "from-preset", init_from=str(root / "preset"), init_public=True,
        freeze_embeddings=True, steps=2, eval_every=2, vocabulary_size=len(vocabulary)),
        log=lambda *_: None)
    assert report["init"]["origin"] == "public" and report["init"]["declared_by_user"]
    assert report["init"]["epsilon"].startswith("adds nothing to epsilon: the user declares")
    schedule = BatchSizeSchedule.from_dict(report["schedule"])
    assert report["epsilon"] == pytest.approx(accounting.compute_epsilon(
        delta=report["delta"], schedule=schedule, noise_multiplier=1.0, accountant="rdp"),
        rel=1e-9)
    continued = training.build_model(config, len(vocabulary))
    continued.load_weights(str(root / "from-preset" / "model.keras"))
    for name in ("token_embedding", "position_embedding", "segment_embedding"):
        for old, new in zip(getattr(public.backbone, name).weights,
                            getattr(continued.backbone, name).weights):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(new),
                                          keras.ops.convert_to_numpy(old))
    # The rest trained.
    assert not np.array_equal(
        keras.ops.convert_to_numpy(continued.masked_lm_head.weights[-1]),
        keras.ops.convert_to_numpy(public.masked_lm_head.weights[-1]))
