"""The smallest pieces of reading a NIfTI file, shared by :mod:`jascl.data.medical` (decoding, preprocessing)
and :mod:`jascl.data.volume_checks` (a sample's integrity checks): nibabel imported on first use, why a path is
not a readable file, an exception as a short reason, what shape a file holds, and the defaults both use. Nothing here imports the
layouts, so either module can be imported first."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

#: default largest absolute difference between two affines (mm for the origin, the
#: direction-cosine-times-spacing entries otherwise) still counted as the same grid
AFFINE_TOLERANCE = 1e-3

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


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def volume_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """An image file's shape with the axes of size 1 after the third dropped: ``(X, Y, Z, 1)`` and ``(X, Y, Z, 1, 1)``
    are one 3D volume, ``(X, Y, Z, 1, C)`` (how ITK and SimpleITK write a C-component image to NIfTI: the 5th
    axis) is 4D with C channels last."""
    shape = tuple(int(n) for n in shape)
    return shape[:3] + tuple(n for n in shape[3:] if n != 1)
