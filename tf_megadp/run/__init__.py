"""What a private run keeps outside the graph: its ledger's recorder, callbacks and files.

The compiled step (`tf_megadp.training`) and the `DPOptimizer`
(`tf_megadp.optimizer`) do the private update; this package keeps the run
around them honest, in Python, between steps:

* `state`: what a private model carries in memory (the private flag, the
  ledger of its weights, its run notes, its training generation);
* `weights_origin`: where a run's weights start (`declare_public_weights`,
  `continue_from_release`);
* `ledger_recorder`: `LedgerRecorder`, which turns the steps the compiled
  step applied into ledger entries, with N and the sampling;
* `reporting`: `PrivacyReporting`, epsilon, the report and the budget of a
  run, from its ledger;
* `callbacks`: the private `fit`'s `LedgerKeeper` and the user's
  `PrivacyCallback`;
* `training_state`, `saving`, `export`, `backup`: the files of a run (a
  training checkpoint, a private model's own `save` and `load_weights`, the
  release, and `keras.callbacks.BackupAndRestore` in a private `fit`).

The package imports none of its modules here: `training_state` reads a
checkpoint's index without TensorFlow (`tf-megadp pretrain --resume`).
"""
