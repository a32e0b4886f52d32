"""The dataset.json variants people actually have (issue 20, item 2): nnU-Net v1 / v2, Decathlon originals,
training lists naming the case or a channel file, with or without ``./``, relative or absolute, from
another machine; nnU-Net v2's explicit ``dataset`` mapping; a missing listed file named as listed and tried."""

import json
import shutil

import nibabel as nib
import numpy as np
import pytest

from fixtures.medical import remove_file, write_msd
from jascl.data.layouts import LAYOUTS
from jascl.errors import DataError


def _layout(root):
    return LAYOUTS.create("msd", root=root)


def _rewrite(root, change):
    meta = json.loads((root / "dataset.json").read_text())
    change(meta)
    (root / "dataset.json").write_text(json.dumps(meta))


def _train(layout):
    return [r for r in layout.scan() if r.split == "train"]


@pytest.mark.parametrize(
    "spell",
    [
        lambda root, case, ch: f"./imagesTr/{case}.nii.gz",  # nnU-Net v1: the case
        lambda root, case, ch: f"./imagesTr/{case}_0000.nii.gz",  # conversion scripts: the channel file
        lambda root, case, ch: f"imagesTr/{case}_0000.nii.gz",  # no ./
        lambda root, case, ch: str(root / "imagesTr" / f"{case}.nii.gz"),  # absolute, this copy
        lambda root, case, ch: f"/data/other-machine/Task09/imagesTr/{case}_0000.nii.gz",  # absolute, elsewhere
    ],
    ids=["case", "channel-file", "no-dot", "absolute", "absolute-elsewhere"],
)
def test_training_lists_name_the_case_or_its_channel_file_in_any_spelling(tmp_path, spell):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)

    def change(meta):
        for entry in meta["training"]:
            case = entry["label"].rsplit("/", 1)[1].removesuffix(".nii.gz")
            entry["image"] = spell(root, case, 0)
            entry["label"] = spell(root, case, 0).replace("imagesTr", "labelsTr").replace("_0000.nii.gz", ".nii.gz")

    _rewrite(root, change)
    layout = _layout(root)
    records = _train(layout)
    assert [r.id for r in records] == ["case_000", "case_001"]
    assert records[0].images == (root / "imagesTr" / "case_000_0000.nii.gz",)
    assert records[0].label == root / "labelsTr" / "case_000.nii.gz"
    assert all(layout.check(r) == [] for r in records)


def test_a_list_with_one_entry_per_channel_file_names_each_case_once(tmp_path):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0, channels=2, style="nnunet-v2")

    def change(meta):
        meta["training"] = [
            {"image": f"./imagesTr/case_{i:03d}_{c:04d}.nii.gz", "label": f"./labelsTr/case_{i:03d}.nii.gz"}
            for i in range(2)
            for c in range(2)
        ]

    _rewrite(root, change)
    records = _train(_layout(root))
    assert [r.id for r in records] == ["case_000", "case_001"]
    assert [p.name for p in records[1].images] == ["case_001_0000.nii.gz", "case_001_0001.nii.gz"]


def test_a_case_name_ending_in_four_digits_keeps_them(tmp_path):
    # AMOS in nnU-Net form: amos_0001_0000.nii.gz; the list names amos_0001.nii.gz (the case) or the channel file
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)
    for i in range(2):
        (root / "imagesTr" / f"case_{i:03d}_0000.nii.gz").rename(root / "imagesTr" / f"amos_{i + 1:04d}_0000.nii.gz")
        (root / "labelsTr" / f"case_{i:03d}.nii.gz").rename(root / "labelsTr" / f"amos_{i + 1:04d}.nii.gz")

    def change(meta):
        meta["training"] = [
            {"image": "./imagesTr/amos_0001.nii.gz", "label": "./labelsTr/amos_0001.nii.gz"},
            {"image": "./imagesTr/amos_0002_0000.nii.gz", "label": "./labelsTr/amos_0002.nii.gz"},
        ]

    _rewrite(root, change)
    layout = _layout(root)
    records = _train(layout)
    assert [r.id for r in records] == ["amos_0001", "amos_0002"]
    assert all(layout.check(r) == [] for r in records)


