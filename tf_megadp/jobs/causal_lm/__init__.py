"""The causal-LM job: DP next-token training of a keras-hub GPT-2 or Llama (issue 51).

`tf-megadp causal-lm` pretrains a `keras_hub.models.GPT2CausalLM` (or,
with `--family llama`, a `LlamaCausalLM`), built from its constructors,
from scratch with DP-SGD on the offline default corpus (the WordPiece
corpus of `tf-megadp pretrain`) or `--corpus`, the tokens packed into
sequences of a fixed length. One packed sequence is one privacy unit, or
with `--privacy-unit FIELD` (a JSONL corpus) every document of one user:
users are Poisson-sampled and clipped whole, as in `tf-megadp pretrain
--privacy-unit`. With `--init-from RUN/model.keras --train FILE` it
fine-tunes such a run's model (of its family) on prompt/completion pairs
instead, the loss on the completion's tokens only, one pair being one
privacy unit (a DP release's ledger is composed into the run's epsilon).
It reports held-out next-token accuracy and perplexity beside the unigram
baseline, with (epsilon, delta).

Modules:

* `config`: `CausalLMConfig`, the run's settings (its privacy section is
  every job's `PrivacySettings`, `tf_megadp.jobs.common.privacy`).
* `families`: the decoders (GPT-2, Llama) and how each is built.
* `data`: packed sequences or prompt/completion pairs as next-token
  examples, the unigram baseline, and the held-out scores (accuracy,
  perplexity).
* `arguments`: the command's flags.
* `run`: `run_causal_lm`, the run on the shared run machinery
  (`tf_megadp.jobs.common`).
"""
