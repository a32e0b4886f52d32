"""NIfTI volumes: decoding, integrity checks shared by the medical layouts, and MONAI preprocessing.

* :func:`load_volume` / :func:`load_label` decode one NIfTI file with nibabel and turn
  every failure into a one-line :class:`~jascl.errors.DataError` naming the file.
* :func:`check_volumes` opens every file of a sample and reports what is wrong as
  :class:`~jascl.data.layouts.base.Problem` lines (missing file or modality,
  unreadable / corrupt NIfTI, image/label shape or affine mismatch, non-integer or
  undeclared label values). The ``msd``, ``totalsegmentator`` and ``brats`` layouts
  use it, so the three report problems the same way.
* :func:`preprocess_volume` applies MONAI's transforms to a decoded
  :class:`~jascl.data.layouts.base.Sample`: reorientation, resampling to a target
  spacing, CT windowing or MRI z-scoring.

Conventions: volumes are ``(C, X, Y, Z)`` float32 in the voxel order of the file
(axis 0 = the NIfTI's first axis); labels are ``(X, Y, Z)`` int64 native ids; affines
are nibabel's voxel-to-world (RAS+ world) 4 x 4 matrices, which is what MONAI's
``MetaTensor.affine`` expects.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.geometry import MAX_SPACING_MM, affine_problem, header_size_problem, planned_shape_problem
from jascl.data.layouts.base import Problem, Sample, image_value_problems
from jascl.errors import ConfigError, DataError

#: default largest absolute difference between two affines (mm for the origin, the
#: direction-cosine-times-spacing entries otherwise) still counted as the same grid
AFFINE_TOLERANCE = 1e-3

#: default CT window in Hounsfield units (the soft-tissue window of MONAI's abdominal CT
#: tutorials); protocols set ``preprocess.window`` to override it
CT_WINDOW = (-175.0, 250.0)

REDOWNLOAD = "re-download or re-extract it from the dataset's release"


def _nib():
    import nibabel  # imported on first use: layouts are imported by every CLI call

    return nibabel


def missing_reason(path: Path) -> str:
    """Why ``path`` is not a readable file: "symlink loop", "broken symlink (to ...)", "a folder, not a file" or
    "file not found"."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python < 3.13 raises RuntimeError for a loop
            return "symlink loop (the link points back to itself)"
        except OSError as exc:
            if getattr(exc, "errno", None) == 40:  # ELOOP
                return "symlink loop (the link points back to itself)"
            return f"broken symlink (to {os.readlink(path)}, which does not exist)"
    if path.is_dir():
        return "a folder, not a file"
    return "file not found"


def _open(path: Path):
    """The nibabel image of ``path`` (header only); DataError when missing, not a NIfTI, or when its header
    declares more voxels than the file holds or than the limit (:func:`jascl.data.geometry.header_size_problem`)."""
    if not path.is_file():
        raise DataError(f"{path}: {missing_reason(path)}; {REDOWNLOAD} or remove the sample from the dataset's list")
    try:
        img = _nib().load(str(path))
    except Exception as exc:  # nibabel raises many types for a bad file (ImageFileError, EOFError, zlib.error ...)
        raise DataError(f"{path}: unreadable or corrupt NIfTI ({_reason(exc)}); {REDOWNLOAD}") from None
    size = header_size_problem(path, img)
    if size is not None:
        raise DataError(f"{path}: {size}")
    return img


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _decode(img, path: Path, dtype: Any | None) -> np.ndarray:
    """Decode the voxel data (applying the scaling slope / intercept); DataError on a truncated / corrupt file."""
    try:
        data = np.asarray(img.dataobj) if dtype is None else img.get_fdata(dtype=dtype)
    except Exception as exc:
        raise DataError(f"{path}: unreadable or corrupt NIfTI ({_reason(exc)}); {REDOWNLOAD}") from None
    return data


