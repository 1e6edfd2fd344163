"""DP masked-LM pretraining of a keras-hub BERT: the same job as `tf-megadp pretrain`.

    python examples/pretrain_bert_mlm.py                      # defaults: offline corpus, CPU
    python examples/pretrain_bert_mlm.py --model mini --schedule 40x1024,40x4096
    python examples/pretrain_bert_mlm.py --strategy mirrored --cpu-replicas 2 --model pico
    python examples/pretrain_bert_mlm.py --strategy tpu --tpu local \\
        --config tpu_configs/bert_base_v3_8.yaml              # the run `tf-megadp plan` checked
    python examples/pretrain_bert_mlm.py --help

It takes exactly the arguments of `tf-megadp pretrain`: one run configuration
(`--config FILE`, flags overriding its fields), one implementation of the job,
shared by the command line, this script and the tests.
"""

import sys

from tf_megadp_cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
