"""The supervised loss: MONAI DiceCE, and ignored pixels (255) left out of both terms."""

import torch

from jascl.engine.losses import SegmentationLoss


def test_ignored_pixels_equal_cropping_them_away():
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 1, 6)
    target = torch.tensor([[[0, 1, 2, 1, 255, 255]]])
    loss = SegmentationLoss()
    full = loss(logits, target)
    cropped = loss(logits[..., :4], target[..., :4])  # no ignore pixels: plain DiceCELoss
    assert torch.allclose(full, cropped, atol=1e-6)


def test_ignore_does_not_count_as_background_ground_truth():
    # a perfect background prediction on the valid pixels; ignored pixels predicted as class 1
    logits = torch.tensor([[[[9.0, 9.0, -9.0, -9.0]], [[-9.0, -9.0, 9.0, 9.0]]]])
    target = torch.tensor([[[0, 0, 255, 255]]])
    loss = SegmentationLoss(lambda_ce=0.0, lambda_dice=1.0)(logits, target)
    # valid pixels are all correct background; class 1 is absent from both -> Dice loss ~ 0 (smoothing)
    assert float(loss) < 0.01  # counting ignored pixels as background would give ~0.17
