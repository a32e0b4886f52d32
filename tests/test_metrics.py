"""Hand-computed checks for jascl.evaluation.metrics."""

from __future__ import annotations

import math

import pytest
import torch

from jascl.errors import DataError
from jascl.evaluation.metrics import (
    ConfusionAccumulator,
    dice_from_confusion,
    harmonic_mean,
    iou_from_confusion,
    per_class_forgetting,
    soft_dice_per_class,
    summarise,
    total_drop,
)


def test_total_drop_reproduces_paper_rows() -> None:
    # JASCL (U-Net): (0.276 + 0.062) / 0.736 = 45.92 %
    assert round(total_drop([0.736, 0.460, 0.398]), 1) == 45.9
    # UCL: (0.270 + 0.105) / 0.700 = 53.57 %
    assert round(total_drop([0.700, 0.430, 0.325]), 1) == 53.6


def test_total_drop_counts_only_falls() -> None:
    # rise 0.5 -> 0.6 ignored, fall 0.6 -> 0.4 = 0.2; 100 * 0.2 / 0.5 = 40
    assert total_drop([0.5, 0.6, 0.4]) == pytest.approx(40.0)
    assert total_drop([0.5, 0.6, 0.7]) == 0.0
    assert total_drop([0.5]) == 0.0


def test_harmonic_mean_of_seen_and_new_by_hand() -> None:
    # 2 * 0.6 * 0.2 / 0.8 = 0.3: pulled towards the weaker side (arithmetic mean 0.4)
    assert harmonic_mean(0.6, 0.2) == pytest.approx(0.3)
    assert harmonic_mean(0.5, 0.5) == pytest.approx(0.5)
    assert harmonic_mean(0.9, 0.0) == 0.0 and harmonic_mean(0.0, 0.0) == 0.0
    assert math.isnan(harmonic_mean(math.nan, 0.7))  # session 0: no seen classes


@pytest.mark.parametrize("scores", [[], [0.0, 0.1], [-0.2, 0.1]])
def test_total_drop_rejects_bad_input(scores: list[float]) -> None:
    with pytest.raises(ValueError):
        total_drop(scores)


def test_dice_iou_2x2() -> None:
    # target [[0,1],[1,1]], pred [[0,1],[0,1]]
    # cm (rows gt, cols pred) = [[1,0],[1,2]]
    # class 0: TP=1 FP=1 FN=0 -> dice 2/3, IoU 1/2
    # class 1: TP=2 FP=0 FN=1 -> dice 4/5, IoU 2/3
    acc = ConfusionAccumulator([0, 1])
    acc.update(torch.tensor([[[0, 1], [0, 1]]]), torch.tensor([[[0, 1], [1, 1]]]))
    cm = acc.matrix()
    assert cm.dtype == torch.int64
    assert cm.tolist() == [[1, 0], [1, 2]]
    assert dice_from_confusion(cm).tolist() == pytest.approx([2 / 3, 4 / 5])
    assert iou_from_confusion(cm).tolist() == pytest.approx([1 / 2, 2 / 3])


def test_dice_iou_3d_noncontiguous_with_ignore() -> None:
    # class_ids [0, 2, 5]; one (1, 2, 2, 2) volume, flattened pairs (gt, pred):
    # (0,0) (0,2) (2,2) (2,2) (5,5) (5,0) (255,5 -> ignored) (2,0)
    # cm rows/cols in order 0,2,5: [[1,1,0],[1,2,0],[1,0,1]]
    # class 0: TP=1 FP=2 FN=1 -> dice 2/5, IoU 1/4
    # class 2: TP=2 FP=1 FN=1 -> dice 4/6, IoU 2/4
    # class 5: TP=1 FP=0 FN=1 -> dice 2/3, IoU 1/2
    target = torch.tensor([0, 0, 2, 2, 5, 5, 255, 2]).reshape(1, 2, 2, 2)
    pred = torch.tensor([0, 2, 2, 2, 5, 0, 5, 0]).reshape(1, 2, 2, 2)
    acc = ConfusionAccumulator([0, 2, 5])
    acc.update(pred, target)
    cm = acc.matrix()
    assert cm.tolist() == [[1, 1, 0], [1, 2, 0], [1, 0, 1]]
    assert cm.sum().item() == 7  # the ignored voxel is not counted
    assert dice_from_confusion(cm).tolist() == pytest.approx([2 / 5, 4 / 6, 2 / 3])
    assert iou_from_confusion(cm).tolist() == pytest.approx([1 / 4, 2 / 4, 1 / 2])


