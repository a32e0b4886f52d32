"""The interface of a public dataset's native on-disk layout.

A layout knows three things about a local copy of one dataset: which samples it
holds (:meth:`DatasetLayout.scan`), what can be wrong with a sample's files
(:meth:`DatasetLayout.check`) and how to decode a sample into arrays
(:meth:`DatasetLayout.read`). It does not know about protocols, sessions, label
maps to global ids, K-shot selection or preprocessing; those live in
``jascl.data`` and ``jascl.protocols`` once, for every layout.

Layouts register in :data:`LAYOUTS` under the name a protocol uses
(``dataset: {layout: msd, root: ...}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jascl.registry import Registry


@dataclass(frozen=True)
class Record:
    """One sample of a dataset, before decoding.

    Attributes:
        id: stable sample id, unique within the dataset (K-shot manifests store it).
        images: the image files: one per channel / modality for volumes (in channel
            order), one RGB file for 2D images.
        label: the label file (or folder, e.g. TotalSegmentator's ``segmentations/``);
            None for unlabelled samples.
        split: the dataset's own split ("train", "val", "test", "unlabelled", ...).
        meta: anything else the layout wants to keep (subject, city, video, ...).
    """

    id: str
    images: tuple[Path, ...]
    label: Path | None = None
    split: str = "train"
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def files(self) -> tuple[Path, ...]:
        return (*self.images, *((self.label,) if self.label is not None else ()))


@dataclass
class Sample:
    """A decoded sample.

    Attributes:
        image: (C, *spatial) float32 raw intensities (no normalisation yet).
        label: (*spatial) int64 *native* label ids of the dataset; None if unlabelled.
        affine: (spatial_dims + 1, spatial_dims + 1) voxel-to-world matrix for volumes, None for 2D.
        meta: e.g. {"spacing": (...)}.
    """

    image: np.ndarray
    label: np.ndarray | None
    affine: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Problem:
    """A problem with a dataset copy: the file it concerns, what is wrong and the fix.

    ``str(problem)`` is the one line ``jascl data check`` prints.
    """

    path: Path | str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f"; {self.fix}" if self.fix else "")


def image_value_problems(path: Path | str, data: np.ndarray, what: str = "image") -> list[Problem]:
    """What in an image's values breaks training: non-finite values (NaN, +-inf) and a constant image.

    ``jascl data check`` reports these per file, and ``jascl run`` refuses a sample it loads with the
    same line (:class:`jascl.data.real.storage.SampleStore`), so a NaN voxel never reaches the loss.

    Args:
        path: the file the values come from (named in the line).
        data: its decoded values, any shape.
        what: "image", "modality T1w", ... as the line calls it.
    """
    data = np.asarray(data)
    if data.size == 0:
        return [Problem(path, f"{what} holds no values", "re-export the file")]
    low, high = data.min(), data.max()  # NaN propagates through both, +-inf is one of them: two passes, no mask
    if data.dtype.kind in "fc" and not (np.isfinite(low) and np.isfinite(high)):
        bad = int(data.size - np.count_nonzero(np.isfinite(data)))
        return [
            Problem(
                path,
                f"{what} holds {bad} non-finite value(s) (NaN or +-inf) out of {data.size}",
                "replace them (e.g. numpy.nan_to_num) and save the file again, or drop the sample",
            )
        ]
    if low == high:
        return [
            Problem(
                path,
                f"{what} is constant (every value is {low.item():g})",
                "the file holds no image (an empty export or a blank frame); re-export it or drop the sample",
            )
        ]
    return []


class DatasetLayout:
    """Base class of a dataset layout.

    Subclasses set :attr:`name`, :attr:`spatial_dims` and :attr:`description`
    (where the dataset comes from and the layout expected), and implement the
    three methods.

    Args:
        root: the local copy's root folder.
        options: layout-specific options from the protocol (e.g. a split, modalities).
    """

    name: str = ""
    spatial_dims: int = 3
    description: str = ""

    def __init__(self, root: str | Path, **options: Any) -> None:
        self.root = Path(root)
        self.options = options
        #: what :meth:`scan` found odd but could read (e.g. a case listed twice), one line each;
        #: ``jascl data check`` prints them as warnings
        self.warnings: list[str] = []

    def scan(self) -> list[Record]:
        """Every sample found under :attr:`root`, sorted by id.

        Raises:
            jascl.errors.DataError: the root is missing or does not look like this
                layout (one line naming the root and the layout expected).
        """
        raise NotImplementedError

    def label_names(self) -> dict[int, str]:
        """Native label id -> name, as far as the dataset defines them (0 included)."""
        raise NotImplementedError

    def check(self, record: Record) -> list[Problem]:
        """Open the record's files and report what is wrong (missing, unreadable,
        image/label shape or affine mismatch); an empty list if nothing is."""
        raise NotImplementedError

    def read(self, record: Record) -> Sample:
        """Decode the record.

        Raises:
            jascl.errors.DataError: a file is missing or corrupt (naming the file).
        """
        raise NotImplementedError


LAYOUTS: Registry[DatasetLayout] = Registry("dataset layout")
