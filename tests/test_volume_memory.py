"""What keeps a ``jascl data prepare`` worker's memory down (issue 33): label ids in the smallest integer dtype, one
channel stacked without a copy, Fortran-ordered volumes copied to C order in slabs, resampling one volume at a time
without a sampling grid; and that this computes what MONAI's own pipeline computes (within the documented bound of its
float64 default)."""

import nibabel as nib
import numpy as np
import pytest
import torch

from fixtures.medical import fixture_affine
from jascl.data import medical
from jascl.data.layouts import Sample
from jascl.data.layouts.base import image_value_problems
from jascl.data.medical import load_label, preprocess_volume, stack_channels
from jascl.data.real.sources import present_values
from jascl.data.types import ValueTable, c_order, compact_dtype, id_counts
from jascl.errors import DataError


@pytest.mark.parametrize(
    "ids, dtype",
    [
        ([], np.uint8),
        ([0, 255], np.uint8),
        ([0, 256], np.uint16),
        ([0, 65535], np.uint16),
        ([0, 65536], np.int32),
        ([-1, 3], np.int32),
        ([-(2**31), 2**31 - 1], np.int32),
        ([0, 2**31], np.int64),
        ([-(2**31) - 1, 0], np.int64),
    ],
)
def test_compact_dtype_is_the_smallest_integer_type_holding_the_ids(ids, dtype):
    assert compact_dtype(np.array(ids, dtype=np.int64)) == np.dtype(dtype)


@pytest.mark.parametrize(
    "label, ids, counts",
    [
        (np.array([[0, 0, 3], [3, 3, 7]], np.uint8), [0, 3, 7], [2, 3, 1]),
        (np.asfortranarray(np.array([[0, 0, 3], [3, 3, 7]], np.uint8)), [0, 3, 7], [2, 3, 1]),  # nibabel's order
        (np.array([[5, 5], [1, 5]], np.int16)[:, ::-1], [1, 5], [1, 3]),  # neither order: counted all the same
        (np.array([[9, 9, 0], [255, 9, 0]], np.uint8)[:, ::-1], [0, 9, 255], [2, 3, 1]),  # uint8: counted in pairs
        (np.array([4, 1, 4, 4, 7], np.uint8)[::2], [4, 7], [2, 1]),  # an odd count of voxels, strided
        (np.array([3, 3], np.uint8), [3], [2]),  # one pair holding the id twice
        (np.array([True, False, True]), [0, 1], [1, 2]),
        (np.array([-1, 0, 0, 9], np.int32), [-1, 0, 9], [1, 2, 1]),  # a negative id: np.unique
        (np.array([2.0, 2.0, 0.0]), [0, 2], [1, 2]),
        (np.array([0, 1 << 20], np.int64), [0, 1 << 20], [1, 1]),  # past bincount's range: np.unique
        (np.zeros((0, 3), np.uint8), [], []),
    ],
)
def test_id_counts_by_hand(label, ids, counts):
    got_ids, got_counts = id_counts(label)
    assert got_ids.dtype == got_counts.dtype == np.int64
    assert got_ids.tolist() == ids and got_counts.tolist() == counts
    assert present_values(label) == ids


def test_id_counts_across_slabs_of_a_million_voxels():
    label = np.zeros((3 << 20) + 5, np.uint8)
    label[(1 << 20) - 1 : (1 << 20) + 1] = 4  # one voxel either side of the first slab boundary
    label[-1] = 200
    ids, counts = id_counts(label)
    assert ids.tolist() == [0, 4, 200] and counts.tolist() == [label.size - 3, 2, 1]


def _reversed_ids() -> np.ndarray:
    return (255 - np.arange(256)).astype(np.uint8)  # id v -> 255 - v


@pytest.mark.parametrize(
    "values, expected",
    [
        (np.array([0, 1, 2, 255], np.uint8), [255, 254, 253, 0]),  # two pairs
        (np.array([[7, 0, 9]], np.uint8), [[248, 255, 246]]),  # odd: the last voxel on its own
        (np.array([4], np.uint8), [251]),
        (np.array([[1, 2], [3, 4]], np.uint8)[:, ::-1], [[253, 254], [251, 252]]),  # a reversed view
        (np.zeros((0, 2), np.uint8), np.zeros((0, 2))),
        (np.array([3, 300], np.uint16), None),  # not uint8: np.take, which refuses an id past the table
    ],
)
def test_value_table_looks_up_uint8_ids_two_at_a_time_with_the_tables_values(values, expected):
    table = ValueTable(_reversed_ids())
    assert table.pairs is not None and table.pairs.dtype == np.uint16 and table.pairs.shape == (65536,)
    if expected is None:
        with pytest.raises(IndexError):
            table(values)
        return
    got = table(values)
    assert got.dtype == np.uint8 and got.flags.c_contiguous and got.shape == values.shape
    fortran = np.asfortranarray(values)  # nibabel's order: read where it lies, the result in the same order
    assert np.array_equal(table(fortran), got) and (table(fortran).flags.f_contiguous or fortran.ndim < 2)
    assert got.tolist() == np.asarray(expected).tolist()


