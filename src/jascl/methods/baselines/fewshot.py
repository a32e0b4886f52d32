"""Few-shot class-incremental baselines: shared helpers.

The methods live in one module each (all registered on import):

* ``pifs``     -- :mod:`.fewshot_pifs`     (Cermelli et al., BMVC 2021)
* ``gaps``     -- :mod:`.fewshot_gaps`     (Qiu et al., CVPR Workshops 2023)
* ``nc-fscil`` -- :mod:`.fewshot_ncfscil`  (Yang et al., ICLR 2023)
* ``fecam``    -- :mod:`.fewshot_fecam`    (Goswami et al., NeurIPS 2023)
* ``subspace`` -- :mod:`.fewshot_subspace` (Akyurek et al., ICLR 2022)

Left out, because a faithful segmentation version needs machinery the paper
gives no segmentation recipe for and a loose one would not be worth comparing:
C-FSCIL (Hersche et al., CVPR 2022: a meta-learned backbone and a
hyperdimensional fully-connected reduction trained episodically), FACT
(Zhou et al., CVPR 2022: virtual-class base training with manifold mixup of
instances), SoftNet (Kang et al., ICLR 2023: learned soft/binary masks over
every backbone weight) and FSCIL-SS (cited by an IEEE document number only;
probably Cui et al., "Uncertainty-Guided Semi-Supervised Few-Shot
Class-Incremental Learning With Knowledge Distillation", IEEE TMM, but this
could not be confirmed, and no official code was found).

This module holds what several of them share: the frozen copy of the model at
the start of a session, a loader over the session's labelled data with its
training labels, and the ``freeze`` option.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from jascl.data.datasets import LabelledDataset
from jascl.errors import ConfigError
from jascl.methods.gas import clean_state_dict

if TYPE_CHECKING:
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter

FREEZE_CHOICES = ("config", "none", "all_but_classifier")


def freeze_policy(value: str, method: str) -> str | None:
    """The plugin's ``freeze_incremental`` for a method's ``freeze`` option.

    Args:
        value: "config" (the run configuration's policy), "none" or "all_but_classifier".
        method: method name, for the error message.

    Returns:
        None for "config", else ``value``.
    """
    if value not in FREEZE_CHOICES:
        raise ConfigError(f"method_args.{method}.freeze: must be one of {', '.join(FREEZE_CHOICES)} (got {value!r})")
    return None if value == "config" else value


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
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                features = model.forward_features(batch["image"].to(device)).features
                yield features.float(), batch["label"].to(device)
    finally:
        for module, mode in modes.items():
            module.train(mode)


def resize_features(features: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """Bilinear/trilinear resize of (B, C, *spatial) features to ``size`` (no-op if equal)."""
    if features.shape[2:] == size:
        return features
    mode = "bilinear" if features.dim() == 4 else "trilinear"
    return torch.nn.functional.interpolate(features, size=size, mode=mode, align_corners=False)