def load_volume(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Decode an image volume.

    Returns:
        (data, affine): data ``(X, Y, Z)`` or ``(X, Y, Z, C)`` (multi-channel files,
        as the Decathlon stores its MRI tasks) float32 with the file's scaling applied;
        affine ``(4, 4)`` float64.

    Raises:
        DataError: the file is missing or corrupt (naming the file).
    """
    path = Path(path)
    img = _open(path)
    return _decode(img, path, np.float32), np.asarray(img.affine, dtype=np.float64)


def load_label(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Decode a label volume.

    Returns:
        (label, affine): label ``(X, Y, Z)`` int64 native ids; affine ``(4, 4)``.

    Raises:
        DataError: the file is missing, corrupt, not 3D or holds non-integer values.
    """
    path = Path(path)
    img = _open(path)
    data = _decode(img, path, None)
    data = _squeeze_to_3d(data, path)
    return _as_ids(data, path), np.asarray(img.affine, dtype=np.float64)


def _squeeze_to_3d(data: np.ndarray, path: Path) -> np.ndarray:
    while data.ndim > 3 and data.shape[-1] == 1:  # some converters write (X, Y, Z, 1) labels
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{path}: a label volume must be 3D, got shape {data.shape}; write the label as one 3D file")
    return data


def _as_ids(data: np.ndarray, path: Path) -> np.ndarray:
    if data.dtype.kind == "f":
        rounded = np.rint(data)
        if not np.array_equal(rounded, data):
            raise DataError(f"{path}: label volume holds non-integer values; save labels with an integer type")
        data = rounded
    return data.astype(np.int64)


def stack_channels(volumes: Sequence[np.ndarray], paths: Sequence[Path]) -> np.ndarray:
    """Stack channel volumes ``(X, Y, Z)`` (or one ``(X, Y, Z, C)`` file) into ``(C, X, Y, Z)`` float32.

    Raises:
        DataError: the channel files differ in shape (naming the first that does).
    """
    if len(volumes) == 1 and volumes[0].ndim == 4:
        return np.ascontiguousarray(np.moveaxis(volumes[0], -1, 0), dtype=np.float32)
    for volume, path in zip(volumes, paths):
        if volume.ndim != 3:
            raise DataError(f"{path}: expected a 3D volume per channel, got shape {volume.shape}")
        if volume.shape != volumes[0].shape:
            raise DataError(
                f"{path}: shape {volume.shape} differs from {paths[0].name} {volumes[0].shape}; "
                "all channels of a sample must share one voxel grid"
            )
    return np.stack(volumes).astype(np.float32, copy=False)


def check_options(layout: str, options: dict, known: Sequence[str]) -> None:
    """Raise ConfigError naming an option the layout does not know (a typo would otherwise be ignored)."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"dataset layout {layout!r}: unknown option(s) {unknown}; known: {sorted(known)}")


def voxel_spacing(affine: np.ndarray) -> tuple[float, ...]:
    """Voxel sizes (mm) along the three voxel axes: the column norms of the affine's 3 x 3 part."""
    return tuple(float(v) for v in np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(0)))


def check_label_shape(label: np.ndarray, image: np.ndarray, label_path: Path) -> None:
    """Raise DataError when a ``(X, Y, Z)`` label does not fit a ``(C, X, Y, Z)`` image."""
    if label.shape != image.shape[1:]:
        raise DataError(
            f"{label_path}: label shape {label.shape} differs from its image's {image.shape[1:]}; "
            "the label must be on the image's voxel grid (re-export it, or resample it with nearest "
            "neighbour to the image)"
        )


# ----------------------------------------------------------------------------------------------------------------
# checks


def read_volumes(record_id: str, images: Sequence[Path], label: Path | None, meta: dict) -> Sample:
    """Decode one volume per channel file (stacked in order) and the optional label map into a :class:`Sample`.

    The affine is the first channel's; the label must match the image's spatial shape.
    """
    volumes, affine = [], None
    for path in images:
        data, file_affine = load_volume(path)
        volumes.append(data)
        affine = file_affine if affine is None else affine
    image = stack_channels(volumes, images)
    label_ids = None
    if label is not None:
        label_ids, _ = load_label(label)
        check_label_shape(label_ids, image, label)
    meta = {"spacing": voxel_spacing(affine), "id": record_id, "path": str(images[0]), **meta}
    return Sample(image, label_ids, affine, meta)


