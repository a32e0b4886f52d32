"""Volume geometry checked before any voxel is decoded or resampled: the header's size, the affine that
resampling uses, and the shape a volume will have after preprocessing.

Why here and not in the pixel checks: nibabel repairs what it can of a header when it reads ``pixdim``
(the zooms come from the qform), but MONAI resamples with the *affine* (the sform when its code is set,
:attr:`nibabel.Nifti1Image.affine`), so a NaN or a zero column in the sform passes a zoom check and then
fails inside ``Orientationd`` (``SVD did not converge``) or ``Spacingd`` (``Unable to find out axis``).
And a header that claims more voxels than the file holds makes a decode allocate them all before it fails.

* :func:`affine_problem` -- the affine MONAI will use: finite, no zero-length or over-long voxel axis.
* :func:`header_size_problem` -- the voxel count the header declares against the file's size and
  :data:`MAX_VOXELS`, read from the header alone.
* :func:`planned_shape` -- the ``(X, Y, Z)`` shape after ``preprocess.orientation`` and
  ``preprocess.spacing`` (:func:`jascl.data.medical.preprocess_volume`), computed as MONAI's ``Orientation``
  and ``Spacing`` compute it (nibabel's orientation arithmetic, ``monai.data.utils.compute_shape_offset``),
  without resampling anything; :func:`planned_shape_problem` refuses a shape that resampling collapses
  (an axis of fewer than :data:`MIN_PLANNED_VOXELS` voxels) or inflates past :data:`MAX_VOXELS`.
* :func:`check_planned_volumes` -- the header checks above on every volume a run selected, before it trains.

Each returns one line (``"<what> ...; <fix>"``) or None; the callers prefix the file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.errors import DataError

#: the largest voxel spacing (mm) accepted along an axis of the affine; thicker "slices" are a header error
MAX_SPACING_MM = 20.0

#: the most voxels one volume (per channel) may hold, declared or after resampling: 2**30 (4 GiB as float32).
#: The environment variable ``JASCL_MAX_VOXELS`` raises it for a machine with the memory.
MAX_VOXELS = 2**30

#: the fewest voxels an axis may keep after resampling when it had more before; fewer means the header's
#: spacing is wrong (0.01 mm voxels resampled to 1.5 mm leave a 0.3 mm wide "volume")
MIN_PLANNED_VOXELS = 2

#: deflate cannot compress more than about 1032:1, so a gzipped NIfTI of n bytes holds at most this many times
#: n bytes of voxels (zlib's technical note, "Maximum compression factor")
DEFLATE_MAX_RATIO = 1032


def max_voxels() -> int:
    """:data:`MAX_VOXELS`, or ``JASCL_MAX_VOXELS`` when set to a positive integer."""
    value = os.environ.get("JASCL_MAX_VOXELS", "")
    return int(value) if value.isdigit() and int(value) > 0 else MAX_VOXELS


def spacing_of(affine: np.ndarray) -> tuple[float, ...]:
    """Voxel sizes (mm) along the three voxel axes: the column norms of the affine's 3 x 3 part."""
    return tuple(float(v) for v in np.sqrt((np.asarray(affine, dtype=np.float64)[:3, :3] ** 2).sum(0)))


def _mm(values: Sequence[float]) -> str:
    return " x ".join(f"{v:.4g}" for v in values)


