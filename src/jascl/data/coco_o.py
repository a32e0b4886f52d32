"""COCO-O (Mao et al., "COCO-O: A Benchmark for Object Detectors under Natural Distribution Shifts", ICCV 2023):
its on-disk layout and the paper's detection sessions on it.

COCO-O holds COCO's 80 object classes in six domains far from photographs (6,782 images, 26,624 boxes). Its
archive (``ood_coco.zip``) unpacks into one folder per domain, each laid out like COCO's validation split, so
every domain is a COCO-format split (:mod:`jascl.data.coco`)::

    <root>/                                  e.g. /data/ood_coco
        cartoon/
            annotations/instances_val2017.json
            val2017/<image files>
        handmake/   (same two entries)
        painting/
        sketch/
        tattoo/
        weather/

The sessions (the paper's appendix "Detection results", Table ``det:methods_session1``): a Faster R-CNN
(SoftTeacher's) learns a base session of 77 classes on the Painting domain (the paper's base model: 0.2840
mAP), then session 1 on the Weather domain adds three novel classes, person, car and bench, from 30 labelled
images per class and 41 / 224 / 174 unlabelled images of bench / car / person.

Which 77 classes: the paper does not list them; the authors' split script (``Detection/tools/prepare_split.py``)
takes COCO's 80 classes other than person, car and bench, and the built-in ``coco-o`` protocol lists exactly
those. That is also *the non-novel COCO classes with at least one annotation in Painting* (:func:`base_classes`)
when Painting annotates every COCO class; ``jascl data coco-o-classes --root ROOT`` prints the classes Painting
annotates, with their count, and warns when it is not 77, and loading the protocol warns about every base class
without a box in Painting (its AP is then undefined and left out of the means).
"""

from __future__ import annotations

from pathlib import Path

from jascl.data.coco import check_coco, load_coco
from jascl.data.layouts.base import Problem
from jascl.errors import DataError

__all__ = [
    "ANNOTATIONS",
    "BASE_CLASS_COUNT",
    "BASE_DOMAIN",
    "COCO_CLASSES",
    "DOMAINS",
    "IMAGES",
    "NOVEL_CLASSES",
    "SESSION1_DOMAIN",
    "SHOTS",
    "UNLABELLED",
    "base_classes",
    "check_coco_o",
    "domain_paths",
]

#: the six domain folders of the archive
DOMAINS = ("cartoon", "handmake", "painting", "sketch", "tattoo", "weather")
#: inside each domain folder: the instances JSON and the image folder (COCO val2017's names)
ANNOTATIONS = "annotations/instances_val2017.json"
IMAGES = "val2017"

#: the paper's sessions: base on Painting, session 1 on Weather with three novel classes
BASE_DOMAIN = "painting"
SESSION1_DOMAIN = "weather"
NOVEL_CLASSES = ("person", "car", "bench")
#: labelled images per novel class in session 1
SHOTS = 30
#: unlabelled images per novel class in session 1
UNLABELLED = {"bench": 41, "car": 224, "person": 174}
#: the base session's class count the paper states
BASE_CLASS_COUNT = 77

#: COCO 2017's 80 detection classes: category id -> name (ids 1..90 with gaps, as in instances_*.json)
COCO_CLASSES: dict[int, str] = {
    1: "person", 2: "bicycle", 3: "car", 4: "motorcycle", 5: "airplane", 6: "bus", 7: "train", 8: "truck",
    9: "boat", 10: "traffic light", 11: "fire hydrant", 13: "stop sign", 14: "parking meter", 15: "bench",
    16: "bird", 17: "cat", 18: "dog", 19: "horse", 20: "sheep", 21: "cow", 22: "elephant", 23: "bear",
    24: "zebra", 25: "giraffe", 27: "backpack", 28: "umbrella", 31: "handbag", 32: "tie", 33: "suitcase",
    34: "frisbee", 35: "skis", 36: "snowboard", 37: "sports ball", 38: "kite", 39: "baseball bat",
    40: "baseball glove", 41: "skateboard", 42: "surfboard", 43: "tennis racket", 44: "bottle",
    46: "wine glass", 47: "cup", 48: "fork", 49: "knife", 50: "spoon", 51: "bowl", 52: "banana", 53: "apple",
    54: "sandwich", 55: "orange", 56: "broccoli", 57: "carrot", 58: "hot dog", 59: "pizza", 60: "donut",
    61: "cake", 62: "chair", 63: "couch", 64: "potted plant", 65: "bed", 67: "dining table", 70: "toilet",
    72: "tv", 73: "laptop", 74: "mouse", 75: "remote", 76: "keyboard", 77: "cell phone", 78: "microwave",
    79: "oven", 80: "toaster", 81: "sink", 82: "refrigerator", 84: "book", 85: "clock", 86: "vase",
    87: "scissors", 88: "teddy bear", 89: "hair drier", 90: "toothbrush",
}  # fmt: skip


def domain_paths(root: str | Path, domain: str) -> tuple[Path, Path]:
    """``(instances JSON, image folder)`` of one domain under the archive's root.

    Raises:
        DataError: ``domain`` is not one of :data:`DOMAINS`.
    """
    if domain not in DOMAINS:
        raise DataError(f"COCO-O has no domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    folder = Path(root) / domain
    return folder / ANNOTATIONS, folder / IMAGES


def check_coco_o(root: str | Path, expect_annotations: bool = True) -> list[str]:
    """Every defect of a COCO-O copy, one line each: a missing domain folder, then :func:`check_coco` per domain."""
    root = Path(root)
    if not root.is_dir():
        return [str(Problem(root, "COCO-O root not found", "give the folder ood_coco.zip unpacked into"))]
    problems: list[str] = []
    for domain in DOMAINS:
        json_path, image_dir = domain_paths(root, domain)
        if not (root / domain).is_dir():
            problems.append(
                str(Problem(root / domain, f"COCO-O domain folder {domain!r} missing", "unpack the whole archive"))
            )
            continue
        problems += check_coco(json_path, image_dir, expect_annotations=expect_annotations)
    return problems


def base_classes(root: str | Path) -> list[str]:
    """The base session's classes: COCO classes with at least one annotation in Painting, other than the novel
    ones (person, car, bench), in category-id order.

    Only Painting's instances JSON is read (the images are not opened).

    Raises:
        DataError: Painting's JSON is missing or malformed.
    """
    json_path, image_dir = domain_paths(root, BASE_DOMAIN)
    split = load_coco(json_path, image_dir)
    counts = split.annotation_counts()
    return [
        split.categories[c]
        for c in sorted(split.categories)
        if counts[c] > 0 and split.categories[c] not in NOVEL_CLASSES
    ]
