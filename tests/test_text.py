"""Specification of tf_megadp.jobs.bert.text: corpus files to BertMaskedLM micro-batches."""

import os
import re

import numpy as np
import pytest
from scipy import stats

from tf_megadp.data import PoissonSampler
from tf_megadp.steps import BatchSizeSchedule
from tf_megadp.jobs.bert.text import (
    SPECIAL_TOKENS,
    CorpusError,
    MaskedLMBatcher,
    default_corpus_documents,
    load_vocabulary,
    prepare_corpus,
    read_documents,
    read_vocabulary_file,
    write_synthetic_corpus,
)

PAD, CLS, SEP, UNK, MASK = range(5)
LENGTH = 32

# A small made-up English text: generated here, so no third-party prose is stored.
SUBJECTS = ["the model", "a gradient", "the optimizer", "every example", "the batch", "our sampler"]
VERBS = ["clips", "adds noise to", "reads", "updates", "samples", "accumulates"]
OBJECTS = ["the weights.", "each sequence.", "a noisy sum.", "the privacy ledger.", "many tokens.", "its shards."]


def make_documents(count, seed=0):
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        sentences = [
            f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            for _ in range(rng.integers(2, 6))
        ]
        documents.append(" ".join(sentences))
    return documents


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n\n".join(make_documents(150)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def shards(corpus_file, tmp_path_factory):
    return prepare_corpus(
        tmp_path_factory.mktemp("shards"), corpus_file, sequence_length=LENGTH, vocabulary_size=120, min_tokens=4
    )


def words(text):
    """Reference split: lowercase words and single punctuation marks."""
    return re.findall(r"\w+|[^\w\s]", text.lower())


def detokenize(ids, vocabulary):
    out = []
    for i in ids:
        piece = vocabulary[i]
        if piece.startswith("##") and out:
            out[-1] += piece[2:]
        elif piece.startswith("##"):
            out.append(piece[2:])
        else:
            out.append(piece)
    return out


class TestReadDocuments:
    def test_blank_lines_separate_documents(self, tmp_path):
        path = tmp_path / "a.txt"
        path.write_bytes(b"First one.\nStill first.\n\nSecond.\r\n  \r\nThird.\n\n\n")
        documents, skipped = read_documents(path)
        assert documents == ["First one.\nStill first.", "Second.", "Third."] and skipped == 0

    def test_jsonl_field_and_globs(self, tmp_path):
        (tmp_path / "a.jsonl").write_text('{"body": "one"}\n{"body": "two"}\n', encoding="utf-8")
        (tmp_path / "b.jsonl").write_text('{"body": "three"}\n', encoding="utf-8")
        documents, _ = read_documents(str(tmp_path / "*.jsonl"), jsonl_field="body")
        assert documents == ["one", "two", "three"]
        with pytest.raises(CorpusError, match="'text'"):
            read_documents(tmp_path / "a.jsonl")

    def test_missing_empty_and_folder_inputs_are_named(self, tmp_path):
        with pytest.raises(CorpusError, match="does not exist"):
            read_documents(tmp_path / "nope.txt")
        (tmp_path / "empty.txt").write_bytes(b"")
        with pytest.raises(CorpusError, match="empty.txt is empty"):
            read_documents(tmp_path / "empty.txt")
        with pytest.raises(CorpusError, match="matches no file"):
            read_documents(str(tmp_path / "*.md"))
        with pytest.raises(CorpusError, match="is a folder"):
            read_documents(tmp_path)

    def test_non_utf8_bytes_are_reported_with_file_and_offset(self, tmp_path):
        path = tmp_path / "bad.txt"
        path.write_bytes(b"Good text.\n\nBad \xff byte.\n\nGood again.")
        with pytest.raises(CorpusError, match=r"bad.txt: byte 16 is not valid UTF-8"):
            read_documents(path)
        documents, skipped = read_documents(path, skip_undecodable=True)
        assert documents == ["Good text.", "Good again."] and skipped == 1


