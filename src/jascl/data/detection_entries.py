"""COCO-format dataset entries of a detection protocol, opened: the instances JSON read, categories mapped to the
protocol's global class ids, boxes clipped (:mod:`jascl.data.detection_real` builds the sessions from them).

Layouts: ``coco-o`` (one domain folder of a COCO-O copy, :mod:`jascl.data.coco_o`; option ``folder`` names another
domain folder than the entry's ``domain``) or ``coco`` (options ``annotations`` and ``images``, paths relative to the
root). Category names (or ids) map to class names through the entry's ``labels``, else by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jascl.data.coco import CocoSplit, load_coco
from jascl.data.coco_o import domain_paths
from jascl.errors import ConfigError, DataError
from jascl.protocols.schema import DatasetSpec, Protocol

__all__ = ["COCO_LAYOUTS", "CocoEntry", "entry_paths", "open_entry"]

#: the dataset layouts this module reads
COCO_LAYOUTS = ("coco", "coco-o")


@dataclass
class CocoEntry:
    """One opened dataset entry: its COCO split and boxes in global ids.

    Attributes:
        spec: the protocol's entry.
        split: the instances JSON as read by :func:`jascl.data.coco.load_coco`.
        label_of: COCO category id -> global class id (categories the protocol maps).
        boxes: image id -> ``(x1, y1, x2, y2, global id, iscrowd)`` rows, clipped to the image, with area.
        shows: image id -> global ids of its non-crowd boxes.
    """

    spec: DatasetSpec
    split: CocoSplit
    label_of: dict[int, int]
    boxes: dict[int, list[tuple[float, float, float, float, int, bool]]]
    shows: dict[int, frozenset[int]]

    @property
    def name(self) -> str:
        return self.spec.name

    def ref(self, image_id: int) -> str:
        """The sample id ``<entry>/<image id>``."""
        return f"{self.spec.name}/{image_id}"

    def images_showing(self, classes: Iterable[int]) -> list[int]:
        """Image ids (JSON order) with a non-crowd box of one of ``classes``."""
        wanted = set(classes)
        return [im.id for im in self.split.images if self.shows[im.id] & wanted]


def entry_paths(spec: DatasetSpec, root: Path) -> tuple[Path, Path]:
    """(instances JSON, image folder) of a COCO-format entry under its root."""
    if spec.layout == "coco-o":
        return domain_paths(root, str(spec.options.get("folder", spec.domain)))
    ann, images = spec.options.get("annotations"), spec.options.get("images")
    if not isinstance(ann, str) or not isinstance(images, str):
        raise ConfigError(
            f"datasets.{spec.name}.options: layout 'coco' needs 'annotations' (the instances JSON) and 'images' "
            "(the image folder), paths relative to the root"
        )
    return root / ann, root / images


def open_entry(protocol: Protocol, spec: DatasetSpec, root: Path) -> CocoEntry:
    """Read one entry's instances JSON (images are not opened) and map its categories to global ids.

    Raises:
        ConfigError: the entry's layout is not a COCO layout, or it names dataset splits.
        DataError: the JSON is missing or malformed (one line naming the file).
    """
    if spec.layout not in COCO_LAYOUTS:
        raise ConfigError(
            f"{protocol.path}: datasets.{spec.name}.layout: detection protocols read COCO-format data "
            f"({', '.join(COCO_LAYOUTS)}), got {spec.layout!r}"
        )
    if spec.test_splits or spec.group_by:
        raise ConfigError(
            f"{protocol.path}: datasets.{spec.name}: a COCO-format entry is one split; hold its test images out "
            "with test_fraction (no test_splits / group_by)"
        )
    json_path, image_dir = entry_paths(spec, root)
    if not json_path.is_file():
        raise DataError(
            f"{json_path}: instances JSON of dataset {spec.name} not found; point --root {spec.root}=PATH at the "
            "folder ood_coco.zip unpacks into (with its domain folders)"
            if spec.layout == "coco-o"
            else f"{json_path}: instances JSON of dataset {spec.name} not found; check --root {spec.root}=PATH "
            "and the entry's options.annotations"
        )
    split = load_coco(json_path, image_dir)
    names = {c.name: c.id for c in protocol.classes}
    label_of: dict[int, int] = {}
    for cid, cname in split.categories.items():
        target = spec.labels.get(cname, spec.labels.get(cid))
        if target is not None and target in names.values() and target != 0:
            label_of[cid] = target
    by_id = {im.id: im for im in split.images}
    boxes: dict[int, list[tuple[float, float, float, float, int, bool]]] = {im.id: [] for im in split.images}
    for image_id, rows in split.boxes.items():
        im = by_id.get(image_id)
        if im is None:
            continue
        for b in rows:
            gid = label_of.get(b.category_id)
            if gid is None:
                continue
            x1, y1, x2, y2 = b.box
            x1, x2 = min(max(x1, 0.0), im.width), min(max(x2, 0.0), im.width)
            y1, y2 = min(max(y1, 0.0), im.height), min(max(y2, 0.0), im.height)
            if x2 > x1 and y2 > y1:
                boxes[image_id].append((x1, y1, x2, y2, gid, b.iscrowd))
    shows = {i: frozenset(r[4] for r in rows if not r[5]) for i, rows in boxes.items()}
    return CocoEntry(spec, split, label_of, boxes, shows)
