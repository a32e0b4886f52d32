"""Axis-by-axis resampling (``jascl.data.resample``): by hand, against MONAI's ``Spacing`` on the same plan, and the
choice between the two in ``jascl.data.medical._regrid``."""

import numpy as np
import pytest
import torch

from jascl.data import medical
from jascl.data.resample import AXIS_ALIGNED_TOLERANCE, axis_aligned, axis_pairing, resample_axes


def _map(scales, shifts=(0.0, 0.0, 0.0)):
    xform = np.diag([*scales, 1.0])
    xform[:3, 3] = shifts
    return xform


def test_linear_samples_by_hand_with_the_border_clamped():
    # axis 0 holds 0, 10, 20, 30; output i reads 0.75 * i + 0.5: 0.5, 1.25, 2.0, 2.75, then 3.5 clamped to 3
    volume = (np.arange(4, dtype=np.float32) * 10).reshape(1, 4, 1, 1)
    out = resample_axes(volume, _map([0.75, 1, 1], [0.5, 0, 0]), (5, 1, 1), "bilinear")
    assert out.dtype == np.float32 and out.shape == (1, 5, 1, 1)
    assert np.allclose(out.ravel(), [5.0, 12.5, 20.0, 27.5, 30.0])
    # a negative coordinate is clamped to the first voxel
    assert np.allclose(resample_axes(volume, _map([1, 1, 1], [-2, 0, 0]), (4, 1, 1), "bilinear").ravel(), [0, 0, 0, 10])


def test_trilinear_is_the_product_of_the_three_linear_weights():
    # v = x + 10 y + 100 z is linear, so trilinear interpolation reproduces it at every in-range point
    x, y, z = np.meshgrid(np.arange(4.0), np.arange(4.0), np.arange(5.0), indexing="ij")
    volume = (x + 10 * y + 100 * z).astype(np.float32)
    out = resample_axes(volume, _map([0.5, 1.5, 0.25], [0.25, 0, 1]), (5, 3, 13), "bilinear")
    i, j, k = np.meshgrid(np.arange(5.0), np.arange(3.0), np.arange(13.0), indexing="ij")
    expected = (0.5 * i + 0.25) + 10 * (1.5 * j) + 100 * (0.25 * k + 1)
    assert out.shape == (5, 3, 13) and np.allclose(out, expected, atol=1e-4)


def test_nearest_rounds_half_to_even_clamps_and_keeps_the_dtype():
    label = np.arange(5, dtype=np.uint8).reshape(5, 1, 1) * 7
    # coordinates 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5 -> voxels 0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 4
    out = resample_axes(label, _map([0.5, 1, 1]), (11, 1, 1), "nearest")
    assert out.dtype == np.uint8
    assert out.ravel().tolist() == [7 * v for v in (0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 4)]


def test_identity_copies_nothing_and_a_bad_mode_is_refused():
    volume = np.arange(60, dtype=np.float32).reshape(1, 3, 4, 5)
    same = resample_axes(volume, np.eye(4), (3, 4, 5), "bilinear")
    assert np.shares_memory(same, volume) and np.array_equal(same, volume)
    fortran = np.asfortranarray(volume)  # as nibabel decodes: one copy, to C order
    copied = resample_axes(fortran, np.eye(4), (3, 4, 5), "bilinear")
    assert copied.flags.c_contiguous and not np.shares_memory(copied, fortran) and np.array_equal(copied, volume)
    with pytest.raises(ValueError, match="mode 'cubic'"):
        resample_axes(volume, np.eye(4), (3, 4, 5), "cubic")


