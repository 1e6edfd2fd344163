"""The installed version of tf_megadp (a leaf: every module may import it)."""

__version__ = "0.1.0"
