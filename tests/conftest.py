"""Shared test set-up: quiet TensorFlow, TensorFlow backend, small thread pools."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# One thread per kernel: two xdist workers (and the distributed scenarios'
# interpreters, which inherit this) already fill the two cores, and the
# tests' tiny kernels gain nothing from a pool that oversubscribes them
# (a heavy pair of files ran 7 % faster beside another TF process).
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")


# Files whose tests take minutes, heaviest first (measured with
# `--durations=0`). Under `-n 2 --dist loadfile` a worker takes whole files
# in collection order: starting these first keeps one long file from
# running alone at the end while the other core idles.
_HEAVIEST_FIRST = (
    "test_distribute.py",
    "test_pretraining.py",
    "test_clipping_matrix.py",
    "test_clipping.py",
    "test_train_step.py",
    "test_callbacks.py",
    "test_optimizer.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return _HEAVIEST_FIRST.index(name) if name in _HEAVIEST_FIRST else len(_HEAVIEST_FIRST)

    items.sort(key=rank)  # Stable: the order inside a file is kept.