def test_axis_aligned_by_the_reach_of_the_off_diagonal_terms():
    assert axis_aligned(_map([1.875, 1.875, 1.0]), (274, 274, 300))
    tilted = _map([1.0, 1.0, 1.0])
    tilted[0, 1] = AXIS_ALIGNED_TOLERANCE / 100  # the last of 100 rows moves by 0.99 of the tolerance...
    assert axis_aligned(tilted, (2, 100, 2))
    tilted[0, 1] = AXIS_ALIGNED_TOLERANCE / 98  # ...or by 1.01 of it
    assert not axis_aligned(tilted, (2, 100, 2))
    rotated = np.eye(4)
    rotated[:2, :2] = [[0.8, -0.6], [0.6, 0.8]]
    assert not axis_aligned(rotated, (10, 10, 10))
    assert not axis_aligned(_map([1.0, 0.0, 1.0]), (3, 3, 3))  # a zero axis
    assert not axis_aligned(_map([np.nan, 1.0, 1.0]), (3, 3, 3))


def _smooth_ct(shape, seed=0):
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.linspace(0, 1, n) for n in shape], indexing="ij"))
    image = 1000 * np.sin(3 * grid[0] + 2 * grid[1] - grid[2]) + rng.normal(0, 20, shape)
    label = (grid[0] > 0.4).astype(np.uint8) + (grid[1] + grid[2] > 1.1)
    return image[None].astype(np.float32), label.astype(np.uint8)


def _monai(volume, affine, spacing, mode, dtype):
    from monai.data import MetaTensor
    from monai.transforms import Orientation, Spacing

    data = Orientation(axcodes="RAS", labels=None)(MetaTensor(torch.as_tensor(volume), affine=affine.clone()))
    return Spacing(pixdim=spacing, mode=mode, dtype=dtype)(
        data.to(torch.float64 if dtype == np.float64 else torch.float32)
    )


@pytest.mark.parametrize(
    "shape, native, spacing",
    [
        ((64, 64, 40), (0.8, 0.8, 1.5), [1.5, 1.5, 1.5]),  # a CT's in-plane down-sampling
        ((50, 45, 30), (0.8, 0.9, 1.5), [1.0, 1.3, 2.5]),  # all three axes, down
        ((16, 9, 20), (1.5, 1.5, 2.0), [1.2, 2.1, 1.3]),  # up and down, outputs past the last voxel centre
    ],
)
def test_closer_to_monais_float64_resampling_than_monais_float32_and_the_same_labels(shape, native, spacing):
    image, label = _smooth_ct(shape)
    affine = torch.as_tensor(np.diag([-native[0], -native[1], native[2], 1.0]))  # LPS-like: flipped to RAS first
    grid = {"orientation": "RAS", "spacing": spacing}
    ours = medical._regrid(image, affine, "bilinear", **grid)
    float64 = _monai(image, affine, spacing, "bilinear", np.float64).as_tensor().numpy()
    float32 = _monai(image, affine, spacing, "bilinear", np.float32).as_tensor().numpy()
    assert ours.shape == float64.shape and ours.dtype == np.float32
    ours_error, monai_error = np.abs(ours - float64).max(), np.abs(float32 - float64).max()
    # HU, on values up to 1000: two float32 steps (0.000122 each from 1024 up); MONAI's error grows with the size
    assert ours_error <= 0.00025 and ours_error <= monai_error
    labels = medical._regrid(label[None], affine, "nearest", **grid)
    expected = _monai(label[None].astype(np.float32), affine, spacing, "nearest", np.float32).as_tensor().numpy()
    assert labels.dtype == np.uint8 and np.array_equal(labels, expected.astype(np.uint8))


def test_an_oblique_scan_keeps_its_directions_so_it_is_resampled_axis_by_axis_too():
    """MONAI's ``Spacing`` changes the voxel size along the scan's own axes: the voxel map stays diagonal."""
    image, label = _smooth_ct((40, 36, 20), seed=3)
    turn = np.eye(4)
    turn[:2, :2] = [[np.cos(0.3), -np.sin(0.3)], [np.sin(0.3), np.cos(0.3)]]
    affine = torch.as_tensor(turn @ np.diag([1.5, 1.5, 2.0, 1.0]))
    grid = {"orientation": "RAS", "spacing": [2.0, 2.0, 2.0]}
    ours = medical._regrid(image, affine, "bilinear", **grid)
    float64 = _monai(image, affine, grid["spacing"], "bilinear", np.float64).as_tensor().numpy()
    float32 = _monai(image, affine, grid["spacing"], "bilinear", np.float32).as_tensor().numpy()
    assert ours.shape == (1, 30, 27, 20)
    assert np.abs(ours - float64).max() <= min(0.00025, np.abs(float32 - float64).max())
    ids = medical._regrid(label[None], affine, "nearest", **grid)
    monai_ids = _monai(label[None].astype(np.float32), affine, grid["spacing"], "nearest", np.float32)
    assert ids.dtype == np.uint8 and np.array_equal(ids, monai_ids.as_tensor().numpy())


