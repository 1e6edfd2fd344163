"""DP masked-LM pretraining of a keras-hub BERT: the same job as `tf-megadp pretrain`.

    python examples/pretrain_bert_mlm.py                      # defaults: offline corpus, CPU
    python examples/pretrain_bert_mlm.py --model mini --schedule 40x1024,40x4096
    python examples/pretrain_bert_mlm.py --strategy tpu --tpu local --model large ...
    python examples/pretrain_bert_mlm.py --help

The job itself lives in `tf_megadp.pretraining` so that the command line, this
script and tests share one implementation.
"""

import sys

from tf_megadp_cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
