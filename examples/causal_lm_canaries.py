"""DP text generation and what a canary extraction attack finds in it, DP against non-private.

A corpus of generated English-like text (`write_synthetic_corpus`: no
third-party text) gets secret canaries, "my pin code is D D D D", each put
in 1, 8 or 32 times (and control canaries never put in). The script trains
`tf-megadp causal-lm` on it twice, privately (epsilon 5.36 by default) and
as the non-private twin, then attacks both releases as Carlini et al.'s
secret sharer does:

* exposure: the rank of each canary's secret among all 10^4 candidates by
  the model's log-likelihood of the digits after "my pin code is"
  (`tf_megadp.audit.canaries.canary_exposure`, exact); a memorised secret
  ranks first (exposure log2(10^4) = 13.3 bits), one the model never saw
  ranks anywhere (the controls: about 1 bit);
* extraction: the model's greedy generation of four digits after the
  prefix, and whether it is the secret.

Run (about 6 minutes on 2 CPU cores):

    python examples/causal_lm_canaries.py --output-dir runs/causal-lm-canaries
"""

from __future__ import annotations

import argparse
import os

import numpy as np

PREFIX = "my pin code is"
DIGITS = [str(digit) for digit in range(10)]
SECRET_LENGTH = 4


def write_corpus(folder: str, canaries, size_bytes: int) -> str:
    """Generated text, then every canary as its own document, `repetitions` times each."""
    from tf_megadp.jobs.bert.corpus import write_synthetic_corpus

    path = os.path.join(folder, "corpus.txt")
    write_synthetic_corpus(path, size_bytes, seed=0)
    rng = np.random.default_rng(0)
    documents = [f"{PREFIX} {' '.join(secret)} ." for secret, repetitions in canaries
                 for _ in range(repetitions)]
    rng.shuffle(documents)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n\n" + "\n\n".join(documents) + "\n")
    return path


def log_likelihoods(model, sequences: np.ndarray, cls_id: int) -> np.ndarray:
    """Log-likelihood of each sequence's last `SECRET_LENGTH` tokens after [CLS] and the rest."""
    import keras

    rows = np.concatenate([np.full((len(sequences), 1), cls_id), sequences], 1)
    inputs, targets = rows[:, :-1].astype(np.int32), rows[:, 1:]
    total = np.zeros(len(sequences))
    for start in range(0, len(sequences), 2000):
        part = slice(start, start + 2000)
        logits = keras.ops.convert_to_numpy(model(
            {"token_ids": inputs[part], "padding_mask": np.ones_like(inputs[part])},
            training=False)).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_p, targets[part][..., None], -1)[..., 0]
        total[part] = picked[:, -SECRET_LENGTH:].sum(1)
    return total


def score_fn(model, fmt, digit_ids: list[int], cls_id: int):
    """`canary_exposure`'s scores: every candidate scored once, then looked up by its digits."""
    table = log_likelihoods(model, fmt.fill(fmt.all_secrets()), cls_id)
    position = {token: index for index, token in enumerate(digit_ids)}

    def scores(sequences: np.ndarray) -> np.ndarray:
        digits = np.vectorize(position.get)(sequences[:, -SECRET_LENGTH:])
        # all_secrets enumerates the digits in row-major order of the slots.
        return table[np.ravel_multi_index(tuple(digits.T), (len(digit_ids),) * SECRET_LENGTH)]

    return scores


def greedy_digits(model, prefix_ids: list[int], cls_id: int, length: int) -> list[int]:
    """The model's most likely next tokens after [CLS] and the prefix, one at a time."""
    import keras

    tokens = [cls_id] + prefix_ids
    for _ in range(length):
        inputs = np.array([tokens], np.int32)
        logits = keras.ops.convert_to_numpy(
            model({"token_ids": inputs, "padding_mask": np.ones_like(inputs)}, training=False))
        tokens.append(int(np.argmax(logits[0, -1])))
    return tokens[-length:]


def main(argv=None, **job_settings) -> list[tuple]:
    """Writes the corpus, trains DP and non-private, prints each canary's exposure and extraction.

    Args:
        argv: the flags (None: the command line).
        **job_settings: more `CausalLMConfig` fields for both runs (the
            tests train a smaller model).

    Returns:
        One row per model and canary: (model, copies, secret, exposure in
        bits, rank, whether greedy generation gave the secret).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/causal-lm-canaries")
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target-epsilon", type=float, default=5.36)
    args = parser.parse_args(argv)

    import keras
    import keras_hub

    from tf_megadp.audit.canaries import Canary, CanaryFormat, canary_exposure
    from tf_megadp.jobs.bert import text
    from tf_megadp.jobs.causal_lm.config import CausalLMConfig
    from tf_megadp.jobs.causal_lm.run import run_causal_lm

    os.makedirs(args.output_dir, exist_ok=True)
    rng = np.random.default_rng(1)
    repetitions = [1, 1, 8, 8, 32, 32, 0, 0]  # the zeros: controls, never in the corpus
    secrets = [tuple(rng.choice(DIGITS, SECRET_LENGTH)) for _ in repetitions]
    corpus = write_corpus(args.output_dir, list(zip(secrets, repetitions)), args.corpus_bytes)
    reports = {}
    for name, settings in (("DP", {"target_epsilon": args.target_epsilon}),
                           ("non-private", {"non_private": True, "target_epsilon": None})):
        folder = os.path.join(args.output_dir, name)
        if not os.path.exists(os.path.join(folder, "report.json")):
            run_causal_lm(CausalLMConfig(**{
                "corpus": [corpus], "output_dir": folder, "steps": args.steps,
                "eval_every": args.steps, "verbose": 0, **settings, **job_settings}))
        reports[name] = folder
    rows = []
    for name, folder in reports.items():
        model = keras.saving.load_model(os.path.join(folder, "model.keras"), compile=False)
        vocabulary = text.read_vocabulary_file(os.path.join(folder, "vocab.txt"))
        missing = [digit for digit in DIGITS if digit not in vocabulary]
        if missing:
            raise SystemExit(f"The {name} run's vocabulary has no token for the digits {missing}, "
                             "so its secrets cannot be scored: train with a larger "
                             "vocabulary_size.")
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
        prefix_ids = keras.ops.convert_to_numpy(tokenizer(PREFIX)).tolist()
        digit_ids = [int(tokenizer.token_to_id(digit)) for digit in DIGITS]
        fmt = CanaryFormat(prefix_ids + [None] * SECRET_LENGTH, digit_ids)
        scores = score_fn(model, fmt, digit_ids, tokenizer.cls_token_id)
        generated = greedy_digits(model, prefix_ids, tokenizer.cls_token_id, SECRET_LENGTH)
        for secret, count in zip(secrets, repetitions):
            secret_ids = tuple(digit_ids[DIGITS.index(digit)] for digit in secret)
            result = canary_exposure(Canary(fmt, secret_ids, count), scores)
            rows.append((name, count, " ".join(secret), result["exposure"], result["rank"],
                         list(secret_ids) == generated))
    print(f"\nsecret space 10^{SECRET_LENGTH}: exposure at most "
          f"{SECRET_LENGTH * np.log2(10):.1f} bits (rank 1)")
    print("| model | copies in the corpus | secret | exposure (bits) | rank | greedy generation "
          "is the secret |")
    print("|---|---|---|---|---|---|")
    for name, count, secret, bits, rank, extracted in rows:
        print(f"| {name} | {count} | {secret} | {bits:.2f} | {rank:.0f} | "
              f"{'yes' if extracted else 'no'} |")
    return rows


if __name__ == "__main__":
    main()