def test_class_order_follows_class_ids_and_accumulates() -> None:
    # ids given unsorted: row/col 0 <-> id 7, 1 <-> id 0, 2 <-> id 3
    acc = ConfusionAccumulator([7, 0, 3])
    acc.update(torch.tensor([[7, 0]]), torch.tensor([[7, 3]]))  # (7,7), (3,0)
    acc.update(torch.tensor([[3]]), torch.tensor([[3]]))  # (3,3)
    assert acc.matrix().tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 1]]
    acc.reset()
    assert acc.matrix().sum().item() == 0


def test_unknown_target_value_raises_data_error() -> None:
    acc = ConfusionAccumulator([0, 1, 2])
    with pytest.raises(DataError, match="4"):
        acc.update(torch.tensor([[0, 1]]), torch.tensor([[0, 4]]))


def test_ids_outside_the_classes_fail_except_under_ignored_targets() -> None:
    acc = ConfusionAccumulator([0, 1, 2])
    # a prediction outside class_ids where the target is ignored is not counted, so not an error:
    # pairs (gt, pred) (0,0) (255,9) (2,1) -> rows/cols 0,1,2: [[1,0,0],[0,0,0],[0,1,0]]
    acc.update(torch.tensor([[0, 9, 1]]), torch.tensor([[0, 255, 2]]))
    assert acc.matrix().tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]
    for pred, target, value in (([[0, 9]], [[0, 1]], "9"), ([[0, 1]], [[-3, 1]], "-3"), ([[300, 1]], [[0, 1]], "300")):
        with pytest.raises(DataError, match=f"contains class id {value},"):
            acc.update(torch.tensor(pred), torch.tensor(target))
    assert acc.matrix().sum().item() == 2  # a refused batch adds nothing
    with pytest.raises(ValueError, match="non-negative"):
        ConfusionAccumulator([0, -1])
    # an ignore_index outside the ids' range (here -1) is skipped as well
    neg = ConfusionAccumulator([0, 1], ignore_index=-1)
    neg.update(torch.tensor([[1, 1]]), torch.tensor([[-1, 1]]))
    assert neg.matrix().tolist() == [[0, 0], [0, 1]]


def test_absent_class_is_nan() -> None:
    # class 3 has neither ground truth nor predictions -> 0/0 -> NaN
    acc = ConfusionAccumulator([0, 1, 3])
    acc.update(torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))
    dice = dice_from_confusion(acc.matrix())
    iou = iou_from_confusion(acc.matrix())
    assert dice[:2].tolist() == [1.0, 1.0] and math.isnan(dice[2].item())
    assert iou[:2].tolist() == [1.0, 1.0] and math.isnan(iou[2].item())


def test_soft_dice_per_class() -> None:
    # B=1, C=2, 2 pixels. p0=[0.9,0.4], p1=[0.1,0.6]; g0=[1,0], g1=[0,1]
    # class 0: 2*0.9 / (1.3 + 1) = 1.8/2.3 ; class 1: 2*0.6 / (0.7 + 1) = 1.2/1.7
    probs = torch.tensor([[[0.9, 0.4], [0.1, 0.6]]])
    onehot = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    out = soft_dice_per_class(probs, onehot, smooth=0.0)
    assert out.tolist() == pytest.approx([1.8 / 2.3, 1.2 / 1.7])
    # absent class with zero probability: smooth/smooth = 1
    zeros = torch.zeros(1, 1, 2)
    assert soft_dice_per_class(zeros, zeros).tolist() == pytest.approx([1.0])


def test_per_class_forgetting() -> None:
    out = per_class_forgetting({1: [0.8, 0.9, 0.5], 2: [0.7], 3: [0.6, math.nan, 0.5], 4: [0.5, 0.7], 5: [math.nan]})
    assert out[1] == pytest.approx(0.4)  # 0.9 - 0.5
    assert out[2] == 0.0  # single score
    assert out[3] == pytest.approx(0.1)  # NaN ignored: 0.6 - 0.5
    assert out[4] == pytest.approx(-0.2)  # improved
    assert math.isnan(out[5])


def test_summarise_with_and_without_background() -> None:
    per_class = {0: 0.9, 1: 0.8, 2: 0.6, 3: math.nan, 4: 0.4}
    s = summarise(per_class, old=[0, 1, 2], new=[3, 4])
    assert s["all"] == pytest.approx(0.6)  # (0.8+0.6+0.4)/3, NaN class 3 ignored
    assert s["old"] == pytest.approx(0.7)  # (0.8+0.6)/2, background excluded
    assert s["new"] == pytest.approx(0.4)
    assert s["background"] == 0.9
    s_bg = summarise(per_class, old=[0, 1, 2], new=[3, 4], include_background=True)
    assert s_bg["all"] == pytest.approx(0.675)  # (0.9+0.8+0.6+0.4)/4
    assert s_bg["old"] == pytest.approx(0.7)
    empty = summarise(per_class, old=[1], new=[3])
    assert math.isnan(empty["new"])
