"""BraTS's own layout (``brats``).

::

    <root>/BraTS2021_00000/BraTS2021_00000_{t1,t1ce,t2,flair,seg}.nii.gz    # BraTS 2018-2021
    <root>/BraTS-GLI-00000-000/BraTS-GLI-00000-000-{t1n,t1c,t2w,t2f,seg}.nii.gz   # BraTS 2023 names

Subject folders may also sit one level deeper (``<root>/MICCAI_BraTS2020_TrainingData/...``).
Labels: 2018-2021 use 1 (necrotic / non-enhancing tumour core), 2 (peritumoral
edema), 4 (GD-enhancing tumour); 2023 uses 1, 2, 3 (enhancing tumour). Files are
matched by their modality suffix, so case-name quirks in the releases do not matter.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data import medical, nifti, volume_checks
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import ConfigError, DataError

MODALITIES = ("t1", "t1ce", "t2", "flair")
#: BraTS 2023 file suffix of each classic modality name
NAMES_2023 = {"t1": "t1n", "t1ce": "t1c", "t2": "t2w", "flair": "t2f"}
LABELS = {
    "2021": {
        0: "background",
        1: "necrotic / non-enhancing tumour core",
        2: "peritumoral edema",
        4: "GD-enhancing tumour",
    },
    "2023": {
        0: "background",
        1: "non-enhancing tumour core",
        2: "surrounding FLAIR hyperintensity",
        3: "enhancing tumour",
    },
}
ENDINGS = (".nii.gz", ".nii")


@LAYOUTS.register("brats", doc="BraTS (<subject>/<subject>_{t1,t1ce,t2,flair,seg}.nii.gz; 2023 names too)")
class BraTSLayout(DatasetLayout):
    """BraTS dataset.

    Options:
        modalities: channels in order, by classic name (default ``[t1, t1ce, t2, flair]``;
            2023 names t1n / t1c / t2w / t2f are accepted too).
        labelled: True = every subject must have a seg file (a missing one is reported);
            False = ignore seg files (unlabelled pool); default: True when any subject has one.
        affine_tolerance: largest affine difference accepted between a subject's files.

    Records: id = subject folder name; split "train" when labelled, else "val" (BraTS
    releases its validation data without labels); meta ``{"subject", "modality": "MRI"}``.
    """

    name = "brats"
    spatial_dims = 3
    description = (
        "BraTS (synapse.org / the RSNA-ASNR-MICCAI challenge): one folder per subject with "
        "<subject>_t1/_t1ce/_t2/_flair/_seg.nii.gz (2023: -t1n/-t1c/-t2w/-t2f/-seg)"
    )

    def __init__(self, root: str | Path, **options: Any) -> None:
        super().__init__(root, **options)
        medical.check_options(self.name, options, ("modalities", "labelled", "affine_tolerance"))
        self.tolerance = float(options.get("affine_tolerance", nifti.AFFINE_TOLERANCE))
        reverse = {v: k for k, v in NAMES_2023.items()}
        modalities = options.get("modalities", MODALITIES)
        if isinstance(modalities, str) or not modalities:
            modalities = [modalities] if modalities else []
        classic = [reverse.get(str(m).lower(), str(m).lower()) for m in modalities]
        bad = [m for m in classic if m not in MODALITIES]
        if bad or not classic or len(set(classic)) != len(classic):
            raise ConfigError(
                f"brats option modalities={list(modalities)!r}: choose distinct names from "
                f"{list(MODALITIES)} (or the 2023 names {list(NAMES_2023.values())})"
            )
        self.modalities = classic
        labelled = options.get("labelled")
        self._labelled = None if labelled is None else bool(labelled)

    # --- discovery --------------------------------------------------------------------------------------------

    @staticmethod
    def _volumes(folder: Path) -> list[Path]:
        return [p for p in folder.iterdir() if p.is_file() and p.name.endswith(ENDINGS)]

    @cached_property
    def _subjects(self) -> list[Path]:
        if not self.root.is_dir():
            raise DataError(
                f"{self.root}: dataset root not found; pass the BraTS folder holding the subject "
                "folders (--root NAME=PATH)"
            )
        subjects = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if self._volumes(folder):
                subjects.append(folder)
            else:  # e.g. <root>/MICCAI_BraTS2020_TrainingData/<subject>/
                subjects += [p for p in sorted(folder.iterdir()) if p.is_dir() and self._volumes(p)]
        if not subjects:
            raise DataError(
                f"{self.root}: no subject folders with .nii.gz volumes found; point the root at the "
                "folder holding BraTS2021_00000/, ... (or the release folder above them)"
            )
        return subjects

    @cached_property
    def naming(self) -> str:
        """ "2023" when the files use the BraTS 2023 suffixes (``-t2f``), else "2021"."""
        for folder in self._subjects:
            for path in self._volumes(folder):
                if any(path.name.lower().endswith(f"-{n}{e}") for n in NAMES_2023.values() for e in ENDINGS):
                    return "2023"
        return "2021"

    def _file(self, folder: Path, key: str) -> Path:
        """The file of modality (or "seg") ``key`` in ``folder``; its expected path when missing."""
        suffix = NAMES_2023.get(key, key) if self.naming == "2023" else key
        sep = "-" if self.naming == "2023" else "_"
        for path in self._volumes(folder):
            if any(path.name.lower().endswith(f"{sep}{suffix}{e}") for e in ENDINGS):
                return path
        return folder / f"{folder.name}{sep}{suffix}.nii.gz"

    @cached_property
    def labelled(self) -> bool:
        if self._labelled is not None:
            return self._labelled
        return any(self._file(f, "seg").exists() for f in self._subjects)

    def scan(self) -> list[Record]:
        labelled = self.labelled
        records = [
            Record(
                f.name,
                tuple(self._file(f, m) for m in self.modalities),
                self._file(f, "seg") if labelled else None,
                "train" if labelled else "val",
                {"subject": f.name, "modality": "MRI"},
            )
            for f in self._subjects
        ]
        ids = [r.id for r in records]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})[0]
            raise DataError(f"{self.root}: subject {dup} appears in two folders; keep one copy")
        return sorted(records, key=lambda r: r.id)

    def label_names(self) -> dict[int, str]:
        return dict(LABELS[self.naming])

    # --- checking and reading -------------------------------------------------------------------------------

    def check(self, record: Record) -> list[Problem]:
        return volume_checks.check_volumes(
            record.images, record.label, self.modalities, label_values=self.label_names(), tolerance=self.tolerance
        )

    def read_label(self, record: Record) -> np.ndarray:
        """The label :meth:`read` gives, without the image (:func:`jascl.data.medical.read_label_only`)."""
        return medical.read_label_only(record.id, record.label)

    def read(self, record: Record) -> Sample:
        return medical.read_volumes(
            record.id, record.images, record.label, {"modalities": list(self.modalities), "modality": "MRI"}
        )
