"""Atomic file writes: a reader finds the old file or the whole new one, never a part.

Every file tf_megadp writes (checkpoints, privacy reports, token shards and
their manifests, canary lists, run reports, plots) goes through `atomic_write`,
so a crash or a full disk mid-write cannot leave a truncated file where a
complete one is expected.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

__all__ = ["atomic_write", "publishable_path", "publishable_paths", "write_bytes_atomically",
           "write_json_atomically"]


def sha256_of_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as hex, read in 4 MiB chunks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Calls `write(temporary_path)`, flushes the result to disk and renames it onto `path`.

    The temporary file lives in `path`'s folder (a rename is atomic only within
    one file system) and its name ends with `path`'s own name, so writers that
    check the extension (Keras `.keras` / `.weights.h5`, NumPy `.npy`,
    Matplotlib) accept it. It is removed if `write` fails.

    Args:
        path: the destination file; its folder must exist.
        write: writes the complete file at the path it is given.

    Example:
    ```python
    atomic_write("model.keras", model.save)
    ```
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=f"-{name}")
    os.close(handle)
    try:
        write(temporary)
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` atomically."""

    def write(temporary: str) -> None:
        with open(temporary, "wb") as stream:
            stream.write(data)

    atomic_write(path, write)


def write_json_atomically(path: str | os.PathLike, payload: Any, *,
                          default: Callable[[Any], Any] | None = None) -> None:
    """Writes `payload` as indented JSON (sorted keys, final newline) to `path` atomically.

    Args:
        path: the destination file; its folder must exist.
        payload: JSON-serializable data.
        default: as in `json.dumps`: converts values JSON cannot represent
            (without it they raise `TypeError`, and nothing is written).
    """
    text = json.dumps(payload, indent=2, sort_keys=True, default=default) + "\n"
    write_bytes_atomically(path, text.encode("utf-8"))


def publishable_path(path: str | os.PathLike, folder: str | os.PathLike) -> str:
    """How a report published from `folder` names `path`: relative to `folder`, or by name only.

    A run's publishable reports (the BERT job's report.json, a privacy.json)
    name files: an absolute path there would publish the machine's layout
    (user names, mounts) and means nothing on another machine. A path inside
    `folder` becomes relative to it ("." for the folder itself, "/" as the
    separator); any other path (relative ones are read from the current
    directory) becomes its last component, the file's or folder's name.

    Example:
    ```python
    publishable_path("/home/ann/runs/a/model.keras", "/home/ann/runs/a")  # 'model.keras'
    publishable_path("/home/ann/data/notes.txt", "/home/ann/runs/a")      # 'notes.txt'
    ```
    """
    absolute = os.path.abspath(os.fspath(path))
    root = os.path.abspath(os.fspath(folder))
    try:
        inside = os.path.commonpath([absolute, root]) == root
    except ValueError:  # Another drive.
        inside = False
    if inside:
        return os.path.relpath(absolute, root).replace(os.sep, "/")
    return os.path.basename(absolute.rstrip(os.sep)) or absolute


def publishable_paths(value: Any, folder: str | os.PathLike) -> Any:
    """JSON `value` with every absolute path string in it replaced by its `publishable_path`."""
    if isinstance(value, dict):
        return {key: publishable_paths(item, folder) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [publishable_paths(item, folder) for item in value]
    if isinstance(value, str) and os.path.isabs(value):
        return publishable_path(value, folder)
    return value