def check_volumes(
    images: Sequence[Path],
    label: Path | None = None,
    names: Sequence[str] | None = None,
    label_values: Iterable[int] | None = None,
    tolerance: float = AFFINE_TOLERANCE,
    extra_labels: Sequence[tuple[Path, str]] = (),
    channels: Sequence[str] | None = None,
) -> list[Problem]:
    """Open every file of one sample and report what is wrong.

    The first image readable is the reference grid: every other image and the
    label(s) must have its spatial shape and (within ``tolerance``) its affine.
    Every image is decoded: non-finite values and constant images are reported
    (:func:`~jascl.data.layouts.base.image_value_problems`), as are voxel spacings
    that are zero, negative or over :data:`MAX_SPACING_MM` (in ``pixdim`` or in the affine resampling uses,
    which must also be finite), headers that declare more voxels than the file holds, 4D files where one 3D
    channel file is expected (and a file whose channel count differs from
    ``channels``), and 4D labels.

    Args:
        images: the image files, one per channel (or one multi-channel file).
        label: the label file, or None (unlabelled sample).
        names: a name per image file (e.g. modalities) used in "missing modality" lines.
        label_values: the native label ids the dataset declares; other values are reported.
        tolerance: largest absolute difference between affine entries still accepted.
        extra_labels: further (mask file, structure name) pairs on the same grid
            (TotalSegmentator's one-file-per-structure masks; values must be 0/1).
        channels: the channels the sample must have over all its image files, by name (e.g. the
            modalities dataset.json declares); None = not checked.

    Returns:
        One :class:`Problem` per defect; empty when the sample is sound.
    """
    problems: list[Problem] = []
    reference: tuple[Path, tuple[int, ...], np.ndarray] | None = None

    def open_checked(path: Path, what: str, decode: bool) -> tuple[Any, np.ndarray | None] | None:
        if not path.is_file():
            reason = missing_reason(path)
            problems.append(
                Problem(
                    path,
                    f"missing {what}" if reason == "file not found" else f"{what} is unreadable: {reason}",
                    f"restore the file ({REDOWNLOAD}) or drop the sample from the dataset",
                )
            )
            return None
        try:
            img = _nib().load(str(path))
        except Exception as exc:
            problems.append(Problem(path, f"unreadable or corrupt NIfTI ({_reason(exc)})", REDOWNLOAD))
            return None
        size = header_size_problem(path, img)  # before decoding: a lying header would allocate what it claims
        if size is not None:
            problems.append(Problem(path, f"{what}: {size}"))
            return None
        try:
            # decoding the voxels is the only way to find a truncated / corrupt compressed stream
            data = np.asarray(img.dataobj) if decode else img.dataobj.get_unscaled()
        except Exception as exc:
            problems.append(Problem(path, f"unreadable or corrupt NIfTI ({_reason(exc)})", REDOWNLOAD))
            return None
        return img, data

    def compare_grid(path: Path, img, what: str) -> bool:
        nonlocal reference
        shape = tuple(int(s) for s in img.shape[:3])
        if reference is None:
            reference = (path, shape, np.asarray(img.affine))
            return True
        ref_path, ref_shape, ref_affine = reference
        ok = True
        if shape != ref_shape:
            problems.append(
                Problem(
                    path,
                    f"{what} shape {shape} differs from {ref_path.name} {ref_shape}",
                    f"re-export the {what} on {ref_path.name}'s voxel grid",
                )
            )
            ok = False
        diff = float(np.abs(np.asarray(img.affine) - ref_affine).max())
        if diff > tolerance:
            problems.append(
                Problem(
                    path,
                    f"{what} affine differs from {ref_path.name}'s by up to {diff:.4g} (tolerance {tolerance:g})",
                    f"re-export the {what} with {ref_path.name}'s header (origin, spacing, "
                    "direction), or raise the layout option affine_tolerance if the difference "
                    "is rounding",
                )
            )
            ok = False
        return ok

    names = list(names) if names is not None else [f"image {i}" for i in range(len(images))]
    for path, name in zip(images, names):
        what = f"modality {name}" if len(images) > 1 else "image"
        opened = open_checked(Path(path), what, decode=False)
        if opened is not None:
            img, data = opened
            compare_grid(Path(path), img, "image")
            problems += _shape_problems(Path(path), img.shape, what, len(images), channels)
            problems += _spacing_problems(Path(path), img, what)
            problems += image_value_problems(Path(path), data, what)
    declared = set(int(v) for v in label_values) if label_values is not None else None
    if label is not None:
        opened = open_checked(Path(label), "label", decode=True)
        if opened is not None:
            img, data = opened
            compare_grid(Path(label), img, "label")
            if len(img.shape) > 3 and any(int(n) != 1 for n in img.shape[3:]):
                problems.append(
                    Problem(
                        Path(label),
                        f"label is {len(img.shape)}D {tuple(int(n) for n in img.shape)}; a label map is one 3D volume",
                        "save the label map as one 3D volume of class ids (not one-hot, not per-class channels)",
                    )
                )
            problems += _label_value_problems(Path(label), data, declared)
    for path, structure in extra_labels:
        opened = open_checked(Path(path), f"segmentation {structure}", decode=True)
        if opened is not None:
            img, data = opened
            compare_grid(Path(path), img, "segmentation")
            problems += _label_value_problems(Path(path), data, {0, 1}, binary=True)
    return problems