def affine_problem(affine: Any) -> str | None:
    """What is wrong with a voxel-to-world affine for resampling, as one line, or None.

    Checked: a 4 x 4 matrix of finite values whose voxel axes (the columns of its 3 x 3 part) are longer
    than 0 and at most :data:`MAX_SPACING_MM` mm and span the three world axes (a rank-3 matrix).
    """
    fix = "fix the header's sform / qform (srow_x/y/z, pixdim) from the scanner's or the dataset's documented geometry"
    try:
        matrix = np.asarray(affine, dtype=np.float64)
    except (TypeError, ValueError):
        return f"the affine is not a matrix of numbers; {fix}"
    if matrix.shape != (4, 4):
        return f"the affine has shape {matrix.shape}, not 4 x 4; {fix}"
    if not np.isfinite(matrix).all():
        return f"the affine (sform/qform used for resampling) holds NaN or infinite values; {fix}"
    spacing = spacing_of(matrix)
    if not all(0 < s <= MAX_SPACING_MM for s in spacing):
        return (
            f"the affine's voxel spacing {_mm(spacing)} mm is zero or over {MAX_SPACING_MM:g} mm along an axis "
            f"(the affine is what resampling uses, whatever pixdim says); {fix}"
        )
    if np.linalg.matrix_rank(matrix[:3, :3]) < 3:
        return f"the affine's voxel axes do not span three dimensions (two are parallel); {fix}"
    return None


def header_size_problem(path: str | Path, img: Any) -> str | None:
    """Whether a NIfTI header declares more voxels than the file holds or than :func:`max_voxels` allows.

    Read from the header and the file's size only: nothing is decoded. An uncompressed file must hold the
    header's offset plus every declared byte; a gzipped one at most :data:`DEFLATE_MAX_RATIO` times its size.
    """
    shape = tuple(int(n) for n in img.shape)
    count = math.prod(shape) if shape else 0
    spatial = math.prod(shape[:3]) if shape else 0
    try:
        itemsize = int(np.dtype(img.get_data_dtype()).itemsize)
    except Exception:  # a header without a dtype: only the limit is checked
        itemsize = 0
    declared = count * itemsize
    size = Path(path).stat().st_size
    gib = declared / 2**30
    shown = " x ".join(map(str, shape))
    if Path(path).name.endswith(".gz"):
        holds, how = size * DEFLATE_MAX_RATIO, "at most"
    else:
        holds, how = max(size - int(getattr(img.dataobj, "offset", 0) or 0), 0), ""
    if declared and declared > holds:
        return (
            f"the header declares {shown} voxels ({gib:.3g} GiB of {img.get_data_dtype()}) but the file holds "
            f"{how + ' ' if how else ''}{holds / 2**30:.3g} GiB; the header's dimensions are wrong or the file is "
            "truncated: re-export or re-download it"
        )
    if spatial > max_voxels():
        return (
            f"the header declares {shown} voxels ({spatial:,} per channel), over the limit of {max_voxels():,} "
            "(set JASCL_MAX_VOXELS to raise it on a machine with the memory, or crop / resample the volume first)"
        )
    return None


def _orientation(shape: tuple[int, ...], affine: np.ndarray, axcodes: str) -> tuple[tuple[int, ...], np.ndarray]:
    """(shape, affine) after reorienting to ``axcodes`` (what MONAI's ``Orientation`` does to a RAS affine)."""
    from nibabel import orientations

    start = orientations.io_orientation(affine)
    transform = orientations.ornt_transform(start, orientations.axcodes2ornt(str(axcodes)))
    new_shape = [0] * len(shape)
    for axis, (target, _) in enumerate(transform):
        new_shape[int(target)] = shape[axis]
    return tuple(new_shape), affine @ orientations.inv_ornt_aff(transform, shape)


def planned_shape(
    shape: Sequence[int], affine: Any, orientation: str | None = "RAS", spacing: Sequence[float] | None = None
) -> tuple[int, ...]:
    """The ``(X, Y, Z)`` shape :func:`jascl.data.medical.preprocess_volume` will give a volume.

    Args:
        shape: the file's spatial shape (its first three dimensions).
        affine: its voxel-to-world affine (must pass :func:`affine_problem`).
        orientation: ``preprocess.orientation`` (default "RAS"; None or "" = kept).
        spacing: ``preprocess.spacing`` in mm (None = the native spacing is kept).
    """
    out = tuple(int(n) for n in shape[:3])
    matrix = np.asarray(affine, dtype=np.float64)
    if orientation:
        out, matrix = _orientation(out, matrix, str(orientation))
    if spacing is not None:
        from monai.data.utils import compute_shape_offset, zoom_affine

        target = zoom_affine(matrix, [float(s) for s in spacing], diagonal=False)
        resampled, _ = compute_shape_offset(out, matrix, target)
        out = tuple(int(n) for n in resampled)
    return out


