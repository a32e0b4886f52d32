"""Medical layouts (msd, totalsegmentator, brats) on fixture datasets; preprocessing; the on-disk cache."""

import json
import os
import shutil

import nibabel as nib
import numpy as np
import pytest

from fixtures.medical import (
    SPACING,
    corrupt_file,
    fixture_affine,
    remove_file,
    write_brats,
    write_label_value,
    write_msd,
    write_totalsegmentator,
    write_wrong_affine,
    write_wrong_shape,
)
from jascl.data.cache import cache_key, cached, entry_path
from jascl.data.layouts import LAYOUTS, Problem, Sample
from jascl.data.medical import preprocess_volume
from jascl.errors import ConfigError, DataError


def _layout(name, root, **options):
    return LAYOUTS.create(name, root=root, **options)


def _raw(path):
    return np.asarray(nib.load(str(path)).dataobj)


# --- msd -------------------------------------------------------------------------------------------------------


def test_msd_nnunet_v1_scan_and_read(tmp_path):
    root = write_msd(tmp_path / "msd", cases=3, test_cases=1, labels=(1, 2))
    layout = _layout("msd", root)
    records = layout.scan()
    assert [(r.id, r.split) for r in records] == [
        ("case_000", "train"),
        ("case_001", "train"),
        ("case_002", "train"),
        ("case_003", "test"),
    ]
    assert records[0].images == (root / "imagesTr" / "case_000_0000.nii.gz",)
    assert records[0].label == root / "labelsTr" / "case_000.nii.gz" and records[3].label is None
    assert layout.label_names() == {0: "background", 1: "class1", 2: "class2"}
    sample = layout.read(records[1])
    assert sample.image.dtype == np.float32 and sample.image.shape == (1, 16, 16, 12)
    assert np.array_equal(sample.image[0], _raw(records[1].images[0]).astype(np.float32))
    assert sample.label.dtype == np.uint8 and np.array_equal(sample.label, _raw(records[1].label))
    assert set(np.unique(sample.label)) == {0, 1, 2}
    assert np.allclose(sample.affine, fixture_affine((16, 16, 12)))
    assert sample.meta["spacing"] == pytest.approx(SPACING) and sample.meta["modality"] == "CT"
    assert layout.read(records[3]).label is None
    assert all(layout.check(r) == [] for r in records)


@pytest.mark.parametrize("style", ["msd", "nnunet-v2"])
def test_msd_styles_two_channels_in_order(tmp_path, style):
    root = write_msd(tmp_path / style, cases=2, test_cases=0, channels=2, style=style)
    layout = _layout("msd", root)
    records = layout.scan()
    assert [r.id for r in records] == ["case_000", "case_001"]
    assert layout.label_names() == {0: "background", 1: "class1", 2: "class2"}
    sample = layout.read(records[0])
    assert sample.image.shape == (2, 16, 16, 12) and sample.meta["modality"] == "MRI"
    if style == "msd":  # one 4D file, channels on the last axis
        assert np.array_equal(sample.image, np.moveaxis(_raw(records[0].images[0]), -1, 0))
    else:  # _0000, _0001 in channel order
        assert [p.name for p in records[0].images] == ["case_000_0000.nii.gz", "case_000_0001.nii.gz"]
        assert np.array_equal(sample.image[1], _raw(records[0].images[1]))
    assert layout.check(records[0]) == []


def test_msd_root_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="dataset root not found"):
        _layout("msd", tmp_path / "nowhere").scan()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"dataset\.json: not found") as err:
        _layout("msd", tmp_path / "empty").scan()
    assert "\n" not in str(err.value)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "dataset.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        _layout("msd", tmp_path / "bad").scan()


def test_msd_follows_listed_label_paths_and_rejects_unknown_options(tmp_path):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)
    meta = json.loads((root / "dataset.json").read_text())
    (root / "labelsTr" / "case_001.nii.gz").rename(root / "labelsTr" / "case_001_gt.nii.gz")
    meta["training"][1]["label"] = "./labelsTr/case_001_gt.nii.gz"
    (root / "dataset.json").write_text(json.dumps(meta))
    layout = _layout("msd", root)
    record = layout.scan()[1]
    assert record.label == root / "labelsTr" / "case_001_gt.nii.gz" and layout.check(record) == []
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['afine_tolerance'\]"):
        _layout("msd", root, afine_tolerance=1)


