"""Lazy splits: samples decoded, preprocessed and cached on disk on first access, never all held in memory; ground
truth mapped to global class ids per session."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.cache import cached
from jascl.data.real.selection import split_ref
from jascl.data.real.sources import PREPROCESS_VERSION, DatasetSource
from jascl.data.types import LazySequence, Split
from jascl.errors import DataError
from jascl.protocols.schema import IGNORE_INDEX, Protocol


def label_lut(protocol: Protocol, source: DatasetSource, session: int) -> Callable[[np.ndarray], np.ndarray]:
    """Native -> global label mapping of ``source`` samples in session ``session`` (see the module docstring)."""
    taught = protocol.taught_from(source.name, session)
    unmapped = 0 if source.spec.unmapped == "background" else IGNORE_INDEX
    values: dict[int, int] = {}
    for native, g in source.native.items():
        values[native] = g if g in (0, IGNORE_INDEX) or g in taught else IGNORE_INDEX
    known = source.known

    def value_of(v: int) -> int:
        if v in values:
            return values[v]
        if known is not None and v not in known:
            return IGNORE_INDEX
        return unmapped

    def apply(label: np.ndarray) -> np.ndarray:
        label = np.asarray(label)
        if label.size == 0:
            return label.astype(np.uint8)
        lo, hi = int(label.min()), int(label.max())
        if lo >= 0 and hi < 1 << 16:
            table = np.fromiter((value_of(v) for v in range(hi + 1)), dtype=np.uint8, count=hi + 1)
            return table[label]
        uniq, inverse = np.unique(label, return_inverse=True)
        return np.array([value_of(int(v)) for v in uniq], dtype=np.uint8)[inverse].reshape(label.shape)

    return apply


def no_labels(label: np.ndarray) -> np.ndarray:
    """The label map of a borrowed unlabelled sample (``unlabelled_sources``): every pixel 255, images only."""
    return np.full(np.shape(label), IGNORE_INDEX, dtype=np.uint8)


class SampleStore:
    """Decodes, preprocesses and caches samples of the opened sources (one decoded sample kept in memory).

    Cache entries (``jascl.data.cache`` under ``<cache>/real/samples/``) hold the preprocessed
    image and *native* label, keyed by the files' paths, sizes and times, the layout options
    and the preprocessing options; label maps are applied on access (they depend on the session).
    """

    def __init__(self, protocol: Protocol, sources: Mapping[str, DatasetSource], cache_dir: Path) -> None:
        self.protocol = protocol
        self.sources = sources
        self.cache_dir = cache_dir
        self._memo: OrderedDict[str, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()

    def preprocess(self, source: DatasetSource, sample: Any) -> tuple[np.ndarray, np.ndarray | None]:
        options = dict(source.spec.preprocess)
        if self.protocol.spatial_dims == 3:
            from jascl.data.medical import preprocess_volume

            return preprocess_volume(sample, options)
        from jascl.data.natural import preprocess_image

        return preprocess_image(sample, options)

    def load(self, ref: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(image (C, *spatial) float32, native label (*spatial) int or None) of sample ``ref``."""
        if ref in self._memo:
            self._memo.move_to_end(ref)
            return self._memo[ref]
        d, rid = split_ref(ref)
        source = self.sources[d]
        record = source.records[rid]

        def compute() -> tuple[np.ndarray, np.ndarray | None]:
            sample = source.layout.read(record)
            check_sample_values(record, sample.image)  # once per file version: the result is cached below
            image, label = self.preprocess(source, sample)
            if not np.isfinite(image).all():
                raise DataError(
                    f"{record.images[0]}: preprocessing made non-finite values (e.g. a z-score of a constant channel "
                    f"or a resampling of an empty volume); check the sample with 'jascl data check' or change "
                    f"datasets.{d}.preprocess"
                )
            return (
                np.ascontiguousarray(image, dtype=np.float32),
                None if label is None else np.ascontiguousarray(label, dtype=compact_dtype(label)),
            )

        # keyed by the files (paths, sizes, times), the layout and its options and the preprocessing
        key = [
            PREPROCESS_VERSION,
            source.spec.layout,
            list(record.files),
            dict(source.spec.options),
            dict(source.spec.preprocess),
            self.protocol.spatial_dims,
        ]
        image, label = cached(key, compute, self.cache_dir / "real" / "samples")
        item = (image, label)
        if item[0].ndim != self.protocol.spatial_dims + 1 or item[0].shape[0] != self.protocol.in_channels:
            raise DataError(
                f"{record.images[0]}: preprocessed image has shape {tuple(item[0].shape)}, protocol "
                f"{self.protocol.name} expects {self.protocol.in_channels} channel(s) and "
                f"{self.protocol.spatial_dims} spatial dims; fix in_channels or the layout options"
            )
        self._memo[ref] = item
        while len(self._memo) > 2:
            self._memo.popitem(last=False)
        return item


