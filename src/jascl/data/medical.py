"""NIfTI volumes: decoding, integrity checks shared by the medical layouts, and MONAI preprocessing.

* :func:`load_volume` / :func:`load_label` decode one NIfTI file with nibabel and turn
  every failure into a one-line :class:`~jascl.errors.DataError` naming the file.
* :func:`jascl.data.volume_checks.check_volumes` (its own module) opens every file of a sample and
  reports what is wrong, with this module's readers.
* :func:`preprocess_volume` applies MONAI's transforms to a decoded
  :class:`~jascl.data.layouts.base.Sample`: reorientation, resampling to a target
  spacing (planned by MONAI, sampled by :mod:`jascl.data.resample`), CT windowing or MRI z-scoring.

Conventions: volumes are ``(C, X, Y, Z)`` float32 in the voxel order of the file
(axis 0 = the NIfTI's first axis); labels are ``(X, Y, Z)`` native ids in the smallest integer
dtype holding them (:func:`~jascl.data.types.compact_dtype`); affines
are nibabel's voxel-to-world (RAS+ world) 4 x 4 matrices, which is what MONAI's
``MetaTensor.affine`` expects.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.geometry import header_size_problem, planned_shape_problem
from jascl.data.layouts.base import Sample
from jascl.data.nifti import REDOWNLOAD, _nib, _reason, missing_reason, volume_shape
from jascl.data.resample import axis_aligned, resample_axes
from jascl.data.types import c_order, compact_dtype
from jascl.errors import ConfigError, DataError

#: default CT window in Hounsfield units (the soft-tissue window of MONAI's abdominal CT
#: tutorials); protocols set ``preprocess.window`` to override it
CT_WINDOW = (-175.0, 250.0)


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


def _decode(img, path: Path, dtype: Any | None) -> np.ndarray:
    """Decode the voxel data (applying the scaling slope / intercept); DataError on a truncated / corrupt file.

    A gzipped file is inflated with ISA-L (``isal.igzip``, when installed) instead of Python's zlib: 0.38 s
    instead of 0.85 s for a 512 x 512 x 300 int16 CT (best of 3, one core). nibabel still reads the header and
    does the rest: an ``ArrayProxy`` with the image's own (shape, dtype, offset, slope, intercept, order) reads
    the inflating stream, as ``img.get_fdata`` / ``img.dataobj`` read the file, so the arrays are the same.
    """
    try:
        igzip = _igzip() if path.name.endswith(".gz") else None
        if igzip is None:
            data = np.asarray(img.dataobj) if dtype is None else img.get_fdata(dtype=dtype)
        else:
            from nibabel.arrayproxy import ArrayProxy

            on_file = img.dataobj  # the image's header has its offset reset on load; the proxy keeps the file's
            spec = (on_file.shape, on_file.dtype, on_file.offset, on_file.slope, on_file.inter)
            with igzip.open(path, "rb") as stream:
                proxy = ArrayProxy(stream, spec, mmap=False, order=on_file.order)
                data = np.asarray(proxy) if dtype is None else np.asanyarray(proxy, dtype=dtype)
    except Exception as exc:
        raise DataError(f"{path}: unreadable or corrupt NIfTI ({_reason(exc)}); {REDOWNLOAD}") from None
    return data


def _igzip() -> Any | None:
    """ISA-L's gzip module, or None where it is not installed (then nibabel inflates with zlib)."""
    try:
        from isal import igzip
    except ImportError:
        return None
    return igzip


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
        (label, affine): label ``(X, Y, Z)`` native ids in the smallest integer dtype that holds them
        (:func:`~jascl.data.types.compact_dtype`: uint8 for the usual ids 0-255, not int64, which would be 8 x
        the memory of a large CT's label while it is preprocessed); affine ``(4, 4)``.

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
    return data.astype(compact_dtype(data), copy=False)


def _squeeze_extra_axes(volume: np.ndarray) -> np.ndarray:
    """``volume`` as :func:`~jascl.data.nifti.volume_shape` reads it (a view)."""
    return np.squeeze(volume, axis=tuple(i for i in range(3, volume.ndim) if volume.shape[i] == 1))


def stack_channels(volumes: Sequence[np.ndarray], paths: Sequence[Path]) -> np.ndarray:
    """Stack channel volumes ``(X, Y, Z)`` (or one ``(X, Y, Z, C)`` file) into ``(C, X, Y, Z)`` float32.

    Axes of size 1 after the third are dropped first (:func:`jascl.data.nifti.volume_shape`).

    One file's voxels stay as decoded, a view with the channel axis first when they are float32 already: nibabel
    decodes in the file's Fortran order, and preprocessing samples a volume where it lies in memory
    (:func:`jascl.data.resample.resample_axes`), so the transposing copy to C order (0.56 s for a 512 x 512 x 300
    CT, one thread) is not made. Several files are stacked in C order, each copied through
    :func:`~jascl.data.types.c_order`.

    Raises:
        DataError: the channel files differ in shape (naming the first that does).
    """
    volumes = [_squeeze_extra_axes(v) for v in volumes]
    if len(volumes) == 1 and volumes[0].ndim == 4:
        return np.moveaxis(volumes[0], -1, 0).astype(np.float32, copy=False)
    for volume, path in zip(volumes, paths):
        if volume.ndim != 3:
            raise DataError(
                f"{path}: expected a 3D volume per channel file, got shape {volume.shape}; save each channel as "
                "one 3D file (case_0000, case_0001, ...) or a case's channels as one 4D file (X, Y, Z, C)"
            )
        if volume.shape != volumes[0].shape:
            raise DataError(
                f"{path}: shape {volume.shape} differs from {paths[0].name} {volumes[0].shape}; "
                "all channels of a sample must share one voxel grid"
            )
    if len(volumes) == 1:
        return volumes[0].astype(np.float32, copy=False)[None]
    stacked = np.empty((len(volumes),) + volumes[0].shape, dtype=np.float32)
    for channel, volume in zip(stacked, volumes):
        channel[...] = c_order(volume, np.float32)
    return stacked


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
    check_label_grid(label.shape, image.shape[1:], label_path)


def check_label_grid(shape: Sequence[int], grid: Sequence[int], label_path: Path) -> None:
    """Raise DataError when a label of ``shape`` is not on the image's voxel ``grid`` ``(X, Y, Z)``."""
    if tuple(shape) != tuple(grid):
        raise DataError(
            f"{label_path}: label shape {tuple(shape)} differs from its image's {tuple(grid)}; "
            "the label must be on the image's voxel grid (re-export it, or resample it with nearest "
            "neighbour to the image)"
        )


def grid_shape(path: str | Path) -> tuple[int, ...]:
    """The ``(X, Y, Z)`` voxel grid of an image file, from its header (nothing decoded); DataError as
    :func:`load_volume` for a missing or unreadable file."""
    return volume_shape(_open(Path(path)).shape)[:3]


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


def read_label_only(record_id: str, label: Path | None) -> np.ndarray:
    """The label :func:`read_volumes` gives a sample, without decoding its image: what a layout's ``read_label``
    returns for the label index (which ids each label holds), at a fraction of the cost (for a 512 x 512 x 300 CT,
    the label's decode instead of the image's, its C-order copy and the label's).

    Raises:
        DataError: the sample has no label file, or the label cannot be read (as :func:`load_label`).
    """
    if label is None:
        raise DataError(f"{record_id}: the layout read no label for this sample")
    return load_label(label)[0]


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

    MONAI's ``Orientation`` and ``Spacing`` plan the resampling (output grid and voxel map). They permute and flip
    the axes and change the voxel size along the scan's own axes, so the map is a scale and a shift per axis, and
    :mod:`jascl.data.resample` samples it one axis at a time in float32 with float64 coordinates, instead of MONAI's sampling grid: within 0.00025 HU (two float32
    steps at 1000 HU) of MONAI's float64 resampling in the tests, where MONAI's own float32 resampling
    (preprocessing version 2), whose voxel map is float32, was up to 0.02 HU off on a 512 x 512 x 300 CT; labels
    are looked up in their integer dtype, with no float copy, and equal MONAI's except at a voxel whose centre
    falls exactly half-way between two source voxels. A 512 x 512 x 300 CT to 1.5 mm: 3.2 -> 0.34 s of resampling
    on one thread. Version 3 of the volume preprocessing (:data:`~jascl.data.real.sources.PREPROCESS_VERSIONS`)
    marks the change, so store entries made before it are rebuilt, and ``jascl data prepare --remove-outdated``
    deletes the old ones.

    Args:
        sample: image ``(C, X, Y, Z)`` float32, label ``(X, Y, Z)`` integer ids or None, affine ``(4, 4)``.
        options: the protocol's preprocessing options (keys above).

    Returns:
        (image, label): ``(C, X', Y', Z')`` float32 and ``(X', Y', Z')`` native ids in the smallest integer
        dtype holding them (:func:`~jascl.data.types.compact_dtype`; None if unlabelled).

    Raises:
        ConfigError: an unknown option key or value.
        DataError: the affine cannot be resampled (NaN, a zero axis) or resampling would collapse an axis or
            exceed the voxel limit (:func:`jascl.data.geometry.planned_shape_problem`).
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(PREPROCESS_KEYS))
    if unknown:
        raise ConfigError(f"preprocess: unknown option(s) {unknown}; known: {list(PREPROCESS_KEYS)}")
    orientation = options.get("orientation", "RAS")
    spacing = options.get("spacing")
    if spacing is not None and not (
        isinstance(spacing, (list, tuple))
        and len(spacing) == 3
        and all(isinstance(s, numbers.Real) and not isinstance(s, bool) and s > 0 for s in spacing)
    ):
        raise ConfigError(
            f"preprocess.spacing={spacing!r}: give three positive voxel sizes in mm, e.g. [1.5, 1.5, 2.0]"
        )
    modality = str(sample.meta.get("modality", "")).lower()
    intensity = str(options.get("intensity", "ct" if modality == "ct" else "mri")).lower()
    if intensity not in ("ct", "mri", "none"):
        raise ConfigError(f"preprocess.intensity={intensity!r}: choose ct, mri or none")
    window = span = None
    if intensity == "ct":
        window = _two_numbers(options.get("window", CT_WINDOW), "window", "[-175, 250] (HU)")
        span = _two_numbers(options.get("range", (0.0, 1.0)), "range", "[0, 1]")
        if window[1] <= window[0]:
            raise ConfigError(f"preprocess.window={list(window)}: the upper bound must exceed the lower one")
    if sample.affine is not None:  # the geometry MONAI resamples with, checked before it fails inside MONAI
        wrong, _ = planned_shape_problem(sample.image.shape[1:], sample.affine, options)
        if wrong is not None:
            where = sample.meta.get("path") or f"sample {sample.meta.get('id', '?')}"
            raise DataError(f"{where}: {wrong} (found while preprocessing it; 'jascl data check' lists all)")

    import torch
    from monai.transforms import NormalizeIntensity, ScaleIntensityRange

    affine = torch.as_tensor(sample.affine if sample.affine is not None else np.eye(4), dtype=torch.float64)
    grid = {"orientation": orientation, "spacing": spacing}
    label = None
    if sample.label is not None:  # first, so that its buffers are gone before the image is resampled
        ids = _regrid(np.asarray(sample.label)[None], affine, "nearest", **grid)[0]
        if ids.dtype.kind == "f":  # MONAI's resampling (an oblique map): float32 holds every id exactly
            ids = np.rint(ids)
        label = c_order(ids, compact_dtype(ids))
        del ids
    image = torch.as_tensor(_regrid(np.asarray(sample.image, dtype=np.float32), affine, "bilinear", **grid))

    if window is not None and span is not None:
        image = ScaleIntensityRange(a_min=window[0], a_max=window[1], b_min=span[0], b_max=span[1], clip=True)(image)
    elif intensity == "mri":
        image = NormalizeIntensity(nonzero=bool(options.get("nonzero", True)), channel_wise=True)(image)
    return c_order(torch.as_tensor(image).numpy(), np.float32), label


