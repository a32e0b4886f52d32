"""The data types every layer shares: a split of samples and a session's data.

Arrays are NumPy (or lazy array-likes with the same indexing, for datasets on
disk; :mod:`jascl.data.real`). Labels are global class ids: 0 = background,
255 = ignore (:data:`jascl.data.datasets.IGNORE_INDEX`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from jascl.protocols.schema import SessionSpec


def compact_dtype(label: np.ndarray) -> np.dtype:
    """The smallest integer dtype holding a native label map's ids: uint8 for ids 0-255 (every dataset jascl reads
    so far), uint16 for 0-65535, int32, else int64. A 512 x 512 x 300 CT label is 75 MiB in uint8 against 600 MiB
    as int64, in memory while it is preprocessed and on disk in the store."""
    label = np.asarray(label)
    if label.size == 0:
        return np.dtype(np.uint8)
    lo, hi = int(label.min()), int(label.max())
    if lo >= 0 and hi < 1 << 8:
        return np.dtype(np.uint8)
    if lo >= 0 and hi < 1 << 16:
        return np.dtype(np.uint16)
    if -(1 << 31) <= lo and hi < 1 << 31:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


def id_counts(label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids of a label map, ascending, and how many voxels hold each: ``(ids (K,), counts (K,))`` int64.

    Non-negative integer ids below 2**20 are counted with ``np.bincount`` in slabs of 1 M voxels (bincount makes
    an int64 copy of what it counts: 600 MiB for a whole 512 x 512 x 300 label, 8 MiB per slab, which the
    allocator reuses: 0.09 s for that label, against 0.17-0.38 s in slabs of 4 M), uint8 labels two voxels at a
    time (:func:`_byte_counts`); other labels with ``np.unique``.
    """
    flat = np.ravel(label, order="K")  # no copy of a C- or Fortran-ordered array (nibabel decodes the latter)
    if flat.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if flat.dtype == np.uint8:
        return _byte_counts(flat)
    if flat.dtype.kind in "iub" and int(flat.min()) >= 0 and int(flat.max()) < 1 << 20:
        top = int(flat.max()) + 1
        counts = np.zeros(top, np.int64)
        for i in range(0, flat.size, 1 << 20):
            counts += np.bincount(flat[i : i + (1 << 20)], minlength=top)
        ids = np.flatnonzero(counts)
        return ids.astype(np.int64), counts[ids]
    ids, counts = np.unique(flat, return_counts=True)
    return ids.astype(np.int64), counts.astype(np.int64)


class ValueTable:
    """A value map of non-negative integer ids to uint8, applied by table lookup: ``self(values)[i] ==
    table[values[i]]`` (``np.take``, which raises on an id the table does not cover).

    ``np.take`` costs about 2 ns per index on a 2-core machine whatever the table's size, so on uint8 ids with a
    table of all 256 values the lookup goes two voxels at a time: the input's bytes read as uint16 index a
    65,536-entry table of value pairs (built once, 128 KiB). The result is the same, in half the time or less
    (best of 20, one thread, a 2-core machine; ``docs/performance.md``): a training crop's label (128 x 120 x 120
    voxels from the store's memory map) 2.0 ms instead of 3.8-4.1 ms; a whole 274 x 274 x 300 label 24 ms instead
    of 77-81 ms by fancy indexing.
    """

    def __init__(self, table: np.ndarray) -> None:
        self.table = np.ascontiguousarray(table, dtype=np.uint8).reshape(-1)
        self.pairs: np.ndarray | None = None
        if len(self.table) == 256:
            # the two bytes of every uint16 as they lie in memory (either byte order), each mapped by the table
            both = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
            self.pairs = np.ascontiguousarray(self.table[both]).view(np.uint16).reshape(-1)

    def __call__(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values)
        if self.pairs is None or values.dtype != np.uint8:
            return np.take(self.table, values)
        # a C- or Fortran-ordered input is read where it lies, and the result has its order; others are copied
        ids = values if values.flags.c_contiguous or values.flags.f_contiguous else np.ascontiguousarray(values)
        out = np.empty_like(ids)
        flat, result = np.ravel(ids, order="K"), np.ravel(out, order="K")  # views, in memory order
        even = flat.size - flat.size % 2
        pairs, into = flat[:even].view(np.uint16), result[:even].view(np.uint16)
        # in slabs of 64 Ki pairs: take widens its indices to int64, 512 KiB per slab, which stays in cache (a
        # whole 274 x 274 x 300 label: 24 ms against 53 ms in one call). Every uint16 is a valid index of
        # ``pairs``: "clip" never clips, and spares the buffered copy of ``out`` that take's default mode makes
        for start in range(0, pairs.size, 1 << 16):
            np.take(self.pairs, pairs[start : start + (1 << 16)], out=into[start : start + (1 << 16)], mode="clip")
        if even < flat.size:
            result[-1] = self.table[flat[-1]]
        return out


