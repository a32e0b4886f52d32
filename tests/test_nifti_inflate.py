"""jascl.data.medical inflates .nii.gz with ISA-L where installed: the arrays equal nibabel's own decode."""

import platform

import nibabel as nib
import numpy as np
import pytest

from jascl.data import medical


def _write(path, data, slope=None, inter=None, big_endian=False):
    header = nib.Nifti1Header(endianness=">" if big_endian else "<")
    image = nib.Nifti1Image(data, np.diag([0.8, 0.8, 1.5, 1.0]), header)
    if slope is not None:
        image.header.set_slope_inter(slope, inter)
    nib.save(image, path)
    return path


CASES = {
    "int16 CT with slope and intercept": (np.arange(-60, 60, dtype=np.int16).reshape(4, 5, 6), 2.0, -1024.0, False),
    "big-endian int16": (np.arange(120, dtype=np.int16).reshape(4, 5, 6) * 7, None, None, True),
    "float32 MRI, 4D": (np.linspace(0, 1, 240, dtype=np.float32).reshape(4, 5, 3, 4), None, None, False),
    "uint8 label": ((np.arange(120) % 5).astype(np.uint8).reshape(6, 5, 4), None, None, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("inflate", ["isal", "zlib"])
def test_decode_equals_nibabels_for_both_inflaters(tmp_path, monkeypatch, case, inflate):
    data, slope, inter, big_endian = CASES[case]
    path = _write(tmp_path / "v.nii.gz", data, slope, inter, big_endian)
    if inflate == "zlib":
        monkeypatch.setattr(medical, "_igzip", lambda: None)
    elif medical._igzip() is None:
        pytest.skip("isal is not installed here")
    reference = nib.load(str(path))
    image, _ = medical.load_volume(path)
    expected = reference.get_fdata(dtype=np.float32)
    assert image.dtype == np.float32 and image.flags.f_contiguous
    np.testing.assert_array_equal(image, expected)
    if slope is not None:  # the scaling was applied: the first voxel is -60 * 2 - 1024
        assert image.flat[0] == -1144.0
    if data.dtype == np.uint8:
        label, _ = medical.load_label(path)
        assert label.dtype == np.uint8
        np.testing.assert_array_equal(label, data)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"), reason="isal is a dependency on these only"
)
def test_isal_is_installed_where_the_dependency_asks_for_it():
    assert medical._igzip() is not None


def test_a_truncated_gzip_is_one_line_naming_the_file(tmp_path):
    path = _write(tmp_path / "v.nii.gz", np.arange(4000, dtype=np.int16).reshape(10, 20, 20))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(medical.DataError, match=r"v\.nii\.gz: unreadable or corrupt NIfTI \(.+\); re-download"):
        medical.load_volume(path)
