"""The BERT job: DP masked-LM pretraining of a keras-hub `BertMaskedLM`.

Modules:

* `config`: the one run configuration (`PretrainConfig`, from a run file of
  tpu_configs/ or from flags; `Hardware` of a planned run).
* `plan`: the cost model behind `tf-megadp plan` (FLOPs, memory, epsilon).
* `text`: the corpus, WordPiece vocabulary and `MaskedLMBatcher`.
* `pretraining`: data preparation, canaries, model presets (`build_model`,
  mixed_bfloat16 and mixed_float16 included), training on any strategy, the report.

The audit of a finished run is `tf_megadp.jobs.bert.audit.audit_pretraining_run`
(`tf-megadp audit`); the score of a model without training it,
`tf_megadp.jobs.bert.evaluation.evaluate_model` (`tf-megadp evaluate`).
"""