def compact_dtype(label: np.ndarray) -> np.dtype:
    """The smallest dtype holding a native label map: uint8 for ids 0-255 (every dataset jascl reads so far),
    uint16, else int32. The cached label is read back for every training patch, so a 274 x 274 x 300 CT
    label is 22 MiB instead of 90; entries cached as int32 by earlier versions hold the same values and stay
    valid."""
    label = np.asarray(label)
    if label.size == 0:
        return np.dtype(np.uint8)
    lo, hi = int(label.min()), int(label.max())
    if lo >= 0 and hi < 1 << 8:
        return np.dtype(np.uint8)
    if lo >= 0 and hi < 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def check_sample_values(record: Any, image: np.ndarray) -> None:
    """Refuse a decoded sample whose values break training, with ``jascl data check``'s line for its file.

    Args:
        record: the sample's :class:`~jascl.data.layouts.base.Record` (its files name the line).
        image: (C, *spatial) decoded values; channel c comes from ``record.images[c]`` when there is one
            file per channel, else all from ``record.images[0]``.

    Raises:
        DataError: non-finite values or a constant channel (:func:`~jascl.data.layouts.base.image_value_problems`).
    """
    from jascl.data.layouts.base import image_value_problems

    image = np.asarray(image)
    files = list(record.images)
    per_file = len(files) == image.shape[0] and len(files) > 1
    for c in range(image.shape[0]):
        path = files[c] if per_file else files[0]
        what = f"image channel {c}" if image.shape[0] > 1 and not per_file else "image"
        problems = image_value_problems(path, image[c], what)
        if problems:
            raise DataError(f"{problems[0]} (found while loading it for training; 'jascl data check' lists all)")


class SplitBackend:
    """The samples of one split: loads (image, global label) pairs on demand.

    Args:
        store: the shared sample store.
        refs: sample ids ``<dataset>/<record id>``.
        luts: dataset name -> native-to-global mapping of this session.
        crop: if given, every access returns a random crop of this size (zero / ignore
            padded where the sample is smaller), drawn from a seeded stream: unlabelled
            pools are served this way so variable-size volumes batch together.
        seed: seed of the crop stream.
    """

    def __init__(
        self,
        store: SampleStore,
        refs: Sequence[str],
        luts: Mapping[str, Callable],
        crop: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        self.store = store
        self.refs = list(refs)
        self.luts = luts
        self.crop = tuple(int(c) for c in crop) if crop is not None else None
        self.rng = np.random.default_rng([seed, 31337])

        self._last: tuple[int, tuple[np.ndarray, np.ndarray], set[str]] | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def get(self, index: int, part: str) -> tuple[np.ndarray, np.ndarray]:
        """The (image, label) pair of sample ``index``.

        ``split.images[i]`` then ``split.labels[i]`` (how datasets read a pair) get the
        same pair, hence the same random crop; the next read of either part draws anew.
        """
        if self._last is not None and self._last[0] == index and part not in self._last[2]:
            self._last[2].add(part)
            return self._last[1]
        pair = self._load(index)
        self._last = (index, pair, {part})
        return pair

    def _load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        ref = self.refs[index]
        image, native = self.store.load(ref)
        spatial = image.shape[1:]
        if native is None:
            label = np.full(spatial, IGNORE_INDEX, dtype=np.uint8)  # no ground truth at all
        else:
            label = self.luts[split_ref(ref)[0]](native)
        if self.crop is not None:
            image, label = random_crop(image, label, self.crop, self.rng)
        return image, label


def random_crop(
    image: np.ndarray, label: np.ndarray, size: Sequence[int], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A uniformly placed crop of ``size``; image padded with 0 and label with 255 where smaller.

    Shapes: image (C, *spatial), label (*spatial) -> (C, *size), (*size).
    """
    pad = [max(0, s - n) for s, n in zip(size, label.shape)]
    if any(pad):
        widths = [(p // 2, p - p // 2) for p in pad]
        image = np.pad(image, [(0, 0), *widths])
        label = np.pad(label, widths, constant_values=IGNORE_INDEX)
    starts = [int(rng.integers(0, n - s + 1)) for s, n in zip(size, label.shape)]
    box = tuple(slice(a, a + s) for a, s in zip(starts, size))
    return np.ascontiguousarray(image[(slice(None),) + tuple(box)]), np.ascontiguousarray(label[box])


class LazySamples(LazySequence):
    """Array-like view of a split's images (``part="image"``) or labels (``part="label"``).

    See the module docstring for what it supports (indexing, slicing, ``ndim``, ``shape``).
    """

    def __init__(
        self,
        backend: SplitBackend,
        part: str,
        spatial_dims: int,
        channels: int,
        uniform_shape: Sequence[int] | None = None,
    ) -> None:
        self.backend = backend
        self.part = part
        self.ndim = spatial_dims + (2 if part == "image" else 1)
        if backend.crop is not None:
            uniform_shape = backend.crop
        self.uniform = uniform_shape is not None
        spatial = tuple(uniform_shape) if uniform_shape is not None else (None,) * spatial_dims
        self.shape = (len(backend), channels, *spatial) if part == "image" else (len(backend), *spatial)
        self.dtype = np.dtype(np.float32 if part == "image" else np.uint8)

    def __len__(self) -> int:
        return len(self.backend)

    def _one(self, index: int) -> np.ndarray:
        image, label = self.backend.get(index, self.part)
        return image if self.part == "image" else label

    def __array__(self, dtype=None):
        raise TypeError("a lazy split is not held in memory as one array; index it sample by sample")


def lazy_split(
    store: SampleStore,
    refs: Sequence[str],
    luts: Mapping[str, Callable],
    protocol: Protocol,
    crop: Sequence[int] | None = None,
    seed: int = 0,
) -> Split:
    backend = SplitBackend(store, refs, luts, crop, seed)
    args = (protocol.spatial_dims, protocol.in_channels)
    return Split(LazySamples(backend, "image", *args), LazySamples(backend, "label", *args), list(refs))