def test_decathlon_original_4d_files_and_macos_resource_files(tmp_path):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=1, channels=2, style="msd")
    for folder in ("imagesTr", "labelsTr", "imagesTs"):
        for path in list((root / folder).glob("*.nii.gz")):
            (root / folder / f"._{path.name}").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    layout = _layout(root)
    assert [(r.id, r.split) for r in layout.scan()] == [
        ("case_000", "train"),
        ("case_001", "train"),
        ("case_002", "test"),
    ]
    _rewrite(root, lambda meta: (meta.pop("training"), meta.pop("test")))  # found by listing the folders instead
    layout = _layout(root)
    records = layout.scan()
    assert [(r.id, r.split) for r in records] == [("case_000", "train"), ("case_001", "train"), ("case_002", "test")]
    assert records[0].images == (root / "imagesTr" / "case_000.nii.gz",)
    assert all(layout.check(r) == [] for r in records)


def test_nnunet_v2_explicit_dataset_mapping(tmp_path, monkeypatch):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0, channels=2, style="nnunet-v2")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("case_001_0000.nii.gz", "case_001_0001.nii.gz"):
        shutil.move(root / "imagesTr" / name, elsewhere / name)
    monkeypatch.setenv("JASCL_TEST_IMAGES", str(elsewhere))

    def change(meta):
        meta["dataset"] = {
            "first": {
                "images": ["imagesTr/case_000_0000.nii.gz", "./imagesTr/case_000_0001.nii.gz"],
                "label": "labelsTr/case_000.nii.gz",
            },
            "second": {
                "images": ["$JASCL_TEST_IMAGES/case_001_0000.nii.gz", str(elsewhere / "case_001_0001.nii.gz")],
                "label": str(root / "labelsTr" / "case_001.nii.gz"),
            },
        }

    _rewrite(root, change)
    layout = _layout(root)
    records = layout.scan()
    assert [r.id for r in records] == ["first", "second"]
    assert records[1].images == (elsewhere / "case_001_0000.nii.gz", elsewhere / "case_001_0001.nii.gz")
    assert records[0].label == root / "labelsTr" / "case_000.nii.gz"
    assert all(layout.check(r) == [] for r in records)
    sample = layout.read(records[1])
    assert sample.image.shape[0] == 2
    _rewrite(root, lambda meta: meta.update(dataset={"x": {"images": "one.nii.gz"}}))
    with pytest.raises(DataError, match=r"dataset\.json: 'dataset' must map each case to"):
        _layout(root).scan()


def test_a_missing_listed_file_is_named_as_listed_and_as_tried(tmp_path):
    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)

    def change(meta):
        meta["training"][1]["image"] = "./imagesTr/case_001_0000.nii.gz"
        meta["training"][1]["label"] = "/mnt/old-copy/labelsTr/case_001.nii.gz"

    _rewrite(root, change)
    remove_file(root / "imagesTr" / "case_001_0000.nii.gz")
    remove_file(root / "labelsTr" / "case_001.nii.gz")
    layout = _layout(root)
    record = {r.id: r for r in layout.scan()}["case_001"]
    lines = sorted(str(p) for p in layout.check(record))
    assert len(lines) == 2, lines
    image_line = next(line for line in lines if "imagesTr" in line.split(":")[0])
    label_line = next(line for line in lines if line is not image_line)
    assert image_line.startswith(f"{root / 'imagesTr' / 'case_001_0000.nii.gz'}: missing image")
    assert "dataset.json lists './imagesTr/case_001_0000.nii.gz'; this is the path tried" in image_line
    # the listed absolute path does not exist here, nor does labelsTr/<its name>: the listed one is reported
    assert label_line.startswith("/mnt/old-copy/labelsTr/case_001.nii.gz: missing label")
    assert "dataset.json lists '/mnt/old-copy/labelsTr/case_001.nii.gz'" in label_line
    assert all("\n" not in line for line in lines)


def test_a_3d_file_where_the_dataset_declares_channels_and_a_4d_channel_file(tmp_path):
    from fixtures.medical import rewrite_volume

    root = write_msd(tmp_path / "msd", cases=2, test_cases=0, channels=2, style="msd")  # one 4D file per case
    image = rewrite_volume(root / "imagesTr" / "case_001.nii.gz", lambda d: d[..., 0])
    layout = _layout(root)
    records = {r.id: r for r in layout.scan()}
    assert layout.check(records["case_000"]) == []
    (problem,) = layout.check(records["case_001"])
    assert str(problem) == (
        f"{image}: image is 3D (16, 16, 12) with 1 channel(s); the dataset declares 2 (FLAIR, T1w); give one file "
        "per declared channel, or fix the channels (modality / channel_names) in dataset.json"
    )
    root = write_msd(tmp_path / "nnunet", cases=1, test_cases=0, channels=2, style="nnunet-v2")
    channel = rewrite_volume(
        root / "imagesTr" / "case_000_0001.nii.gz", lambda d: __import__("numpy").stack([d, d], -1)
    )
    layout = _layout(root)
    (problem,) = layout.check(layout.scan()[0])
    assert problem.path == channel
    assert problem.message == (
        "modality T1w is 4D (16, 16, 12, 2) with 2 channels; a channel file (_0000, _0001, ...) holds one 3D volume"
    )


