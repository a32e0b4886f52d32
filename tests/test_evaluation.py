"""Evaluation modes on controlled predictors."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from jascl.data.synthetic import Split
from jascl.evaluation.evaluator import evaluate


class Oracle(nn.Module):
    """Predicts a fixed label map: logits = 10 * one-hot(target rows)."""

    def __init__(self, rows: torch.Tensor, k: int) -> None:
        super().__init__()
        self.rows = rows
        self.k = k

    def forward(self, x):
        onehot = torch.nn.functional.one_hot(self.rows[: x.shape[0]], self.k).movedim(-1, 1).float()
        return 10 * onehot


def test_sliding_window_dice_iou_by_hand():
    # 1 image 2x2 (padded to 4x4 for U-Net-free evaluation): gt [[0,5],[5,5]], prediction [[0,5],[0,5]]
    gt = np.array([[[0, 5], [5, 5]]], dtype=np.uint8)
    split = Split(np.zeros((1, 1, 2, 2), np.float32), gt, ["x"])
    pred_rows = torch.tensor([[[0, 1], [0, 1]]])
    res = evaluate(Oracle(pred_rows, 2), [split], [0, 5], torch.device("cpu"))
    # class 5: TP 2, FP 0, FN 1 -> Dice 4/5, IoU 2/3; class 0: TP 1, FP 1, FN 0 -> Dice 2/3, IoU 1/2
    assert res.dice[5] == pytest.approx(0.8) and res.iou[5] == pytest.approx(2 / 3)
    assert res.dice[0] == pytest.approx(2 / 3) and res.iou[0] == pytest.approx(0.5)
    assert res.background_in_mean is False


def test_absent_class_is_nan_and_union_of_splits():
    a = Split(np.zeros((1, 1, 2, 2), np.float32), np.array([[[0, 1], [1, 1]]], np.uint8), ["a"])
    b = Split(np.zeros((1, 1, 2, 2), np.float32), np.array([[[0, 0], [0, 1]]], np.uint8), ["b"])
    perfect = torch.tensor([[[0, 1], [1, 1]], [[0, 0], [0, 1]]])

    class Seq(nn.Module):
        calls = 0

        def forward(self, x):
            out = 10 * torch.nn.functional.one_hot(perfect[self.calls: self.calls + 1], 3).movedim(-1, 1).float()
            self.calls += 1
            return out

    res = evaluate(Seq(), [a, b], [0, 1, 2], torch.device("cpu"), batch_size=1)
    assert res.dice[1] == 1.0 and res.dice[0] == 1.0 and math.isnan(res.dice[2])


def test_authors_mode_soft_dice_on_centred_crop():
    # 8^3 volume, class-1 cube at [4:8)^3 (centroid 5.5); a 6^3 crop centred on it (jitter <= 0.6 voxel)
    # starts at clip(round(5.5 - 3 +- 0.6), 0, 2) = 2, so it holds the 64 object voxels and 152 background ones
    gt = np.zeros((1, 8, 8, 8), np.uint8)
    gt[0, 4:, 4:, 4:] = 1
    split = Split(np.zeros((1, 1, 8, 8, 8), np.float32), gt, ["v"])

    class Half(nn.Module):
        def forward(self, x):  # softmax 0.5 / 0.5 everywhere
            return torch.zeros(x.shape[0], 2, *x.shape[2:])

    res = evaluate(Half(), [split], [0, 1], torch.device("cpu"), mode="authors", roi=[6, 6, 6])
    # soft Dice = 2 * sum(p g) / (sum p + sum g): class 1 = 64 / (108 + 64); class 0 = 152 / (108 + 152)
    assert res.dice[1] == pytest.approx(64 / 172, rel=1e-4)
    assert res.dice[0] == pytest.approx(152 / 260, rel=1e-4)
    assert res.background_in_mean is True
