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
# XLA's CPU backend without LLVM's optimization passes: the tests compile
# hundreds of tiny functions and run each a few times, so compiling is most
# of their XLA time (tests/test_train_step.py: 12 % less CPU). The same
# semantics; jobs, examples and benchmarks keep the default level. Set
# XLA_FLAGS yourself (even empty) to test at another level.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")


# Test files by the time their tests take, heaviest first (measured with
# `--durations=0`). Under `-n 2 --dist loadfile` a worker takes whole files
# in collection order: starting these first keeps one long file from
# running alone at the end while the other core idles.
_HEAVIEST_FIRST = (  # 2026-12-07: 1,574 s of tests; this order splits them 787 / 787
    "test_pretraining.py",
    "test_distribute.py",
    "test_callbacks.py",
    "test_clipping.py",
    "test_train_step.py",
    "test_custom_loop.py",
    "test_jobs_finetune.py",
    "test_clipping_matrix.py",
    "test_optimizer.py",
    "test_adaptive_clipping.py",
    "test_clipping_independence.py",
    "test_audit_one_run.py",
    "test_weights_origin.py",
    "test_accounting.py",
    "test_preemption.py",
    "test_prompts.py",
    "test_jobs_bert_config.py",
    "test_noise_buffers.py",
    "test_privacy_units.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return _HEAVIEST_FIRST.index(name) if name in _HEAVIEST_FIRST else len(_HEAVIEST_FIRST)

    items.sort(key=rank)  # Stable: the order inside a file is kept.
