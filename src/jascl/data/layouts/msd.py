"""The Medical Segmentation Decathlon / nnU-Net raw layout (``msd``).

Covers the Decathlon's own release and the nnU-Net v1 / v2 "raw" conversions that
AMOS, BCV (BTCV), MOTS, BraTS and VerSe are commonly distributed in::

    <root>/dataset.json
    <root>/imagesTr/<case>.nii.gz              # Decathlon: one file per case (4D when multi-channel)
    <root>/imagesTr/<case>_0000.nii.gz, ...    # nnU-Net: one file per channel, suffix _XXXX
    <root>/labelsTr/<case>.nii.gz
    <root>/imagesTs/...                        # unlabelled test cases (optional)

``dataset.json`` gives the channel names (``modality`` in v1, ``channel_names`` in v2),
the labels (``{"1": "liver"}`` in v1, ``{"liver": 1}`` in v2) and, in v1 and the Decathlon
originals, the ``training`` / ``test`` file lists; without lists the cases are found by listing
the folders. The variants found in the wild are read alike:

* list entries with or without ``./``, relative to the root or absolute (an absolute path from
  another machine is tried under the root's ``imagesTr`` / ``labelsTr`` by its file name);
* image entries that name the case (``./imagesTr/case.nii.gz``, as nnU-Net v1 writes) or one of
  its channel files (``./imagesTr/case_0000.nii.gz``, as several conversion scripts write): the
  channel suffix is recognised and not appended a second time;
* nnU-Net v2's explicit ``dataset`` mapping (``{case: {"images": [...], "label": ...}}``, paths
  relative to the root or absolute, ``$VARIABLES`` expanded as nnU-Net does);
* the macOS ``._<name>`` resource files the Decathlon archives carry are not cases.

A listed file that is missing is reported with the path as listed and the path tried.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data import medical, nifti, volume_checks
from jascl.data.layouts.base import LAYOUTS, DatasetLayout, Problem, Record, Sample
from jascl.errors import DataError

CHANNEL_SUFFIX_DIGITS = 4

#: file endings nibabel reads as volumes (NIfTI first; Analyze and MGH as nibabel opens them too)
NIFTI_ENDINGS = (".nii.gz", ".nii", ".img", ".hdr", ".img.gz", ".mgz", ".mgh")


#: the dataset.json keys jascl reads, with the JSON type each must have
_META_TYPES = (
    ("labels", dict, "an object of label ids and names"),
    ("modality", dict, "an object of channel index: name"),
    ("channel_names", dict, "an object of channel index: name"),
    ("training", list, "a list of entries"),
    ("test", list, "a list of entries"),
    ("dataset", dict, "an object of case: {images, label}"),
    ("file_ending", str, "a string such as .nii.gz"),
)


def _strip(name: str, ending: str) -> str:
    return name[: -len(ending)] if name.endswith(ending) else name


def _layouts_2d() -> list[str]:
    """The registered layouts of 2D images (what a PNG dataset wants instead)."""
    return [n for n in LAYOUTS.list() if getattr(LAYOUTS.get(n), "spatial_dims", 3) == 2]


@LAYOUTS.register(
    "msd", doc="Medical Segmentation Decathlon / nnU-Net raw (dataset.json, imagesTr, labelsTr, _0000 channels)"
)
class MSDLayout(DatasetLayout):
    """Decathlon / nnU-Net raw dataset.

    Options:
        include_test: also list ``imagesTs`` cases (split "test", no label); default True.
        affine_tolerance: largest affine difference accepted between a case's files
            (default :data:`jascl.data.nifti.AFFINE_TOLERANCE`).

    Records: id = case name (``imagesTs`` cases whose name is also a training case get
    the prefix ``imagesTs/``); split "train" (``imagesTr``) or "test" (``imagesTs``);
    meta ``{"case", "modalities", "modality"}`` where ``modality`` is "CT" when the
    single channel is CT, else "MRI".
    """

    name = "msd"
    spatial_dims = 3
    description = (
        "Medical Segmentation Decathlon (medicaldecathlon.com) or an nnU-Net raw conversion of AMOS, "
        "BCV, MOTS, BraTS, VerSe: dataset.json + imagesTr/ + labelsTr/ (+ imagesTs/), channel "
        "files <case>_0000.nii.gz or one (4D) file per case"
    )

    def __init__(self, root: str | Path, **options: Any) -> None:
        super().__init__(root, **options)
        medical.check_options(self.name, options, ("include_test", "affine_tolerance"))
        self.include_test = bool(options.get("include_test", True))
        self.tolerance = float(options.get("affine_tolerance", nifti.AFFINE_TOLERANCE))
        self._meta: dict | None = None
        self._ending: str | None = None

    # --- dataset.json ---------------------------------------------------------------------------------------

    @property
    def meta(self) -> dict:
        if self._meta is None:
            if not self.root.is_dir():
                raise DataError(
                    f"{self.root}: dataset root not found; pass the folder holding dataset.json, "
                    "imagesTr/ and labelsTr/ (--root NAME=PATH)"
                )
            path = self.root / "dataset.json"
            if not path.is_file():
                raise DataError(
                    f"{path}: not found, so {self.root} is not an MSD / nnU-Net raw dataset; point the "
                    "root at the folder holding dataset.json, imagesTr/ and labelsTr/"
                )
            try:
                # utf-8-sig: a byte-order mark, as Windows editors write one, is read, not refused
                meta = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=self._no_twice(path))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DataError(f"{path}: not valid JSON ({exc}); restore the dataset's dataset.json") from None
            if not isinstance(meta, dict):
                raise DataError(f"{path}: expected a JSON object; restore the dataset's dataset.json")
            for key, kind, what in _META_TYPES:
                if meta.get(key) is not None and not isinstance(meta[key], kind):
                    raise DataError(
                        f"{path}: '{key}' must be {what} (got {type(meta[key]).__name__}); fix dataset.json "
                        "or restore the dataset's own"
                    )
            self._meta = meta
        return self._meta

    def _no_twice(self, path: Path):
        """A JSON object hook that keeps the last of a repeated key, as ``json`` does, and warns about it."""

        def pairs(items: list[tuple[str, Any]]) -> dict:
            seen: dict[str, Any] = {}
            for key, value in items:
                if key in seen:
                    self.warnings.append(
                        f"{path}: key {key!r} appears twice in one object; the last one is used (remove the other)"
                    )
                seen[key] = value
            return seen

        return pairs

    @property
    def ending(self) -> str:
        """The volumes' file ending: dataset.json's ``file_ending`` (nnU-Net v2 writes one); without it, the ending
        every listed training image carries when that is ``.nii`` (a v1 list of uncompressed files), or ``.nii``
        when ``imagesTr`` holds ``.nii`` files and no ``.nii.gz`` (a conversion that wrote no list); else
        ``.nii.gz``, the Decathlon's."""
        if self._ending is None:
            ending = self.meta.get("file_ending")
            if ending is None:
                listed = [e.get("image") if isinstance(e, dict) else e for e in self.meta.get("training") or []]
                names = [n for n in listed if isinstance(n, str)]
                folder = self.root / "imagesTr"
                if names and all(n.endswith(".nii") for n in names):
                    ending = ".nii"
                elif not names and any(folder.glob("*.nii")) and not any(folder.glob("*.nii.gz")):
                    ending = ".nii"
            self._ending = str(ending or ".nii.gz")
        return self._ending

    def _check_nifti(self, records: list[Record]) -> None:
        """One line for a dataset whose files are not NIfTI (a PNG dataset given to this layout), instead of an
        "unreadable NIfTI" line per file."""
        names = [p.name for r in records for p in r.images]
        names += [Path(n).name for r in records for n in (r.meta.get("listed") or {}).get("images", [])]
        endings = {self.ending} | {
            "".join(Path(n).suffixes[-2:]) if n.endswith(".gz") else Path(n).suffix for n in names
        }
        foreign = sorted(e for e in endings if e and e.lower() not in NIFTI_ENDINGS)
        if foreign:
            example = next((n for n in names if not n.lower().endswith(NIFTI_ENDINGS)), None)
            raise DataError(
                f"{self.root}: the msd layout reads NIfTI volumes (.nii.gz, .nii), but this dataset's files are "
                f"{', '.join(foreign)}" + (f" (e.g. {example})" if example is not None else "") + "; convert them to "
                f"NIfTI, or give a 2D dataset a 2D layout ({', '.join(_layouts_2d())})"
            )

    @property
    def modalities(self) -> list[str]:
        """Channel names in channel order (v1 ``modality`` / v2 ``channel_names``)."""
        channels = self.meta.get("channel_names", self.meta.get("modality")) or {}
        try:
            return [str(channels[k]) for k in sorted(channels, key=int)]
        except (ValueError, TypeError):
            raise DataError(
                f"{self.root / 'dataset.json'}: channel keys must be '0', '1', ...; fix 'modality' / 'channel_names'"
            ) from None

    def label_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for key, value in (self.meta.get("labels") or {}).items():
            if isinstance(value, int) and not isinstance(value, bool):  # v2: name -> id
                names[value] = str(key)
            elif str(key).lstrip("-").isdigit():  # v1: "id" -> name
                names[int(key)] = str(value)
            # v2 region labels (name -> list of ids) are unions of ids already listed: skipped
        names.setdefault(0, "background")
        return dict(sorted(names.items()))

    # --- scanning ---------------------------------------------------------------------------------------------

    def _image_files(self, folder: Path, case: str, split_channels: bool) -> tuple[Path, ...]:
        if not split_channels:
            return (folder / f"{case}{self.ending}",)
        count = max(len(self.modalities), 1)
        return tuple(folder / f"{case}_{c:0{CHANNEL_SUFFIX_DIGITS}d}{self.ending}" for c in range(count))

    def _uses_channel_files(self, folder: Path, listed: list[str]) -> bool:
        """nnU-Net style (``<case>_0000``) or one file per case: decided once per folder."""
        if any(folder.glob(f"*_0000{self.ending}")):
            return True
        if any((folder / f"{c}{self.ending}").is_file() for c in listed):
            return False
        return "file_ending" in self.meta  # nnU-Net v2 always splits channels

    def _resolve_listed(self, listed: str, folder: str) -> Path:
        """A file named in dataset.json: as listed (relative to the root, or absolute) if it exists, else the
        file of that name in ``<root>/<folder>`` if that exists, else as listed (reported missing)."""
        path = Path(os.path.expandvars(listed))
        path = path if path.is_absolute() else self.root / path
        if path.is_file():
            return path
        fallback = self.root / folder / path.name
        return fallback if fallback.is_file() else path

    def _entry_case(self, image: str, folder: Path, channel_files: bool) -> str:
        """The case an image entry names: its file name without the ending and, in a folder of channel files,
        without a channel suffix the entry carries (``case_0000`` -> ``case``; ``amos_0001`` stays when
        ``amos_0001_0000`` exists or 0001 is not a channel of this dataset)."""
        stem = _strip(Path(image).name, self.ending)
        base, sep, digits = stem.rpartition("_")
        if not (channel_files and sep and len(digits) == CHANNEL_SUFFIX_DIGITS and digits.isdigit()):
            return stem
        if (folder / f"{stem}_{0:0{CHANNEL_SUFFIX_DIGITS}d}{self.ending}").is_file():
            return stem
        return base if int(digits) < max(len(self.modalities), 1) else stem

    def _listed_cases(self, key: str, folder: Path) -> dict[str, tuple[Path | None, str, str]] | None:
        """Case -> (its label file, the image and the label as listed) from the v1 / Decathlon ``training`` /
        ``test`` list; None without a list."""
        entries = self.meta.get(key)
        if entries is None:
            return None
        if not isinstance(entries, list):
            raise DataError(f"{self.root / 'dataset.json'}: '{key}' must be a list of entries; fix the file")
        channel_files = any(folder.glob(f"*_0000{self.ending}")) if folder.is_dir() else "file_ending" in self.meta
        cases: dict[str, tuple[Path | None, str, str]] = {}
        listed: set[str] = set()
        for entry in entries:
            image = entry.get("image") if isinstance(entry, dict) else entry
            label = entry.get("label") if isinstance(entry, dict) else None
            if not isinstance(image, str) or not isinstance(label, (str, type(None))):
                raise DataError(
                    f"{self.root / 'dataset.json'}: '{key}' entries must name an image file "
                    "(and a label file); fix the list"
                )
            case = self._entry_case(image, folder, channel_files)
            same = os.path.normpath(image)
            if same in listed:  # the same file listed again (an entry per channel file is no repeat)
                self.warnings.append(
                    f"{self.root / 'dataset.json'}: '{key}' lists case {case} ({image}) more than once; it is used "
                    "once (remove the repeated entry)"
                )
            listed.add(same)
            if case not in cases:  # an entry per channel file names the case once
                cases[case] = (self._resolve_listed(label, "labelsTr") if label else None, image, label or "")
        return cases

    def _explicit_records(self) -> list[Record] | None:
        """nnU-Net v2's ``dataset`` mapping: case -> {"images": [...], "label": ...}; None without one."""
        mapping = self.meta.get("dataset")
        if mapping is None:
            return None
        bad = DataError(
            f'{self.root / "dataset.json"}: \'dataset\' must map each case to {{"images": [files], "label": file}}; '
            "fix the file"
        )
        if not isinstance(mapping, dict):
            raise bad
        names = self.modalities
        records = []
        for case, entry in sorted(mapping.items()):
            images = entry.get("images") if isinstance(entry, dict) else None
            label = entry.get("label") if isinstance(entry, dict) else None
            if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
                raise bad
            if not isinstance(label, (str, type(None))):
                raise bad
            records.append(
                Record(
                    str(case),
                    tuple(self._resolve_listed(i, "imagesTr") for i in images),
                    self._resolve_listed(label, "labelsTr") if label else None,
                    "train",
                    {
                        "case": str(case),
                        "modalities": names,
                        "modality": self._modality(names),
                        "listed": {"images": list(images), "label": label or ""},
                    },
                )
            )
        return records

    @staticmethod
    def _modality(names: list[str]) -> str:
        return "CT" if len(names) == 1 and names[0].upper() == "CT" else "MRI"

    def _found_cases(self, folder: Path) -> list[str]:
        cases = set()
        for path in folder.glob(f"*{self.ending}"):
            if path.name.startswith("."):  # macOS "._<name>" resource files (in the Decathlon archives), hidden files
                continue
            case = _strip(path.name, self.ending)
            suffix = case.rsplit("_", 1)
            if len(suffix) == 2 and len(suffix[1]) == CHANNEL_SUFFIX_DIGITS and suffix[1].isdigit():
                case = suffix[0]
            cases.add(case)
        return sorted(cases)

    def scan(self) -> list[Record]:
        names = self.modalities
        modality = self._modality(names)
        images_tr, labels_tr, images_ts = (self.root / n for n in ("imagesTr", "labelsTr", "imagesTs"))
        explicit = self._explicit_records()
        if explicit is not None:
            records, train = explicit, [r.id for r in explicit]
        else:
            records, train = self._training_records(images_tr, labels_tr, names, modality)
        if self.include_test:
            listed_test = self._listed_cases("test", images_ts)
            test = (
                list(listed_test)
                if listed_test is not None
                else (self._found_cases(images_ts) if images_ts.is_dir() else [])
            )
            split_ts = self._uses_channel_files(images_ts, test)
            train_ids = set(train)
            for case in test:
                rid = f"imagesTs/{case}" if case in train_ids else case
                meta: dict[str, Any] = {"case": case, "modalities": names, "modality": modality}
                if listed_test is not None:
                    meta["listed"] = {"images": [listed_test[case][1]], "label": ""}
                records.append(Record(rid, self._image_files(images_ts, case, split_ts), None, "test", meta))
        if not records:
            raise DataError(f"{self.root}: no cases found in imagesTr/ or dataset.json; check the root")
        self._check_nifti(records)
        return sorted(records, key=lambda r: r.id)

    def _training_records(
        self, images_tr: Path, labels_tr: Path, names: list[str], modality: str
    ) -> tuple[list[Record], list[str]]:
        """The training cases from the ``training`` list, else from the folders."""
        listed = self._listed_cases("training", images_tr)
        if listed is None and not images_tr.is_dir():
            raise DataError(f"{images_tr}: not found; an MSD / nnU-Net raw dataset keeps its training images there")
        # cases found only in labelsTr are listed too, so a missing image is reported, not silently skipped
        if listed is None:
            found = set(self._found_cases(images_tr)) | set(self._found_cases(labels_tr) if labels_tr.is_dir() else ())
            listed = {case: (None, "", "") for case in sorted(found)}
        train = list(listed)
        split_tr = self._uses_channel_files(images_tr, train)
        records = []
        for case in train:
            label, listed_image, listed_label = listed[case]
            meta: dict[str, Any] = {"case": case, "modalities": names, "modality": modality}
            if listed_image:
                meta["listed"] = {"images": [listed_image], "label": listed_label}
            records.append(
                Record(
                    case,
                    self._image_files(images_tr, case, split_tr),
                    label or labels_tr / f"{case}{self.ending}",
                    "train",
                    meta,
                )
            )
        return records, train

    # --- checking and reading -------------------------------------------------------------------------------

    def _channel_names(self, record: Record) -> list[str]:
        names = list(record.meta.get("modalities") or self.modalities)
        if len(record.images) == len(names):
            return names
        return [f"channel {i}" for i in range(len(record.images))]

    def check(self, record: Record) -> list[Problem]:
        problems = volume_checks.check_volumes(
            record.images,
            record.label,
            self._channel_names(record),
            label_values=self.label_names(),
            tolerance=self.tolerance,
            channels=self.modalities or None,
        )
        listed = record.meta.get("listed")
        if not listed:
            return problems
        out = []
        for problem in problems:
            if problem.message.startswith("missing"):
                if record.label is not None and Path(problem.path) == record.label:
                    as_listed = listed.get("label") or ""
                else:
                    images = listed.get("images") or []
                    index = record.images.index(Path(problem.path)) if Path(problem.path) in record.images else 0
                    as_listed = images[min(index, len(images) - 1)] if images else ""
                if as_listed:
                    problem = Problem(
                        problem.path,
                        f"{problem.message} (dataset.json lists {as_listed!r}; this is the path tried)",
                        problem.fix,
                    )
            out.append(problem)
        return out

    def read_label(self, record: Record) -> np.ndarray:
        """The label :meth:`read` gives, without the image (:func:`jascl.data.medical.read_label_only`)."""
        return medical.read_label_only(record.id, record.label)

    def read(self, record: Record) -> Sample:
        return medical.read_volumes(
            record.id,
            record.images,
            record.label,
            {"modalities": self._channel_names(record), "modality": record.meta.get("modality", "")},
        )
