"""What the few-shot baselines share: features in eval mode (the frozen copy and the labelled loader are
:mod:`jascl.methods.common`'s)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from jascl.methods.common import whole_forward
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter


def eval_features(
    state: LoopState, model: Segmenter, loader: DataLoader
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (features (B, C, *spatial'), labels (B, *spatial)) of every batch in eval mode, no gradient, on the
    run's device; volumes larger than the training patch through sliding windows (:func:`whole_forward`).

    The train/eval mode of every module is restored when the iteration ends.
    """
    with eval_mode(model), torch.no_grad():
        for batch in loader:
            features = whole_forward(state, model, batch["image"].to(state.device)).features
            yield features.float(), batch["label"].to(state.device)
