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
    state: LoopState, model: Segmenter, loader: DataLoader, pieces: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (features (B, C, *spatial'), labels (B, *spatial)) of every batch in eval mode, no gradient, on the
    run's device; volumes larger than the training patch through sliding windows (:func:`whole_forward`).

    ``pieces``: for statistics that add up over pixels (class sums and counts, covariances), never per-sample
    ones. A batch whose stitched features would pass the prototype pass's bound
    (:data:`jascl.engine.tasks.segmentation.PROTOTYPE_BLOCK_ELEMENTS`, 2 GiB) then comes one sample at a time in
    blocks (:func:`jascl.engine.tasks.segmentation.block_features`), each with the whole sample's feature values
    over its part: at the paper's scale a 288 x 288 x 224 CT at 32 channels holds 2.4 GB of features whole.
    Without, every batch comes whole, as before.

    The train/eval mode of every module is restored when the iteration ends.
    """
    from jascl.engine.tasks.segmentation import block_features, prototype_blocks

    cfg = state.config
    with eval_mode(model), torch.no_grad():
        for batch in loader:
            images, labels = batch["image"].to(state.device), batch["label"].to(state.device)
            channels = model.backbone.feature_channels
            blocks = prototype_blocks(images, cfg.patch_size, cfg.sw_overlap, channels) if pieces else None
            if blocks is None:
                yield whole_forward(state, model, images).features.float(), labels
                continue
            for _, features, piece in block_features(
                model, images, labels, blocks, cfg.patch_size, cfg.sw_batch_size, cfg.sw_overlap
            ):
                yield features.float(), piece