def _two_numbers(value: Any, key: str, example: str) -> tuple[float, float]:
    """``value`` as (lower, upper) floats; ConfigError naming ``preprocess.<key>`` otherwise."""
    try:
        if isinstance(value, (str, bytes)) or len(value) != 2:
            raise ValueError
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"preprocess.{key}={value!r}: give two numbers, lower and upper, e.g. {example}") from None
    return lo, hi


def _regrid(volume: np.ndarray, affine: Any, mode: str, orientation: Any, spacing: Any) -> np.ndarray:
    """``volume`` ``(C, X, Y, Z)`` (on ``affine``'s grid; any memory order) reoriented to ``orientation`` and
    resampled to ``spacing`` (``mode``: "bilinear" for float32 images, "nearest" for integer labels), as a
    C-contiguous array.

    MONAI plans both steps lazily (``Orientation`` and ``Spacing`` with ``lazy=True``, on a tensor of no memory):
    the output grid and one voxel map from it to ``volume``. A reorientation and a change of voxel size make a
    scaled, signed permutation, which :func:`jascl.data.resample.resample_axes` samples axis by axis where the
    volume lies in memory (no copy for the reorientation, no sampling grid, labels in their own dtype); any other
    map is resampled by MONAI itself, on a float32 copy. One volume at a time: the label's buffers are freed before
    the image's exist.
    """
    import torch
    from monai.data import MetaTensor
    from monai.transforms import Orientation, Spacing
    from monai.utils import LazyAttr

    planned = MetaTensor(torch.zeros(()).expand(*volume.shape), affine=affine.clone())
    if orientation:
        # labels=None: axis labels from the MetaTensor's space (RAS, as nibabel's affines are)
        planned = Orientation(axcodes=str(orientation), labels=None, lazy=True)(planned)
    pixdim = None if spacing is None else [float(s) for s in spacing]
    if pixdim is not None:
        planned = Spacing(pixdim=pixdim, mode=mode, dtype=np.float32, lazy=True)(planned)
    xform = np.eye(4)
    for step in planned.pending_operations:
        xform = xform @ np.asarray(step[LazyAttr.AFFINE], dtype=np.float64)
    shape = [int(s) for s in planned.peek_pending_shape()]
    if axis_aligned(xform, shape):
        return resample_axes(volume, xform, shape, mode)
    data = MetaTensor(torch.as_tensor(c_order(volume, np.float32)), affine=affine.clone())
    if orientation:
        data = Orientation(axcodes=str(orientation), labels=None)(data)
    if pixdim is not None:
        data = Spacing(pixdim=pixdim, mode=mode, dtype=np.float32)(data)
    return c_order(data.as_tensor().numpy())
