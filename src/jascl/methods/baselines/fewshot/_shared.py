"""What the few-shot baselines share: features in eval mode (the frozen copy and the labelled loader are
:mod:`jascl.methods.common`'s)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.networks.base import Segmenter


def eval_features(
    model: Segmenter, loader: DataLoader, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (features (B, C, *spatial'), labels (B, *spatial)) of every batch in eval mode, no gradient.

    The train/eval mode of every module is restored when the iteration ends.
    """
    with eval_mode(model), torch.no_grad():
        for batch in loader:
            features = model.forward_features(batch["image"].to(device)).features
            yield features.float(), batch["label"].to(device)