def test_value_table_equals_np_take_on_strided_crops_and_short_tables_keep_take():
    rng = np.random.default_rng(0)
    table = rng.integers(0, 256, 256).astype(np.uint8)
    volume = rng.integers(0, 256, (11, 13, 17)).astype(np.uint8)
    fortran = np.asfortranarray(volume)
    for crop in [volume, volume[1:8, 2:9, 3:14], volume[::2, ::-1, 1:6], fortran, fortran[2:5], fortran[..., 1:4]]:
        assert np.array_equal(ValueTable(table)(crop), np.take(table, crop))
    short = ValueTable(np.array([0, 5, 6], np.uint8))  # the ids up to an entry's largest: no pairs
    assert short.pairs is None and short(np.array([2, 1, 0], np.uint8)).tolist() == [6, 5, 0]
    with pytest.raises(IndexError):
        short(np.array([3], np.uint8))


def _save(tmp_path, name, array):
    path = tmp_path / f"{name}.nii.gz"
    nib.save(nib.Nifti1Image(array, fixture_affine(array.shape)), str(path))
    return path


@pytest.mark.parametrize(
    "stored, ids, dtype",
    [
        (np.int16, [0, 1, 2], np.uint8),  # the usual CT label file: int16 on disk, uint8 in memory
        (np.float32, [0, 7, 300], np.uint16),  # float label files are rounded, checked, then made compact
        (np.int32, [0, 70000], np.int32),
        (np.int16, [-1, 0, 4], np.int32),
    ],
)
def test_labels_are_decoded_into_the_smallest_dtype_with_their_ids_unchanged(tmp_path, stored, ids, dtype):
    raw = np.array(ids, dtype=stored)[np.arange(4 * 3 * 2) % len(ids)].reshape(4, 3, 2)
    label, _ = load_label(_save(tmp_path, "label", raw))
    assert label.dtype == np.dtype(dtype)
    assert np.array_equal(label.astype(np.int64), raw.astype(np.int64))


def test_a_non_integer_label_is_still_refused(tmp_path):
    path = _save(tmp_path, "label", np.full((2, 2, 2), 0.5, np.float32))
    with pytest.raises(DataError, match="non-integer values"):
        load_label(path)


def test_one_channel_is_stacked_as_a_view_several_are_copied():
    volume = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    one = stack_channels([volume], ["a.nii.gz"])
    assert one.shape == (1, 2, 3, 4) and one.flags.c_contiguous and np.shares_memory(one, volume)
    two = stack_channels([volume, volume + 1], ["a.nii.gz", "b.nii.gz"])
    assert two.shape == (2, 2, 3, 4) and not np.shares_memory(two, volume)
    assert np.array_equal(two[1], volume + 1)


def test_fortran_ordered_channels_as_nibabel_decodes_them_stay_where_they_lie_when_one_file_holds_them():
    """nibabel gives Fortran-ordered arrays: one float32 file (3D, or 4D with its channels) is a view in that order,
    an int16 one a float32 copy in that order; several files are stacked in C order; the values are the same."""
    volume = np.asfortranarray(np.arange(2 * 3 * 20, dtype=np.int16).reshape(2, 3, 20))
    four_d = np.asfortranarray(np.stack([volume, -volume], -1).astype(np.float32))
    one = stack_channels([volume.astype(np.float32, order="F")], ["a.nii.gz"])
    assert one.base is not None and one[0].flags.f_contiguous
    channels = stack_channels([four_d], ["a.nii.gz"])
    assert np.shares_memory(channels, four_d) and channels[1].flags.f_contiguous
    converted = stack_channels([volume], ["a.nii.gz"])
    assert converted[0].flags.f_contiguous and not np.shares_memory(converted, volume)
    several = stack_channels([volume, 2 * volume], ["a.nii.gz", "b.nii.gz"])
    assert several.flags.c_contiguous
    for stacked, expected in (
        (one, volume[None]),
        (converted, volume[None]),
        (several, np.stack([volume, 2 * volume])),
        (channels, [volume, -volume]),
    ):
        assert stacked.dtype == np.float32 and np.array_equal(stacked, np.asarray(expected, np.float32))


@pytest.mark.parametrize(
    "make",
    [
        lambda a: np.asfortranarray(a),  # nibabel's order: copied in slabs of the last axis
        lambda a: np.moveaxis(np.asfortranarray(np.moveaxis(a, 0, -1)), -1, 0),  # a 4D file's channels moved first
        lambda a: np.asfortranarray(a)[:, ::2, 1:],  # strided, last axis strided too
        lambda a: a[..., ::-1],  # C order reversed: the last axis is the fastest, copied by numpy
        lambda a: a[:, 1:],  # C order, sliced
    ],
)
@pytest.mark.parametrize("dtype", [None, np.float32])
def test_c_order_copies_any_layout_to_c_order_with_the_same_values(make, dtype):
    base = np.arange(3 * 4 * 5 * 19, dtype=np.int16).reshape(3, 4, 5, 19)  # 19: slabs of 8, 8 and 3
    array = make(base)
    out = c_order(array, dtype)
    assert out.flags.c_contiguous and out.dtype == (array.dtype if dtype is None else np.dtype(dtype))
    assert np.array_equal(out, array) and not np.shares_memory(out, base)


