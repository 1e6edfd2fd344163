"""Specification of prompt (infilling) classification (`tf_megadp.prompts`).

The label is a word predicted at the [MASK] of a template by the masked
LM's own head: the logits are the MLM logits of the label words there,
exactly (a hand computation from the masked LM's output), the loss and its
gradients are those of a softmax over the label words, and the private
step clips them as the naive per-example loop does, every weight and
under LoRA. The model saves, loads and trains like any private Keras model.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tf_megadp
from tests import reference

WORDS = ["it", "was", "good", "bad", "the", "film", "plot", "acting", "great", "dull",
         "##s", "fine", "is", "a"]
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
T = 12
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def tokenizer():
    return keras_hub.models.BertTokenizer(vocabulary=VOCABULARY, lowercase=True)


def masked_lm(seed=0):
    return reference.tiny_bert(vocabulary_size=len(VOCABULARY), sequence_length=T, seed=seed)


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS[4:10], int(rng.integers(2, 12)))) for _ in range(n)]


class TestVerbalizer:
    def test_each_label_word_is_one_token(self, tokenizer):
        verbalizer = tf_megadp.Verbalizer(["neg", "pos"], ["bad", "good"], tokenizer)
        assert verbalizer.token_ids == [VOCABULARY.index("bad"), VOCABULARY.index("good")]

    @pytest.mark.parametrize("word, pieces", [("plots", "['plot', '##s']"),
                                              ("superb", "['[UNK]']")])
    def test_a_word_the_tokenizer_splits_or_does_not_know_is_refused_by_name(
            self, tokenizer, word, pieces):
        with pytest.raises(ValueError) as refusal:
            tf_megadp.Verbalizer(["neg", "pos"], ["bad", word], tokenizer)
        message = str(refusal.value)
        assert f"{word!r} (label 'pos') is not one token" in message
        assert f"reads it as {pieces}" in message and "single token" in message

    def test_labels_need_their_own_words(self, tokenizer):
        with pytest.raises(ValueError, match="repeats"):
            tf_megadp.Verbalizer(["neg", "pos"], ["bad", "bad"], tokenizer)
        with pytest.raises(ValueError, match="one word per label"):
            tf_megadp.Verbalizer(["neg", "pos", "mixed"], ["bad", "good"], tokenizer)


class TestTemplate:
    def test_rows_hold_the_text_then_the_prompt_and_point_at_the_mask(self, tokenizer):
        x = tf_megadp.PromptTemplate("{text} it was [MASK] .").encode(
            ["the film", "the plot the plot the plot the plot the plot"], tokenizer, T)
        ids = {token: i for i, token in enumerate(VOCABULARY)}
        first = [ids[t] for t in ("[CLS]", "the", "film", "it", "was", "[MASK]")]
        # "." is not in the vocabulary: [UNK], as the tokenizer reads it.
        assert x["token_ids"][0].tolist()[:8] == first + [ids["[UNK]"], ids["[SEP]"]]
        assert x["padding_mask"][0].tolist() == [1] * 8 + [0] * 4
        # A long text is cut from its end; the prompt always fits.
        assert x["token_ids"][1].tolist()[-5:] == [ids[t] for t in ("it", "was", "[MASK]")] + [
            ids["[UNK]"], ids["[SEP]"]]
        assert x["padding_mask"][1].all()
        for row, position in enumerate(x["mask_positions"][:, 0]):
            assert x["token_ids"][row, position] == ids["[MASK]"]
        assert x["mask_positions"].shape == (2, 1)

    def test_a_mask_before_the_text_and_bad_templates(self, tokenizer):
        x = tf_megadp.PromptTemplate("[MASK] : {text}").encode(["good film"], tokenizer, T)
        assert x["mask_positions"][0, 0] == 1
        for bad in ("{text} it was good", "it was [MASK]", "{text} [MASK] [MASK]"):
            with pytest.raises(ValueError, match="once"):
                tf_megadp.PromptTemplate(bad)
        with pytest.raises(ValueError, match="lengthen the sequences"):
            tf_megadp.PromptTemplate("{text} it was the film the plot [MASK] .").encode(
                ["good"], tokenizer, 8)


@pytest.fixture(scope="module")
def task(tokenizer):
    verbalizer = tf_megadp.Verbalizer(["neg", "pos"], ["bad", "good"], tokenizer)
    x = tf_megadp.PromptTemplate("{text} it was [MASK]").encode(texts(8), tokenizer, T)
    y = np.random.default_rng(1).integers(0, 2, 8).astype("int32")
    return verbalizer, x, y


def test_the_logits_are_the_mlm_logits_of_the_label_words_at_the_mask(task):
    verbalizer, x, y = task
    lm = masked_lm()
    model = tf_megadp.PromptClassifier(lm, verbalizer.token_ids)
    full = keras.ops.convert_to_numpy(lm(x))  # [N, 1, V]
    expected = full[:, 0, verbalizer.token_ids]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), expected, rtol=1e-6)
    # The loss is a softmax over the label words, by hand.
    shifted = expected - expected.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    hand = -log_softmax[np.arange(len(y)), y].mean()
    assert float(LOSS(y, model(x))) == pytest.approx(hand, rel=1e-5)


def test_the_gradients_are_the_label_softmax_backpropagated_through_the_mlm_head(task):
    verbalizer, x, y = task
    lm = masked_lm()
    model = tf_megadp.PromptClassifier(lm, verbalizer.token_ids)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    ours = tape.gradient(loss, model.trainable_variables)
    # By hand: d loss / d (full logits at the mask) is (softmax - onehot) / N
    # on the label words and 0 elsewhere; backpropagate that through lm.
    with tf.GradientTape() as tape:
        full = lm(x)[:, 0, :]
    probabilities = tf.nn.softmax(tf.gather(full, verbalizer.token_ids, axis=1))
    upstream = tf.scatter_nd(
        tf.constant([[i] for i in verbalizer.token_ids]),
        tf.transpose((probabilities - tf.one_hot(y, 2)) / len(y)),
        [len(VOCABULARY), len(y)])
    theirs = tape.gradient(full, lm.trainable_variables, output_gradients=tf.transpose(upstream))
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)  # the pooler: no gradient from the MLM head
        if a is not None:
            np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(),
                                       tf.convert_to_tensor(b).numpy(), rtol=1e-4, atol=1e-7)


@pytest.mark.filterwarnings("ignore:DPOptimizer with noise_multiplier=0")
@pytest.mark.filterwarnings("ignore:arrays passed to fit")
@pytest.mark.parametrize("clipping, lora", [
    # LoRA through the prompt head: slow (CI's 15 minutes); LoRA on BERT is
    # exact in tests/test_clipping_lora.py by default.
    ("ghost", False), pytest.param("ghost", True, marks=pytest.mark.slow),
    # auto picks ghost or vectorized per layer; its BERT rows are tested elsewhere.
    pytest.param("auto", False, marks=pytest.mark.slow)])
def test_the_private_step_clips_as_the_naive_per_example_loop(task, clipping, lora):
    verbalizer, x, y = task
    model = tf_megadp.PromptClassifier(masked_lm(), verbalizer.token_ids)
    if lora:
        model.masked_lm.backbone.enable_lora(2)
    grads = reference.naive_per_example_gradients(model, LOSS, x, y)
    clip = float(np.median([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in grads]))
    expected = reference.naive_clipped_update(model, LOSS, x, y, clip, divisor=len(y))
    tf_megadp.make_private(model)
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.SGD(learning_rate=1.0), l2_norm_clip=clip, noise_multiplier=0.0,
        accumulation_steps=2, clipping=clipping), loss=LOSS)
    before = reference.weights(model)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    for a, b, e in zip(reference.weights(model), before, expected):
        np.testing.assert_allclose(a - b, e, rtol=1e-5, atol=2e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_private_prompt_classifier_saves_loads_and_trains_on(task, tmp_path):
    verbalizer, x, y = task
    sampler = tf_megadp.PoissonSampler.from_arrays(x, y, batch_size=4, epochs=2,
                                                   micro_batch_size=4)
    model = tf_megadp.make_private(tf_megadp.PromptClassifier(masked_lm(), verbalizer.token_ids))
    model.compile(optimizer=tf_megadp.DPOptimizer(
        keras.optimizers.Adam(1e-3), 1.0, 1.0, schedule=sampler.schedule), loss=LOSS,
        metrics=["accuracy"])
    privacy = tf_megadp.PrivacyCallback(delta=1e-2)
    model.fit(sampler.as_dataset(), callbacks=[privacy], verbose=0)
    model.save(tmp_path / "prompt.keras")
    loaded = tf_megadp.make_private(keras.models.load_model(tmp_path / "prompt.keras"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)),
                               keras.ops.convert_to_numpy(model(x)), rtol=1e-6)
    assert loaded.label_token_ids == verbalizer.token_ids
    assert tf_megadp.read_ledger(loaded.optimizer).total_steps == privacy.ledger.total_steps
