"""Console entry point of `tf-megadp`: the accounting commands answer without TensorFlow.

It lives outside the package on purpose: it acts before `tf_megadp` is
imported. The accounting commands (`--help`, `epsilon`, `calibrate`,
`plan`) are questions about numbers: NumPy, SciPy and dp_accounting answer
them in about a second, where importing TensorFlow takes 5-10 s. The
launcher sets `DEFER_LIBRARY_IMPORT`, which `tf_megadp/__init__.py` reads:
the package then imports its TensorFlow exports on first use, and these
commands never import TensorFlow (tests/test_cli.py checks it). The
commands that train or score a model (`pretrain`, `audit`) import
TensorFlow with its C++ start-up chatter silenced (`tf_megadp.cli`).
"""

import os
import sys

# Read by tf_megadp/__init__.py: import the library's TensorFlow exports on first use.
DEFER_LIBRARY_IMPORT = True


def main(argv=None) -> int:
    # Run as a file (`python tf_megadp_cli.py`), this module is __main__:
    # the package looks for it under its own name.
    sys.modules.setdefault("tf_megadp_cli", sys.modules[__name__])
    # Read once, when TensorFlow's C++ runtime loads (if a command loads it).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from tf_megadp.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
