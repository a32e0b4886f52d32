"""What the few-shot baselines share: the frozen copy of the model at the start of a session, the labelled set
with its training labels (augmented as in training), and features in eval mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from jascl.data.datasets import LabelledDataset
from jascl.methods.gas import clean_state_dict
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter


def frozen_copy(state: LoopState) -> Segmenter:
    """A frozen, eval-mode copy of ``state.model`` as it is now (GAS perturbation removed)."""
    model = state.new_model(state.model.num_classes)
    model.load_state_dict(clean_state_dict(state.model))
    model.eval().requires_grad_(False)
    return model


def labelled_loader(state: LoopState, batch_size: int | None = None) -> DataLoader:
    """The session's labelled training data with its training labels, no augmentation, in order.

    Items: ``image`` (B, C, *spatial) float, ``label`` (B, *spatial) global ids
    (untaught classes -> background or 255 per the protocol), ``id``.
    """
    session = state.session
    dataset = LabelledDataset(state.data.train, session.classes, session.other_classes)
    return DataLoader(dataset, batch_size=batch_size or state.config.batch_size)


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
