"""The supervised segmentation loss: MONAI's Dice + cross-entropy, with ignore-label support; and the per-class
binary (sigmoid) losses of the one-mask-per-class heads (CLIP-driven universal model, CLIP-CT)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from monai.losses import DiceCELoss, MaskedDiceLoss
from torch import nn

from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig


def authors_class_weights(num_classes: int) -> torch.Tensor:
    """The authors' per-class loss weights over K classifier rows: [0.25] + [0.75] * (K - 1) (their run.py)."""
    return torch.tensor([0.25] + [0.75] * (num_classes - 1))


class SegmentationLoss(nn.Module):
    """lambda_ce * CE + lambda_dice * soft Dice on softmax outputs (MONAI ``DiceCELoss``).

    Where the target contains ``ignore`` pixels (255), those pixels are left out
    of both terms (CE with ``ignore_index``, MONAI ``MaskedDiceLoss``), since
    ``DiceCELoss`` has no ignore label.

    Args:
        lambda_ce, lambda_dice: term weights.
        class_weights: (K,) weights of the classifier rows in both terms (None: all 1). CE is then the weighted
            mean ``sum_i w_{y_i} CE_i / sum_i w_{y_i}`` (torch's), Dice ``mean_k w_k Dice_k``.
        batch_dice: one Dice per class over the whole batch instead of per sample (MONAI ``batch``).
        squared: squared terms in the Dice denominator, ``sum p^2 + sum y^2`` (MONAI ``squared_pred``).
            ``batch_dice`` + ``squared`` + the authors' class weights is exactly the authors' ``DiceLoss``
            (smooth 1e-5 in numerator and denominator, weighted, averaged over all K classes).
    Shapes:
        logits (B, K, *spatial); target (B, *spatial) classifier-row indices or 255.
    """

    def __init__(
        self,
        lambda_ce: float = 1.0,
        lambda_dice: float = 1.0,
        class_weights: torch.Tensor | None = None,
        batch_dice: bool = False,
        squared: bool = False,
    ) -> None:
        super().__init__()
        self.lambda_ce = lambda_ce
        self.lambda_dice = lambda_dice
        self.class_weights = class_weights
        self.dice_ce = DiceCELoss(
            to_onehot_y=True,
            softmax=True,
            lambda_ce=lambda_ce,
            lambda_dice=lambda_dice,
            weight=class_weights,
            batch=batch_dice,
            squared_pred=squared,
        )
        # one-hot encoding is done here, before masking: MONAI's MaskedDiceLoss(to_onehot_y=True)
        # masks the *index* map first, which turns ignored pixels into background ground truth
        self.masked_dice = MaskedDiceLoss(
            to_onehot_y=False, softmax=True, weight=class_weights, batch=batch_dice, squared_pred=squared
        )

    @classmethod
    def for_session(cls, config: RunConfig, session: int, num_classes: int) -> SegmentationLoss:
        """The run configuration's supervised loss in session ``session`` with ``num_classes`` classifier rows
        (``lambda_*_base`` in session 0, ``class_weights``, ``dice``)."""
        lambda_ce, lambda_dice = config.lambda_ce, config.lambda_dice
        if session == 0:
            lambda_ce = config.lambda_ce if config.lambda_ce_base is None else config.lambda_ce_base
            lambda_dice = config.lambda_dice if config.lambda_dice_base is None else config.lambda_dice_base
        weights = authors_class_weights(num_classes) if config.class_weights == "authors" else None
        authors = config.dice == "authors"
        return cls(lambda_ce, lambda_dice, weights, batch_dice=authors, squared=authors)

    def forward(self, logits: torch.Tensor, target: torch.Tensor, has_ignore: bool | None = None) -> torch.Tensor:
        """``has_ignore``: whether ``target`` holds 255 anywhere, if the caller knows (from the labels on the
        host, say); None = find out here, which waits for a GPU to finish the batch so far."""
        if has_ignore is None:
            has_ignore = bool((target == IGNORE_INDEX).any())
        if not has_ignore:
            return self.dice_ce(logits, target.unsqueeze(1))
        ignore = target == IGNORE_INDEX
        weight = None if self.class_weights is None else self.class_weights.to(logits.device, logits.dtype)
        ce = F.cross_entropy(logits, target, weight=weight, ignore_index=IGNORE_INDEX)
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
