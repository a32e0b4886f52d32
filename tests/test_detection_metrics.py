"""COCO mAP (``jascl.evaluation.detection``) on hand-made boxes: values worked out by hand with COCO's 101-point
interpolated AP, the same input through pycocotools itself, and the merge of several processes' images."""

import math

import pytest
import torch

from jascl import distributed
from jascl.errors import DataError
from jascl.evaluation.detection import DetectionMetrics, map_total_drop


def boxes(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# Image A: class 1 at [0, 0, 10, 10] and class 2 at [0, 0, 10, 10]; image B: class 1 at [0, 0, 10, 10].
TARGETS = [
    {"boxes": boxes([0, 0, 10, 10], [0, 0, 10, 10]), "labels": torch.tensor([1, 2])},
    {"boxes": boxes([0, 0, 10, 10]), "labels": torch.tensor([1])},
]
# Class 1: a perfect match in A (score 0.9), a false positive in B (0.8) and B's box missed.
# Class 2: a box of IoU 72 / 100 = 0.72 with A's (0.7). Class 3: a prediction without any ground truth.
PREDS = [
    {"boxes": boxes([0, 0, 10, 10], [0, 0, 10, 7.2]), "scores": torch.tensor([0.9, 0.7]), "labels": torch.tensor([1, 2])},
    {"boxes": boxes([50, 50, 60, 60], [30, 30, 40, 40]), "scores": torch.tensor([0.8, 0.6]), "labels": torch.tensor([1, 3])},
]  # fmt: skip

# By hand. Class 1, at every IoU threshold (its match is exact): ranked by score TP, FP -> precision (1, 1/2),
# recall (1/2, 1/2) of its 2 boxes; made monotone the precision stays (1, 1/2). COCO reads it at the 101 recall
# points 0, 0.01, ..., 1 as the precision of the first rank reaching that recall: 1 for the 51 points <= 0.5,
# 0 for the 50 above (recall never passes 1/2). AP = 51 / 101 at each IoU, so also averaged over them.
AP1 = 51 / 101
# Class 2: IoU 0.72 matches at the thresholds 0.50, 0.55, 0.60, 0.65, 0.70 (AP 1: recall 1 at precision 1) and
# not at 0.75 ... 0.95 (AP 0: a false positive and a miss); averaged over the 10 thresholds: 5 / 10.
AP2, AP2_50 = 0.5, 1.0
# Class 3 has no ground truth: no AP, and it enters no mean.
MAP = (AP1 + AP2) / 2  # 203 / 404
MAP_50 = (AP1 + AP2_50) / 2  # 76 / 101


def test_map_on_hand_made_boxes_equals_the_hand_computation():
    m = DetectionMetrics(old=[1], new=[2])
    m.update(PREDS[:1], TARGETS[:1])
    m.update(PREDS[1:], TARGETS[1:])
    assert len(m) == 2
    r = m.compute()
    assert r["map"] == pytest.approx(MAP, abs=1e-6) and r["map"] == pytest.approx(203 / 404, abs=1e-6)
    assert r["map_50"] == pytest.approx(MAP_50, abs=1e-6)
    assert set(r["per_class"]) == {1, 2, 3}
    assert r["per_class"][1] == pytest.approx(AP1, abs=1e-6)
    assert r["per_class"][2] == pytest.approx(AP2, abs=1e-6)
    assert math.isnan(r["per_class"][3])
    assert r["old"] == pytest.approx(AP1, abs=1e-6) and r["new"] == pytest.approx(AP2, abs=1e-6)
    assert r["all"] == pytest.approx(MAP, abs=1e-6)  # old + new cover every class with ground truth


def test_without_old_and_new_all_is_over_every_class_with_ground_truth():
    m = DetectionMetrics()
    m.update(PREDS, TARGETS)
    r = m.compute()
    assert r["all"] == pytest.approx(MAP, abs=1e-6) and math.isnan(r["old"]) and math.isnan(r["new"])


def test_the_same_input_through_pycocotools():
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(b):
        x1, y1, x2, y2 = (float(v) for v in b)
        return [x1, y1, x2 - x1, y2 - y1]

    gt, dets = COCO(), []
    anns = []
    for image_id, t in enumerate(TARGETS):
        for b, c in zip(t["boxes"], t["labels"]):
            w, h = xywh(b)[2:]
            anns.append(
                {"id": len(anns) + 1, "image_id": image_id, "category_id": int(c), "bbox": xywh(b), "area": w * h}
            )
            anns[-1]["iscrowd"] = 0
    gt.dataset = {
        "images": [{"id": i} for i in range(len(TARGETS))],
        "annotations": anns,
        "categories": [{"id": c} for c in (1, 2, 3)],
    }
    gt.createIndex()
    for image_id, p in enumerate(PREDS):
        for b, s, c in zip(p["boxes"], p["scores"], p["labels"]):
            dets.append({"image_id": image_id, "category_id": int(c), "bbox": xywh(b), "score": float(s)})
    ev = COCOeval(gt, gt.loadRes(dets), "bbox")
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    precision = ev.eval["precision"]  # (IoU thresholds, recall points, classes, areas, max dets)

    def class_ap(k):
        p = precision[:, :, k, 0, -1]
        return float(p[p > -1].mean()) if (p > -1).any() else math.nan

    m = DetectionMetrics()
    m.update(PREDS, TARGETS)
    r = m.compute()
    assert r["map"] == pytest.approx(ev.stats[0], abs=1e-6) and ev.stats[0] == pytest.approx(MAP, abs=1e-9)
    assert r["map_50"] == pytest.approx(ev.stats[1], abs=1e-6)
    assert r["per_class"][1] == pytest.approx(class_ap(0), abs=1e-6)
    assert r["per_class"][2] == pytest.approx(class_ap(1), abs=1e-6)
    assert math.isnan(class_ap(2))


def test_images_of_several_processes_are_scored_together(monkeypatch):
    """Rank 0 holds image A, rank 1 image B (uneven shares work: one gather of whole lists, not one per image)."""
    ranks = [DetectionMetrics(old=[1], new=[2]), DetectionMetrics(old=[1], new=[2])]
    ranks[0].update(PREDS[:1], TARGETS[:1])
    ranks[1].update(PREDS[1:], TARGETS[1:])
    shares = [(r._preds, r._targets) for r in ranks]
    monkeypatch.setattr(distributed, "all_gather_object", lambda obj: shares)
    r = ranks[0].compute()
    assert r["map"] == pytest.approx(MAP, abs=1e-6) and r["old"] == pytest.approx(AP1, abs=1e-6)
    monkeypatch.undo()
    alone = ranks[0].compute()  # image A alone: both classes matched exactly at IoU >= 0.5
    assert alone["map_50"] == pytest.approx(1.0, abs=1e-6) and alone["old"] == pytest.approx(1.0, abs=1e-6)


def test_no_ground_truth_is_nan_and_bad_input_is_one_line():
    m = DetectionMetrics()
    m.update(PREDS[:1], [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}])
    r = m.compute()
    assert math.isnan(r["map"]) and math.isnan(r["all"]) and r["per_class"] == {}
    none = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
    blind = DetectionMetrics(old=[1])
    blind.update([none], TARGETS[1:])  # ground truth but no detection: AP 0, not absent
    r = blind.compute()
    assert (r["map"], r["map_50"], r["per_class"], r["old"], r["all"]) == (0.0, 0.0, {1: 0.0}, 0.0, 0.0)
    with pytest.raises(DataError, match="prediction 1 lacks key"):
        m.update([{"boxes": boxes([0, 0, 1, 1]), "labels": torch.tensor([1])}], TARGETS[:1])
    with pytest.raises(DataError, match="counts differ"):
        m.update([{**PREDS[0], "scores": torch.tensor([0.5])}], TARGETS[:1])
    with pytest.raises(DataError, match="2 predictions for 1 targets"):
        m.update(PREDS, TARGETS[:1])


def test_total_drop_on_map_uses_the_paper_formula():
    # base session 0.2840 mAP (the paper's base model), session 1 0.063 (its JASCL row): 100 * 0.221 / 0.284
    assert map_total_drop([0.2840, 0.063]) == pytest.approx(100 * (0.2840 - 0.063) / 0.2840)
    assert map_total_drop([0.2, 0.3, 0.1]) == pytest.approx(100 * 0.2 / 0.2)  # only falls count
