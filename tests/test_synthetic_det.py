"""The synthetic detection benchmark: boxes of visible pixels, K-shot splits, determinism, cache, built-in."""

import dataclasses

import numpy as np
import pytest

from jascl.data.synthetic import SyntheticRenderer
from jascl.data.synthetic_det import (
    MIN_BOX_PIXELS,
    DetectionRenderer,
    generate_detection,
    load_or_generate_detection,
    visible_boxes,
)
from jascl.data.types import DetectionSplit
from jascl.engine.config import resolve_config
from jascl.errors import DataError
from jascl.protocols import get_protocol, parse_protocol


def _det_dict(**session_overrides) -> dict:
    return {
        "name": "toy-det",
        "task": "detection",
        "seed": 5,
        "synthetic": {"size": 32, "objects_per_image": [1, 3], "object_radius": [0.25, 0.35], "distractors": 2},
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "disc", "shape": "disc"},
            {"id": 2, "name": "square", "shape": "square"},
            {"id": 3, "name": "cross", "shape": "cross"},
        ],
        "domains": {"a": {"appearance": {"class_intensity": [0.5, 0.9]}}, "b": {"appearance": {"invert": True}}},
        "sessions": [
            {"name": "base", "domains": ["a"], "new_classes": [1, 2], "shots": "all", "train": 5, "test": 3},
            {
                "name": "inc",
                "domains": ["b"],
                "new_classes": [3],
                "recurring_classes": [1],
                "shots": 3,
                "unlabelled": 4,
                "test": 2,
                "validation": 1,
                **session_overrides,
            },
        ],
    }


@pytest.fixture(scope="module")
def det_protocol():
    return parse_protocol(_det_dict(), "toy-det.yaml")


def _bbox(mask: np.ndarray) -> list[float]:
    rows, cols = np.nonzero(mask)
    return [cols.min(), rows.min(), cols.max() + 1, rows.max() + 1]


def test_visible_boxes_by_hand():
    a = np.zeros((10, 12), bool)
    a[2:7, 3:10] = True  # rows 2..6, columns 3..9: 35 pixels
    b = np.zeros_like(a)
    b[2:7, 7:10] = True  # drawn over a's columns 7..9: 15 pixels
    hidden = np.zeros_like(a)
    hidden[3:5, 4:8] = True  # drawn first, entirely under a
    sliver = np.zeros_like(a)
    sliver[8:10, 0:5] = True  # 10 visible pixels < MIN_BOX_PIXELS
    out = visible_boxes([hidden, a, b, sliver], [4, 1, 2, 3])
    # a keeps columns 3..6 -> x1 3, x2 7; rows 2..6 -> y1 2, y2 7; drawing order kept, hidden and sliver dropped
    np.testing.assert_array_equal(out["boxes"], np.array([[3, 2, 7, 7], [7, 2, 10, 7]], np.float32))
    np.testing.assert_array_equal(out["labels"], np.array([1, 2], np.int64))
    assert out["boxes"].dtype == np.float32 and out["labels"].dtype == np.int64
    assert MIN_BOX_PIXELS == 12
    one = np.zeros((6, 8), bool)
    one[4, 5] = True  # row 4, column 5 -> [x1 5, y1 4, x2 6, y2 5]
    np.testing.assert_array_equal(visible_boxes([one], [7], min_pixels=1)["boxes"], [[5, 4, 6, 5]])
    empty = visible_boxes([], [])
    assert empty["boxes"].shape == (0, 4) and empty["labels"].shape == (0,)


def test_boxes_are_the_visible_label_map_boxes_of_a_rerendered_sample(det_protocol):
    """Objects of distinct classes, so each class's pixels in the segmentation renderer's label map (same random
    stream) are one object's visible pixels; rendering only the first object gives its full, unoccluded mask."""
    det, seg = DetectionRenderer(det_protocol), SyntheticRenderer(det_protocol)
    domain = det_protocol.domains["a"]
    objects = [1, 2, 3]
    occluded_box_changed = 0
    for k in range(12):
        image, target = det.render_boxes(np.random.default_rng(k), domain, objects)
        seg_image, label = seg.render(np.random.default_rng(k), domain, objects)
        np.testing.assert_array_equal(image, seg_image)  # the same scene, bit for bit
        expected = [(_bbox(label == c), c) for c in objects if (label == c).sum() >= MIN_BOX_PIXELS]
        np.testing.assert_array_equal(target["boxes"], np.array([b for b, _ in expected], np.float32).reshape(-1, 4))
        np.testing.assert_array_equal(target["labels"], [c for _, c in expected])
        _, alone = seg.render(np.random.default_rng(k), domain, [1])  # the first object's draws come first
        full, visible = alone == 1, label == 1
        assert (visible & ~full).sum() == 0
        if visible.sum() >= MIN_BOX_PIXELS and _bbox(visible) != _bbox(full):
            occluded_box_changed += 1
    assert occluded_box_changed >= 1  # some sample's first object is cut by later ones and its box shrinks


