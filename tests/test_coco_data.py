"""COCO-format data (``jascl.data.coco``) and the COCO-O layout (``jascl.data.coco_o``) on tiny fixtures written
in the real layout (``<split>/annotations/instances_val2017.json`` beside ``<split>/val2017/``): every defect is
one line naming the file, ``jascl data check --coco`` / ``--coco-o`` exit 2 on any, a clean split passes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from jascl.cli import main
from jascl.data.coco import CocoDetection, check_coco, load_coco, xywh_to_xyxy
from jascl.data.coco_o import (
    ANNOTATIONS,
    BASE_CLASS_COUNT,
    COCO_CLASSES,
    DOMAINS,
    IMAGES,
    NOVEL_CLASSES,
    SHOTS,
    UNLABELLED,
    base_classes,
    check_coco_o,
    domain_paths,
)
from jascl.errors import DataError

W, H = 16, 12
CATEGORIES = [{"id": 1, "name": "person"}, {"id": 3, "name": "car"}, {"id": 17, "name": "cat"}]


def image(i: int) -> dict:
    return {"id": i, "file_name": f"{i:012d}.png", "width": W, "height": H}


def box(i: int, image_id: int, category_id: int, bbox: list[float], iscrowd: int = 0) -> dict:
    return {"id": i, "image_id": image_id, "category_id": category_id, "bbox": bbox, "iscrowd": iscrowd, "area": 1.0}


def write_split(root: Path, images: list[dict], annotations: list[dict], skip_files=()) -> tuple[Path, Path]:
    """A COCO-format split in COCO val2017's layout; image ``i`` is filled with the value ``10 * i``."""
    json_path, image_dir = root / ANNOTATIONS, root / IMAGES
    json_path.parent.mkdir(parents=True, exist_ok=True)
    image_dir.mkdir(parents=True, exist_ok=True)
    for im in images:
        if im["file_name"] not in skip_files:
            pixels = np.full((im["height"], im["width"], 3), 10 * im["id"], dtype=np.uint8)
            Image.fromarray(pixels).save(image_dir / im["file_name"])
    json_path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": CATEGORIES}))
    return json_path, image_dir


def clean(root: Path) -> tuple[Path, Path]:
    return write_split(
        root,
        [image(1), image(2)],
        [box(1, 1, 1, [2, 3, 4, 5]), box(2, 1, 17, [0, 0, W, H]), box(3, 2, 3, [1.5, 2.0, 3.0, 4.0])],
    )


def test_xywh_to_xyxy():
    assert xywh_to_xyxy([10, 20, 30, 40]) == (10.0, 20.0, 40.0, 60.0)
    assert xywh_to_xyxy([1.5, 2.0, 3.0, 4.0]) == (1.5, 2.0, 4.5, 6.0)


def test_clean_split_passes_and_serves_images_and_xyxy_boxes(tmp_path):
    json_path, image_dir = clean(tmp_path)
    assert check_coco(json_path, image_dir) == []
    split = load_coco(json_path, image_dir)
    assert split.categories == {1: "person", 3: "car", 17: "cat"}
    assert split.annotation_counts() == {1: 1, 3: 1, 17: 1}
    ds = CocoDetection(json_path, image_dir)
    assert len(ds) == 2
    img, target = ds[0]
    assert img.shape == (3, H, W) and img.dtype == torch.float32
    assert torch.allclose(img, torch.full((3, H, W), 10 / 255))
    assert set(target) == {"boxes", "labels"}
    assert torch.equal(target["boxes"], torch.tensor([[2.0, 3.0, 6.0, 8.0], [0.0, 0.0, W, H]]))
    assert target["labels"].dtype == torch.int64 and target["labels"].tolist() == [1, 17]
    assert torch.equal(ds[1][1]["boxes"], torch.tensor([[1.5, 2.0, 4.5, 6.0]]))


