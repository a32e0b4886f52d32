"""TotalSegmentator's own layout (``totalsegmentator``).

::

    <root>/meta.csv                                  # optional: image_id;...;split (train / val / test)
    <root>/<subject>/ct.nii.gz
    <root>/<subject>/segmentations/<structure>.nii.gz   # one binary mask per structure

Native label ids are 1-based positions in the structure list: the layout option
``structures`` (a list of names, in id order) or, without it, the sorted union of the
mask file names found under every subject. Where two masks overlap, the structure
later in the list wins.
"""

from __future__ import annotations

import csv
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data import medical, nifti, volume_checks
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.data.types import compact_dtype
from jascl.errors import ConfigError, DataError

MASK_ENDINGS = (".nii.gz", ".nii")


def _structure_name(path: Path) -> str | None:
    for ending in MASK_ENDINGS:
        if path.name.endswith(ending):
            return path.name[: -len(ending)]
    return None


@LAYOUTS.register("totalsegmentator", doc="TotalSegmentator (<subject>/ct.nii.gz + segmentations/<structure>.nii.gz)")
class TotalSegmentatorLayout(DatasetLayout):
    """TotalSegmentator dataset.

    Options:
        structures: structure names in native-id order (id = position + 1); default:
            the sorted union of mask names under all subjects.
        affine_tolerance: largest affine difference accepted between a subject's files.

    Records: id = subject folder name; images = (``ct.nii.gz``,); label = the
    ``segmentations`` folder; split from ``meta.csv`` (default "train"); meta
    ``{"subject", "modality": "CT"}``.
    """

    name = "totalsegmentator"
    spatial_dims = 3
    description = (
        "TotalSegmentator (zenodo.org, Wasserthal et al.): one folder per subject with ct.nii.gz and "
        "segmentations/<structure>.nii.gz, plus meta.csv with the split"
    )

    def __init__(self, root: str | Path, **options: Any) -> None:
        super().__init__(root, **options)
        medical.check_options(self.name, options, ("structures", "affine_tolerance"))
        self.tolerance = float(options.get("affine_tolerance", nifti.AFFINE_TOLERANCE))
        structures = options.get("structures")
        if structures is not None and (
            isinstance(structures, str)
            or not all(isinstance(s, str) for s in structures)
            or len(set(structures)) != len(structures)
            or not structures
        ):
            raise ConfigError(
                f"totalsegmentator option structures={structures!r}: give a list of distinct "
                "structure names (mask file names without .nii.gz)"
            )
        self._given = list(structures) if structures is not None else None

    def _subjects(self) -> list[Path]:
        if not self.root.is_dir():
            raise DataError(
                f"{self.root}: dataset root not found; pass the TotalSegmentator folder holding the "
                "subject folders (--root NAME=PATH)"
            )
        subjects = sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and ((p / "ct.nii.gz").exists() or (p / "segmentations").is_dir())
        )
        if not subjects:
            raise DataError(
                f"{self.root}: no subject folders with ct.nii.gz / segmentations/ found; point the root "
                "at the folder holding s0000/, s0001/, ..."
            )
        return subjects

    @cached_property
    def structures(self) -> list[str]:
        """Structure names in native-id order."""
        if self._given is not None:
            return self._given
        names: set[str] = set()
        for subject in self._subjects():
            folder = subject / "segmentations"
            if folder.is_dir():
                names.update(n for n in map(_structure_name, folder.iterdir()) if n)
        if not names:
            raise DataError(
                f"{self.root}: no segmentations/<structure>.nii.gz masks found; give the layout option "
                "structures or check the root"
            )
        return sorted(names)

    def _splits(self) -> dict[str, str]:
        path = self.root / "meta.csv"
        if not path.is_file():
            return {}
        try:
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f, delimiter=";"))
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise DataError(f"{path}: unreadable ({exc}); restore it from the release or delete it") from None
        return {r["image_id"]: r["split"] for r in rows if r.get("image_id") and r.get("split")}

    def scan(self) -> list[Record]:
        splits = self._splits()
        return [
            Record(
                s.name,
                (s / "ct.nii.gz",),
                s / "segmentations",
                splits.get(s.name, "train"),
                {"subject": s.name, "modality": "CT"},
            )
            for s in self._subjects()
        ]

    def label_names(self) -> dict[int, str]:
        return {0: "background", **{i: name for i, name in enumerate(self.structures, start=1)}}

    def _mask_path(self, folder: Path, structure: str) -> Path:
        for ending in MASK_ENDINGS:
            if (folder / f"{structure}{ending}").exists():
                return folder / f"{structure}{ending}"
        return folder / f"{structure}.nii.gz"

    def check(self, record: Record) -> list[Problem]:
        masks = []
        if record.label is not None:
            if not record.label.is_dir():
                return [
                    *volume_checks.check_volumes(
                        record.images, None, ["ct"], tolerance=self.tolerance, channels=["CT"]
                    ),
                    Problem(
                        record.label,
                        "missing segmentations folder",
                        f"restore {record.label.name}/ with one <structure>.nii.gz mask per structure",
                    ),
                ]
            masks = [(self._mask_path(record.label, s), s) for s in self.structures]
        return volume_checks.check_volumes(
            record.images, None, ["ct"], tolerance=self.tolerance, extra_labels=masks, channels=["CT"]
        )

    def read_label(self, record: Record) -> np.ndarray:
        """The label :meth:`read` gives, without decoding the CT (its shape comes from the header): what the K-shot
        label index reads (:func:`jascl.data.real.sources.read_native_label`)."""
        if record.label is None:
            raise DataError(f"{record.id}: the layout read no label for this sample")
        return self._combined_masks(record.label, medical.grid_shape(record.images[0]))

    def _combined_masks(self, folder: Path, shape: tuple[int, ...]) -> np.ndarray:
        """The structures' masks in ``folder`` as one id map of ``shape``, in nibabel's Fortran order, as the masks
        are decoded (so each mask is merged in memory order); later structures win where masks overlap."""
        label = np.zeros(shape, compact_dtype(np.array([len(self.structures)])), order="F")
        for index, structure in enumerate(self.structures, start=1):
            path = self._mask_path(folder, structure)
            mask, _ = medical.load_label(path)
            medical.check_label_grid(mask.shape, shape, path)
            label[mask > 0] = index
        return label

    def read(self, record: Record) -> Sample:
        ct, affine = medical.load_volume(record.images[0])
        image = medical.stack_channels([ct], record.images)
        label = None if record.label is None else self._combined_masks(record.label, image.shape[1:])
        return Sample(
            image,
            label,
            affine,
            {"spacing": medical.voxel_spacing(affine), "id": record.id, "modalities": ["CT"], "modality": "CT"},
        )
