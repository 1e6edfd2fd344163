"""The fine-tuning job: DP text classification from a public BERT, by prompt or by head.

`tf-megadp finetune` fine-tunes a BERT that has learned (the public model
of `tf-megadp public-model`, a DP release, or a local keras-hub preset) on
labelled text with DP-SGD, and reports its test accuracy beside the
majority class, with (epsilon, delta):

* `--objective prompt` (default): the label is a word predicted at the
  [MASK] of a template by the pretrained MLM head (`tf_megadp.prompts`),
  the objective the model was pretrained with (Li et al. 2022);
* `--objective head`: a `keras_hub.models.BertTextClassifier` head on
  [CLS], the baseline.

Modules:

* `config`: `FinetuneConfig`, the run's settings (its privacy section is
  every job's `PrivacySettings`, `tf_megadp.jobs.common.privacy`).
* `data`: labelled JSONL or CSV files, their labels and split, and the
  default task (which package a docstring comes from, from installed
  packages kept out of the public pretraining corpus).
* `arguments`: the command's flags.
* `run`: `run_finetuning`, the run on the shared run machinery
  (`tf_megadp.jobs.common`).
"""
