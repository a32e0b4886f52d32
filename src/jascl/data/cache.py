"""On-disk cache of decoded, preprocessed samples (2D and 3D alike).

A second run over the same files with the same options reads ``.npz`` files
instead of decoding and resampling NIfTI volumes / PNGs again. The key is a
digest of:

* every :class:`pathlib.Path` among the key parts: its resolved path, size and
  modification time (a folder contributes those of every file below it), so an
  edited or replaced file invalidates its entries;
* every other key part (options, layout name, ...) as canonical JSON;
* :data:`CACHE_VERSION`.

Writes are atomic and durable (:func:`jascl.fileio.atomic_write`: a temporary file in the same folder, fsynced, then renamed),
so an interrupted run or two runs sharing a cache never leave a half-written
entry; an unreadable entry is recomputed and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from jascl.fileio import atomic_write

log = logging.getLogger(__name__)

#: bump when the meaning of cached arrays changes (e.g. a preprocessing fix)
CACHE_VERSION = 1

Arrays = dict | tuple | np.ndarray | None
T = TypeVar("T")

_NONE = "__none__"


def _file_state(path: Path) -> list:
    try:
        st = path.stat()
    except OSError:
        return [str(path), None]  # a missing file still keys (and is reported by whoever reads it)
    return [str(path), st.st_size, st.st_mtime_ns]


def _path_state(path: Path) -> list:
    path = Path(os.path.abspath(path))
    if path.is_dir():
        return [str(path), "dir", [_file_state(p) for p in sorted(path.rglob("*")) if p.is_file()]]
    return _file_state(path)


def _canonical(part: Any) -> Any:
    if isinstance(part, os.PathLike):
        return {"path": _path_state(Path(part))}
    if isinstance(part, dict):
        return {str(k): _canonical(v) for k, v in sorted(part.items(), key=lambda kv: str(kv[0]))}
    if isinstance(part, (list, tuple)):
        return [_canonical(p) for p in part]
    if isinstance(part, np.ndarray):
        return {
            "array": hashlib.sha256(np.ascontiguousarray(part).tobytes()).hexdigest(),
            "shape": list(part.shape),
            "dtype": str(part.dtype),
        }
    if isinstance(part, (np.integer, np.floating, np.bool_)):
        return part.item()
    if part is None or isinstance(part, (str, int, float, bool)):
        return part
    return repr(part)


def cache_key(key_parts: Sequence[Any]) -> str:
    """Hex digest of ``key_parts`` (paths by path + size + mtime, the rest by value)."""
    payload = json.dumps([CACHE_VERSION, _canonical(list(key_parts))], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def _pack(value: Arrays) -> dict[str, np.ndarray]:
    if isinstance(value, dict):
        kind, items = "dict", list(value.items())
    elif isinstance(value, tuple):
        kind, items = "tuple", [(str(i), v) for i, v in enumerate(value)]
    else:
        kind, items = "array", [("0", value)]
    arrays = {"__kind__": np.array(kind), "__keys__": np.array([str(k) for k, _ in items])}
    for i, (key, v) in enumerate(items):
        if not isinstance(key, str):
            raise TypeError(f"cached dict keys must be strings, got {key!r}")
        arrays[f"v{i}"] = np.array(_NONE) if v is None else np.asarray(v)
    return arrays


def _unpack(npz: Any) -> Arrays:
    kind = str(npz["__kind__"])
    keys = [str(k) for k in npz["__keys__"]]
    values = []
    for i in range(len(keys)):
        v = npz[f"v{i}"]
        values.append(None if v.dtype.kind == "U" and v.shape == () and str(v) == _NONE else v)
    if kind == "dict":
        return dict(zip(keys, values))
    if kind == "tuple":
        return tuple(values)
    return values[0]


def entry_path(cache_dir: str | Path, key: str) -> Path:
    """Where the entry for digest ``key`` lives (two-character fan-out keeps folders small)."""
    return Path(cache_dir) / key[:2] / f"{key}.npz"


def cached(
    key_parts: Sequence[Any], compute_fn: Callable[[], T], cache_dir: str | Path | None, compress: bool = False
) -> T:
    """``compute_fn()``, or its stored result for the same key.

    Args:
        key_parts: what the result depends on: the input files as :class:`~pathlib.Path`
            (their size and mtime are part of the key), the options, the layout name ...
            Strings are keyed by value, never treated as paths.
        compute_fn: returns an array, a tuple of arrays / None, or a dict of
            str -> array / None (e.g. ``(image, label)`` from ``preprocess_volume``).
        cache_dir: the cache folder; None computes without caching.
        compress: store with ``np.savez_compressed`` (smaller, slower to read).

    Returns:
        What ``compute_fn`` returned (arrays read back from the cache have the
        dtypes and shapes that were stored).
    """
    if cache_dir is None:
        return compute_fn()
    path = entry_path(cache_dir, cache_key(key_parts))
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as npz:
                return _unpack(npz)  # type: ignore[return-value]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("cache entry %s unreadable (%s); recomputing", path, exc)
    value = compute_fn()
    arrays = _pack(value)  # type: ignore[arg-type]

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            (np.savez_compressed if compress else np.savez)(f, **arrays)  # type: ignore[arg-type]  # numpy's stub

    atomic_write(path, write)
    return value
