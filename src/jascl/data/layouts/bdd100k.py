"""BDD100K (Yu et al., CVPR 2020) semantic segmentation, in its released layout.

Layout (``bdd100k_images_10k.zip`` + ``bdd100k_sem_seg_labels_trainval.zip`` unpacked into one root)::

    <root>/images/10k/<split>/<name>.jpg              (train, val, test)
    <root>/labels/sem_seg/masks/<split>/<name>.png    (train, val; one channel)

Native ids are the 19 BDD100K semantic-segmentation categories, which are the
Cityscapes train ids (road 0 ... bicycle 18), and 255 = "unknown", not evaluated
(doc.bdd100k.com, "Label Format" -> Semantic Segmentation). The older release
layout ``<root>/seg/images/<split>/<name>.jpg`` + ``<root>/seg/labels/<split>/<name>_train_id.png``
is recognised too. A root that holds a single ``bdd100k/`` folder is descended into.
Test images have no released labels: they are records with ``label=None``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jascl.data import natural
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import DataError

# doc.bdd100k.com Label Format, Semantic Segmentation (identical to Cityscapes' train ids).
BDD100K_NAMES: dict[int, str] = {
    0: "road",
    1: "sidewalk",
    2: "building",
    3: "wall",
    4: "fence",
    5: "pole",
    6: "traffic light",
    7: "traffic sign",
    8: "vegetation",
    9: "terrain",
    10: "sky",
    11: "person",
    12: "rider",
    13: "car",
    14: "truck",
    15: "bus",
    16: "train",
    17: "motorcycle",
    18: "bicycle",
    255: "unknown",
}

_SPLITS = ("train", "val", "test")


@LAYOUTS.register("bdd100k", doc="BDD100K images/10k/ + labels/sem_seg/masks/ (19 classes, 255 ignore)")
class Bdd100kLayout(DatasetLayout):
    """BDD100K 10K semantic segmentation; native ids 0..18 and 255 (unknown).

    Options:
        splits: a split name or list of them to scan (default: train, val, test).

    Record ids are ``<split>/<name>``.
    """

    name = "bdd100k"
    spatial_dims = 2
    description = (
        "BDD100K (bdd-data.berkeley.edu): bdd100k_images_10k.zip and bdd100k_sem_seg_labels_trainval.zip "
        "unpacked into one root: images/10k/<split>/*.jpg, labels/sem_seg/masks/<split>/*.png"
    )
    ignore_index = natural.IGNORE_INDEX

    def _folders(self) -> tuple[Path, Path, str, str]:
        """(images root, labels root, label suffix, layout kind) of this copy."""
        root = self.root
        if not (root / "images").is_dir() and not (root / "seg").is_dir() and (root / "bdd100k").is_dir():
            root = root / "bdd100k"
        if (root / "images" / "10k").is_dir():
            return root / "images" / "10k", root / "labels" / "sem_seg" / "masks", ".png", "10k"
        if (root / "seg" / "images").is_dir():
            return root / "seg" / "images", root / "seg" / "labels", "_train_id.png", "seg"
        raise DataError(
            f"{self.root}: neither images/10k/ nor seg/images/ found, so this is not a BDD100K root; "
            "point the dataset root at the folder that holds images/10k/ and labels/sem_seg/masks/"
        )

    def scan(self) -> list[Record]:
        natural.require_root(self.root, self.name, "images/10k/ and labels/sem_seg/masks/")
        image_root, label_root, label_suffix, kind = self._folders()
        records = []
        for split in sorted(natural.wanted_splits(self.options, _SPLITS, self.name)):
            image_dir, label_dir = image_root / split, label_root / split
            stems = {p.stem for p in image_dir.glob("*.jpg")}
            stems |= {p.name[: -len(label_suffix)] for p in label_dir.glob(f"*{label_suffix}")}
            has_labels = label_dir.is_dir()
            for stem in sorted(stems):
                records.append(
                    Record(
                        id=f"{split}/{stem}",
                        images=(image_dir / f"{stem}.jpg",),
                        label=(label_dir / f"{stem}{label_suffix}") if has_labels else None,
                        split=split,
                        meta={"release": kind},
                    )
                )
        return sorted(records, key=lambda r: r.id)

    def label_names(self) -> dict[int, str]:
        return dict(BDD100K_NAMES)

    def decode_label(self, path: Path) -> tuple[np.ndarray, list[str]]:
        """(H, W) ids 0..18 / 255 of a semantic mask and the values outside that set."""
        return natural.lookup_values(natural.index_mask(path), {i: i for i in BDD100K_NAMES})

    def check(self, record: Record) -> list[Problem]:
        return natural.check_image_label(
            record,
            self.decode_label,
            "BDD100K",
            "sem_seg masks hold ids 0..18 and 255; use the masks from bdd100k_sem_seg_labels_trainval.zip, "
            "not the colormaps (those pixels are read as ignore, 255)",
        )

    def read(self, record: Record) -> Sample:
        return natural.read_image_label(record, self.decode_label)