def _shape_problems(
    path: Path, shape: Sequence[int], what: str, files: int, channels: Sequence[str] | None
) -> list[Problem]:
    """A 3D volume, or 4D with channels last; one channel per file when a sample has one file per channel."""
    shape = tuple(int(n) for n in shape)
    if len(shape) < 3 or len(shape) > 4:
        return [
            Problem(
                path,
                f"{what} has {len(shape)} dimension(s) {shape}; a volume is 3D (or 4D, channels last)",
                "re-export it as a 3D NIfTI volume",
            )
        ]
    held = 1 if len(shape) == 3 else shape[3]
    if files > 1 and held > 1:
        return [
            Problem(
                path,
                f"{what} is 4D {shape} with {held} channels; a channel file (_0000, _0001, ...) holds one 3D volume",
                "split it into one 3D file per channel, or keep one 4D file per case without channel files",
            )
        ]
    if files == 1 and channels is not None and held != len(channels):
        kind = "3D" if len(shape) == 3 else "4D"
        return [
            Problem(
                path,
                f"image is {kind} {shape} with {held} channel(s); the dataset declares {len(channels)} "
                f"({', '.join(channels)})",
                "give one file per declared channel, or fix the channels (modality / channel_names) in dataset.json",
            )
        ]
    return []


def _spacing_problems(path: Path, img: Any, what: str) -> list[Problem]:
    """Voxel spacing (the header's zooms) that is zero, negative, not finite or over MAX_SPACING_MM; else what
    is wrong with the affine resampling uses (:func:`jascl.data.geometry.affine_problem`: NaN, a zero axis)."""
    try:
        zooms = [float(z) for z in img.header.get_zooms()[:3]]
    except Exception:  # a header without zooms: only the affine is checked
        zooms = [1.0, 1.0, 1.0]
    if all(np.isfinite(z) and 0 < z <= MAX_SPACING_MM for z in zooms):
        wrong = affine_problem(img.affine)
        return [] if wrong is None else [Problem(path, f"{what}: {wrong}")]
    return [
        Problem(
            path,
            f"{what} has an implausible voxel spacing {tuple(round(z, 4) for z in zooms)} mm (zero, negative or "
            f"over {MAX_SPACING_MM:g} mm)",
            "fix the header's voxel size (pixdim) from the scanner's or the dataset's documented spacing",
        )
    ]


def _label_value_problems(
    path: Path, data: np.ndarray, declared: set[int] | None, binary: bool = False
) -> list[Problem]:
    values = np.unique(data)
    if values.dtype.kind == "f" and not np.array_equal(values, np.rint(values)):
        return [Problem(path, "label holds non-integer values", "save labels with an integer type")]
    if declared is None:
        return []
    unknown = sorted(int(v) for v in values if int(v) not in declared)
    if not unknown:
        return []
    if binary:
        return [
            Problem(path, f"mask holds values {unknown}; a structure mask must be 0/1", "re-export the mask as binary")
        ]
    return [
        Problem(
            path,
            f"label value(s) {unknown} not declared by the dataset (declared: {sorted(declared)})",
            "fix the label file, or declare the value in the dataset's label list",
        )
    ]


# ----------------------------------------------------------------------------------------------------------------
# preprocessing

PREPROCESS_KEYS = ("orientation", "spacing", "intensity", "window", "range", "nonzero")


