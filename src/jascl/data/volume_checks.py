"""Integrity checks of a sample's NIfTI files, shared by the medical layouts.

:func:`check_volumes` opens every file of a sample and reports what is wrong as
:class:`~jascl.data.layouts.base.Problem` lines (missing file or modality, unreadable / corrupt NIfTI,
header sizes the file cannot hold, image/label shape or affine mismatch, implausible spacing,
non-integer or undeclared label values). The ``msd``, ``totalsegmentator`` and ``brats`` layouts use
it, so the three report problems the same way. Decoding and preprocessing are :mod:`jascl.data.medical`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.geometry import MAX_SPACING_MM, affine_problem, header_size_problem
from jascl.data.layouts.base import Problem, image_value_problems
from jascl.data.nifti import AFFINE_TOLERANCE, REDOWNLOAD, _nib, _reason, missing_reason, volume_shape


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

    def open_checked(path: Path, what: str, decode: bool) -> tuple[Any, np.ndarray] | None:
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
    """A 3D volume, or 4D with channels last (axes of size 1 after the third do not count:
    :func:`jascl.data.nifti.volume_shape`); one channel per file when a sample has one file per channel."""
    shape = volume_shape(shape)
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