def test_splits_counts_and_k_shot_primaries(det_protocol):
    base, inc = generate_detection(det_protocol)
    for data in (base, inc):
        for split in (data.train, data.test, data.unlabelled, data.validation):
            if split is not None:
                assert isinstance(split, DetectionSplit)
                assert split.images.shape == (len(split), 1, 32, 32) and len(split.targets) == len(split)
    assert (len(base.train), len(base.test), base.unlabelled, base.validation) == (5, 3, None, None)
    assert (len(inc.train), len(inc.test), len(inc.unlabelled), len(inc.validation)) == (6, 2, 4, 2)
    assert inc.train.ids[4] == "s1-inc/train/00004"
    # K-shot: 3 images per taught class (3, then 1), each with a box of its class; distractors only of class 2
    for i, target in enumerate(inc.train.targets):
        primary = (3, 1)[i // 3]
        assert primary in target["labels"]
        assert set(target["labels"]) <= {1, 2, 3}
    for i, target in enumerate(inc.validation.targets):
        assert set(target["labels"]) == {(3, 1)[i]}
    for target in base.train.targets + base.test.targets:
        assert len(target["labels"]) >= 1 and set(target["labels"]) <= {1, 2}
    for target in inc.test.targets:
        assert set(target["labels"]) <= {1, 3}
    for split in (base.train, inc.train, inc.unlabelled):
        boxes = np.concatenate([t["boxes"] for t in split.targets])
        assert (boxes[:, 0] < boxes[:, 2]).all() and (boxes[:, 1] < boxes[:, 3]).all()
        assert boxes.min() >= 0 and boxes.max() <= 32


def test_generation_is_deterministic_and_cache_round_trips(det_protocol, tmp_path):
    first, second = generate_detection(det_protocol), generate_detection(det_protocol)
    messages: list[str] = []
    made = load_or_generate_detection(det_protocol, tmp_path, progress=messages.append)
    assert len(messages) == 2
    files = sorted(p.name for p in tmp_path.glob("synthetic/toy-det-*/*"))
    assert files == ["session0.det1.npz", "session1.det1.npz"]
    loaded = load_or_generate_detection(det_protocol, tmp_path, progress=messages.append)
    assert len(messages) == 2  # read back, not generated
    for other in (second, made, loaded):
        for a, b in zip(first, other):
            for name in ("train", "test", "unlabelled", "validation"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None)
                if x is None:
                    continue
                assert x.ids == y.ids
                np.testing.assert_array_equal(x.images, y.images)
                assert y.images.dtype == np.float32
                for tx, ty in zip(x.targets, y.targets, strict=True):
                    np.testing.assert_array_equal(tx["boxes"], ty["boxes"])
                    np.testing.assert_array_equal(tx["labels"], ty["labels"])
                    assert ty["boxes"].dtype == np.float32 and ty["labels"].dtype == np.int64
                    assert ty["boxes"].shape == (len(ty["labels"]), 4)


def test_refuses_protocols_it_cannot_generate(det_protocol):
    segmentation = parse_protocol({**_det_dict(), "task": "segmentation", "metric": "iou"}, "seg.yaml")
    with pytest.raises(DataError, match="seg.yaml: task is 'segmentation'"):
        generate_detection(segmentation)
    with pytest.raises(DataError, match="no 'synthetic' section"):
        load_or_generate_detection(dataclasses.replace(det_protocol, synthetic=None))


def test_builtin_synthetic_det():
    p = get_protocol("synthetic-det")
    assert (p.task, p.metric, p.spatial_dims, p.in_channels, p.synthetic.size) == ("detection", "map", 2, 1, (64, 64))
    summary = [(s.domains, s.new_classes, s.shots, s.train, s.test, s.unlabelled) for s in p.sessions]
    assert summary == [
        (("ct",), (1, 2, 3, 4), None, 160, 40, 0),
        (("mri",), (5, 6), 10, None, 30, 40),
        (("us",), (7,), 10, None, 30, 40),
    ]
    assert [s.num_labelled for s in p.sessions] == [160, 20, 10]
    cfg = resolve_config(p.training, "synthetic-det")
    assert (cfg.backbone, cfg.epochs_base, cfg.epochs_incremental, cfg.batch_size) == ("fasterrcnn-small", 20, 12, 8)
    assert (cfg.lr_base, cfg.lr_incremental, cfg.freeze_incremental) == (0.02, 0.01, "all_but_classifier")
    assert cfg.method_args["jascl"]["base"] == "shared"  # one base for every row, as the paper's detection table
    DetectionRenderer(p)  # every shape known, nothing the detection generator refuses
