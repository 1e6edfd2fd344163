"""Jobs built on the tf_megadp library: complete runs with their data, models and reports.

A job imports the library, never the reverse (`import tf_megadp` loads no
job). `tf_megadp.jobs.bert` is the DP masked-LM pretraining of a keras-hub
BERT behind `tf-megadp plan`, `tf-megadp pretrain` and `tf-megadp audit`.
"""