def test_a_map_that_is_not_axis_aligned_is_resampled_by_monai_itself(monkeypatch):
    image, label = _smooth_ct((12, 10, 8), seed=4)
    affine = torch.as_tensor(np.diag([-1.5, 1.5, 2.0, 1.0]))
    grid = {"orientation": "RAS", "spacing": [2.0, 1.0, 3.0]}
    monkeypatch.setattr(medical, "axis_aligned", lambda xform, shape: False)
    expected = _monai(image, affine, grid["spacing"], "bilinear", np.float32).as_tensor().numpy()
    assert np.array_equal(medical._regrid(image, affine, "bilinear", **grid), expected)
    ids = medical._regrid(label[None], affine, "nearest", **grid)  # on a float32 copy, as MONAI samples
    monai_ids = _monai(label[None].astype(np.float32), affine, grid["spacing"], "nearest", np.float32)
    assert ids.dtype == np.float32 and np.array_equal(ids, monai_ids.as_tensor().numpy())


def test_axis_pairing_of_a_reorientation_with_swapped_axes_by_hand():
    # output axis 0 reads input axis 1 backwards, output axis 1 input axis 0 backwards, axis 2 itself
    xform = np.array([[0.0, -1.25, 0.0, 49.0], [-1.1, 0.0, 0.0, 39.0], [0.0, 0.0, 1.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert axis_pairing(xform, (32, 45, 23)) == [1, 0, 2]
    volume = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    swapped = np.array([[0.0, 1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 2.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    # output (i, j, k) reads input (j, 2 - i, k): a transpose and a flip, looked up, not interpolated
    out = resample_axes(volume, swapped, (3, 2, 4), "bilinear")
    assert out.flags.c_contiguous and np.array_equal(out, volume.transpose(1, 0, 2)[::-1])


def test_swapped_axes_on_a_fortran_ordered_volume_match_monai():
    """A scan stored with its first two axes swapped and reversed, decoded in Fortran order as nibabel does: the
    same result as from a C-ordered copy, within the bound of MONAI's float64 resampling, and MONAI's labels."""
    image, label = _smooth_ct((30, 26, 18), seed=5)
    affine = torch.as_tensor(np.array([[0, -0.8, 0, 10], [-0.9, 0, 0, 5], [0, 0, 1.5, -3], [0, 0, 0, 1.0]]))
    grid = {"orientation": "RAS", "spacing": [1.0, 1.0, 2.0]}
    ours = medical._regrid(np.asfortranarray(image), affine, "bilinear", **grid)
    assert np.array_equal(ours, medical._regrid(image, affine, "bilinear", **grid))
    float64 = _monai(image, affine, grid["spacing"], "bilinear", np.float64).as_tensor().numpy()
    float32 = _monai(image, affine, grid["spacing"], "bilinear", np.float32).as_tensor().numpy()
    assert ours.shape == float64.shape == (1, 21, 27, 14) and ours.flags.c_contiguous
    assert np.abs(ours - float64).max() <= min(0.00025, np.abs(float32 - float64).max())
    ids = medical._regrid(np.asfortranarray(label)[None], affine, "nearest", **grid)
    monai_ids = _monai(label[None].astype(np.float32), affine, grid["spacing"], "nearest", np.float32)
    assert ids.dtype == np.uint8 and np.array_equal(ids, monai_ids.as_tensor().numpy())
