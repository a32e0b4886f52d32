"""m2caiSeg (Maqbool et al., arXiv:2008.10134, 2020) in its released layout.

Layout (Kaggle ``salmanmaq/m2caiseg``, unzipped to a folder ``m2caiSeg dataset``)::

    <root>/m2caiSeg dataset/train/images/<n>.jpg        <root>/m2caiSeg dataset/train/groundtruth/<n>_gt.png
    <root>/m2caiSeg dataset/trainval/images/<n>.jpg     <root>/m2caiSeg dataset/trainval/groundtruth/<n>_gt.png
    <root>/m2caiSeg dataset/test/images/<n>.jpg         <root>/m2caiSeg dataset/test/groundtruth/<n>_gt.png

(``<root>`` may also be the ``m2caiSeg dataset`` folder itself.) ``trainval`` holds the
training images plus the validation images, so the ``val`` split is the ``trainval``
images whose names are not in ``train`` (as torch-em's loader reads it).

Ground truth is a colour mask. Native ids and colours are the dataset authors' class
definition, ``datasets/miccaiSegClasses.json`` of github.com/salmanmaq/segmentationNetworks
at its "Corrected labels definition" commit: 0 unknown, 1 grasper ... 18 black (out of
the endoscope's field of view). Note that public re-implementations disagree on the
``hook`` colour (torch-em uses (0, 170, 255)); this follows the authors' file,
(0, 170, 85). Colours are matched exactly; others are reported by ``check()`` and read
as ignore (255). The dataset authors snapped colours blended by the annotation tool to
the nearest class colour; ``colour_tolerance`` offers the same for near-exact colours.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from jascl.data import natural
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import DataError


class M2caiClass(NamedTuple):
    id: int
    name: str
    colour: tuple[int, int, int]
    category: str


M2CAISEG_CLASSES: tuple[M2caiClass, ...] = tuple(
    M2caiClass(*row)
    for row in (
        (0, "unknown", (170, 0, 85), "misc"),
        (1, "grasper", (0, 85, 170), "instrument"),
        (2, "bipolar", (0, 85, 255), "instrument"),
        (3, "hook", (0, 170, 85), "instrument"),
        (4, "scissors", (0, 255, 85), "instrument"),
        (5, "clipper", (0, 255, 170), "instrument"),
        (6, "irrigator", (85, 0, 170), "instrument"),
        (7, "specimen bag", (85, 0, 255), "instrument"),
        (8, "trocars", (170, 85, 85), "instrument"),
        (9, "clip", (170, 170, 170), "instrument"),
        (10, "liver", (85, 170, 0), "organ"),
        (11, "gallbladder", (85, 170, 255), "organ"),
        (12, "fat", (85, 255, 0), "organ"),
        (13, "upper wall", (85, 255, 170), "organ"),
        (14, "artery", (170, 0, 255), "artery"),
        (15, "intestine", (255, 0, 255), "organ"),
        (16, "bile", (255, 255, 0), "fluid"),
        (17, "blood", (255, 0, 0), "fluid"),
        (18, "black", (0, 0, 0), "misc"),
    )
)

_SPLITS = ("train", "val", "test")
_INNER = "m2caiSeg dataset"
_LABEL_SUFFIX = "_gt.png"
_IMAGE_EXTENSIONS = (".jpg", ".png")


@LAYOUTS.register("m2caiseg", doc="m2caiSeg {train,trainval,test}/{images,groundtruth} (19 colour classes)")
class M2caiSegLayout(DatasetLayout):
    """m2caiSeg; native ids 0..18 of the authors' class file.

    Options:
        splits: a split name or list of them to scan (default: train, val, test).
        colour_tolerance: also accept colours within this max-channel distance of exactly
            one class colour (default 0: exact colours only).

    Record ids are ``<split>/<n>``.
    """

    name = "m2caiseg"
    spatial_dims = 2
    description = (
        "m2caiSeg (kaggle.com/datasets/salmanmaq/m2caiseg): 'm2caiSeg dataset'/{train,trainval,test}/"
        "images/<n>.jpg with groundtruth/<n>_gt.png colour masks"
    )
    ignore_index = natural.IGNORE_INDEX

    def __init__(self, root, **options) -> None:
        super().__init__(root, **options)
        self.tolerance = int(options.get("colour_tolerance", 0))

    def _base(self) -> Path:
        return self.root / _INNER if (self.root / _INNER).is_dir() else self.root

    def _pairs(self, folder: Path) -> dict[str, tuple[Path, Path]]:
        """name -> (image, label) of one release folder (a label without image, or vice versa, included)."""
        images = {p.stem: p for p in (folder / "images").glob("*") if p.suffix.lower() in _IMAGE_EXTENSIONS}
        labels = {p.name[: -len(_LABEL_SUFFIX)]: p for p in (folder / "groundtruth").glob(f"*{_LABEL_SUFFIX}")}
        return {
            name: (
                images.get(name, folder / "images" / f"{name}.jpg"),
                labels.get(name, folder / "groundtruth" / f"{name}{_LABEL_SUFFIX}"),
            )
            for name in set(images) | set(labels)
        }

    def scan(self) -> list[Record]:
        natural.require_root(self.root, self.name, "the 'm2caiSeg dataset' folder")
        base = self._base()
        if not any((base / folder / "images").is_dir() for folder in ("train", "trainval", "test")):
            raise DataError(
                f"{self.root}: no train/, trainval/ or test/ folder with images/, so this is not an "
                "m2caiSeg root; point the dataset root at the 'm2caiSeg dataset' folder or its parent"
            )
        train = self._pairs(base / "train")
        by_split = {
            "train": train,
            "val": {n: p for n, p in self._pairs(base / "trainval").items() if n not in train},
            "test": self._pairs(base / "test"),
        }
        records = []
        for split in sorted(natural.wanted_splits(self.options, _SPLITS, self.name)):
            for name, (image, label) in sorted(by_split[split].items()):
                records.append(Record(id=f"{split}/{name}", images=(image,), label=label, split=split))
        return sorted(records, key=lambda r: r.id)

    def label_names(self) -> dict[int, str]:
        return {c.id: c.name for c in M2CAISEG_CLASSES}

    def decode_label(self, path: Path) -> tuple[np.ndarray, list[str]]:
        """(H, W) class ids 0..18 of a colour mask and its colours outside the class table."""
        pixels = natural.read_colour_mask(path)
        return natural.lookup_colours(pixels, {c.colour: c.id for c in M2CAISEG_CLASSES}, self.tolerance)

    def check(self, record: Record) -> list[Problem]:
        return natural.check_image_label(
            record,
            self.decode_label,
            "m2caiSeg",
            "ground truth must use the class colours of the dataset's miccaiSegClasses.json; set the layout "
            "option colour_tolerance to snap near-exact colours (those pixels are read as ignore, 255)",
        )

    def read(self, record: Record) -> Sample:
        return natural.read_image_label(record, self.decode_label)