def _byte_counts(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`id_counts` of a contiguous uint8 array, two voxels per count: its bytes read as uint16 are counted
    (65,536 bins, in slabs of 1 Mi pairs), then each id's count is the pairs holding it first plus those holding it
    second. Half the indices ``np.bincount`` widens to int64: a 512 x 512 x 300 label in 0.17 s instead of 0.33 s
    (best of 3, one thread, a 2-core machine)."""
    pairs = flat[: flat.size - flat.size % 2].view(np.uint16)
    joint = np.zeros(1 << 16, np.int64)
    for start in range(0, pairs.size, 1 << 20):
        joint += np.bincount(pairs[start : start + (1 << 20)], minlength=1 << 16)
    square = joint.reshape(256, 256)  # [a, b]: the pairs whose uint16 is a * 256 + b, in either byte order
    counts = square.sum(axis=0) + square.sum(axis=1)
    if flat.size % 2:
        counts[int(flat[-1])] += 1
    ids = np.flatnonzero(counts)
    return ids.astype(np.int64), counts[ids]


def c_order(array: np.ndarray, dtype: DTypeLike | None = None) -> np.ndarray:
    """``array`` as a C-contiguous array of ``dtype`` (default its own); ``array`` itself when it is one already.

    nibabel decodes NIfTI voxels in the file's Fortran order (x fastest). Copying such a volume to C order
    element by element in C order (``np.ascontiguousarray``, or torch's ``.contiguous()``, which MONAI's
    resampling calls) reads it with a stride of one whole slice: for a 512 x 512 x 300 CT, a memory page per voxel,
    1.35-1.45 s for the float32 volume (best of 3, one thread, a 2-core machine). Copied in slabs of 8 along the
    last axis, the same copy touches a few hundred pages per row at a time: 0.39 s (0.39 s too for a uint8 label
    made float32, 0.89 s with ``np.ascontiguousarray``), the result identical. Arrays whose last axis is already
    the fastest (C order, sliced or not) are copied by ``np.ascontiguousarray``.
    """
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    if array.flags.c_contiguous or array.ndim < 3 or abs(array.strides[-1]) <= array.itemsize:
        return np.ascontiguousarray(array, dtype=dtype)
    out = np.empty(array.shape, dtype=dtype)
    for start in range(0, array.shape[-1], 8):
        out[..., start : start + 8] = array[..., start : start + 8]
    return out


class LazySequence:
    """Array-like indexing for samples produced one at a time (subclasses give ``__len__`` and ``_one``):
    an integer (negative counts from the end) gives one sample, a slice a stacked array when the shapes
    agree (else a list), iteration yields every sample."""

    def __len__(self) -> int:
        raise NotImplementedError

    def _one(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            items = [self._one(i) for i in range(*index.indices(len(self)))]
            if items and all(a.shape == items[0].shape for a in items):
                return np.stack(items)
            return items
        if isinstance(index, (int, np.integer)):
            i = int(index)
            if i < 0:
                i += len(self)
            if not 0 <= i < len(self):
                raise IndexError(index)
            return self._one(i)
        raise TypeError(f"lazy splits take an integer or a slice, not {type(index).__name__}")

    def __iter__(self):
        for i in range(len(self)):
            yield self._one(i)


class CropReader(Protocol):
    """What a lazy split offers training patches (``split.images.crop_reader``; :mod:`jascl.data.real`): reads
    of a box of one sample, and where the sample shows given classes, without reading the whole sample.

    Conventions as :class:`Split`'s: image (C, *spatial) float32, label (*spatial) uint8 global ids.
    """

    def spatial_shape(self, index: int) -> tuple[int, ...]:
        """Spatial size of sample ``index``."""
        ...

    def read_box(
        self,
        index: int,
        starts: Sequence[int],
        size: Sequence[int],
        label_fn: Callable[[np.ndarray], np.ndarray] | None = None,
        flip: Sequence[int] = (),
        out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Crop ``starts`` .. ``starts + size`` (starts may be negative, the end past the sample: padded with
        image 0, label 255); ``label_fn``, a value map, maps the global label inside the sample before padding;
        the padded crop is reversed along the spatial axes ``flip``. Both arrays C-contiguous, written into
        ``out`` (image, label) when given."""
        ...

    def foreground(self, index: int, classes: Iterable[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(voxel counts (K,), (n_k, D) voxel coordinates each) of the parts of sample ``index`` showing
        ``classes``."""
        ...


@dataclass
class Split:
    """One split of a session.

    Attributes:
        images: (N, C, *spatial) float32 intensities.
        labels: (N, *spatial) uint8 full ground truth in global class ids (0 = background).
        ids: stable sample ids (used in K-shot manifests).
    """

    images: np.ndarray
    labels: np.ndarray
    ids: list[str]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class DetectionSplit:
    """One split of a detection session (protocols with ``task: detection``).

    Attributes:
        images: one (C, H, W) float32 array per sample (sizes may differ between samples), or an
            (N, C, H, W) array when they agree.
        targets: per sample ``{"boxes": (M, 4) float32 [x1, y1, x2, y2] in pixels, "labels": (M,) int64
            global class ids}``: every box of the image (the session's loader keeps those of the classes it
            teaches). An unlabelled pool's targets are its hidden ground truth, used only to measure
            pseudo-label quality, or empty. Test and validation targets of datasets may add ``"iscrowd": (M,) int64``:
            1 marks an ignore region (a crowd box, or a box of a class that domain does not teach), neither rewarded
            nor penalised by mAP.
        ids: stable sample ids (K-shot manifests).
    """

    images: Sequence[np.ndarray] | np.ndarray
    targets: list[dict[str, np.ndarray]]
    ids: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def dense(split: Split | DetectionSplit) -> Split:
    """``split`` as a segmentation split (dense labels); a detection split is a TypeError naming the fix."""
    if isinstance(split, DetectionSplit):
        raise TypeError("this needs dense labels (a segmentation protocol); the split holds boxes (task: detection)")
    return split


@dataclass
class SessionData:
    """The data of one session: labelled ``train``, ``test``, an optional ``unlabelled`` pool and optional
    labelled ``validation`` samples (``SessionSpec.validation`` per class; model selection only, never trained on)."""

    session: SessionSpec
    train: Split | DetectionSplit
    test: Split | DetectionSplit
    unlabelled: Split | DetectionSplit | None = None
    validation: Split | DetectionSplit | None = None