def _only(problems):
    assert len(problems) == 1, [str(p) for p in problems]
    p = problems[0]
    assert isinstance(p, Problem) and p.fix and "\n" not in str(p)
    return p


@pytest.mark.parametrize(
    "defect,file,phrase",
    [
        ("missing image", "imagesTr/case_001_0000.nii.gz", "missing image"),
        ("missing label", "labelsTr/case_001.nii.gz", "missing label"),
        ("truncated label", "labelsTr/case_001.nii.gz", "unreadable or corrupt NIfTI"),
        ("garbage image", "imagesTr/case_001_0000.nii.gz", "unreadable or corrupt NIfTI"),
        (
            "label shape",
            "labelsTr/case_001.nii.gz",
            "label shape (16, 16, 11) differs from case_001_0000.nii.gz (16, 16, 12)",
        ),
        ("label affine", "labelsTr/case_001.nii.gz", "label affine differs from case_001_0000.nii.gz's by up to 5"),
        ("label value", "labelsTr/case_001.nii.gz", "label value(s) [7] not declared"),
    ],
)
def test_msd_check_reports_each_defect_with_file_and_fix(tmp_path, defect, file, phrase):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)
    path = root / file
    {
        "missing image": remove_file,
        "missing label": remove_file,
        "truncated label": corrupt_file,
        "garbage image": lambda p: corrupt_file(p, "garbage"),
        "label shape": write_wrong_shape,
        "label affine": write_wrong_affine,
        "label value": lambda p: write_label_value(p, 7),
    }[defect](path)
    layout = _layout("msd", root)
    records = {r.id: r for r in layout.scan()}
    assert layout.check(records["case_000"]) == []
    problem = _only(layout.check(records["case_001"]))
    assert problem.path == path and phrase in problem.message
    assert str(problem).startswith(str(path))


def test_msd_missing_modality_is_named(tmp_path):
    root = write_msd(tmp_path / "msd", cases=1, test_cases=0, channels=2, style="nnunet-v2")
    remove_file(root / "imagesTr" / "case_000_0001.nii.gz")
    layout = _layout("msd", root)
    problem = _only(layout.check(layout.scan()[0]))
    assert problem.message == "missing modality T1w" and problem.path.name == "case_000_0001.nii.gz"


def test_read_of_corrupt_or_missing_file_raises_data_error_naming_it(tmp_path):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)
    corrupt_file(root / "labelsTr" / "case_000.nii.gz")
    corrupt_file(root / "imagesTr" / "case_001_0000.nii.gz", "garbage")
    layout = _layout("msd", root)
    r0, r1 = layout.scan()
    with pytest.raises(DataError, match="labelsTr/case_000.nii.gz: unreadable or corrupt NIfTI"):
        layout.read(r0)
    with pytest.raises(DataError, match="imagesTr/case_001_0000.nii.gz: unreadable or corrupt NIfTI"):
        layout.read(r1)
    remove_file(root / "imagesTr" / "case_001_0000.nii.gz")
    with pytest.raises(DataError, match="case_001_0000.nii.gz: file not found"):
        layout.read(r1)
    write_msd(tmp_path / "msd2", cases=1, test_cases=0)
    write_wrong_shape(tmp_path / "msd2" / "labelsTr" / "case_000.nii.gz")
    layout2 = _layout("msd", tmp_path / "msd2")
    with pytest.raises(DataError, match="label shape"):
        layout2.read(layout2.scan()[0])


def test_affine_tolerance(tmp_path):
    root = write_msd(tmp_path / "msd", cases=1, test_cases=0)
    label = root / "labelsTr" / "case_000.nii.gz"
    write_wrong_affine(label, shift=1e-4)  # float rounding in a converter: accepted
    assert _layout("msd", root).check(_layout("msd", root).scan()[0]) == []
    write_wrong_affine(label, shift=0.05)  # now 0.0501 mm off
    assert "affine" in _only(_layout("msd", root).check(_layout("msd", root).scan()[0])).message
    loose = _layout("msd", root, affine_tolerance=0.1)
    assert loose.check(loose.scan()[0]) == []


# --- totalsegmentator ------------------------------------------------------------------------------------------


