"""The supervised segmentation loss: MONAI's Dice + cross-entropy, with ignore-label support; and the per-class
binary (sigmoid) losses of the one-mask-per-class heads (CLIP-driven universal model, CLIP-CT)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from monai.losses import DiceCELoss, MaskedDiceLoss
from torch import nn

from jascl.protocols.schema import IGNORE_INDEX


class SegmentationLoss(nn.Module):
    """lambda_ce * CE + lambda_dice * soft Dice on softmax outputs (MONAI ``DiceCELoss``).

    Where the target contains ``ignore`` pixels (255), those pixels are left out
    of both terms (CE with ``ignore_index``, MONAI ``MaskedDiceLoss``), since
    ``DiceCELoss`` has no ignore label.

    Args:
        lambda_ce, lambda_dice: term weights.
    Shapes:
        logits (B, K, *spatial); target (B, *spatial) classifier-row indices or 255.
    """

    def __init__(self, lambda_ce: float = 1.0, lambda_dice: float = 1.0) -> None:
        super().__init__()
        self.lambda_ce = lambda_ce
        self.lambda_dice = lambda_dice
        self.dice_ce = DiceCELoss(to_onehot_y=True, softmax=True, lambda_ce=lambda_ce, lambda_dice=lambda_dice)
        # one-hot encoding is done here, before masking: MONAI's MaskedDiceLoss(to_onehot_y=True)
        # masks the *index* map first, which turns ignored pixels into background ground truth
        self.masked_dice = MaskedDiceLoss(to_onehot_y=False, softmax=True)

    def forward(self, logits: torch.Tensor, target: torch.Tensor, has_ignore: bool | None = None) -> torch.Tensor:
        """``has_ignore``: whether ``target`` holds 255 anywhere, if the caller knows (from the labels on the
        host, say); None = find out here, which waits for a GPU to finish the batch so far."""
        if has_ignore is None:
            has_ignore = bool((target == IGNORE_INDEX).any())
        if not has_ignore:
            return self.dice_ce(logits, target.unsqueeze(1))
        ignore = target == IGNORE_INDEX
        ce = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)
        safe = target.masked_fill(ignore, 0)
        onehot = F.one_hot(safe, logits.shape[1]).movedim(-1, 1).to(logits.dtype)
        dice = self.masked_dice(logits, onehot, mask=(~ignore).unsqueeze(1).to(logits.dtype))
        return self.lambda_ce * ce + self.lambda_dice * dice


def binary_segmentation_losses(
    logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, smooth: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class binary cross-entropy and soft Dice, each averaged over the (sample, class) pairs with valid pixels.

    For a pair with valid pixels V: ``BCE = mean_V BCE(l, y)`` and ``Dice = 1 - (2 sum_V p y + s) / (sum_V p +
    sum_V y + s)``, ``p = sigmoid(l)``, ``s = smooth`` (official ``Multi_BCELoss`` / ``BinaryDiceLoss``).

    Args:
        logits: (B, K', *spatial) foreground logits.
        targets: (B, K', *spatial) in {0, 1}.
        valid: (B, K', *spatial) bool, pixels that count.

    Returns:
        (bce, dice) scalars; zeros (with gradient) when no pixel is valid.
    """
    v = valid.to(logits.dtype).flatten(2)
    lo, y = logits.flatten(2), targets.to(logits.dtype).flatten(2)
    n = v.sum(-1)
    pairs = n > 0
    if not pairs.any():
        zero = logits.sum() * 0.0
        return zero, zero
    bce = (F.binary_cross_entropy_with_logits(lo, y, reduction="none") * v).sum(-1)
    p = torch.sigmoid(lo) * v
    y = y * v
    dice = 1 - (2 * (p * y).sum(-1) + smooth) / (p.sum(-1) + y.sum(-1) + smooth)
    return (bce[pairs] / n[pairs]).mean(), dice[pairs].mean()
