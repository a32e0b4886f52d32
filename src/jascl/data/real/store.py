"""The preprocessed store: one folder per sample, read by crops.

What ``jascl data prepare`` writes and every run reads (:class:`~jascl.data.real.storage.SampleStore`).
An entry lives in ``<cache>/real/store/<key[:2]>/<key>/`` and holds:

* ``image.npy``: the preprocessed image, ``(C, *spatial)`` float32, C order, uncompressed;
* ``label.npy``: the *native* label, ``(*spatial)`` in the smallest integer dtype holding its ids
  (:func:`~jascl.data.types.compact_dtype`); absent for a sample without a label;
* ``index.npz`` and ``coords.npy``: the foreground index: for every native id present, its voxel count
  and up to :data:`FOREGROUND_CAP` of its voxel coordinates, drawn once with a fixed seed (``coords.npy``
  holds them one id after another, memory-mapped when a crop needs one);
* ``entry.json``: :data:`STORE_VERSION`, shapes, dtypes and what the entry was made from.

Why this layout (measurements in ``docs/performance.md``): a training patch memory-maps the two ``.npy``
files and copies out the crop, so it reads only the pages the crop covers (about 18 MiB for a
128 x 120 x 120 patch of a 274 x 274 x 300 CT instead of the whole 108 MiB); the label map of the session is
applied to the crop only; and the foreground-biased crop draws its centre from the index, never scanning the
volume. Blosc2 chunks were 2.5 x smaller on disk but took twice the CPU per crop and a new dependency.

Validity: the key (:func:`jascl.data.cache.cache_key`) digests the sample's files (path, size, modification
time), the layout, its options, the preprocessing options, the spatial dims and :data:`STORE_VERSION`, so an
edited source file or a changed option leads to a new entry, and entries of another format are never read.
An entry is written as a temporary folder renamed into place (:func:`jascl.fileio.atomic_write_dir`), so a
folder under the entry's name is complete; one that fails to open (damaged on disk) is removed and rebuilt.
"""

from __future__ import annotations

import json
import logging
import shutil
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jascl.data.types import id_counts
from jascl.errors import DataError
from jascl.fileio import atomic_write_dir, stale_temporary_dirs
from jascl.protocols.schema import IGNORE_INDEX

log = logging.getLogger(__name__)

#: bump when the entry layout or the meaning of its arrays changes (1: the first crop-readable store; the
#: ``.npz`` entries of ``<cache>/real/samples`` before it are never read)
STORE_VERSION = 1

#: voxel coordinates kept per native class in the foreground index (as nnU-Net v2 keeps 10,000 per class)
FOREGROUND_CAP = 10_000

#: a class covering at least this share of the voxels (background, typically) is sampled by rejection
#: instead of listing all its voxels, so indexing never allocates an array of the volume's size
_LARGE_CLASS_SHARE = 1 / 64


def store_folder(cache_dir: str | Path) -> Path:
    """The store's folder in cache folder ``cache_dir``."""
    return Path(cache_dir) / "real" / "store"


def remove_abandoned(cache_dir: str | Path) -> int:
    """Remove the temporary entry folders of processes that no longer run (a worker ended or killed while it
    wrote an entry; :func:`~jascl.fileio.stale_temporary_dirs`) and return how many there were."""
    store = store_folder(cache_dir)
    stale = [p for folder in (store.glob("*") if store.is_dir() else []) for p in stale_temporary_dirs(folder)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)


def entry_dir(cache_dir: str | Path, key: str) -> Path:
    """Folder of the entry with digest ``key`` (two-character fan-out keeps folders small)."""
    return store_folder(cache_dir) / key[:2] / key