def test_dataset_maps_labels_clips_boxes_and_drops_crowd(tmp_path):
    json_path, image_dir = write_split(
        tmp_path,
        [image(1)],
        [
            box(1, 1, 1, [-2, 1, 6, 4]),  # reaches 2 px left of the image: clipped to x1 = 0
            box(2, 1, 3, [1, 1, 2, 2]),  # car: not in label_of, dropped
            box(3, 1, 17, [0, 0, 4, 4], iscrowd=1),  # crowd: dropped unless keep_crowd
            box(4, 1, 17, [W, 0, 3, 3]),  # wholly right of the image: no area once clipped, dropped
        ],
    )
    target = CocoDetection(json_path, image_dir, label_of={1: 1, 17: 2}).target(0)
    assert target["boxes"].tolist() == [[0.0, 1.0, 4.0, 5.0]] and target["labels"].tolist() == [1]
    target = CocoDetection(json_path, image_dir, label_of={1: 1, 17: 2}, keep_crowd=True).target(0)
    assert target["labels"].tolist() == [1, 2] and target["iscrowd"].tolist() == [0, 1]
    with pytest.raises(DataError, match="image id"):
        CocoDetection(json_path, image_dir, image_ids=[7])


def test_every_defect_is_one_line_naming_the_file(tmp_path):
    json_path, image_dir = write_split(
        tmp_path,
        [image(1), image(2), image(3), image(4)],
        [
            box(1, 1, 1, [2, 2, 4, 4]),
            box(2, 1, 1, [10, 2, 8, 4]),  # x2 = 18 > width 16 + 1 px tolerance
            box(3, 2, 3, [2, 2, 0, 4]),  # zero width
            box(4, 2, 99, [1, 1, 2, 2]),  # unknown category
            box(5, 4, 1, [1, 1, 2, 2]),
            box(6, 9, 1, [1, 1, 2, 2]),  # unknown image
        ],  # image 3 has no annotation
        skip_files={image(4)["file_name"]},  # image 4's file is missing
    )
    lines = check_coco(json_path, image_dir)
    assert len(lines) == 6, lines
    assert all("\n" not in line for line in lines)
    missing, outside, size, category, empty, unknown = (
        next(line for line in lines if key in line)
        for key in (
            "image file missing",
            "lies outside",
            "non-positive size",
            "category id 99",
            "no annotation",
            "image id 9 is not",
        )
    )
    assert unknown.startswith(f"{json_path}: annotation id 6 (image id 9): image id 9 is not in 'images'")
    assert missing.startswith(f"{image_dir / image(4)['file_name']}: image file missing (image id 4")
    assert outside.startswith(f"{json_path}: annotation id 2 (image id 1): box (x1 10, y1 2, x2 18, y2 6) lies outside")
    assert size.startswith(f"{json_path}: annotation id 3 (image id 2): box has non-positive size (w 0, h 4)")
    assert category.startswith(f"{json_path}: annotation id 4 (image id 2): category id 99 is not in 'categories'")
    assert empty.startswith(f"{json_path}: image id 3 ({image(3)['file_name']}) has no annotation")
    assert len(check_coco(json_path, image_dir, expect_annotations=False)) == 5


def test_a_box_within_the_tolerance_and_a_wrong_image_size(tmp_path):
    json_path, image_dir = write_split(tmp_path, [image(1)], [box(1, 1, 1, [-0.5, 0, W + 0.5, H])])
    assert check_coco(json_path, image_dir) == []
    Image.fromarray(np.zeros((5, 7, 3), dtype=np.uint8)).save(image_dir / image(1)["file_name"])
    (line,) = check_coco(json_path, image_dir)
    assert line.startswith(f"{image_dir / image(1)['file_name']}: image is 7 x 5 pixels but the JSON says 16 x 12")


def test_malformed_json_and_missing_keys_are_one_line(tmp_path):
    json_path, image_dir = clean(tmp_path)
    json_path.write_text('{"images": [')
    (line,) = check_coco(json_path, image_dir)
    assert line.startswith(f"{json_path}: not valid JSON (")
    json_path.write_text(json.dumps({"images": [], "categories": []}))
    assert check_coco(json_path, image_dir) == [
        f"{json_path}: key(s) annotations missing or not lists; "
        "a COCO instances file has 'images', 'annotations' and 'categories' lists"
    ]
    json_path.write_text(json.dumps({"images": [{"id": 1}], "annotations": [], "categories": CATEGORIES}))
    assert check_coco(json_path, image_dir) == [
        f"{json_path}: images[0] (id 1) lacks key(s) file_name, width, height; fix the entry"
    ]
    with pytest.raises(DataError, match="lacks key"):
        load_coco(json_path, image_dir)


