"""Console entry point of `tf-megadp`: TensorFlow's start-up chatter stays out of the terminal.

It lives outside the package on purpose. Importing `tf_megadp` imports
TensorFlow, whose C++ runtime prints start-up lines (CUDA probing, CPU
features) through absl logging before any Python setting can reach it, and
TF_CPP_MIN_LOG_LEVEL is read only when that runtime loads. So the launcher
sets the variable, then imports TensorFlow and initialises its devices with
the process's stderr pointed at /dev/null, and restores stderr before any of
our own output. Python exceptions are printed after stderr is restored.
"""

import os
import sys


def _import_tensorflow_quietly() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        import tensorflow as tf

        tf.config.list_physical_devices()
        tf.get_logger().setLevel("ERROR")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def main(argv=None) -> int:
    _import_tensorflow_quietly()
    from tf_megadp.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
