"""Torch datasets over session splits, with the protocol's training-label policy."""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import numpy as np
import torch
from monai.transforms import Compose, RandFlipd, RandSpatialCropd
from torch.utils.data import DataLoader, Dataset

from jascl.data.synthetic import Split

IGNORE_INDEX = 255


def repeat_loader(loader: DataLoader) -> Iterator[dict]:
    """Iterate ``loader`` again and again (a fresh shuffle and augmentation on every pass)."""
    while True:
        yield from loader


def iterate_steps(loader: DataLoader, n_steps: int) -> Iterator[dict]:
    """``n_steps`` batches from ``loader``: whole passes first, each run to exhaustion, then a partial pass.

    Running every whole pass to its end keeps the sampler's random stream the
    same as a plain ``for batch in loader`` epoch, so an epoch of exactly
    ``len(loader)`` steps is bit-identical to one.
    """
    full, rest = divmod(n_steps, max(len(loader), 1))
    for _ in range(full):
        yield from loader
    if rest:
        yield from itertools.islice(loader, rest)


def training_labels(labels: np.ndarray, taught: Sequence[int], other_classes: str = "background") -> np.ndarray:
    """Hide classes not taught in the session.

    Args:
        labels: (*spatial) full ground truth in global ids.
        taught: foreground classes labelled in this session.
        other_classes: "background" -> untaught classes become 0 (the authors'
            convention); "ignore" -> they become 255 and are excluded from the loss.
    """
    keep = np.isin(labels, [0, *taught])
    fill = 0 if other_classes == "background" else IGNORE_INDEX
    return np.where(keep, labels, fill).astype(np.int64)


class LabelledDataset(Dataset):
    """(image, training label) pairs of one split.

    Items are dicts ``{"image": (C, *spatial) float32, "label": (*spatial) int64, "id": str}``.
    """

    def __init__(self, split: Split, taught: Sequence[int], other_classes: str = "background",
                 augment: bool = False, patch_size: Sequence[int] | None = None, seed: int = 0) -> None:
        self.split = split
        self.taught = list(taught)
        self.other_classes = other_classes
        dims = split.images.ndim - 2
        transforms = []
        if patch_size is not None and tuple(patch_size) != tuple(split.images.shape[2:]):
            transforms.append(RandSpatialCropd(keys=["image", "label"], roi_size=list(patch_size), random_size=False))
        if augment:
            transforms += [RandFlipd(keys=["image", "label"], prob=0.5, spatial_axis=axis) for axis in range(dims)]
        self.transform = Compose(transforms).set_random_state(seed) if transforms else None

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> dict:
        image = torch.from_numpy(self.split.images[index])
        label = torch.from_numpy(training_labels(self.split.labels[index], self.taught, self.other_classes))
        if self.transform is not None:
            out = self.transform({"image": image, "label": label[None]})
            image, label = torch.as_tensor(out["image"]), torch.as_tensor(out["label"])[0]
        return {"image": image.float().contiguous(), "label": label.long().contiguous(), "id": self.split.ids[index]}