def planned_shape_problem(
    shape: Sequence[int], affine: Any, options: dict | None = None, where: str = "preprocess"
) -> tuple[str | None, tuple[int, ...] | None]:
    """(one line of what is wrong, the planned shape) for a volume of ``shape`` and ``affine`` under the
    preprocessing ``options`` (a dataset entry's ``preprocess``); the line is None when the shape is sound.

    ``where`` names the options in the fix (e.g. ``datasets.ct.preprocess``).
    """
    options = dict(options or {})
    problem = affine_problem(affine)
    if problem is not None:
        return problem, None
    spacing = options.get("spacing")
    try:
        if spacing is not None and not (len(spacing) == 3 and all(float(v) > 0 for v in spacing)):
            spacing = None  # refused with its own line where the options are read
    except (TypeError, ValueError):
        spacing = None
    planned = planned_shape(shape, affine, options.get("orientation", "RAS"), spacing)
    native = tuple(int(n) for n in shape[:3])
    oriented = planned_shape(shape, affine, options.get("orientation", "RAS"), None)
    if spacing is not None:
        collapsed = [i for i, (p, n) in enumerate(zip(planned, oriented)) if p < MIN_PLANNED_VOXELS <= n]
        if collapsed:
            return (
                f"resampling to {where}.spacing {list(spacing)} mm would leave {' x '.join(map(str, planned))} "
                f"voxels (from {' x '.join(map(str, native))} at {_mm(spacing_of(affine))} mm in the affine): "
                f"fewer than {MIN_PLANNED_VOXELS} along axis {collapsed[0]}; fix the voxel spacing in the header "
                f"(sform / qform) or change {where}.spacing",
                planned,
            )
    if math.prod(planned) > max_voxels():
        return (
            f"after preprocessing the volume would have {' x '.join(map(str, planned))} voxels, over the limit of "
            f"{max_voxels():,} (JASCL_MAX_VOXELS); check the spacing in the header or choose a coarser "
            f"{where}.spacing",
            planned,
        )
    return None, planned


def check_planned_volumes(sources: Mapping[str, Any], plans: Sequence[Any]) -> None:
    """Refuse, before training, the first volume of the session ``plans`` whose header declares more voxels than
    its file holds (:func:`jascl.data.geometry.header_size_problem`) or whose geometry preprocessing cannot use
    (:func:`jascl.data.geometry.planned_shape_problem`): a run learns of a NaN affine or a collapsed resampling
    from its header, not from MONAI in the middle of a session. Headers only are read.

    Raises:
        DataError: ``<file>: <what is wrong>; <fix> ('jascl data check' lists every sample)``.
    """
    import nibabel

    seen: set[str] = set()
    for plan in plans:
        for part in (plan.train, plan.test, plan.unlabelled or [], plan.validation or []):
            for ref in part:
                if ref in seen:
                    continue
                seen.add(ref)
                dataset, _, rid = str(ref).partition("/")
                src = sources.get(dataset)
                if src is None or getattr(src.layout, "spatial_dims", 3) != 3 or rid not in src.records:
                    continue
                record = src.records[rid]
                if not record.images:
                    continue
                try:
                    img: Any = nibabel.load(str(record.images[0]))
                except Exception:  # unreadable: loading the sample names it
                    continue
                wrong = header_size_problem(record.images[0], img)
                if wrong is None:
                    wrong, _ = planned_shape_problem(
                        img.shape[:3], img.affine, dict(src.spec.preprocess), where=f"datasets.{dataset}.preprocess"
                    )
                if wrong is not None:
                    raise DataError(f"{record.images[0]}: {wrong} ('jascl data check' lists every sample)")