class TestLargeCorpora:
    """A corpus of megabytes: line- or blank-line-separated, with progress lines and N.

    The CI file is 0.5 MB; docs/results.md reports a run on a 30 MB one.
    """

    @pytest.fixture(scope="class")
    def prepared(self, tmp_path_factory):
        folder = tmp_path_factory.mktemp("large")
        path = folder / "lines.txt"
        documents = write_synthetic_corpus(path, 500_000, separator="line", seed=3)
        lines = []
        shards = prepare_corpus(folder / "shards", path, sequence_length=64, vocabulary_size=300,
                                separator="line", progress=lines.append)
        return path, documents, shards, lines

    def test_the_generator_writes_the_size_and_documents_it_says(self, tmp_path):
        for separator in ("line", "blank-line"):
            path = tmp_path / f"{separator}.txt"
            count = write_synthetic_corpus(path, 50_000, separator=separator, seed=1)
            assert os.path.getsize(path) >= 50_000
            documents, _ = read_documents(path, separator=separator)
            assert len(documents) == count
        # Without blank lines, a file of lines is one paragraph.
        assert len(read_documents(tmp_path / "line.txt", separator="blank-line")[0]) == 1
        again = tmp_path / "again.txt"
        write_synthetic_corpus(again, 50_000, separator="blank-line", seed=1)
        assert again.read_bytes() == (tmp_path / "blank-line.txt").read_bytes()

    def test_progress_names_every_stage_and_n(self, prepared):
        path, documents, shards, lines = prepared
        text = "\n".join(lines)
        assert f"{documents:,} documents" in text
        for stage in ("counting words", "tokenizing"):
            shares = [int(m) for m in re.findall(stage + r":\s+(\d+)%", text)]
            # At least every tenth of the work once it is big enough, ending at 100 %.
            assert len(shares) >= 5 and shares == sorted(shares) and shares[-1] == 100
        assert "learning a WordPiece vocabulary of 300" in text
        assert f"wrote N = {len(shards):,} sequences of 64 tokens" in lines[-1]
        assert shards.manifest["num_documents"] == documents

    def test_prepared_shards_are_reused_and_say_n(self, prepared, tmp_path):
        path, _, shards, _ = prepared
        lines = []
        again = prepare_corpus(shards.directory, path, sequence_length=64, vocabulary_size=300,
                               separator="line", progress=lines.append)
        assert len(again) == len(shards)
        assert lines == [f"  reusing the prepared shards in {shards.directory}: "
                         f"N = {len(shards):,} sequences of 64 tokens"]

    def test_a_long_document_is_tokenized_in_pieces_as_a_whole(self, shards):
        import keras_hub

        from tf_megadp.jobs.bert import text

        vocabulary = load_vocabulary(shards)
        document = " ".join(make_documents(40, seed=5)) + " averyveryverylongwordwithoutspaces"
        reference = np.asarray(keras_hub.tokenizers.WordPieceTokenizer(
            vocabulary=vocabulary, lowercase=True, oov_token="[UNK]")(document))
        for limit in (40, 64, 1000):
            pieces = text._pieces(document, limit)
            assert "".join(pieces) == document and max(map(len, pieces)) <= limit
            (ids,) = text._tokenize([document], vocabulary, True, piece_characters=limit)
            np.testing.assert_array_equal(ids, reference)

    def test_an_unknown_separator_is_named(self, corpus_file, tmp_path):
        with pytest.raises(CorpusError, match="separator must be one of blank-line, line"):
            read_documents(corpus_file, separator="paragraph")
        with pytest.raises(CorpusError, match="separator"):
            prepare_corpus(tmp_path, corpus_file, separator="paragraph")


