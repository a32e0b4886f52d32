"""CholecSeg8k (Hong et al., arXiv:2012.12453, 2020) in its released layout.

Layout (Kaggle ``newslab/cholecseg8k``; 17 videos, 80-frame clips, 854 x 480 PNGs)::

    <root>/<video>/<video>_<first frame>/frame_<n>_endo.png                   image
    <root>/<video>/<video>_<first frame>/frame_<n>_endo_watershed_mask.png    class mask (default)
    <root>/<video>/<video>_<first frame>/frame_<n>_endo_color_mask.png        colour rendering
    <root>/<video>/<video>_<first frame>/frame_<n>_endo_mask.png              annotation-tool mask (unused)

Native ids are the 13 classes 0..12 of the paper's Table I, in its order.

The known quirk: the paper's table lists a "colour code" per class written as
``#505050``, ``#111111``, ``#212121`` ...; these are not hex colours but the
*decimal* grey value of the class in the **watershed** masks repeated three times
(50, 11, 21, ...). The **colour** masks use other, real RGB colours (e.g.
background (127, 127, 127), liver (255, 114, 114)), given in :data:`CHOLECSEG8K_CLASSES`.
Both are mapped by exact value. The released masks additionally contain a white
one-pixel border and, where a region was left unannotated, black (watershed) or
white (colour) pixels; these are documented non-classes and are read as ignore
(255) without being reported. Any other value is reported by ``check()`` and read
as ignore. Sources: the class names and watershed codes are the paper's Table I
(also on the dataset's Kaggle page); the colour-mask RGB values are those found in
the released ``*_color_mask.png`` files, as tabulated by public loaders (e.g.
github.com/we66530/Train_CholecSeg8k_with_DeeplabV3Res101_pytorch, README).

The dataset has no official split: every record is ``train`` unless the
``video_splits`` option assigns its video to another split.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from jascl.data import natural
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import ConfigError, DataError


class CholecClass(NamedTuple):
    id: int
    name: str
    watershed: int
    colour: tuple[int, int, int]


CHOLECSEG8K_CLASSES: tuple[CholecClass, ...] = tuple(
    CholecClass(*row)
    for row in (
        (0, "black background", 50, (127, 127, 127)),
        (1, "abdominal wall", 11, (210, 140, 140)),
        (2, "liver", 21, (255, 114, 114)),
        (3, "gastrointestinal tract", 13, (231, 70, 156)),
        (4, "fat", 12, (186, 183, 75)),
        (5, "grasper", 31, (170, 255, 0)),
        (6, "connective tissue", 23, (255, 85, 0)),
        (7, "blood", 24, (255, 0, 0)),
        (8, "cystic duct", 25, (255, 255, 0)),
        (9, "l-hook electrocautery", 32, (169, 255, 184)),
        (10, "gallbladder", 22, (255, 160, 165)),
        (11, "hepatic vein", 33, (0, 50, 128)),
        (12, "liver ligament", 5, (111, 74, 0)),
    )
)
# Values that mark "no annotation" in the released masks (border, unannotated regions): read as ignore, not reported.
UNANNOTATED_WATERSHED = (0, 255)
UNANNOTATED_COLOUR = ((255, 255, 255),)

_MASKS = {"watershed": "_endo_watershed_mask.png", "color": "_endo_color_mask.png"}
_IMAGE_SUFFIX = "_endo.png"


@LAYOUTS.register("cholecseg8k", doc="CholecSeg8k video*/video*_*/frame_*_endo*.png (13 classes from masks)")
class CholecSeg8kLayout(DatasetLayout):
    """CholecSeg8k; native ids 0..12 (Table I of the dataset paper).

    Options:
        mask: ``"watershed"`` (default; the class masks) or ``"color"`` (the colour renderings).
        video_splits: {split: [video, ...]} assigning whole videos to splits, e.g.
            ``{"test": ["video12", "video18"]}``; other videos are ``train``.
        splits: a split name or list of them to return (default: all).
        colour_tolerance: for ``mask: color``, also accept colours within this max-channel
            distance of exactly one class colour (default 0: exact colours only).

    Record ids are ``<video>/<clip>/frame_<n>``; ``meta`` holds video and clip.
    """

    name = "cholecseg8k"
    spatial_dims = 2
    description = (
        "CholecSeg8k (kaggle.com/datasets/newslab/cholecseg8k): "
        "<video>/<video>_<start>/frame_<n>_endo.png with frame_<n>_endo_watershed_mask.png "
        "(and _endo_color_mask.png)"
    )
    ignore_index = natural.IGNORE_INDEX

    def __init__(self, root, **options) -> None:
        super().__init__(root, **options)
        self.mask = options.get("mask", "watershed")
        if self.mask not in _MASKS:
            raise ConfigError(f"cholecseg8k layout: mask: {self.mask!r} is not known; choose watershed or color")
        self.tolerance = int(options.get("colour_tolerance", 0))
        video_splits = options.get("video_splits") or {}
        if not isinstance(video_splits, dict) or not all(
            isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v) for v in video_splits.values()
        ):
            raise ConfigError(
                "cholecseg8k layout: video_splits must map split names to lists of video folder "
                "names, e.g. {test: [video12]}"
            )
        self.split_of: dict[str, str] = {}
        for split, videos in video_splits.items():
            for video in videos:
                if video in self.split_of:
                    raise ConfigError(
                        f"cholecseg8k layout: video {video!r} is in two video_splits "
                        f"({self.split_of[video]}, {split}); give each video one split"
                    )
                self.split_of[video] = str(split)

    def _base(self) -> Path:
        """The folder holding the video folders (a root holding one ``CholecSeg8k/`` folder is descended into)."""
        if not any(self.root.glob("video*/video*_*")) and any((self.root / "CholecSeg8k").glob("video*/video*_*")):
            return self.root / "CholecSeg8k"
        return self.root

    def scan(self) -> list[Record]:
        natural.require_root(self.root, self.name, "the video01/, video09/, ... folders")
        base = self._base()
        suffix = _MASKS[self.mask]
        stems = {p.as_posix()[: -len(_IMAGE_SUFFIX)] for p in base.glob(f"video*/video*_*/frame_*{_IMAGE_SUFFIX}")}
        stems |= {p.as_posix()[: -len(suffix)] for p in base.glob(f"video*/video*_*/frame_*{suffix}")}
        if not stems:
            raise DataError(
                f"{self.root}: no video*/video*_*/frame_*_endo.png files, so this is not a CholecSeg8k "
                "root; point the dataset root at the folder that holds video01/, video09/, ..."
            )
        known_splits = sorted({"train", *self.split_of.values()})
        wanted = natural.wanted_splits(self.options, known_splits, self.name)
        records = []
        for stem in sorted(stems):
            path = Path(stem)
            video, clip = path.parent.parent.name, path.parent.name
            split = self.split_of.get(video, "train")
            if split not in wanted:
                continue
            records.append(
                Record(
                    id=f"{video}/{clip}/{path.name}",
                    images=(Path(stem + _IMAGE_SUFFIX),),
                    label=Path(stem + suffix),
                    split=split,
                    meta={"video": video, "clip": clip},
                )
            )
        return sorted(records, key=lambda r: r.id)

    def label_names(self) -> dict[int, str]:
        return {c.id: c.name for c in CHOLECSEG8K_CLASSES}

    def decode_label(self, path: Path) -> tuple[np.ndarray, list[str]]:
        """(H, W) class ids 0..12 of a watershed (grey) or colour mask, and the unknown values / colours."""
        if self.mask == "watershed":
            table = {c.watershed: c.id for c in CHOLECSEG8K_CLASSES}
            table.update({value: natural.IGNORE_INDEX for value in UNANNOTATED_WATERSHED})
            return natural.lookup_values(natural.index_mask(path), table)
        pixels = natural.read_colour_mask(path)
        colours = {c.colour: c.id for c in CHOLECSEG8K_CLASSES}
        colours.update({colour: natural.IGNORE_INDEX for colour in UNANNOTATED_COLOUR})
        return natural.lookup_colours(pixels, colours, self.tolerance)

    def check(self, record: Record) -> list[Problem]:
        fix = (
            "watershed masks hold the grey values of the dataset paper's Table I (50, 11, 21, ...) and colour "
            "masks the released class colours; those pixels are read as ignore (255)"
        )
        return natural.check_image_label(record, self.decode_label, "CholecSeg8k", fix)

    def read(self, record: Record) -> Sample:
        return natural.read_image_label(record, self.decode_label)
