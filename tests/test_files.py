"""Specification of atomic writes: a failed write leaves the old file and no debris."""

import json
import os

import numpy as np
import pytest

from tf_megadp.files import atomic_write, write_bytes_atomically, write_json_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomically(path, {"epsilon": 1.0})

    def half_then_crash(temporary):
        with open(temporary, "w") as stream:
            stream.write('{"epsilon": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_crash)
    assert json.loads(path.read_text()) == {"epsilon": 1.0}
    assert os.listdir(tmp_path) == ["report.json"]


def test_the_temporary_keeps_the_extension_writers_check(tmp_path):
    # np.save appends ".npy" to a path without it: the rename would miss the data.
    path = tmp_path / "index.npy"
    atomic_write(path, lambda temporary: np.save(temporary, np.arange(3)))
    np.testing.assert_array_equal(np.load(path), [0, 1, 2])
    assert os.listdir(tmp_path) == ["index.npy"]


def test_json_is_sorted_indented_and_refuses_what_it_cannot_represent(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomically(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    with pytest.raises(TypeError):
        write_json_atomically(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 1}
    write_json_atomically(path, {"a": np.float32(0.5)}, default=str)
    assert json.loads(path.read_text()) == {"a": "0.5"}


def test_bytes_replace_the_whole_file(tmp_path):
    path = tmp_path / "vocab.txt"
    write_bytes_atomically(path, b"a long first version\n")
    write_bytes_atomically(path, b"short\n")
    assert path.read_bytes() == b"short\n"