def test_cli_coco_check_exits_2_with_one_line_per_defect_and_0_when_clean(tmp_path, capsys):
    json_path, image_dir = clean(tmp_path / "good")
    assert main(["data", "check", "--coco", str(json_path), "--images", str(image_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no problems found"
    bad_json, bad_dir = write_split(tmp_path / "bad", [image(1), image(2)], [box(1, 1, 42, [0, 0, 2, 2])])
    assert main(["data", "check", "--coco", str(bad_json), "--images", str(bad_dir)]) == 2
    out = capsys.readouterr().out.splitlines()
    errors = [line for line in out if line.startswith("error: ")]
    assert len(errors) == 2 and out[-1] == "2 problem(s) found"  # unknown category 42, image 2 without annotation
    assert main(["data", "check", "--coco", str(bad_json), "--images", str(bad_dir), "--allow-unannotated"]) == 2
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]) == 1
    assert main(["data", "check", "--coco", str(json_path)]) == 2  # --images missing
    assert main(["data", "check"]) == 2  # neither a protocol nor a COCO split
    assert "give --protocol" in capsys.readouterr().err


def test_cli_coco_o_checks_every_domain(tmp_path, capsys):
    root = tmp_path / "ood_coco"
    for domain in DOMAINS:
        if domain != "tattoo":
            clean(root / domain)
    write_split(root / "sketch", [image(1)], [box(1, 1, 1, [0, 0, 40, 2])])  # outside the 16 x 12 image
    lines = check_coco_o(root)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{root / 'sketch' / ANNOTATIONS}: annotation id 1 (image id 1): box")
    assert lines[1].startswith(f"{root / 'tattoo'}: COCO-O domain folder 'tattoo' missing")
    assert main(["data", "check", "--coco-o", str(root)]) == 2
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]) == 2
    assert domain_paths(root, "weather") == (root / "weather" / ANNOTATIONS, root / "weather" / IMAGES)
    with pytest.raises(DataError, match="no domain 'oil'"):
        domain_paths(root, "oil")


def test_base_classes_rule_and_cli(tmp_path, capsys):
    """Annotated in Painting, less person / car / bench, in category-id order; a count other than 77 warns."""
    root = tmp_path / "ood_coco"
    write_split(
        root / "painting",
        [image(1)],
        [
            box(1, 1, 18, [0, 0, 2, 2]),
            box(2, 1, 1, [0, 0, 2, 2]),
            box(3, 1, 17, [0, 0, 2, 2]),
            box(4, 1, 3, [0, 0, 2, 2]),
            box(5, 1, 95, [0, 0, 2, 2]),
        ],
    )
    data = json.loads((root / "painting" / ANNOTATIONS).read_text())
    # kite: no annotation; unicorn: annotated but not a COCO class (listed, with a warning)
    data["categories"] += [{"id": 18, "name": "dog"}, {"id": 38, "name": "kite"}, {"id": 95, "name": "unicorn"}]
    (root / "painting" / ANNOTATIONS).write_text(json.dumps(data))
    assert base_classes(root) == ["cat", "dog", "unicorn"]
    assert main(["data", "coco-o-classes", "--root", str(root)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "cat",
        "dog",
        "unicorn",
        "3 base classes",
        "warning: not COCO class names: unicorn",
        "warning: the paper's base session has 77 classes, this copy gives 3",
    ]
    assert main(["data", "coco-o-classes", "--root", str(tmp_path / "nowhere")]) == 2
    assert "instances JSON not found" in capsys.readouterr().err


def test_session_constants_are_consistent_with_coco():
    """COCO's 80 classes (ids 1..90 less ten gaps); 77 base = 80 less the 3 novel, which are COCO classes."""
    assert len(COCO_CLASSES) == 80 and sorted(set(range(1, 91)) - set(COCO_CLASSES)) == [
        12, 26, 29, 30, 45, 66, 68, 69, 71, 83,
    ]  # fmt: skip
    assert {COCO_CLASSES[i] for i in (1, 3, 15)} == set(NOVEL_CLASSES) == set(UNLABELLED)
    assert BASE_CLASS_COUNT == len(COCO_CLASSES) - len(NOVEL_CLASSES)
    assert (SHOTS, UNLABELLED) == (30, {"bench": 41, "car": 224, "person": 174})