def test_totalsegmentator_ids_follow_sorted_structures_and_meta_split(tmp_path):
    root = write_totalsegmentator(tmp_path / "ts", subjects=3, structures=("liver", "spleen", "kidney_left"))
    layout = _layout("totalsegmentator", root)
    records = layout.scan()
    assert [(r.id, r.split) for r in records] == [("s0000", "train"), ("s0001", "train"), ("s0002", "test")]
    assert layout.label_names() == {0: "background", 1: "kidney_left", 2: "liver", 3: "spleen"}
    sample = layout.read(records[0])
    seg = root / "s0000" / "segmentations"
    assert np.array_equal(sample.label == 2, _raw(seg / "liver.nii.gz") > 0)
    assert np.array_equal(sample.label == 1, _raw(seg / "kidney_left.nii.gz") > 0)
    assert set(np.unique(sample.label)) == {0, 1, 2, 3} and sample.image.shape == (1, 16, 16, 12)
    # an explicit structure list fixes the ids (and drops unlisted masks)
    given = _layout("totalsegmentator", root, structures=["spleen", "liver"])
    label = given.read(given.scan()[0]).label
    assert given.label_names() == {0: "background", 1: "spleen", 2: "liver"}
    assert np.array_equal(label == 1, _raw(seg / "spleen.nii.gz") > 0) and set(np.unique(label)) == {0, 1, 2}
    assert all(layout.check(r) == [] for r in records)


def test_totalsegmentator_label_index_reads_the_masks_without_decoding_the_ct(tmp_path, monkeypatch):
    from jascl.data import medical
    from jascl.data.real.sources import present_values, read_native_label

    root = write_totalsegmentator(tmp_path / "ts", subjects=2, structures=("liver", "spleen", "kidney_left"))
    layout = _layout("totalsegmentator", root)
    records = layout.scan()
    expected = [layout.read(r).label for r in records]
    monkeypatch.setattr(medical, "load_volume", lambda path: pytest.fail(f"decoded {path}"))
    for record, label in zip(records, expected):
        only = read_native_label(layout, record)  # the index's reader takes the layout's read_label
        assert only.dtype == label.dtype == np.uint8 and np.array_equal(only, label)
        assert present_values(only) == [0, 1, 2, 3]
    write_wrong_shape(root / "s0001" / "ct.nii.gz")  # the CT's header no longer matches the masks
    with pytest.raises(DataError, match=r"kidney_left\.nii\.gz: label shape \(16, 16, 12\) differs from its image's"):
        layout.read_label(records[1])


def test_totalsegmentator_check(tmp_path):
    root = write_totalsegmentator(tmp_path / "ts", subjects=2)
    layout = _layout("totalsegmentator", root)
    remove_file(root / "s0000" / "segmentations" / "spleen.nii.gz")
    write_label_value(root / "s0001" / "segmentations" / "liver.nii.gz", 3)
    r0, r1 = layout.scan()
    p0 = _only(layout.check(r0))
    assert p0.message == "missing segmentation spleen" and p0.path.name == "spleen.nii.gz"
    assert "must be 0/1" in _only(layout.check(r1)).message
    write_wrong_shape(root / "s0001" / "ct.nii.gz")
    assert len(layout.check(r1)) == 4  # every mask now mismatches the CT, plus the non-binary one
    with pytest.raises(DataError, match="spleen.nii.gz: file not found"):
        layout.read(r0)
    shutil.rmtree(root / "s0000" / "segmentations")
    assert _only(layout.check(r0)).message == "missing segmentations folder"


# --- brats -----------------------------------------------------------------------------------------------------


def test_brats_channels_labels_and_check(tmp_path):
    root = write_brats(tmp_path / "brats", subjects=2)
    layout = _layout("brats", root)
    records = layout.scan()
    assert [r.id for r in records] == ["BraTS2021_00000", "BraTS2021_00001"]
    assert [p.name for p in records[0].images] == [f"BraTS2021_00000_{m}.nii.gz" for m in ("t1", "t1ce", "t2", "flair")]
    assert layout.label_names() == {
        0: "background",
        1: "necrotic / non-enhancing tumour core",
        2: "peritumoral edema",
        4: "GD-enhancing tumour",
    }
    sample = layout.read(records[0])
    assert sample.image.shape == (4, 16, 16, 12) and set(np.unique(sample.label)) == {0, 1, 2, 4}
    assert np.array_equal(sample.image[3], _raw(records[0].images[3]))  # flair is channel 3
    flair_first = _layout("brats", root, modalities=["flair", "t1"])
    assert np.array_equal(flair_first.read(flair_first.scan()[0]).image[0], sample.image[3])
    assert all(layout.check(r) == [] for r in records)
    remove_file(records[1].images[1])
    write_label_value(records[0].label, 3)  # 3 is not a BraTS 2021 label
    assert _only(layout.check(records[1])).message == "missing modality t1ce"
    assert "label value(s) [3] not declared" in _only(layout.check(records[0])).message