def preprocess_volume(sample: Sample, options: dict | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Reorient, resample and normalise a decoded volume with MONAI transforms.

    Steps (each optional): ``Orientationd`` to ``orientation`` axis codes (default
    ``"RAS"``); ``Spacingd`` to ``spacing`` mm per voxel (default: keep the native
    spacing; trilinear for the image, nearest neighbour for the label); then the
    intensity normalisation:

    * ``intensity: ct`` -- ``ScaleIntensityRanged``: clip to ``window`` (HU, default
      :data:`CT_WINDOW`) and map it linearly to ``range`` (default ``[0, 1]``);
    * ``intensity: mri`` -- ``NormalizeIntensityd``: z-score per channel, over
      non-zero voxels when ``nonzero`` (default True: the background of skull-stripped
      MRI stays 0 and does not skew the statistics);
    * ``intensity: none`` -- raw intensities.

    The default ``intensity`` follows ``sample.meta["modality"]``: "ct" for CT, "mri" otherwise.

    Args:
        sample: image ``(C, X, Y, Z)`` float32, label ``(X, Y, Z)`` int64 or None, affine ``(4, 4)``.
        options: the protocol's preprocessing options (keys above).

    Returns:
        (image, label): ``(C, X', Y', Z')`` float32 and ``(X', Y', Z')`` int64 (None if unlabelled).

    Raises:
        ConfigError: an unknown option key or value.
        DataError: the affine cannot be resampled (NaN, a zero axis) or resampling would collapse an axis or
            exceed the voxel limit (:func:`jascl.data.geometry.planned_shape_problem`).
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(PREPROCESS_KEYS))
    if unknown:
        raise ConfigError(f"preprocess: unknown option(s) {unknown}; known: {list(PREPROCESS_KEYS)}")
    if sample.affine is not None:  # the geometry MONAI resamples with, checked before it fails inside MONAI
        wrong, _ = planned_shape_problem(sample.image.shape[1:], sample.affine, options)
        if wrong is not None:
            where = sample.meta.get("path") or f"sample {sample.meta.get('id', '?')}"
            raise DataError(f"{where}: {wrong} (found while preprocessing it; 'jascl data check' lists all)")
    import torch
    from monai.data import MetaTensor
    from monai.transforms import NormalizeIntensityd, Orientationd, ScaleIntensityRanged, Spacingd

    affine = torch.as_tensor(sample.affine if sample.affine is not None else np.eye(4), dtype=torch.float64)
    data = {
        "image": MetaTensor(torch.as_tensor(np.ascontiguousarray(sample.image), dtype=torch.float32), affine=affine)
    }
    keys = ["image"]
    if sample.label is not None:
        # float32 holds every native id exactly (ids << 2**24); nearest resampling keeps them exact
        data["label"] = MetaTensor(
            torch.as_tensor(np.asarray(sample.label)[None], dtype=torch.float32), affine=affine.clone()
        )
        keys.append("label")
    modes = ["bilinear", "nearest"][: len(keys)]

    orientation = options.get("orientation", "RAS")
    if orientation:
        # labels=None: axis labels from the MetaTensor's space (RAS, as nibabel's affines are)
        data = Orientationd(keys=keys, axcodes=str(orientation), labels=None)(data)
    spacing = options.get("spacing")
    if spacing is not None:
        if not (isinstance(spacing, (list, tuple)) and len(spacing) == 3 and all(float(s) > 0 for s in spacing)):
            raise ConfigError(
                f"preprocess.spacing={spacing!r}: give three positive voxel sizes in mm, e.g. [1.5, 1.5, 2.0]"
            )
        data = Spacingd(keys=keys, pixdim=[float(s) for s in spacing], mode=modes)(data)

    modality = str(sample.meta.get("modality", "")).lower()
    intensity = str(options.get("intensity", "ct" if modality == "ct" else "mri")).lower()
    if intensity == "ct":
        lo, hi = (float(v) for v in options.get("window", CT_WINDOW))
        b_lo, b_hi = (float(v) for v in options.get("range", (0.0, 1.0)))
        if hi <= lo:
            raise ConfigError(f"preprocess.window={[lo, hi]}: the upper bound must exceed the lower one")
        data = ScaleIntensityRanged(keys="image", a_min=lo, a_max=hi, b_min=b_lo, b_max=b_hi, clip=True)(data)
    elif intensity == "mri":
        data = NormalizeIntensityd(keys="image", nonzero=bool(options.get("nonzero", True)), channel_wise=True)(data)
    elif intensity != "none":
        raise ConfigError(f"preprocess.intensity={intensity!r}: choose ct, mri or none")

    image = np.ascontiguousarray(torch.as_tensor(data["image"]).numpy(), dtype=np.float32)
    label = None
    if sample.label is not None:
        label = np.rint(torch.as_tensor(data["label"]).numpy()[0]).astype(np.int64)
    return image, label
