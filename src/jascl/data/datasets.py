"""Torch datasets over session splits, with the protocol's training-label policy."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from monai.data import get_track_meta, set_track_meta
from monai.transforms import Compose, MapTransform, RandFlipd, Randomizable, RandSpatialCropd, SpatialPadd
from monai.utils import MAX_SEED
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from jascl.data.batch_memory import BatchSlots, batch_bytes, batch_views, leased_batch, remember_lease, take_lease
from jascl.data.sampling import SeededBatchSampler, derive_seed, split_key
from jascl.data.types import CropReader, Split
from jascl.protocols.schema import IGNORE_INDEX

#: share of training crops of lazy (real-data) splits centred on a taught foreground voxel;
#: the rest are placed uniformly (as nnU-Net oversamples foreground for small structures)
FOREGROUND_CROP_PROB = 0.5


def loader_position(loader: DataLoader) -> dict:
    """Where ``loader``'s next pass starts: its seeded sampler's pass count and its own generator's state.

    Together with the batches taken from a pass, this locates a loader exactly
    (:class:`jascl.data.sampling.SeededBatchSampler` draws from ``(seed, pass)``; a
    plain shuffling loader draws from its ``generator``).
    """
    sampler = loader.batch_sampler
    return {
        "passes": sampler.passes if isinstance(sampler, SeededBatchSampler) else None,
        "generator": loader.generator.get_state() if loader.generator is not None else None,
    }


def set_loader_position(loader: DataLoader, position: dict) -> None:
    """Inverse of :func:`loader_position`."""
    if position.get("passes") is not None:
        loader.batch_sampler.passes = int(position["passes"])
    if position.get("generator") is not None and loader.generator is not None:
        loader.generator.set_state(position["generator"])


def open_pass(loader: DataLoader, skip: int = 0) -> Iterator[dict]:
    """An iterator over one pass of ``loader``, without its first ``skip`` batches.

    Every pass of a loader without its own ``generator`` takes exactly one draw
    from the global random generator, the one a fresh DataLoader iterator takes
    for its workers' base seed, whatever the worker setting: a DataLoader with persistent workers reuses its iterator and
    would otherwise draw on its first pass only, and every later random draw of
    the run (GAS noise, dropout) would depend on ``num_workers``.

    ``skip > 0`` re-opens a pass that was opened, and ``skip`` batches taken from,
    before an in-session checkpoint: its draw is already in the checkpoint's
    random state, so none is taken. A seeded sampler leaves the skipped batches
    out without loading them; any other loader loads and drops them (its sampler
    must draw from the loader's own ``generator``).
    """
    sampler = loader.batch_sampler
    seeded = isinstance(sampler, SeededBatchSampler)
    if seeded and skip > 0:
        sampler.skip = skip
    with torch.random.fork_rng(devices=[]):
        it = iter(loader)
        if skip > 0 and not seeded:
            for _ in itertools.islice(it, skip):
                pass
    if skip <= 0 and loader.generator is None:  # (a loader's own generator is not the global one: left as it is)
        torch.empty((), dtype=torch.int64).random_()
    return it


def iterate_steps(loader: DataLoader, n_steps: int, start: int = 0) -> Iterator[dict]:
    """``n_steps`` batches from ``loader``: whole passes first, each run to exhaustion, then a partial pass.

    Running every whole pass to its end keeps the sampler's random stream the
    same as a plain ``for batch in loader`` epoch, so an epoch of exactly
    ``len(loader)`` steps is bit-identical to one.

    ``start``: resume an epoch after its first ``start`` steps (a seeded loader, set
    back to its position at the epoch's start with :func:`set_loader_position`):
    yields exactly the batches an uninterrupted epoch yields from step ``start`` on.
    """
    length = max(len(loader), 1)
    full, rest = divmod(n_steps, length)
    done, offset = divmod(start, length)
    if start:
        if not isinstance(loader.batch_sampler, SeededBatchSampler):
            raise ValueError("resuming inside an epoch needs a loader with a SeededBatchSampler")
        loader.batch_sampler.passes += done
    for p in range(done, full):
        yield from open_pass(loader, offset if p == done else 0)
    if rest and done <= full:
        skip = offset if done == full else 0
        yield from itertools.islice(open_pass(loader, skip), rest - skip)


class BatchStream:
    """Endless batches from ``loader``, pass after pass (a fresh shuffle and augmentation each pass).

    Its position (where the current pass started, how many of its batches were
    taken) is part of a plugin's in-session checkpoint (:meth:`state_dict`), so a
    session resumed inside an epoch draws the very batches it would have drawn.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self._it: Iterator | None = None
        self._start: dict | None = None
        self._taken = 0
        self._resume: tuple[dict, int] | None = None

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> dict:
        for _ in range(2):  # the current pass may be exhausted: then one fresh pass
            if self._it is None:
                skip = 0
                if self._resume is not None:
                    position, skip = self._resume
                    self._resume = None
                    set_loader_position(self.loader, position)
                self._start = loader_position(self.loader)
                self._it = open_pass(self.loader, skip)
                self._taken = skip
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                continue
            self._taken += 1
            return batch
        raise RuntimeError("the loader yields no batches")

    def state_dict(self) -> dict:
        """The position: ``open`` (a pass is under way), its start ``position`` and the batches ``taken``."""
        if self._resume is not None:
            position, taken = self._resume
        elif self._it is not None:
            position, taken = self._start, self._taken
        else:
            return {"open": False}
        return {"open": True, "position": position, "taken": taken}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s position (applied when the next batch is drawn)."""
        self._it = None
        self._resume = (state["position"], int(state["taken"])) if state["open"] else None


def training_labels(labels: np.ndarray, taught: Sequence[int], other_classes: str = "background") -> np.ndarray:
    """Hide classes not taught in the session.

    Every value other than 0 and the taught classes (255 included) becomes the fill value.

    Args:
        labels: (*spatial) full ground truth in global ids.
        taught: foreground classes labelled in this session.
        other_classes: "background" -> untaught classes become 0 (the authors'
            convention); "ignore" -> they become 255 and are excluded from the loss.

    Returns:
        (*spatial) uint8 (global ids and 255 fit; losses widen the batch to int64 on their device). One
        table lookup per voxel: on a 274 x 274 x 300 CT label this is about 10x faster than a membership
        test, and it runs once per training item on the whole volume.
    """
    labels = np.asarray(labels)
    fill = 0 if other_classes == "background" else IGNORE_INDEX
    keep = sorted({0, *(int(c) for c in taught)})
    if labels.dtype == np.uint8:
        size = 256
    elif labels.dtype.kind in "iu" and labels.size and int(labels.min()) >= 0 and int(labels.max()) < 1 << 16:
        size = int(labels.max()) + 1
    else:  # negative or very large ids (not produced by jascl's loaders): a membership test
        return np.where(np.isin(labels, keep), labels, fill).astype(np.uint8)
    table = np.full(size, fill, dtype=np.uint8)
    inside = [c for c in keep if c < size]
    table[inside] = inside
    return table[labels]


@contextlib.contextmanager
def plain_tensors() -> Iterator[None]:
    """MONAI transforms inside return plain tensors: no ``MetaTensor`` (affine, applied-operations list) is built.

    The arrays are the same (the metadata is never read here), at about 40 % of the cost per training item of
    64 x 64 images (the metadata's copying was most of it). MONAI's switch is process-wide; it is restored on exit.
    """
    previous = get_track_meta()
    set_track_meta(False)
    try:
        yield
    finally:
        set_track_meta(previous)


def reseed(transform: Randomizable, seed: int) -> None:
    """``transform.set_random_state(seed=seed)``, draw for draw, reusing the random states it already holds.

    MONAI builds a new ``np.random.RandomState`` for a Compose and each of its random transforms at every call
    (about 0.13 ms each, against 2 us to reseed one); with a sample's seed set once per item this was 6.3 s of
    the 15.7 s the main job's training loader took (cProfile, one thread). A state built from ``s`` and one reseeded with ``s`` are the same state,
    so the draws do not change. Transforms that override ``set_random_state`` (e.g. ``RandSpatialCropd``,
    which seeds an inner cropper) keep their own.
    """
    if isinstance(transform, Compose) and type(transform).set_random_state is Compose.set_random_state:
        _reseed_own(transform, seed)
        for child in transform.transforms:
            if isinstance(child, Randomizable):
                reseed(child, int(transform.R.randint(MAX_SEED, dtype="uint32")))
    elif type(transform).set_random_state is Randomizable.set_random_state or type(transform) in _OWN_STATE_ONLY:
        _reseed_own(transform, seed)
    else:
        transform.set_random_state(seed=seed)


#: MONAI transforms whose ``set_random_state`` override only seeds their own state (tests/test_reseed.py checks
#: the draws against MONAI's own seeding)
_OWN_STATE_ONLY = (RandFlipd,)


def _reseed_own(transform: Randomizable, seed: int) -> None:
    own = transform.__dict__.get("R")  # not the class attribute every MONAI transform shares until seeded
    if isinstance(own, np.random.RandomState):
        own.seed(int(seed) % MAX_SEED)
    else:
        transform.set_random_state(seed=seed)


class RandForegroundCropd(Randomizable, MapTransform):
    """Crop ``roi_size`` centred, with probability ``fg_prob``, on a random voxel of a taught
    class (label not 0 / 255), otherwise placed uniformly; inputs at least ``roi_size`` large.

    Shapes: image (C, *spatial), label (1, *spatial) -> (C, *roi_size), (1, *roi_size).
    """

    def __init__(self, keys: Sequence[str], label_key: str, roi_size: Sequence[int], fg_prob: float) -> None:
        MapTransform.__init__(self, keys)
        self.label_key = label_key
        self.roi_size = [int(r) for r in roi_size]
        self.fg_prob = fg_prob

    def randomize(self, label: torch.Tensor) -> tuple[slice, ...]:
        spatial = label.shape[1:]
        centre = None
        if self.R.random_sample() < self.fg_prob:
            fg = torch.nonzero((label[0] != 0) & (label[0] != IGNORE_INDEX))
            if len(fg):
                centre = [int(v) for v in fg[int(self.R.randint(len(fg)))]]
        if centre is None:
            starts = [int(self.R.randint(n - r + 1)) for n, r in zip(spatial, self.roi_size)]
        else:
            starts = [min(max(c - r // 2, 0), n - r) for c, n, r in zip(centre, spatial, self.roi_size)]
        return tuple(slice(a, a + r) for a, r in zip(starts, self.roi_size))

    def __call__(self, data: dict) -> dict:
        d = dict(data)
        box = self.randomize(torch.as_tensor(d[self.label_key]))
        for key in self.key_iterator(d):
            d[key] = d[key][(slice(None),) + tuple(box)]
        return d


class RandStoreCrop(Randomizable):
    """A ``roi_size`` training patch of one sample of a lazy split, read from its crop reader, and its flips.

    The placement is :class:`RandForegroundCropd`'s on the sample padded (symmetrically, image 0, label 255)
    to at least ``roi_size``: with probability ``fg_prob`` centred on a random voxel of a taught class, else
    uniform. The centre comes from the store's foreground index (a class drawn in proportion to its voxel
    count, then one of its indexed voxels: uniform over the class's voxels, as before, without a scan of
    the volume), and only the patch is read. The label is the training label (:func:`training_labels`).
    With ``flip``, each spatial axis is flipped with probability 1/2 (as ``RandFlipd`` per axis): the crop is
    written flipped as it is read, so each array is copied once.

    Shapes: ``self(index)`` -> image (C, *roi_size) float32, label (*roi_size) uint8, both C-contiguous.
    """

    def __init__(
        self,
        reader: CropReader,
        roi_size: Sequence[int],
        fg_prob: float,
        taught: Sequence[int],
        other_classes: str = "background",
        flip: bool = False,
    ) -> None:
        self.reader = reader
        self.roi_size = [int(r) for r in roi_size]
        self.fg_prob = fg_prob
        self.taught = [int(c) for c in taught]
        self.flip = flip
        self.label_fn = functools.partial(training_labels, taught=self.taught, other_classes=other_classes)

    def randomize(self, index: int) -> list[int]:
        """First voxel per axis of the patch, in the sample's coordinates (negative where it is padded)."""
        spatial = self.reader.spatial_shape(index)
        pad = [max(0, r - n) for n, r in zip(spatial, self.roi_size)]
        padded = [n + p for n, p in zip(spatial, pad)]
        centre = None
        if self.R.random_sample() < self.fg_prob:
            counts, coords = self.reader.foreground(index, self.taught)
            if len(counts):
                k = int(self.R.choice(len(counts), p=counts / counts.sum()))
                voxel = coords[k][int(self.R.randint(len(coords[k])))]
                centre = [int(v) + p // 2 for v, p in zip(voxel, pad)]
        if centre is None:
            starts = [int(self.R.randint(n - r + 1)) for n, r in zip(padded, self.roi_size)]
        else:
            starts = [min(max(c - r // 2, 0), n - r) for c, n, r in zip(centre, padded, self.roi_size)]
        return [a - p // 2 for a, p in zip(starts, pad)]

    def __call__(self, index: int, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The patch of sample ``index``, written into ``out`` (image, label) when given (a batch's slot)."""
        starts = self.randomize(index)  # (the placement is drawn before the flips, as it always was)
        axes = [a for a in range(len(self.roi_size)) if self.flip and self.R.random_sample() < 0.5]
        return self.reader.read_box(index, starts, self.roi_size, self.label_fn, axes, out)


class LabelledDataset(Dataset):
    """(image, training label) pairs of one split.

    Items are dicts ``{"image": (C, *spatial) float32, "label": (*spatial) label_dtype, "id": str, "ignore":
    bool}`` (``ignore``: the label holds 255 somewhere). ``label_dtype`` is int64, what losses index with, or
    uint8 (training labels are global ids < 255 and 255, so they always fit): the training loop's loader
    takes uint8, an eighth of the bytes through the loader workers' shared memory, and the step widens the
    batch on its device (:meth:`jascl.engine.tasks.segmentation.SegmentationTask.training_batch`).
    Keys are sample indices or ``(pass, index)`` pairs from a
    :class:`jascl.data.sampling.SeededBatchSampler`; the random crop and flips of
    an item are drawn from ``(seed, pass, index)`` alone, so they do not depend on
    worker processes, ranks or the order in which items are read.

    Splits held as arrays (synthetic data) are cropped uniformly to ``patch_size``.
    Lazy splits of real datasets (``jascl.data.real.LazySamples``, variable sizes) are
    padded to ``patch_size`` where smaller (image 0, label 255 = ignore) and cropped
    around a taught-class voxel with probability :data:`FOREGROUND_CROP_PROB`; when the
    split offers a crop reader (``split.images.crop_reader``, the preprocessed store) only
    the patch is read (:class:`RandStoreCrop`), else the whole sample.
    """

    def __init__(
        self,
        split: Split,
        taught: Sequence[int],
        other_classes: str = "background",
        augment: bool = False,
        patch_size: Sequence[int] | None = None,
        seed: int = 0,
        label_dtype: torch.dtype = torch.int64,
    ) -> None:
        if label_dtype not in (torch.int64, torch.uint8):
            raise ValueError(f"label_dtype must be torch.int64 or torch.uint8, not {label_dtype}")
        self.label_dtype = label_dtype
        self.split = split
        self.taught = list(taught)
        self.other_classes = other_classes
        dims = split.images.ndim - 2
        transforms: list = []
        reader = getattr(split.images, "crop_reader", None) if patch_size is not None else None
        self.cropper = None
        if reader is not None:
            self.cropper = RandStoreCrop(reader, patch_size, FOREGROUND_CROP_PROB, self.taught, other_classes, augment)
        elif isinstance(split.images, np.ndarray):
            if patch_size is not None and tuple(patch_size) != tuple(split.images.shape[2:]):
                transforms.append(
                    RandSpatialCropd(keys=["image", "label"], roi_size=list(patch_size), random_size=False)
                )
        elif patch_size is not None:
            transforms += [
                SpatialPadd(keys="image", spatial_size=list(patch_size)),
                SpatialPadd(keys="label", spatial_size=list(patch_size), value=IGNORE_INDEX),
                RandForegroundCropd(["image", "label"], "label", patch_size, FOREGROUND_CROP_PROB),
            ]
        if augment and self.cropper is None:
            transforms += [RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=axis) for axis in range(dims)]
        self.seed = seed
        self.transform = Compose(transforms) if transforms else None
        # the batches :meth:`__getitems__` reads in a loader worker: memory the worker reuses (module
        # jascl.data.batch_memory); made here, in the main process, before any worker starts
        self.slots = BatchSlots() if self.cropper is not None and label_dtype == torch.uint8 else None

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, keys: Sequence) -> list[dict]:
        """The items of ``keys`` (torch's DataLoader asks for a batch's items at once).

        On the store path with uint8 labels (the training loader) the patches are read straight into one
        batch and the items are its slots: :func:`collate_items` hands that batch on without another copy.
        Inside a loader worker the batch lies in shared memory the worker reuses once the main process has let
        go of it (:mod:`jascl.data.batch_memory`). The items are those of ``self[key]``, value for value.
        """
        if self.cropper is None or self.slots is None or not len(keys):
            return [self[key] for key in keys]
        size = (len(keys), *self.cropper.roi_size)
        shape = (size[0], self.split.images.shape[1], *size[1:])
        if get_worker_info() is None:
            image, label = torch.empty(shape, dtype=torch.float32), torch.empty(size, dtype=torch.uint8)
        else:
            storage, lease = self.slots.lease(batch_bytes(shape, size))
            image, label = batch_views(storage, shape, size)
            remember_lease(storage, lease)
        images, labels = image.numpy(), label.numpy()
        items = []
        for slot, key in enumerate(keys):
            pass_index, index = split_key(key)
            reseed(self.cropper, derive_seed(self.seed, pass_index, index))
            self.cropper(index, out=(images[slot], labels[slot]))
            items.append(
                {
                    "image": image[slot],
                    "label": label[slot],
                    "id": self.split.ids[index],
                    "ignore": bool((labels[slot] == IGNORE_INDEX).any()),
                }
            )
        return items

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        pass_index, index = split_key(key)
        if self.cropper is not None:  # only the patch is read, flipped in the same copy
            reseed(self.cropper, derive_seed(self.seed, pass_index, index))
            patch, hidden = self.cropper(index)  # both C-contiguous: collated without another copy of their own
            return {
                "image": torch.from_numpy(patch),
                "label": torch.from_numpy(hidden).to(self.label_dtype),
                "id": self.split.ids[index],
                "ignore": bool((hidden == IGNORE_INDEX).any()),  # on uint8: an eighth of the memory to read
            }
        image = torch.from_numpy(np.asarray(self.split.images[index]))
        label = torch.from_numpy(training_labels(self.split.labels[index], self.taught, self.other_classes))
        if self.transform is not None:
            reseed(self.transform, derive_seed(self.seed, pass_index, index))
            # plain tensors: building MONAI's MetaTensor costs more than the flips, and it would route every
            # later operation (the model's too) through its __torch_function__
            with plain_tensors():
                out = self.transform({"image": image, "label": label[None]})
            image = torch.as_tensor(out["image"]).as_subclass(torch.Tensor)
            label = torch.as_tensor(out["label"]).as_subclass(torch.Tensor)[0]
        label = label.to(self.label_dtype).contiguous()
        # whether the label holds ignore pixels, found here in the loader's worker so that the loss does not
        # have to ask the GPU at every step
        return {
            "image": image.float().contiguous(),
            "label": label,
            "id": self.split.ids[index],
            "ignore": bool((label == IGNORE_INDEX).any()),
        }


def collate_items(items: list[dict]) -> dict:
    """A batch of :class:`LabelledDataset` items: items that are the slots of one batch, in order
    (:meth:`LabelledDataset.__getitems__`), give that batch without a copy; any others are stacked by torch's
    ``default_collate``. The result is the same either way: image (B, C, *spatial), label (B, *spatial), ids
    as a list, ``ignore`` as a (B,) bool tensor."""
    first = items[0]
    image, label = first.get("image"), first.get("label")
    if isinstance(image, torch.Tensor) and isinstance(label, torch.Tensor):
        images, labels = image._base, label._base
        if (
            images is not None
            and labels is not None
            and images.shape == (len(items), *image.shape)  # a batch of these items, not some other parent
            and labels.shape == (len(items), *label.shape)
            and all(
                item["image"]._base is images
                and item["label"]._base is labels
                and item["image"].data_ptr() == images[slot].data_ptr()
                and item["label"].data_ptr() == labels[slot].data_ptr()
                for slot, item in enumerate(items)
            )
        ):
            rest = {
                key: default_collate([item[key] for item in items]) for key in first if key not in ("image", "label")
            }
            return leased_batch({"image": images, "label": labels, **rest}, take_lease(images))
    return default_collate(items)
