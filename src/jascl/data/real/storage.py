"""Lazy splits: samples read from the preprocessed store (:mod:`jascl.data.real.store`; preprocessed on first access
when ``jascl data prepare`` has not), never all held in memory, whole or by crops; ground truth mapped to global
class ids per session."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.cache import cache_key
from jascl.data.real.selection import split_ref
from jascl.data.real.sources import PREPROCESS_VERSIONS, DatasetSource
from jascl.data.real.store import STORE_VERSION, Entry, entry_dir, open_entry, write_entry
from jascl.data.types import LazySequence, Split, ValueTable, compact_dtype
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

    byte_table: list[ValueTable] = []  # all 256 ids' values, built at the first uint8 label

    def apply(label: np.ndarray) -> np.ndarray:
        label = np.asarray(label)
        if label.size == 0:
            return label.astype(np.uint8)
        if label.dtype == np.uint8:  # the store's labels, as a rule: two voxels per lookup
            if not byte_table:
                byte_table.append(ValueTable(np.fromiter((value_of(v) for v in range(256)), np.uint8, count=256)))
            return byte_table[0](label)
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
    """Reads preprocessed samples of the opened sources from the store, preprocessing a sample on first access.

    Entries (:mod:`jascl.data.real.store`, under ``<cache>/real/store/``) hold the preprocessed image, the
    *native* label and its foreground index, keyed by the files' paths, sizes and times, the layout and its
    options, the preprocessing options and the store version; label maps are applied on access (they depend
    on the session). ``jascl data prepare`` fills the store in parallel beforehand; a run fills what is missing.
    Whole samples (evaluation, prototypes) are read with :meth:`load` (two kept in memory), training crops
    with :meth:`entry` and :meth:`~jascl.data.real.store.Entry.read_box`.
    """

    def __init__(self, protocol: Protocol, sources: Mapping[str, DatasetSource], cache_dir: Path) -> None:
        self.protocol = protocol
        self.sources = sources
        self.cache_dir = cache_dir
        self._memo: OrderedDict[str, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()
        self._entries: dict[str, Entry] = {}

    def preprocess(self, source: DatasetSource, sample: Any) -> tuple[np.ndarray, np.ndarray | None]:
        options = dict(source.spec.preprocess)
        if self.protocol.spatial_dims == 3:
            from jascl.data.medical import preprocess_volume

            return preprocess_volume(sample, options)
        from jascl.data.natural import preprocess_image

        return preprocess_image(sample, options)

    def entry_path(self, ref: str) -> Path:
        """The store folder of sample ``ref`` for the files as they are now (see the class docstring)."""
        d, rid = split_ref(ref)
        source = self.sources[d]
        key = [
            PREPROCESS_VERSIONS[self.protocol.spatial_dims],
            STORE_VERSION,
            source.spec.layout,
            list(source.records[rid].files),
            dict(source.spec.options),
            dict(source.spec.preprocess),
            self.protocol.spatial_dims,
        ]
        return entry_dir(self.cache_dir, cache_key(key))

    def build(self, ref: str) -> tuple[Path, Any]:
        """Decode, check and preprocess sample ``ref`` and write its store entry.

        Returns:
            (the entry folder, the decoded :class:`~jascl.data.layouts.base.Sample`).

        Raises:
            DataError: an unreadable file, bad values, or preprocessing that made non-finite values.
        """
        d, rid = split_ref(ref)
        source = self.sources[d]
        record = source.records[rid]
        path = self.entry_path(ref)
        sample = source.layout.read(record)
        check_sample_values(record, sample.image)  # once per file version: the result is stored below
        image, label = self.preprocess(source, sample)
        if not np.isfinite(image).all():
            raise DataError(
                f"{record.images[0]}: preprocessing made non-finite values (e.g. a z-score of a constant channel "
                f"or a resampling of an empty volume); check the sample with 'jascl data check' or change "
                f"datasets.{d}.preprocess"
            )
        image = np.ascontiguousarray(image, dtype=np.float32)
        label = None if label is None else np.ascontiguousarray(label, dtype=compact_dtype(label))
        made_from = {
            "sample": ref,
            "layout": source.spec.layout,
            "files": [str(f) for f in record.files],
            "options": dict(source.spec.options),
            "preprocess": dict(source.spec.preprocess),
            "preprocess_version": PREPROCESS_VERSIONS[self.protocol.spatial_dims],
        }
        write_entry(path, image, label, made_from)
        return path, sample

    def entry(self, ref: str) -> Entry:
        """The store entry of sample ``ref``, built first if missing (kept open for the store's lifetime)."""
        if ref in self._entries:
            return self._entries[ref]
        path = self.entry_path(ref)
        found = open_entry(path)
        if found is None:
            self.build(ref)
            found = open_entry(path)
            if found is None:
                raise DataError(f"{path}: store entry unreadable right after writing it; check the disk of the cache")
        d, rid = split_ref(ref)
        shape = found.image_shape
        if len(shape) != self.protocol.spatial_dims + 1 or shape[0] != self.protocol.in_channels:
            raise DataError(
                f"{self.sources[d].records[rid].images[0]}: preprocessed image has shape {shape}, protocol "
                f"{self.protocol.name} expects {self.protocol.in_channels} channel(s) and "
                f"{self.protocol.spatial_dims} spatial dims; fix in_channels or the layout options"
            )
        self._entries[ref] = found
        return found

    def load(self, ref: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(image (C, *spatial) float32, native label (*spatial) int or None) of sample ``ref``, whole."""
        if ref in self._memo:
            self._memo.move_to_end(ref)
            return self._memo[ref]
        item = self.entry(ref).read()
        self._memo[ref] = item
        while len(self._memo) > 2:
            self._memo.popitem(last=False)
        return item


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
        self._tables: dict[tuple, ValueTable] = {}

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
        if self.crop is not None:  # a random crop, read from the store without reading the whole sample
            starts = crop_starts(self.spatial_shape(index), self.crop, self.rng)
            return self.read_box(index, starts, self.crop)
        ref = self.refs[index]
        image, native = self.store.load(ref)
        if native is None:
            label = np.full(image.shape[1:], IGNORE_INDEX, dtype=np.uint8)  # no ground truth at all
        else:
            label = self.luts[split_ref(ref)[0]](native)
        return image, label

    # --- crop reads (jascl.data.types.CropReader): what training patches are read with

    def spatial_shape(self, index: int) -> tuple[int, ...]:
        """Spatial size of sample ``index`` (from its store entry's header)."""
        return self.store.entry(self.refs[index]).spatial

    def read_box(
        self,
        index: int,
        starts: Sequence[int],
        size: Sequence[int],
        label_fn: Callable[[np.ndarray], np.ndarray] | None = None,
        flip: Sequence[int] = (),
        out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The crop ``starts`` .. ``starts + size`` of sample ``index``, equal to the same crop of the whole sample
        (``images[index]``, ``labels[index]``) padded with image 0 and label 255, then reversed along the spatial
        axes ``flip`` (the training flips, done in the same copy).

        Only the crop is read from the store, and the session's label map (then ``label_fn``, e.g. the
        training-label policy) is applied to the crop's voxels inside the volume; padding stays 255. ``out``:
        C-contiguous (image, label) arrays of those shapes and dtypes to write into (then returned).

        Returns:
            image (C, *size) float32, label (*size) uint8 global ids, both C-contiguous.
        """
        ref = self.refs[index]
        entry = self.store.entry(ref)
        image, label = entry.read_box(starts, size, self._label_map(split_ref(ref)[0], entry, label_fn), flip, out)
        if label is None:  # no ground truth at all
            if out is None:
                label = np.full(tuple(int(s) for s in size), IGNORE_INDEX, dtype=np.uint8)
            else:
                label = out[1]
                label.fill(IGNORE_INDEX)
        return image, label

    def _label_map(
        self, dataset: str, entry: Entry, label_fn: Callable[[np.ndarray], np.ndarray] | None
    ) -> Callable[[np.ndarray], np.ndarray]:
        """The session's label map of ``dataset`` followed by ``label_fn`` (a value map), as one table lookup
        over the native ids the entry holds when they are small non-negative integers (one pass over the crop):
        a :class:`jascl.data.types.ValueTable` of all 256 ids for a uint8 label (looked up two voxels at a
        time), else of the ids up to the entry's largest."""
        lut = self.luts[dataset]
        natives = entry.natives
        if not len(natives) or int(natives[0]) < 0 or int(natives[-1]) >= 1 << 16:
            return lut if label_fn is None else (lambda native: label_fn(lut(native)))
        size = 256 if np.dtype(entry.layouts["label.npy"][1]) == np.uint8 else int(natives[-1]) + 1
        key = (dataset, label_fn, size)
        table = self._tables.get(key)
        if table is None:
            values = lut(np.arange(size))
            table = ValueTable(values if label_fn is None else label_fn(values))
            self._tables[key] = table
        return table

    def foreground(self, index: int, classes: Iterable[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Where sample ``index`` shows ``classes`` (global ids), from its store entry's foreground index.

        Returns:
            (counts (K,) voxels of each native id mapped to one of ``classes`` in this session, and per id
            its indexed (n_k, D) voxel coordinates, memory-mapped); empty when the sample shows none of them.
        """
        ref = self.refs[index]
        entry = self.store.entry(ref)
        wanted = sorted({int(c) for c in classes} - {0, IGNORE_INDEX})
        if not entry.has_label or not len(entry.natives) or not wanted:
            return np.zeros(0, np.int64), []
        mapped = self.luts[split_ref(ref)[0]](entry.natives)
        keep = np.flatnonzero(np.isin(mapped, wanted))
        return entry.counts[keep], entry.coords([int(k) for k in keep])


def crop_starts(shape: Sequence[int], size: Sequence[int], rng: np.random.Generator) -> list[int]:
    """First voxel per axis of a uniformly placed crop of ``size`` in a sample of spatial ``shape``.

    Where the sample is smaller it is padded symmetrically first (``p // 2`` before), so a start can be
    negative: the draws and the result are those of :func:`random_crop` on the whole sample.
    """
    pad = [max(0, s - n) for s, n in zip(size, shape)]
    return [int(rng.integers(0, n + p - s + 1)) - p // 2 for s, n, p in zip(size, shape, pad)]


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

    @property
    def crop_reader(self) -> SplitBackend | None:
        """What training patches are read with (:class:`jascl.data.types.CropReader`); None for a split that is
        served as random crops already (unlabelled pools)."""
        return self.backend if self.backend.crop is None else None

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