def test_brats_2023_names_nested_root_and_unlabelled(tmp_path):
    write_brats(tmp_path / "release" / "TrainingData", subjects=2, naming="2023")
    layout = _layout("brats", tmp_path / "release")  # subject folders one level down
    records = layout.scan()
    assert layout.naming == "2023" and layout.label_names()[3] == "enhancing tumour"
    assert records[0].images[0].name == "BraTS-GLI-00000-000-t1n.nii.gz"
    assert set(np.unique(layout.read(records[0]).label)) == {0, 1, 2, 3}
    unlabelled = write_brats(tmp_path / "val", subjects=1, labelled=False)
    r = _layout("brats", unlabelled).scan()[0]
    assert r.label is None and r.split == "val"
    with pytest.raises(ConfigError, match="modalities"):
        _layout("brats", unlabelled, modalities=["t1", "dwi"])


def test_brats_missing_seg_in_labelled_copy(tmp_path):
    root = write_brats(tmp_path / "brats", subjects=2)
    remove_file(root / "BraTS2021_00001" / "BraTS2021_00001_seg.nii.gz")
    layout = _layout("brats", root)
    problem = _only(layout.check(layout.scan()[1]))
    assert problem.message == "missing label" and problem.path.name == "BraTS2021_00001_seg.nii.gz"


# --- preprocessing ---------------------------------------------------------------------------------------------


def _ct_sample(values=None):
    image = np.arange(4 * 4 * 2, dtype=np.float32).reshape(1, 4, 4, 2) * 30 - 300 if values is None else values
    label = (np.arange(32).reshape(4, 4, 2) % 3).astype(np.int64)
    return Sample(image, label, fixture_affine((4, 4, 2)), {"modality": "CT"})


def test_preprocess_ct_window_and_ras_orientation():
    sample = _ct_sample()
    image, label = preprocess_volume(sample, {"window": [-150, 150]})
    # fixture affine has -x, -y: reorienting to RAS flips the first two axes
    raw = sample.image[:, ::-1, ::-1, :]
    assert np.allclose(image, np.clip((raw + 150) / 300, 0, 1), atol=1e-6)
    assert np.array_equal(label, sample.label[::-1, ::-1, :])
    kept, _ = preprocess_volume(sample, {"orientation": None, "intensity": "none"})
    assert np.array_equal(kept, sample.image)


def test_preprocess_spacing_nearest_labels():
    sample = _ct_sample()
    image, label = preprocess_volume(sample, {"orientation": None, "spacing": [3.0, 3.0, 2.0], "intensity": "none"})
    assert image.shape == (1, 2, 2, 2) and label.shape == (2, 2, 2) and label.dtype == np.uint8
    # nearest neighbour at voxel centres 0 and 2 along x/y (3 mm / 1.5 mm = every second voxel)
    assert np.array_equal(label, sample.label[::2, ::2, :])
    assert np.allclose(image, sample.image[:, ::2, ::2, :])


def test_preprocess_mri_zscore_over_nonzero_voxels():
    rng = np.random.default_rng(0)
    image = np.zeros((2, 6, 6, 4), np.float32)
    image[:, 1:5, 1:5, 1:3] = rng.normal(100, 20, size=(2, 4, 4, 2))
    out, label = preprocess_volume(Sample(image, None, np.eye(4), {"modality": "MRI"}), {})
    inside = image[0] != 0
    assert label is None and np.all(out[:, ~inside] == 0)
    for c in range(2):
        assert out[c][inside].mean() == pytest.approx(0, abs=1e-5)
        assert out[c][inside].std() == pytest.approx(1, abs=1e-3)
        assert np.allclose(
            out[c][inside], (image[c][inside] - image[c][inside].mean()) / image[c][inside].std(), atol=1e-4
        )


