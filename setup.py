"""Packaging for tf_megadp."""

import pathlib

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent

setup(
    name="tf_megadp",
    version="0.1.0",
    description=(
        "Differentially private training of language models in TensorFlow / "
        "Keras 3 at mega-batch scale."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["tf_megadp", "tf_megadp.*"]),
    py_modules=["tf_megadp_cli"],
    # Lower bounds are the versions .ci/lowest tests; upper bounds stop at the
    # next minor release of what moves fast or whose private API tf_megadp
    # uses (keras.src, tf.__internal__), so that a new release elsewhere
    # cannot break a fresh install silently. docs/quickstart.md lists the
    # versions tested.
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.16",
        "keras-hub>=0.32,<0.33",
        "tensorflow-text>=2.21.1,<2.22",  # 2.21.0 fails to import (undefined ICU symbol)
        "tensorboard>=2.21,<2.22",
        "dp-accounting>=0.6,<0.7",
        "numpy>=2.0,<3",
        "scipy>=1.13,<2",
        "h5py>=3.11",
        "pyyaml>=6.0",
        # tf_megadp.audit (exported at top level) uses scikit-learn's metrics;
        # the pretraining job plots its report with matplotlib.
        "scikit-learn>=1.5",
        "matplotlib>=3.9",
    ],
    extras_require={
        "dev": ["pytest>=9.2,<9.3", "pytest-xdist>=3.8,<3.9"],
    },
    entry_points={"console_scripts": ["tf-megadp=tf_megadp_cli:main"]},
)
