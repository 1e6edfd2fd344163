"""What every job's run shares: its privacy settings and their plan, its folder, its fit.

A job is a model, its data and its metric on this machinery; nothing here
knows BERT, masked-LM or classification:

* `errors`: `JobError`, bad input to a job (one line that names the fix);
* `privacy`: `PrivacySettings`, the privacy section every job's settings
  embed, planned one way (`plan_privacy`: sigma, delta, the planned
  epsilon, a composed release's ledger first) into one `DPOptimizer`
  (`new_dp_optimizer`);
* `run_folder`: the run's files (names, the guide to them, the release,
  report.json without machine paths), its checkpoints and their cadence,
  its logs, and the resume checks;
* `fitting`: the private fit, or under several workers the same private
  step in a custom loop that drives the same callbacks;
* `verdicts`: whether a run learned, against its trivial baseline;
* `flags`: a job's config from the flags given, over a saved run's;
* `lora`: a job's LoRA rank, checked and described once.
"""
