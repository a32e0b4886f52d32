"""Cityscapes (Cordts et al., CVPR 2016) in its released layout.

Layout (``leftImg8bit_trainvaltest.zip`` + ``gtFine_trainvaltest.zip`` unpacked into one root)::

    <root>/leftImg8bit/<split>/<city>/<city>_<seq>_<frame>_leftImg8bit.png
    <root>/gtFine/<split>/<city>/<city>_<seq>_<frame>_gtFine_labelIds.png

Native ids are Cityscapes *label ids* (0..33), not train ids: the paper's
SS-Natural-JASCL teaches ``parking`` (9) and ``vegetation`` (21) from Cityscapes
(appendix class table, LaTeX around line 2198), and ``parking`` has no train id.
:data:`CITYSCAPES_LABELS` also gives the standard train ids (19 classes, 255 = not
trained) for protocols that want them. The ``test`` split's released labels are
placeholders, so protocols should not evaluate on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from jascl.data import natural
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import DataError


class CityscapesLabel(NamedTuple):
    name: str
    id: int
    train_id: int
    category: str


# Table from cityscapesScripts, cityscapesscripts/helpers/labels.py (mcordts/cityscapesScripts):
# name, label id, train id (255 = not used for training, -1 = none), category.
CITYSCAPES_LABELS: tuple[CityscapesLabel, ...] = tuple(
    CityscapesLabel(*row)
    for row in (
        ("unlabeled", 0, 255, "void"),
        ("ego vehicle", 1, 255, "void"),
        ("rectification border", 2, 255, "void"),
        ("out of roi", 3, 255, "void"),
        ("static", 4, 255, "void"),
        ("dynamic", 5, 255, "void"),
        ("ground", 6, 255, "void"),
        ("road", 7, 0, "flat"),
        ("sidewalk", 8, 1, "flat"),
        ("parking", 9, 255, "flat"),
        ("rail track", 10, 255, "flat"),
        ("building", 11, 2, "construction"),
        ("wall", 12, 3, "construction"),
        ("fence", 13, 4, "construction"),
        ("guard rail", 14, 255, "construction"),
        ("bridge", 15, 255, "construction"),
        ("tunnel", 16, 255, "construction"),
        ("pole", 17, 5, "object"),
        ("polegroup", 18, 255, "object"),
        ("traffic light", 19, 6, "object"),
        ("traffic sign", 20, 7, "object"),
        ("vegetation", 21, 8, "nature"),
        ("terrain", 22, 9, "nature"),
        ("sky", 23, 10, "sky"),
        ("person", 24, 11, "human"),
        ("rider", 25, 12, "human"),
        ("car", 26, 13, "vehicle"),
        ("truck", 27, 14, "vehicle"),
        ("bus", 28, 15, "vehicle"),
        ("caravan", 29, 255, "vehicle"),
        ("trailer", 30, 255, "vehicle"),
        ("train", 31, 16, "vehicle"),
        ("motorcycle", 32, 17, "vehicle"),
        ("bicycle", 33, 18, "vehicle"),
        ("license plate", -1, -1, "vehicle"),
    )
)

# Label id -> train id, for ids that occur in labelIds PNGs (license plate, id -1, is never drawn).
CITYSCAPES_TRAIN_IDS: dict[int, int] = {label.id: label.train_id for label in CITYSCAPES_LABELS if label.id >= 0}
# Train id -> name of the 19 trained classes (the table BDD100K reuses).
CITYSCAPES_TRAIN_NAMES: dict[int, str] = {
    label.train_id: label.name for label in CITYSCAPES_LABELS if 0 <= label.train_id < 255
}

_SPLITS = ("train", "val", "test")
_IMAGE_SUFFIX = "_leftImg8bit.png"
_LABEL_SUFFIX = "_gtFine_labelIds.png"


@LAYOUTS.register("cityscapes", doc="Cityscapes leftImg8bit/ + gtFine/ (label ids 0..33)")
class CityscapesLayout(DatasetLayout):
    """Cityscapes fine annotations; native ids are label ids 0..33.

    Options:
        splits: a split name or list of them to scan (default: train, val, test).

    Record ids are ``<split>/<city>/<city>_<seq>_<frame>``; ``meta`` holds the city.
    """

    name = "cityscapes"
    spatial_dims = 2
    description = (
        "Cityscapes (cityscapes-dataset.com): leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip "
        "unpacked into one root: leftImg8bit/<split>/<city>/*_leftImg8bit.png, "
        "gtFine/<split>/<city>/*_gtFine_labelIds.png"
    )
    ignore_index = natural.IGNORE_INDEX

    def scan(self) -> list[Record]:
        natural.require_root(self.root, self.name, "leftImg8bit/ and gtFine/")
        if not (self.root / "leftImg8bit").is_dir():
            raise DataError(
                f"{self.root}: no leftImg8bit/ folder, so this is not a Cityscapes root; point the "
                "dataset root at the folder that holds leftImg8bit/ and gtFine/"
            )
        records = []
        for split in sorted(natural.wanted_splits(self.options, _SPLITS, self.name)):
            image_dir = self.root / "leftImg8bit" / split
            label_dir = self.root / "gtFine" / split
            stems = {
                p.relative_to(image_dir).as_posix()[: -len(_IMAGE_SUFFIX)]
                for p in image_dir.glob(f"*/*{_IMAGE_SUFFIX}")
            }
            # A label without its image is reported too (check: missing image file).
            stems |= {
                p.relative_to(label_dir).as_posix()[: -len(_LABEL_SUFFIX)]
                for p in label_dir.glob(f"*/*{_LABEL_SUFFIX}")
            }
            has_labels = label_dir.is_dir()
            for stem in sorted(stems):
                city = stem.split("/")[0]
                records.append(
                    Record(
                        id=f"{split}/{stem}",
                        images=(image_dir / f"{stem}{_IMAGE_SUFFIX}",),
                        label=(label_dir / f"{stem}{_LABEL_SUFFIX}") if has_labels else None,
                        split=split,
                        meta={"city": city},
                    )
                )
        return sorted(records, key=lambda r: r.id)

    def label_names(self) -> dict[int, str]:
        return {label.id: label.name for label in CITYSCAPES_LABELS if label.id >= 0}

    def decode_label(self, path: Path) -> tuple[np.ndarray, list[str]]:
        """(H, W) label ids of a ``*_gtFine_labelIds.png`` and the values outside 0..33."""
        return natural.lookup_values(natural.index_mask(path), {i: i for i in CITYSCAPES_TRAIN_IDS})

    def check(self, record: Record) -> list[Problem]:
        return natural.check_image_label(
            record,
            self.decode_label,
            "Cityscapes",
            "labelIds must hold Cityscapes label ids 0..33; regenerate it with cityscapesScripts' "
            "json2labelImg (those pixels are read as ignore, 255)",
        )

    def read(self, record: Record) -> Sample:
        return natural.read_image_label(record, self.decode_label)