class TestPrepareCorpus:
    def test_manifest_describes_shards_vocabulary_and_privacy_unit(self, shards):
        manifest = shards.manifest
        vocabulary = load_vocabulary(shards)
        assert manifest["sequence_length"] == LENGTH
        assert manifest["vocabulary_size"] == len(vocabulary) <= 120
        assert manifest["num_sequences"] == len(shards) > 0
        assert manifest["dtype"] == "uint16"
        assert manifest["privacy_unit"] == f"one sequence of {LENGTH} tokens"
        assert vocabulary[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
        assert len(manifest["checksum"]) == 64

    def test_rows_follow_the_bert_layout(self, shards):
        rows = shards.read(np.arange(len(shards))).astype(np.int64)
        assert np.all(rows[:, 0] == CLS)
        for row in rows:
            sep = np.flatnonzero(row == SEP)
            assert len(sep) == 1
            assert np.all(row[sep[0] + 1 :] == PAD)
            assert np.all(row[1 : sep[0]] > MASK)
        # Stream packing: every row but the last is full.
        assert np.all(rows[:-1, -1] == SEP)

    def test_tokens_spell_the_text(self, shards, corpus_file):
        vocabulary = load_vocabulary(shards)
        rows = shards.read(np.arange(len(shards))).astype(np.int64)
        body = np.concatenate([row[1 : np.flatnonzero(row == SEP)[0]] for row in rows])
        assert UNK not in body
        reference = words(corpus_file.read_text(encoding="utf-8"))
        spelled = detokenize(body, vocabulary)
        # A word split across two rows is spelled in two parts; compare the letters.
        assert "".join(spelled) == "".join(reference[: len(spelled)])
        assert len(reference) - len(spelled) < 4 + 1  # only a short tail is dropped

    def test_same_inputs_reuse_the_shards(self, shards, corpus_file, monkeypatch):
        import tf_megadp.jobs.bert.text as text

        def fail(*args, **kwargs):
            raise AssertionError("the vocabulary was learned again")

        monkeypatch.setattr(text, "learn_vocabulary", fail)
        again = prepare_corpus(shards.directory, corpus_file, sequence_length=LENGTH, vocabulary_size=120, min_tokens=4)
        assert again.manifest == shards.manifest
        with pytest.raises(AssertionError, match="learned again"):
            prepare_corpus(shards.directory, corpus_file, sequence_length=LENGTH, vocabulary_size=121, min_tokens=4)

    def test_document_packing_never_mixes_documents(self, tmp_path):
        path = tmp_path / "docs.txt"
        path.write_text("alpha beta gamma delta epsilon zeta eta theta.\n\nomega psi chi phi upsilon tau sigma.", encoding="utf-8")
        shards = prepare_corpus(tmp_path / "out", path, sequence_length=8, vocabulary_size=200, packing="document", min_tokens=1)
        vocabulary = load_vocabulary(shards)
        rows = shards.read(np.arange(len(shards))).astype(np.int64)
        letters = ["".join(detokenize(r[1 : np.flatnonzero(r == SEP)[0]], vocabulary)) for r in rows]
        first, second = "alphabetagammadeltaepsilonzetaetatheta.", "omegapsichiphiupsilontausigma."
        # Some row boundary falls exactly between the two documents.
        boundaries = ["".join(letters[:j]) for j in range(len(letters) + 1)]
        assert first in boundaries and "".join(letters) == first + second

    def test_a_given_vocabulary_is_used_as_is(self, shards, corpus_file, tmp_path):
        vocabulary_file = os.path.join(shards.directory, "vocab.txt")
        again = prepare_corpus(tmp_path / "given", corpus_file, sequence_length=LENGTH, min_tokens=4, vocabulary=vocabulary_file)
        assert load_vocabulary(again) == load_vocabulary(shards)
        np.testing.assert_array_equal(again.read(np.arange(len(again))), shards.read(np.arange(len(shards))))
        with pytest.raises(CorpusError, match="must start with"):
            prepare_corpus(tmp_path / "bad", corpus_file, vocabulary=["a", "b"])

    def test_a_bert_style_vocabulary_file_is_reordered(self, tmp_path):
        # BERT's public vocab.txt: [PAD] at 0, [unused*], then [UNK] [CLS] [SEP] [MASK].
        path = tmp_path / "vocab.txt"
        path.write_text("[PAD]\n[unused0]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n##s\nthe\n\n",
                        encoding="utf-8")
        assert read_vocabulary_file(path) == [*SPECIAL_TOKENS, "[unused0]", "the", "##s"]
        path.write_text("[PAD]\n[CLS]\nthe\n", encoding="utf-8")
        with pytest.raises(CorpusError, match=r"lacks the special tokens \['\[SEP\]'"):
            read_vocabulary_file(path)
        with pytest.raises(CorpusError, match="Cannot read vocabulary file"):
            read_vocabulary_file(tmp_path / "missing.txt")

    def test_a_given_vocabulary_that_misses_the_text_names_the_fix(self, corpus_file, tmp_path):
        vocabulary = [*SPECIAL_TOKENS, "x", "y"]
        with pytest.raises(CorpusError, match="given vocabulary does not cover"):
            prepare_corpus(tmp_path, corpus_file, sequence_length=LENGTH, vocabulary=vocabulary)

    def test_bad_settings_are_clear_errors(self, corpus_file, tmp_path):
        with pytest.raises(CorpusError, match="sequence_length must be an integer >= 8"):
            prepare_corpus(tmp_path, corpus_file, sequence_length=4)
        with pytest.raises(CorpusError, match="vocabulary_size must be an integer >= 6"):
            prepare_corpus(tmp_path, corpus_file, vocabulary_size=5)
        with pytest.raises(CorpusError, match=r"\[UNK\].*Raise vocabulary_size"):
            prepare_corpus(tmp_path, corpus_file, sequence_length=LENGTH, vocabulary_size=12)
        short = tmp_path / "short.txt"
        short.write_text("too short", encoding="utf-8")
        with pytest.raises(CorpusError, match="No sequence has 16 tokens"):
            prepare_corpus(tmp_path / "o", short, sequence_length=LENGTH, vocabulary_size=50)


class TestDefaultCorpus:
    def test_docstrings_of_installed_code_are_deterministic_english(self):
        first = default_corpus_documents(max_characters=30_000, packages=("stdlib",))
        second = default_corpus_documents(max_characters=30_000, packages=("stdlib",))
        assert first == second
        total = sum(map(len, first))
        assert 30_000 <= total < 30_000 + max(map(len, first))
        assert len(set(first)) == len(first)
        common = sum(words(doc).count("the") for doc in first)
        assert common > 100  # English prose, not code

    def test_unknown_package_is_an_error(self):
        with pytest.raises(CorpusError, match="not installed"):
            default_corpus_documents(1000, packages=("no_such_package_xyz",))


# The key of a logical step, as a sampler's as_dataset passes it.
KEY = np.array([3, 4], np.int64)


class TestMaskedLMBatcher:
    @pytest.fixture(scope="class")
    def batch(self, shards):
        batcher = MaskedLMBatcher.from_shards(shards)
        rows = shards.read(np.arange(min(len(shards), 64))).astype(np.int32)
        rows = np.concatenate([rows, np.zeros((8, LENGTH), np.int32)])
        weights = np.concatenate([np.ones(len(rows) - 8), np.zeros(8)]).astype(np.float32)
        import tensorflow as tf

        element = tf.data.Dataset.from_tensors((rows, weights)).map(
            lambda rows, weights: batcher(rows, weights, key=KEY)).get_single_element()
        return rows, weights, element, batcher

    def test_outputs_match_the_data_contract(self, batch):
        rows, _, (x, y, sample_weight), batcher = batch
        m, p = len(rows), batcher.max_predictions
        assert p == int(np.ceil(0.15 * LENGTH))
        assert set(x) == {"token_ids", "segment_ids", "padding_mask", "mask_positions"}
        assert x["token_ids"].shape == (m, LENGTH) and x["token_ids"].dtype == "int32"
        assert x["segment_ids"].shape == (m, LENGTH) and not np.any(x["segment_ids"])
        assert x["padding_mask"].dtype == "int32"  # BertBackbone's input dtype
        assert x["mask_positions"].shape == (m, p) and x["mask_positions"].dtype == "int32"
        assert y.shape == (m, p) and y.dtype == "int32"
        assert sample_weight.shape == (m, p) and sample_weight.dtype == "float32"

    def test_labels_are_the_original_tokens_at_selected_real_positions(self, batch):
        rows, weights, (x, y, sample_weight), _ = batch
        positions, y, sample_weight = x["mask_positions"].numpy(), y.numpy(), sample_weight.numpy()
        for i in np.flatnonzero(weights):
            chosen = positions[i][sample_weight[i] == 1]
            np.testing.assert_array_equal(y[i][sample_weight[i] == 1], rows[i][chosen])
            assert np.all(rows[i][chosen] > MASK)  # never [PAD], [CLS] or [SEP]
            real = np.count_nonzero(rows[i] > MASK)
            assert abs(len(chosen) - min(0.15 * real, positions.shape[1])) < 1
            np.testing.assert_array_equal(x["padding_mask"].numpy()[i], rows[i] != PAD)

    def test_padding_examples_have_zero_weight_and_finite_attention(self, batch):
        _, weights, (x, _, sample_weight), _ = batch
        padding = weights == 0
        assert not np.any(sample_weight.numpy()[padding])
        mask = x["padding_mask"].numpy()[padding]
        assert np.all(mask[:, 0]) and not np.any(mask[:, 1:])

    def test_selected_tokens_are_masked_80_10_10(self, shards):
        import tensorflow as tf

        batcher = MaskedLMBatcher.from_shards(shards)
        rows = shards.read(np.arange(len(shards))).astype(np.int32)
        weights = np.ones(len(rows), np.float32)
        mask = tf.function(lambda key: batcher(rows, weights, key=key))
        shown, original = [], []
        for step in range(40):  # equal rows get equal masks: 40 keys
            x, y, sample_weight = mask(tf.constant([7, step], tf.int64))
            positions, selected = x["mask_positions"].numpy(), sample_weight.numpy() == 1
            shown.append(np.take_along_axis(x["token_ids"].numpy(), positions, axis=1)[selected])
            original.append(y.numpy()[selected])
        shown, original = np.concatenate(shown), np.concatenate(original)
        masked = np.sum(shown == MASK)
        unchanged = np.sum((shown == original) & (shown != MASK))
        other = len(shown) - masked - unchanged
        # A random replacement may draw the original token: expected "unchanged"
        # share is 0.1 + 0.1 / V.
        v = shards.vocabulary_size
        expected = np.array([0.8, 0.1 + 0.1 / v, 0.1 - 0.1 / v]) * len(shown)
        assert stats.chisquare([masked, unchanged, other], expected).pvalue > 1e-3


def test_batches_train_a_bert_masked_lm_built_from_the_manifest(shards):
    import keras
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=shards.vocabulary_size,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=shards.sequence_length,
    )
    model = keras_hub.models.BertMaskedLM(backbone, preprocessor=None)
    # Eager: this checks that the inputs fit the model, and skips a slow trace.
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        run_eagerly=True,
    )
    schedule = BatchSizeSchedule.constant(1, 8, num_examples=len(shards), micro_batch_size=8)
    dataset = PoissonSampler(shards, schedule, seed=0).as_dataset(MaskedLMBatcher.from_shards(shards))
    spec_x, spec_y, spec_w = dataset.element_spec
    p = int(np.ceil(0.15 * LENGTH))
    assert all(spec.shape == (8, LENGTH) for name, spec in spec_x.items() if name != "mask_positions")
    assert spec_x["mask_positions"].shape == spec_y.shape == spec_w.shape == (8, p)
    history = model.fit(dataset.take(2), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
