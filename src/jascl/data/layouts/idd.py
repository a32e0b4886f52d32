"""IDD, the India Driving Dataset (Varma et al., WACV 2019), segmentation part, in its released layout.

Layout (``idd-segmentation.tar.gz``, folder ``IDD_Segmentation``)::

    <root>/leftImg8bit/<split>/<sequence>/<frame>_leftImg8bit.png
    <root>/gtFine/<split>/<sequence>/<frame>_gtFine_polygons.json
    <root>/gtFine/<split>/<sequence>/<frame>_gtFine_labellevel3Ids.png   (optional)

The release ships polygons only; the level-3 id PNGs are what AutoNUE's
``preperation/createLabels.py --id-type level3Id`` writes next to them (and what the
JASCL authors trained on). This layout reads the PNG when present and otherwise
rasterises the polygons itself with the same rules (objects in file order, deleted
ones skipped, ``<name>group`` -> ``<name>``, uncovered pixels 255).

Native ids are IDD's **level-3 ids**: 26 classes 0..25 and 255 (void). The
level-4 -> level-3 table :data:`IDD_LABELS` and the level-3 names come from AutoNUE's
official ``helpers/anue_labels.py`` (github.com/AutoNUE/public-code). Several level-4
labels share a level-3 id (:data:`IDD_LEVEL3_MEMBERS`): e.g. level-3 id 1 holds
``parking`` and ``drivable fallback``, 3 holds ``rail track`` and ``non-drivable
fallback``, 23 holds ``bridge`` and ``tunnel``. The paper's Natural-JASCL IDD classes
"Parking", "rail track" and "Bridge/tunnel" (appendix class tables, LaTeX around
lines 2099-2101 and 2200-2204) are therefore level-3 ids 1, 3 and 23, and
"Autorickshaw" is 8.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from jascl.data import natural
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import ConfigError, DataError


class IddLabel(NamedTuple):
    name: str
    id: int
    level3_id: int
    level2_id: int
    level1_id: int
    cityscapes_id: int


# From AutoNUE public-code helpers/anue_labels.py: level-4 name, level-4 id ("id"), level3Id,
# level2Id, level1Id, csId (the Cityscapes label id the class corresponds to, 255 if none).
IDD_LABELS: tuple[IddLabel, ...] = tuple(
    IddLabel(*row)
    for row in (
        ("road", 0, 0, 0, 0, 7),
        ("parking", 1, 1, 1, 0, 9),
        ("drivable fallback", 2, 1, 1, 0, 255),
        ("sidewalk", 3, 2, 2, 1, 8),
        ("rail track", 4, 3, 3, 1, 10),
        ("non-drivable fallback", 5, 3, 3, 1, 255),
        ("person", 6, 4, 4, 2, 24),
        ("animal", 7, 4, 4, 2, 255),
        ("rider", 8, 5, 5, 2, 25),
        ("motorcycle", 9, 6, 6, 3, 32),
        ("bicycle", 10, 7, 6, 3, 33),
        ("autorickshaw", 11, 8, 7, 3, 255),
        ("car", 12, 9, 7, 3, 26),
        ("truck", 13, 10, 8, 3, 27),
        ("bus", 14, 11, 8, 3, 28),
        ("caravan", 15, 12, 8, 3, 29),
        ("trailer", 16, 12, 8, 3, 30),
        ("train", 17, 12, 8, 3, 31),
        ("vehicle fallback", 18, 12, 8, 3, 255),
        ("curb", 19, 13, 9, 4, 255),
        ("wall", 20, 14, 9, 4, 12),
        ("fence", 21, 15, 10, 4, 13),
        ("guard rail", 22, 16, 10, 4, 14),
        ("billboard", 23, 17, 11, 4, 255),
        ("traffic sign", 24, 18, 11, 4, 20),
        ("traffic light", 25, 19, 11, 4, 19),
        ("pole", 26, 20, 12, 4, 17),
        ("polegroup", 27, 20, 12, 4, 18),
        ("obs-str-bar-fallback", 28, 21, 12, 4, 255),
        ("building", 29, 22, 13, 5, 11),
        ("bridge", 30, 23, 13, 5, 15),
        ("tunnel", 31, 23, 13, 5, 16),
        ("vegetation", 32, 24, 14, 5, 21),
        ("sky", 33, 25, 15, 6, 23),
        ("fallback background", 34, 25, 15, 6, 255),
        ("unlabeled", 35, 255, 255, 255, 0),
        ("ego vehicle", 36, 255, 255, 255, 1),
        ("rectification border", 37, 255, 255, 255, 2),
        ("out of roi", 38, 255, 255, 255, 3),
        ("license plate", 39, 255, 255, 255, 255),
    )
)

# Level-3 id -> name. Where several level-4 labels merge, the name is the one IDD's own
# evaluation code uses for the merged class (e.g. 1 "drivable fallback" also holds parking).
IDD_LEVEL3_NAMES: dict[int, str] = {
    0: "road",
    1: "drivable fallback",
    2: "sidewalk",
    3: "non-drivable fallback",
    4: "person",
    5: "rider",
    6: "motorcycle",
    7: "bicycle",
    8: "autorickshaw",
    9: "car",
    10: "truck",
    11: "bus",
    12: "vehicle fallback",
    13: "curb",
    14: "wall",
    15: "fence",
    16: "guard rail",
    17: "billboard",
    18: "traffic sign",
    19: "traffic light",
    20: "pole",
    21: "obs-str-bar-fallback",
    22: "building",
    23: "bridge",
    24: "vegetation",
    25: "sky",
    255: "unlabeled",
}
# Level-3 id -> the level-4 labels it holds, e.g. 1 -> ("parking", "drivable fallback").
IDD_LEVEL3_MEMBERS: dict[int, tuple[str, ...]] = {
    level3: tuple(label.name for label in IDD_LABELS if label.level3_id == level3) for level3 in IDD_LEVEL3_NAMES
}

_SPLITS = ("train", "val", "test")
_IMAGE_SUFFIX = "_leftImg8bit.png"
_PNG_SUFFIX = "_gtFine_labellevel3Ids.png"
_JSON_SUFFIX = "_gtFine_polygons.json"
_SOURCES = ("auto", "png", "polygons")


@LAYOUTS.register("idd", doc="IDD Segmentation leftImg8bit/ + gtFine/ (level-3 ids 0..25, 255 void)")
class IddLayout(DatasetLayout):
    """IDD Segmentation; native ids are level-3 ids 0..25 (255 = void).

    Options:
        splits: a split name or list of them to scan (default: train, val, test).
        labels: ``"auto"`` (default: the level-3 PNG where it exists, else the polygons),
            ``"png"`` (only ``*_gtFine_labellevel3Ids.png``) or ``"polygons"`` (only
            ``*_gtFine_polygons.json``).

    Record ids are ``<split>/<sequence>/<frame>``; ``meta`` holds the sequence.
    """

    name = "idd"
    spatial_dims = 2
    description = (
        "IDD Segmentation (idd.insaan.iiit.ac.in, folder IDD_Segmentation): "
        "leftImg8bit/<split>/<seq>/*_leftImg8bit.png with gtFine/<split>/<seq>/*_gtFine_polygons.json "
        "and/or *_gtFine_labellevel3Ids.png (AutoNUE createLabels.py)"
    )
    ignore_index = natural.IGNORE_INDEX

    def __init__(self, root, **options) -> None:
        super().__init__(root, **options)
        self.source = options.get("labels", "auto")
        if self.source not in _SOURCES:
            raise ConfigError(f"idd layout: labels: {self.source!r} is not known; choose one of {', '.join(_SOURCES)}")
        self._level3_by_name = {label.name: label.level3_id for label in IDD_LABELS}

    def scan(self) -> list[Record]:
        natural.require_root(self.root, self.name, "leftImg8bit/ and gtFine/ (IDD_Segmentation)")
        if not (self.root / "leftImg8bit").is_dir():
            raise DataError(
                f"{self.root}: no leftImg8bit/ folder, so this is not an IDD root; point the dataset "
                "root at the IDD_Segmentation folder that holds leftImg8bit/ and gtFine/"
            )
        suffixes = {"auto": (_PNG_SUFFIX, _JSON_SUFFIX), "png": (_PNG_SUFFIX,), "polygons": (_JSON_SUFFIX,)}[
            self.source
        ]
        records = []
        for split in sorted(natural.wanted_splits(self.options, _SPLITS, self.name)):
            image_dir, label_dir = self.root / "leftImg8bit" / split, self.root / "gtFine" / split
            stems = {
                p.relative_to(image_dir).as_posix()[: -len(_IMAGE_SUFFIX)]
                for p in image_dir.glob(f"*/*{_IMAGE_SUFFIX}")
            }
            for suffix in suffixes:
                stems |= {p.relative_to(label_dir).as_posix()[: -len(suffix)] for p in label_dir.glob(f"*/*{suffix}")}
            has_labels = label_dir.is_dir()
            for stem in sorted(stems):
                label = None
                if has_labels:
                    candidates = [label_dir / f"{stem}{suffix}" for suffix in suffixes]
                    # A missing label is recorded under the first accepted name so check() reports it.
                    label = next((c for c in candidates if c.is_file()), candidates[0])
                records.append(
                    Record(
                        id=f"{split}/{stem}",
                        images=(image_dir / f"{stem}{_IMAGE_SUFFIX}",),
                        label=label,
                        split=split,
                        meta={"sequence": stem.split("/")[0]},
                    )
                )
        return sorted(records, key=lambda r: r.id)

    def label_names(self) -> dict[int, str]:
        return dict(IDD_LEVEL3_NAMES)

    def decode_label(self, path: Path) -> tuple[np.ndarray, list[str]]:
        """(H, W) level-3 ids of a level-3 PNG or a polygon file, and the unknown values / names."""
        if path.name.endswith(".json"):
            return natural.render_polygons(path, self._level3_by_name, background=natural.IGNORE_INDEX)
        return natural.lookup_values(natural.index_mask(path), {i: i for i in IDD_LEVEL3_NAMES})

    def check(self, record: Record) -> list[Problem]:
        return natural.check_image_label(
            record,
            self.decode_label,
            "IDD",
            "level-3 masks hold ids 0..25 and 255, and polygons use the label names of AutoNUE's "
            "anue_labels.py; regenerate the file (those pixels are read as ignore, 255)",
        )

    def read(self, record: Record) -> Sample:
        return natural.read_image_label(record, self.decode_label)