@pytest.mark.parametrize("listed", [True, False], ids=["v1-list", "no-list"])
def test_uncompressed_nii_files_without_a_file_ending_key(tmp_path, listed):
    """A conversion that wrote plain .nii files and a v1 list naming them (or no list, no file_ending): the ending
    is taken from the list or the folder, not .nii.gz, which made every path case.nii.nii.gz and "missing"."""
    import gzip

    root = write_msd(tmp_path / "msd", cases=2, test_cases=1)
    original = _layout(root).read(_train(_layout(root))[0])
    for path in sorted(root.rglob("*.nii.gz")):
        path.with_name(path.name.removesuffix(".gz")).write_bytes(gzip.decompress(path.read_bytes()))
        path.unlink()

    def change(meta):
        if not listed:
            del meta["training"], meta["test"]
            return
        for entry in meta["training"]:
            entry["image"], entry["label"] = (entry[k].removesuffix(".gz") for k in ("image", "label"))
        meta["test"] = [name.removesuffix(".gz") for name in meta["test"]]

    _rewrite(root, change)
    layout = _layout(root)
    assert layout.ending == ".nii"
    records = layout.scan()
    assert [(r.id, r.split) for r in records] == [("case_000", "train"), ("case_001", "train"), ("case_002", "test")]
    assert records[0].images == (root / "imagesTr" / "case_000_0000.nii",)
    assert records[0].label == root / "labelsTr" / "case_000.nii"
    assert all(layout.check(r) == [] for r in records)
    sample = layout.read(records[0])
    assert np.array_equal(sample.image, original.image) and np.array_equal(sample.label, original.label)


def test_the_decathlon_ending_stays_the_default(tmp_path):
    root = write_msd(tmp_path / "msd", cases=1, test_cases=0)
    assert _layout(root).ending == ".nii.gz"
    _rewrite(root, lambda meta: meta.update(file_ending=".nii"))
    assert _layout(root).ending == ".nii"


def test_images_with_axes_of_size_one_after_the_third_are_volumes(tmp_path):
    """(X, Y, Z, 1, 1) is one 3D volume and (X, Y, Z, 1, C) C channels (how ITK writes a C-component image to
    NIfTI); data check accepts both, and reading gives the same image as the 3D / 4D file."""
    from fixtures.medical import rewrite_volume

    root = write_msd(tmp_path / "msd", cases=2, test_cases=0)
    layout = _layout(root)
    first, second = _train(layout)
    plain = layout.read(first).image
    rewrite_volume(first.images[0], lambda d: d[..., None, None])
    assert nib.load(str(first.images[0])).shape == (*plain.shape[1:], 1, 1)
    assert layout.check(first) == []
    assert np.array_equal(layout.read(first).image, plain)

    mri = write_msd(tmp_path / "mri", cases=1, test_cases=0, channels=2, style="msd")
    layout = _layout(mri)
    (case,) = _train(layout)
    four_d = layout.read(case).image
    rewrite_volume(case.images[0], lambda d: d[..., None, :])
    assert nib.load(str(case.images[0])).shape == (*four_d.shape[1:], 1, 2)
    assert layout.check(case) == []
    assert np.array_equal(layout.read(case).image, four_d)


def test_an_image_with_two_axes_beyond_the_volume_is_refused_with_the_fix(tmp_path):
    from fixtures.medical import rewrite_volume

    root = write_msd(tmp_path / "msd", cases=1, test_cases=0)
    layout = _layout(root)
    (case,) = _train(layout)
    rewrite_volume(case.images[0], lambda d: np.stack([d, d], -1)[..., None, :].repeat(2, 3))
    (problem,) = layout.check(case)
    assert "image has 5 dimension(s)" in problem.message and problem.fix == "re-export it as a 3D NIfTI volume"
    with pytest.raises(DataError, match=r"expected a 3D volume per channel file, got shape \(16, 16, 12, 2, 2\); save"):
        layout.read(case)