def test_preprocess_rejects_bad_options():
    with pytest.raises(ConfigError, match="unknown option"):
        preprocess_volume(_ct_sample(), {"windw": [0, 1]})
    with pytest.raises(ConfigError, match="spacing"):
        preprocess_volume(_ct_sample(), {"spacing": [1, 0, 1]})
    with pytest.raises(ConfigError, match="intensity"):
        preprocess_volume(_ct_sample(), {"intensity": "pet"})
    for key, value in [("window", [1]), ("window", [-100, 0, 100]), ("window", "ab"), ("range", [0]), ("range", 1)]:
        with pytest.raises(ConfigError, match=rf"preprocess\.{key}=.*give two numbers, lower and upper"):
            preprocess_volume(_ct_sample(), {key: value})
    with pytest.raises(ConfigError, match="upper bound must exceed"):
        preprocess_volume(_ct_sample(), {"window": [100, -100]})
    with pytest.raises(ConfigError, match="spacing"):
        preprocess_volume(_ct_sample(), {"spacing": [1, "a", 1]})


# --- cache -----------------------------------------------------------------------------------------------------


def test_cache_hits_misses_and_atomic_entries(tmp_path):
    src = tmp_path / "volume.nii.gz"
    src.write_bytes(b"x" * 10)
    calls = []

    def compute():
        calls.append(1)
        return np.arange(6, dtype=np.int16).reshape(2, 3), None

    cache = tmp_path / "cache"
    first = cached([src, {"spacing": [1, 1, 2]}, "msd"], compute, cache)
    again = cached([src, {"spacing": [1, 1, 2]}, "msd"], compute, cache)
    assert len(calls) == 1 and again[1] is None
    assert np.array_equal(again[0], first[0]) and again[0].dtype == np.int16
    cached([src, {"spacing": [1, 1, 3]}, "msd"], compute, cache)  # other options: a new entry
    assert len(calls) == 2
    os.utime(src, ns=(1, 1))  # the file changed (mtime): recomputed
    cached([src, {"spacing": [1, 1, 2]}, "msd"], compute, cache)
    assert len(calls) == 3
    assert not list(cache.rglob("*.tmp")) and len(list(cache.rglob("*.npz"))) == 3
    # a damaged entry is recomputed and rewritten
    key = cache_key([src, {"spacing": [1, 1, 2]}, "msd"])
    entry_path(cache, key).write_bytes(b"damaged")
    cached([src, {"spacing": [1, 1, 2]}, "msd"], compute, cache)
    assert len(calls) == 4 and np.array_equal(cached([src, {"spacing": [1, 1, 2]}, "msd"], compute, cache)[0], first[0])
    assert len(calls) == 4
    # dict results and no cache dir
    assert cached(["k"], lambda: {"image": np.ones(2), "label": None}, cache)["label"] is None
    assert cached(["k"], lambda: {"image": np.zeros(2)}, None)["image"].sum() == 0


def test_cache_key_covers_folder_contents_and_not_strings_as_paths(tmp_path):
    folder = tmp_path / "segmentations"
    folder.mkdir()
    (folder / "liver.nii.gz").write_bytes(b"a")
    before = cache_key([folder])
    (folder / "spleen.nii.gz").write_bytes(b"b")
    assert cache_key([folder]) != before
    assert cache_key([str(folder)]) == cache_key([str(folder)])
    assert cache_key([{"a": 1, "b": 2}]) == cache_key([{"b": 2, "a": 1}])
    assert json.loads(json.dumps(cache_key(["x"]))) == cache_key(["x"])


@pytest.mark.parametrize(
    ("zooms", "bad"),
    [
        ((1.5, 1.5, 2.0), False),
        ((0.0, 1.0, 1.0), True),
        ((1.0, -2.0, 1.0), True),
        ((1.0, 1.0, 20.0), False),
        ((1.0, 1.0, 20.5), True),
    ],
)
def test_spacing_zero_negative_or_over_20_mm_is_a_problem(zooms, bad):
    from jascl.data.volume_checks import _spacing_problems

    img = nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4))
    img.header["pixdim"][1:4] = zooms  # written straight into the header, as a broken export has it
    problems = _spacing_problems("v.nii.gz", img, "image")
    assert bool(problems) == bad
    if bad:
        assert problems[0].message == (
            f"image has an implausible voxel spacing {tuple(float(z) for z in zooms)} mm (zero, negative or over 20 mm)"
        )
