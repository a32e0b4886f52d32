"""2D dataset layouts (Cityscapes, IDD, BDD100K, CholecSeg8k, m2caiSeg) and 2D preprocessing."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures import natural as fx  # noqa: E402
from jascl.data import natural  # noqa: E402
from jascl.data.layouts import LAYOUTS, Sample  # noqa: E402
from jascl.data.layouts.bdd100k import BDD100K_NAMES  # noqa: E402
from jascl.data.layouts.cholecseg8k import CHOLECSEG8K_CLASSES  # noqa: E402
from jascl.data.layouts.cityscapes import CITYSCAPES_LABELS, CITYSCAPES_TRAIN_IDS, CITYSCAPES_TRAIN_NAMES  # noqa: E402
from jascl.data.layouts.idd import IDD_LABELS, IDD_LEVEL3_MEMBERS, IDD_LEVEL3_NAMES  # noqa: E402
from jascl.data.layouts.m2caiseg import M2CAISEG_CLASSES  # noqa: E402
from jascl.errors import ConfigError, DataError  # noqa: E402

WRITERS = {
    "cityscapes": fx.write_cityscapes,
    "idd": fx.write_idd,
    "bdd100k": fx.write_bdd100k,
    "cholecseg8k": fx.write_cholecseg8k,
    "m2caiseg": fx.write_m2caiseg,
}


def layout_for(name, tmp_path, **options):
    root = WRITERS[name](tmp_path / name)
    return LAYOUTS.create(name, root=root, **options)


# ---------------------------------------------------------------------------------------------
# Label tables, checked against values read off the cited sources


def test_cityscapes_table_values():
    by_name = {label.name: label for label in CITYSCAPES_LABELS}
    assert [label.id for label in CITYSCAPES_LABELS[:34]] == list(range(34))
    assert (by_name["car"].id, by_name["car"].train_id) == (26, 13)
    assert (by_name["parking"].id, by_name["parking"].train_id) == (9, 255)
    assert (by_name["vegetation"].id, by_name["vegetation"].train_id) == (21, 8)
    assert (by_name["license plate"].id, by_name["license plate"].train_id) == (-1, -1)
    # 19 trained classes with train ids 0..18, road first and bicycle last.
    assert sorted(CITYSCAPES_TRAIN_NAMES) == list(range(19))
    assert (CITYSCAPES_TRAIN_NAMES[0], CITYSCAPES_TRAIN_NAMES[18]) == ("road", "bicycle")
    assert sum(1 for t in CITYSCAPES_TRAIN_IDS.values() if t != 255) == 19


def test_bdd100k_classes_are_cityscapes_train_ids():
    assert {k: v for k, v in BDD100K_NAMES.items() if k != 255} == CITYSCAPES_TRAIN_NAMES
    assert BDD100K_NAMES[255] == "unknown" and len(BDD100K_NAMES) == 20


def test_idd_level3_hierarchy():
    assert sorted(IDD_LEVEL3_NAMES) == [*range(26), 255]
    assert IDD_LEVEL3_MEMBERS[1] == ("parking", "drivable fallback")
    assert IDD_LEVEL3_MEMBERS[3] == ("rail track", "non-drivable fallback")
    assert IDD_LEVEL3_MEMBERS[23] == ("bridge", "tunnel")
    assert IDD_LEVEL3_MEMBERS[12] == ("caravan", "trailer", "train", "vehicle fallback")
    by_name = {label.name: label for label in IDD_LABELS}
    assert by_name["autorickshaw"].level3_id == 8 and by_name["pole"].level3_id == 20
    assert [label.id for label in IDD_LABELS] == list(range(40))
    # Every level-3 class has at least one level-4 member and the fixture's independent copy agrees.
    assert all(IDD_LEVEL3_MEMBERS[i] for i in range(26))
    assert all(by_name[name].level3_id == level3 for name, level3 in fx.IDD_LEVEL3_BY_NAME.items())


def test_cholecseg8k_table():
    assert [c.id for c in CHOLECSEG8K_CLASSES] == list(range(13))
    assert len({c.watershed for c in CHOLECSEG8K_CLASSES}) == 13
    assert len({c.colour for c in CHOLECSEG8K_CLASSES}) == 13
    liver = CHOLECSEG8K_CLASSES[2]
    assert (liver.name, liver.watershed, liver.colour) == ("liver", 21, (255, 114, 114))
    assert CHOLECSEG8K_CLASSES[12].watershed == 5 and CHOLECSEG8K_CLASSES[0].watershed == 50
    assert {c.id: (c.watershed, c.colour) for c in CHOLECSEG8K_CLASSES} == fx.CHOLECSEG8K


def test_m2caiseg_table():
    assert [c.id for c in M2CAISEG_CLASSES] == list(range(19))
    # One colour per class (an older revision of the authors' file gave artery the liver colour).
    assert len({c.colour for c in M2CAISEG_CLASSES}) == 19
    names = {c.name: c for c in M2CAISEG_CLASSES}
    # The paper's surgery benchmark uses upper wall, intestine, grasper and clipper from m2caiSeg.
    assert (names["upper wall"].id, names["intestine"].id, names["grasper"].id, names["clipper"].id) == (13, 15, 1, 5)
    assert names["grasper"].colour == (0, 85, 170) and names["black"].colour == (0, 0, 0)
    assert {c.id: c.colour for c in M2CAISEG_CLASSES} == fx.M2CAISEG


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_registered_and_described(name):
    assert name in LAYOUTS
    layout = LAYOUTS.create(name, root="/nonexistent")
    assert layout.spatial_dims == 2 and layout.description and layout.ignore_index == 255


# ---------------------------------------------------------------------------------------------
# Round trips on fixtures in the native layouts


def test_cityscapes_scan_and_read(tmp_path):
    layout = layout_for("cityscapes", tmp_path)
    records = layout.scan()
    assert [r.id for r in records] == [
        "train/aachen/aachen_000000_000019",
        "train/aachen/aachen_000001_000020",
        "val/frankfurt/frankfurt_000000_000019",
        "val/frankfurt/frankfurt_000001_000020",
    ]
    record = records[0]
    assert record.images[0].name == "aachen_000000_000019_leftImg8bit.png"
    assert record.label.name == "aachen_000000_000019_gtFine_labelIds.png"
    assert record.split == "train" and record.meta == {"city": "aachen"}
    sample = layout.read(record)
    expected_label = np.asarray(Image.open(record.label)).astype(np.int64)
    expected_image = np.asarray(Image.open(record.images[0])).transpose(2, 0, 1).astype(np.float32)
    assert sample.image.dtype == np.float32 and sample.label.dtype == np.int64
    np.testing.assert_array_equal(sample.label, expected_label)
    np.testing.assert_array_equal(sample.image, expected_image)
    assert sample.affine is None
    assert set(np.unique(sample.label)) == set(range(34))
    assert layout.check(record) == []


def test_splits_option_filters_and_rejects_unknown(tmp_path):
    root = fx.write_cityscapes(tmp_path / "cs")
    only_val = LAYOUTS.create("cityscapes", root=root, splits="val").scan()
    assert {r.split for r in only_val} == {"val"} and len(only_val) == 2
    with pytest.raises(ConfigError, match="unknown split.*'training'"):
        LAYOUTS.create("cityscapes", root=root, splits=["training"]).scan()


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_missing_or_foreign_root_is_one_line_error(name, tmp_path):
    with pytest.raises(DataError, match="does not exist") as missing:
        LAYOUTS.create(name, root=tmp_path / "absent").scan()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a") as foreign:
        LAYOUTS.create(name, root=tmp_path / "empty").scan()
    assert "\n" not in str(missing.value) and "\n" not in str(foreign.value)


def test_idd_png_and_polygons_agree(tmp_path):
    root = fx.write_idd(tmp_path / "idd")
    png = LAYOUTS.create("idd", root=root, labels="png")
    polygons = LAYOUTS.create("idd", root=root, labels="polygons")
    png_records, polygon_records = png.scan(), polygons.scan()
    assert [r.id for r in png_records] == ["train/0/000100", "train/0/000107", "val/1/000100", "val/1/000107"]
    assert [r.id for r in png_records] == [r.id for r in polygon_records]
    assert polygon_records[0].label.name == "000100_gtFine_polygons.json"
    for a, b in zip(png_records, polygon_records):
        from_png, from_json = png.read(a).label, polygons.read(b).label
        np.testing.assert_array_equal(from_json, from_png)  # the deleted full-frame "road" object is not drawn
        assert set(np.unique(from_png)) == set(range(26))
        assert polygons.check(b) == []
    # Default "auto" prefers the PNG.
    assert LAYOUTS.create("idd", root=root).scan()[0].label.name == "000100_gtFine_labellevel3Ids.png"


def test_idd_polygon_rules(tmp_path):
    root = fx.write_idd(tmp_path / "idd", per_split=1, splits=("train",), level3_png=False)
    layout = LAYOUTS.create("idd", root=root)
    record = layout.scan()[0]
    document = {
        "imgHeight": 32,
        "imgWidth": 64,
        "objects": [
            {"label": "sky", "polygon": [[0, 0], [63, 0], [63, 31], [0, 31]]},
            {"label": "cargroup", "polygon": [[0, 0], [9, 0], [9, 9], [0, 9]]},  # -> car, level 3 id 9
            {"label": "tunnel", "polygon": [[20, 0], [29, 0], [29, 9], [20, 9]]},  # -> bridge/tunnel, 23
            {"label": "license plate", "polygon": [[40, 0], [49, 0], [49, 9], [40, 9]]},  # void -> 255
            {"label": "spaceship", "polygon": [[0, 20], [9, 20], [9, 31], [0, 31]]},  # unknown -> 255
        ],
    }
    record.label.write_text(json.dumps(document))
    label = layout.read(record).label
    assert label[5, 5] == 9 and label[5, 25] == 23 and label[5, 45] == 255 and label[25, 5] == 255
    assert label[25, 40] == 25  # sky underneath everything
    assert label[10, 10] == 25  # a rectangle [0, 9] covers pixels 0..9 only
    problems = layout.check(record)
    assert len(problems) == 1 and "label name 'spaceship'" in str(problems[0])


def test_bdd100k_unlabelled_test_split_and_old_release(tmp_path):
    root = fx.write_bdd100k(tmp_path / "bdd", per_split=2, unlabelled_test=3)
    layout = LAYOUTS.create("bdd100k", root=root)
    records = layout.scan()
    assert [r.split for r in records].count("test") == 3
    test_record = next(r for r in records if r.split == "test")
    assert test_record.label is None
    sample = layout.read(test_record)
    assert sample.label is None and sample.image.shape == (3, 32, 64)
    assert layout.check(test_record) == []
    train = next(r for r in records if r.split == "train")
    assert train.images[0].parent == root / "images" / "10k" / "train"
    assert train.label == root / "labels" / "sem_seg" / "masks" / "train" / f"{train.images[0].stem}.png"
    np.testing.assert_array_equal(layout.read(train).label, np.asarray(Image.open(train.label)))

    # The older release layout (seg/images, seg/labels/*_train_id.png), under a bdd100k/ folder.
    old = tmp_path / "old" / "bdd100k" / "seg"
    (old / "images" / "val").mkdir(parents=True)
    (old / "labels" / "val").mkdir(parents=True)
    Image.open(train.images[0]).save(old / "images" / "val" / "abc.jpg")
    Image.open(train.label).save(old / "labels" / "val" / "abc_train_id.png")
    old_records = LAYOUTS.create("bdd100k", root=tmp_path / "old").scan()
    assert [r.id for r in old_records] == ["val/abc"]
    np.testing.assert_array_equal(
        LAYOUTS.create("bdd100k", root=tmp_path / "old").read(old_records[0]).label, layout.read(train).label
    )


def test_cholecseg8k_watershed_and_colour_masks_agree(tmp_path):
    root = fx.write_cholecseg8k(tmp_path / "cholec", white_edge=True)
    watershed = LAYOUTS.create("cholecseg8k", root=root)
    colour = LAYOUTS.create("cholecseg8k", root=root, mask="color")
    records = watershed.scan()
    assert [r.id for r in records] == [
        "video01/video01_00080/frame_80",
        "video01/video01_00080/frame_81",
        "video12/video12_00080/frame_80",
        "video12/video12_00080/frame_81",
    ]
    assert records[0].images[0].name == "frame_80_endo.png"
    assert records[0].label.name == "frame_80_endo_watershed_mask.png"
    assert {r.split for r in records} == {"train"}
    for a, b in zip(records, colour.scan()):
        grey = np.asarray(Image.open(a.label))[..., 0]
        label = watershed.read(a).label
        # The white border is the released masks' documented non-class: ignore, and not a problem.
        assert (label[0] == 255).all() and (label[:, -1] == 255).all()
        inner = label[1:-1, 1:-1]
        code_of = {c.id: c.watershed for c in CHOLECSEG8K_CLASSES}
        np.testing.assert_array_equal(np.vectorize(code_of.get)(inner), grey[1:-1, 1:-1])
        np.testing.assert_array_equal(colour.read(b).label, label)
        assert watershed.check(a) == [] and colour.check(b) == []


def test_cholecseg8k_video_splits(tmp_path):
    root = fx.write_cholecseg8k(tmp_path / "cholec")
    layout = LAYOUTS.create("cholecseg8k", root=root, video_splits={"test": ["video12"]})
    splits = {r.id: r.split for r in layout.scan()}
    assert splits["video12/video12_00080/frame_81"] == "test" and splits["video01/video01_00080/frame_80"] == "train"
    assert len(LAYOUTS.create("cholecseg8k", root=root, video_splits={"test": ["video12"]}, splits="test").scan()) == 2
    with pytest.raises(ConfigError, match="video 'video12' is in two"):
        LAYOUTS.create("cholecseg8k", root=root, video_splits={"test": ["video12"], "val": ["video12"]})
    with pytest.raises(ConfigError, match="mask"):
        LAYOUTS.create("cholecseg8k", root=root, mask="rgba")


def test_m2caiseg_splits_and_colours(tmp_path):
    root = fx.write_m2caiseg(tmp_path / "m2cai", per_split=2)
    layout = LAYOUTS.create("m2caiseg", root=root)
    records = layout.scan()
    # val = trainval minus train.
    assert [r.id for r in records] == ["test/100", "test/101", "train/0", "train/1", "val/2", "val/3"]
    val = records[4]
    assert val.images[0] == root / "m2caiSeg dataset" / "trainval" / "images" / "2.jpg"
    assert val.label == root / "m2caiSeg dataset" / "trainval" / "groundtruth" / "2_gt.png"
    label = layout.read(val).label
    colours = np.asarray(Image.open(val.label))
    colour_of = {c.id: c.colour for c in M2CAISEG_CLASSES}
    np.testing.assert_array_equal(np.array([colour_of[v] for v in label.ravel()]).reshape(colours.shape), colours)
    assert set(np.unique(label)) == set(range(19))
    # The inner folder works as root too.
    assert [r.id for r in LAYOUTS.create("m2caiseg", root=root / "m2caiSeg dataset").scan()] == [r.id for r in records]


# ---------------------------------------------------------------------------------------------
# check(): every kind of problem, one line each


def test_check_reports_missing_files(tmp_path):
    layout = layout_for("cityscapes", tmp_path)
    first, second = layout.scan()[:2]
    first.images[0].unlink()
    second.label.unlink()
    records = {r.id: r for r in layout.scan()}
    # Both samples are still scanned (from the surviving file), and each problem names its file.
    (problem,) = layout.check(records[first.id])
    assert problem.path == first.images[0] and "missing image file" in problem.message
    (problem,) = layout.check(records[second.id])
    assert problem.path == second.label and "missing label file" in problem.message
    with pytest.raises(DataError, match="file is missing"):
        layout.read(records[second.id])


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_check_reports_unreadable_files_and_size_mismatch(name, tmp_path):
    layout = layout_for(name, tmp_path)
    records = layout.scan()
    fx.corrupt_file(records[0].images[0])
    fx.corrupt_file(records[1].label)
    fx.resize_label(records[2].label, (16, 16))
    (bad_image,) = layout.check(records[0])
    assert bad_image.path == records[0].images[0] and "cannot decode image" in bad_image.message
    (bad_label,) = layout.check(records[1])
    assert bad_label.path == records[1].label
    assert "\n" not in str(bad_image) and "\n" not in str(bad_label) and bad_label.fix
    (mismatch,) = layout.check(records[2])
    assert "label is 16x16 (HxW) but image" in mismatch.message and "is 32x64" in mismatch.message
    with pytest.raises(DataError, match="16x16"):
        layout.read(records[2])
    with pytest.raises(DataError, match="cannot decode"):
        layout.read(records[0])


@pytest.mark.parametrize(
    "name, value, described",
    [
        ("cityscapes", 34, "value 34"),
        ("bdd100k", 19, "value 19"),
        ("idd", 26, "value 26"),
        ("cholecseg8k", (51, 51, 51), "value 51"),
        ("m2caiseg", (1, 2, 3), "colour (1, 2, 3)"),
    ],
)
def test_unknown_label_values_reported_and_read_as_ignore(name, value, described, tmp_path):
    layout = layout_for(name, tmp_path)
    record = layout.scan()[0]
    before = layout.read(record).label
    fx.paint_value(record.label, value, box=(0, 0, 2, 3))
    (problem,) = layout.check(record)
    assert described in problem.message and problem.path == record.label
    after = layout.read(record).label
    assert (after[:2, :3] == 255).all()
    np.testing.assert_array_equal(after[2:], before[2:])


def test_cholecseg8k_unknown_colour_in_colour_mask(tmp_path):
    root = fx.write_cholecseg8k(tmp_path / "cholec")
    layout = LAYOUTS.create("cholecseg8k", root=root, mask="color")
    record = layout.scan()[0]
    fx.paint_value(record.label, (254, 114, 114), box=(4, 4, 6, 6))  # one off liver
    (problem,) = layout.check(record)
    assert "colour (254, 114, 114)" in problem.message
    assert (layout.read(record).label[4:6, 4:6] == 255).all()
    tolerant = LAYOUTS.create("cholecseg8k", root=root, mask="color", colour_tolerance=1)
    assert (tolerant.read(record).label[4:6, 4:6] == 2).all() and tolerant.check(record) == []


def test_index_mask_rejects_colour_renderings(tmp_path):
    layout = layout_for("cityscapes", tmp_path)
    record = layout.scan()[0]
    colour = record.label.with_name(record.label.name.replace("labelIds", "color"))
    colour.replace(record.label)
    (problem,) = layout.check(record)
    assert "colour image" in problem.message


# ---------------------------------------------------------------------------------------------
# Decoding helpers


def test_lookup_colours_exact_tolerant_and_ambiguous():
    table = {(85, 170, 0): 10, (85, 170, 255): 11, (0, 0, 10): 1, (0, 0, 14): 2}
    pixels = np.array([[[85, 170, 0], [84, 171, 1], [0, 0, 12], [9, 9, 9]]], dtype=np.uint8)
    ids, unknown = natural.lookup_colours(pixels, table)
    assert ids.tolist() == [[10, 255, 255, 255]]
    assert unknown == ["colour (0, 0, 12)", "colour (9, 9, 9)", "colour (84, 171, 1)"]
    ids, unknown = natural.lookup_colours(pixels, table, tolerance=2)
    # (0, 0, 12) is within 2 of two class colours: ambiguous, stays unknown.
    assert ids.tolist() == [[10, 10, 255, 255]] and unknown == ["colour (0, 0, 12)", "colour (9, 9, 9)"]


def test_lookup_values():
    ids, unknown = natural.lookup_values(np.array([[0, 3, 7], [40, 3, 255]]), {0: 0, 3: 1, 255: 255})
    assert ids.tolist() == [[0, 1, 255], [255, 1, 255]] and unknown == ["value 7", "value 40"]


# ---------------------------------------------------------------------------------------------
# preprocess_image


def _sample(image, label=None):
    return Sample(image=np.asarray(image, dtype=np.float32), label=None if label is None else np.asarray(label))


def test_preprocess_resizes_labels_with_nearest_neighbour():
    label = np.array([[0, 1], [2, 3]])
    image = np.full((3, 2, 2), 100.0)
    up_image, up_label = natural.preprocess_image(_sample(image, label), {"size": [4, 4]})
    np.testing.assert_array_equal(up_label, np.kron(label, np.ones((2, 2), dtype=np.int64)))
    np.testing.assert_allclose(up_image, 100.0)  # a constant image stays constant
    assert up_image.shape == (3, 4, 4) and up_label.dtype == np.int64
    down_image, down_label = natural.preprocess_image(_sample(up_image, up_label), {"scale": 0.5})
    np.testing.assert_array_equal(down_label, label)
    assert down_image.shape == (3, 2, 2)


def test_preprocess_bilinear_values():
    # A 1x2 ramp [0, 100] upsampled to 1x4 with half-pixel centres: 0, 25, 75, 100.
    image = np.array([[[0.0, 100.0]]] * 3)
    resized, label = natural.preprocess_image(_sample(image), {"size": [1, 4]})
    np.testing.assert_allclose(resized[0, 0], [0.0, 25.0, 75.0, 100.0])
    assert label is None


def test_preprocess_normalisation():
    image = np.stack([np.full((2, 2), 255.0), np.full((2, 2), 0.0), np.full((2, 2), 51.0)])
    zero_one, _ = natural.preprocess_image(_sample(image), {"normalize": "zero_one"})
    np.testing.assert_allclose(zero_one[:, 0, 0], [1.0, 0.0, 0.2], rtol=1e-6)
    imagenet, _ = natural.preprocess_image(_sample(image), {"normalize": "imagenet"})
    expected = [(1.0 - 0.485) / 0.229, (0.0 - 0.456) / 0.224, (0.2 - 0.406) / 0.225]
    np.testing.assert_allclose(imagenet[:, 1, 1], expected, rtol=1e-5)
    raw, _ = natural.preprocess_image(_sample(image), {})
    np.testing.assert_array_equal(raw, image)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"resize": [2, 2]}, "'resize' not known"),
        ({"size": [4, 4], "scale": 2}, "either size or scale"),
        ({"size": [0, 4]}, "positive"),
        ({"size": "big"}, r"\[height, width\]"),
        ({"scale": -1}, "positive"),
        ({"normalize": "whiten"}, "'whiten' is not known"),
    ],
)
def test_preprocess_option_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        natural.preprocess_image(_sample(np.zeros((3, 2, 2))), options)


def test_preprocess_imagenet_needs_rgb():
    with pytest.raises(ConfigError, match="3-channel"):
        natural.preprocess_image(_sample(np.zeros((1, 2, 2))), {"normalize": "imagenet"})


def test_palette_colour_masks_are_read_by_colour(tmp_path):
    layout = layout_for("m2caiseg", tmp_path)
    record = layout.scan()[0]
    expected = layout.read(record).label
    rgb = np.asarray(Image.open(record.label))
    colours, indices = np.unique(rgb.reshape(-1, 3), axis=0, return_inverse=True)
    palette_image = Image.fromarray(indices.reshape(rgb.shape[:2]).astype(np.uint8), mode="P")
    palette_image.putpalette(colours.astype(np.uint8).ravel().tolist())
    palette_image.save(record.label)
    assert Image.open(record.label).mode == "P"
    np.testing.assert_array_equal(layout.read(record).label, expected)
    assert layout.check(record) == []