def test_c_order_returns_a_c_ordered_array_of_its_dtype_itself():
    array = np.zeros((2, 3, 4), np.float32)
    assert c_order(array) is array and c_order(array, np.float32) is array
    assert c_order(array, np.float64).dtype == np.float64


@pytest.mark.parametrize("value, count", [(np.nan, 1), (np.inf, 2), (-np.inf, 3)])
def test_image_value_problems_counts_nan_and_both_infinities(value, count):
    data = np.asfortranarray(np.arange(60, dtype=np.float32).reshape(3, 4, 5))
    data.flat[:count] = value
    (problem,) = image_value_problems("x.nii.gz", data)
    assert problem.message == f"image holds {count} non-finite value(s) (NaN or +-inf) out of 60"
    assert image_value_problems("x.nii.gz", np.arange(60, dtype=np.float32)) == []


def _ct(shape=(13, 11, 9), seed=0):
    """A smooth CT-like volume (HU -1000..1000) with a 3-class label, on the fixtures' LPS-like 1.5 x 1.5 x 2 mm
    grid, so that preprocessing flips two axes and resamples all three."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.linspace(0, 1, n) for n in shape], indexing="ij"))
    image = 1000 * np.sin(3 * grid[0] + 2 * grid[1] - grid[2]) + rng.normal(0, 20, shape)
    label = ((grid[0] > 0.4).astype(np.int64) + (grid[1] + grid[2] > 1.1)).astype(np.int64)
    label[0, 0, 0] = 300  # an id above 255: the label goes through uint16
    return Sample(image[None].astype(np.float32), label, fixture_affine(shape), {"modality": "CT"})


OPTIONS = {"spacing": [1.2, 2.1, 1.3], "intensity": "ct", "window": [-175, 250]}


def _monai(sample, dtype):
    """MONAI's own dictionary pipeline over both keys at once (as jascl ran it before issue 33's memory work)."""
    from monai.data import MetaTensor
    from monai.transforms import Orientationd, ScaleIntensityRanged, Spacingd

    affine = torch.as_tensor(sample.affine, dtype=torch.float64)
    data = {
        "image": MetaTensor(torch.as_tensor(sample.image), affine=affine),
        "label": MetaTensor(torch.as_tensor(sample.label[None], dtype=torch.float32), affine=affine.clone()),
    }
    data = Orientationd(keys=["image", "label"], axcodes="RAS", labels=None)(data)
    data = Spacingd(keys=["image", "label"], pixdim=OPTIONS["spacing"], mode=["bilinear", "nearest"], dtype=dtype)(data)
    resampled = data["image"].as_tensor().numpy().copy()
    data = ScaleIntensityRanged(keys="image", a_min=-175, a_max=250, b_min=0, b_max=1, clip=True)(data)
    return data["image"].as_tensor().numpy(), np.rint(data["label"].as_tensor().numpy()[0]), resampled


def test_preprocessing_one_volume_at_a_time_matches_monais_joint_float32_pipeline():
    sample = _ct()
    image, label = preprocess_volume(sample, OPTIONS)
    expected_image, expected_label, _ = _monai(sample, np.float32)
    # MONAI keeps the first and last voxel centres: 1 + (n - 1) * old / new, rounded: 1 + 15, 1 + 7.1, 1 + 12.3
    assert image.shape == expected_image.shape == (1, 16, 8, 13)
    # resampled axis by axis (jascl.data.resample): 0.001 HU apart at most, through the window's 425 HU to [0, 1]
    assert np.abs(image - expected_image).max() <= 0.001 / 425
    assert label.dtype == np.uint16 and np.array_equal(label.astype(np.int64), expected_label.astype(np.int64))


def test_resampling_stays_within_two_float32_steps_of_monais_float64_default():
    sample = _ct(seed=1)
    _, _, float64 = _monai(sample, np.float64)
    _, _, float32 = _monai(sample, np.float32)
    resampled, _ = preprocess_volume(sample, {**OPTIONS, "intensity": "none"})
    ours, monais = (np.abs(r.astype(np.float64) - float64).max() for r in (resampled, float32))
    assert 0 < ours <= 0.00025 and ours <= monais  # HU; the docstrings of preprocess_volume and resample


def test_the_label_is_resampled_before_the_image(monkeypatch):
    """The label's float copy is freed before the image's resampling buffers exist (the order is the saving)."""
    seen = []
    regrid = medical._regrid

    def spy(volume, affine, mode, **grid):
        seen.append(mode)
        return regrid(volume, affine, mode, **grid)

    monkeypatch.setattr(medical, "_regrid", spy)
    preprocess_volume(_ct(), OPTIONS)
    assert seen == ["nearest", "bilinear"]
