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
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15",
        "keras-hub>=0.32",
        "tensorflow-text>=2.21,<2.22",
        "tensorboard>=2.20",
        "dp-accounting>=0.6",
        "numpy",
        "scipy",
        "pyyaml",
        # tf_megadp.audit (exported at top level) uses scikit-learn's metrics;
        # the pretraining job plots its report with matplotlib.
        "scikit-learn",
        "matplotlib",
    ],
    extras_require={
        "dev": ["pytest>=8", "scikit-learn", "matplotlib"],
        "examples": ["scikit-learn", "matplotlib"],
    },
    entry_points={"console_scripts": ["tf-megadp=tf_megadp_cli:main"]},
)