@dataclass(frozen=True)
class Entry:
    """An opened store entry (arrays are read on demand).

    Attributes:
        path: the entry folder.
        image_shape: ``(C, *spatial)``.
        has_label: whether ``label.npy`` exists.
        natives: (K,) native ids present in the label, ascending.
        counts: (K,) their voxel counts.
        offsets: (K + 1,) where each id's coordinates start in ``coords.npy`` (:meth:`coords`).
        layouts: file name -> (data offset, dtype, shape) of each ``.npy`` file, read once from its header,
            so a crop maps the file without parsing the header again.
    """

    path: Path
    image_shape: tuple[int, ...]
    has_label: bool
    natives: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    layouts: dict

    def _map(self, name: str) -> np.memmap:
        offset, dtype, shape = self.layouts[name]
        return np.memmap(self.path / name, dtype=dtype, mode="r", offset=offset, shape=shape)

    @property
    def spatial(self) -> tuple[int, ...]:
        return self.image_shape[1:]

    def coords(self, ks: Sequence[int]) -> list[np.ndarray]:
        """Per ``k`` in ``ks``: (n_k, D) int32 indexed voxel coordinates of ``natives[k]`` (n_k = min(count,
        FOREGROUND_CAP)), a memory map: indexing one row reads one page."""
        mapped = self._map("coords.npy")
        return [mapped[self.offsets[k] : self.offsets[k + 1]] for k in ks]

    def read(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The whole (image ``(C, *spatial)`` float32, native label ``(*spatial)`` or None), in memory."""
        image = np.load(self.path / "image.npy")
        label = np.load(self.path / "label.npy") if self.has_label else None
        return image, label

    def read_box(
        self,
        starts: Sequence[int],
        size: Sequence[int],
        label_map: Callable[[np.ndarray], np.ndarray] | None = None,
        flip: Sequence[int] = (),
        out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The crop ``starts`` .. ``starts + size`` (per spatial axis; it may reach outside the volume).

        Only the pages of the two files the crop covers are read (memory maps, dropped before returning), and
        each array is written once: the crop goes straight from the memory map into the (flipped) output.

        Args:
            starts: first voxel per axis, negative or past the end where the crop needs padding.
            size: crop size per axis.
            label_map: applied to the part of the native label inside the volume (e.g. the session's label map)
                before padding: a value map returning uint8.
            flip: spatial axes (0-based) along which the padded crop is reversed, as ``np.flip`` after the read.
            out: C-contiguous (image (C, *size) float32, label (*size) uint8) to write into instead of new arrays
                (e.g. one item's slot of a batch in shared memory); the label one is used with ``label_map`` only.

        Returns:
            image (C, *size) float32 C-contiguous, 0 outside the volume; label (*size): ``label_map`` of the
            native label, 255 outside the volume, uint8 C-contiguous (None without ``label_map`` when the entry
            has no label: the caller decides).
        """
        starts = [int(s) for s in starts]
        size = [int(s) for s in size]
        shape = self.spatial
        inside = tuple(slice(max(a, 0), min(a + s, n)) for a, s, n in zip(starts, size, shape))
        if any(sl.start >= sl.stop for sl in inside):
            raise ValueError(f"crop at {starts} of size {size} lies outside the volume {shape}")
        where = tuple(slice(sl.start - a, sl.stop - a) for sl, a in zip(inside, starts))
        axes = tuple(sorted({int(a) for a in flip}))
        padded = any(w.start > 0 or w.stop < n for w, n in zip(where, size))
        if out is None:
            image = np.zeros((self.image_shape[0], *size), dtype=np.float32)
        else:
            image = out[0]
            if padded:
                image.fill(0)
        mapped = self._map("image.npy")
        # written through a reversed view: the output is the flipped crop, C-contiguous, in one copy
        np.flip(image, tuple(a + 1 for a in axes))[(slice(None),) + where] = mapped[(slice(None),) + inside]
        del mapped
        if not self.has_label:
            return image, None
        native = self._map("label.npy")
        if label_map is None:
            return image, np.ascontiguousarray(np.flip(native[inside], axes))
        if out is None:
            label = np.full(size, IGNORE_INDEX, dtype=np.uint8)
        else:
            label = out[1]
            if padded:
                label.fill(IGNORE_INDEX)
        np.flip(label, axes)[where] = label_map(native[inside])  # read from the memory map by the map itself
        del native
        return image, label


def foreground_index(label: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Where each native id of ``label`` lies: (natives (K,), counts (K,), coordinates per id).

    Coordinates: up to :data:`FOREGROUND_CAP` voxels of each id, (n, D) int32, drawn uniformly without
    replacement with a generator seeded by ``seed`` (so an entry is rebuilt identically). Ids covering a
    large share of the volume are drawn by rejection from random voxels, the others from the list of their
    voxels.
    """
    flat = np.ascontiguousarray(label).reshape(-1)
    if flat.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    natives, counts = id_counts(flat)
    rng = np.random.default_rng([seed, 7919])
    coords = []
    for value, count in zip(natives, counts):
        n = min(int(count), FOREGROUND_CAP)
        if count >= _LARGE_CLASS_SHARE * flat.size and count > n:
            picked: np.ndarray = np.zeros(0, np.int64)
            while len(picked) < n:  # about n / share * 1.5 draws per round: one round almost always
                draws = rng.integers(0, flat.size, size=int(1.5 * (n - len(picked)) * flat.size / count) + 16)
                hits = draws[flat[draws] == value]
                picked = np.unique(np.concatenate([picked, hits]))
            picked = rng.permutation(picked)[:n]
        else:
            where = np.flatnonzero(flat == value)
            picked = where if count <= n else rng.choice(where, size=n, replace=False)
        coords.append(np.stack(np.unravel_index(np.sort(picked), label.shape), axis=1).astype(np.int32))
    return natives.astype(np.int64), counts.astype(np.int64), coords


def write_entry(path: Path, image: np.ndarray, label: np.ndarray | None, made_from: dict) -> bool:
    """Write the entry folder ``path`` atomically (see the module docstring).

    Args:
        image: (C, *spatial) float32.
        label: (*spatial) native ids in a compact integer dtype, or None.
        made_from: what the entry was made from (files, options), recorded in ``entry.json`` for people.

    Returns:
        False if another process wrote the entry meanwhile (its folder is kept).
    """
    index = foreground_index(label) if label is not None else (np.zeros(0, np.int64), np.zeros(0, np.int64), [])
    natives, counts, coords = index
    info = {
        "version": STORE_VERSION,
        "image_shape": list(image.shape),
        "image_dtype": str(image.dtype),
        "label_dtype": None if label is None else str(label.dtype),
        "made_from": made_from,
    }

    def write(tmp: Path) -> None:
        np.save(tmp / "image.npy", np.ascontiguousarray(image, dtype=np.float32))
        if label is not None:
            np.save(tmp / "label.npy", np.ascontiguousarray(label))
        offsets = np.cumsum([0] + [len(c) for c in coords]).astype(np.int64)
        np.save(tmp / "coords.npy", np.concatenate(coords) if coords else np.zeros((0, image.ndim - 1), np.int32))
        with open(tmp / "index.npz", "wb") as f:
            np.savez(f, natives=natives, counts=counts, offsets=offsets)
        (tmp / "entry.json").write_text(json.dumps(info, default=str, indent=1))

    return atomic_write_dir(path, write)


def open_entry(path: Path) -> Entry | None:
    """The entry at ``path``, or None when there is none, it is of another :data:`STORE_VERSION`, or it is damaged
    (a damaged or foreign folder is removed, so the caller rebuilds it)."""
    if not path.is_dir():
        return None
    try:
        info = json.loads((path / "entry.json").read_text())
        if info.get("version") != STORE_VERSION:
            raise ValueError(f"store version {info.get('version')}, expected {STORE_VERSION}")
        layouts = {}
        for name in ("image.npy", "label.npy", "coords.npy"):
            if name == "label.npy" and info["label_dtype"] is None:
                continue
            mapped = np.load(path / name, mmap_mode="r")  # reads the header; fails on a truncated file
            layouts[name] = (int(mapped.offset), mapped.dtype, tuple(int(n) for n in mapped.shape))
            del mapped
        shape = layouts["image.npy"][2]
        if list(shape) != info["image_shape"] or str(layouts["image.npy"][1]) != info["image_dtype"]:
            raise ValueError(f"image.npy is {layouts['image.npy'][1:]}, entry.json says otherwise")
        has_label = "label.npy" in layouts
        if has_label and (layouts["label.npy"][2] != shape[1:] or str(layouts["label.npy"][1]) != info["label_dtype"]):
            raise ValueError(f"label.npy is {layouts['label.npy'][1:]}, entry.json says otherwise")
        with np.load(path / "index.npz") as z:
            natives, counts, offsets = z["natives"], z["counts"], z["offsets"]
        if len(offsets) != len(natives) + 1 or layouts["coords.npy"][2] != (int(offsets[-1]), len(shape) - 1):
            raise ValueError(f"coords.npy is {layouts['coords.npy'][2]}, index.npz says otherwise")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        log.warning("store entry %s unreadable (%s); rebuilding it", path, exc)
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            raise DataError(f"{path}: damaged store entry that cannot be removed; delete the folder by hand") from None
        return None
    return Entry(path, shape, has_label, natives, counts, offsets, layouts)
