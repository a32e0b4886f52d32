"""Prototype replay (L_proto): stored prototypes of earlier sessions trained through the classifier."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Plugin

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


def prototype_replay_loss(
    classifier: torch.nn.Module,
    prototypes: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "sum",
    unit: bool = False,
) -> torch.Tensor:
    """Cross-entropy of the classifier applied to stored prototypes.

    Args:
        classifier: maps (N, D) vectors to (N, K) logits.
        prototypes: (N, D) stored prototypes.
        targets: (N,) classifier row index of each prototype's class (0 = background).
        reduction: "sum" over prototypes (the authors' code) or "mean".
        unit: ``prototypes`` are already L2-normalised rows, for a cosine
            :class:`~jascl.networks.classifier.PixelClassifier` (which then skips normalising them).
    """
    logits = classifier(prototypes, unit=True) if unit else classifier(prototypes)
    return F.cross_entropy(logits, targets, reduction=reduction)


class PrototypeReplayPlugin(Plugin):
    """Adds ``weight * L_proto`` in incremental sessions, replaying every earlier session's prototypes.

    Args:
        weight: loss weight (paper / authors, medical: 0.1).
        reduction: "sum" (authors) or "mean" over prototypes.
    """

    name = "proto"
    loss_terms = ("proto",)

    def __init__(self, weight: float = 0.1, reduction: str = "sum") -> None:
        self.weight = weight
        self.reduction = reduction
        self._protos: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        self._unit = False

    def before_session(self, state: LoopState) -> None:
        self._protos = None
        if state.session.index == 0:
            return
        protos, class_ids = state.prototypes.before(state.session.index).tensors()
        if len(class_ids):
            from jascl.networks.classifier import PixelClassifier

            self._protos = protos.to(state.device)
            classifier = state.model.classifier
            # a cosine classifier would normalise the same constant rows at every step: do it once here
            self._unit = isinstance(classifier, PixelClassifier) and classifier.cosine
            if self._unit:
                self._protos = F.normalize(self._protos, dim=1)
            self._targets = state.class_index(class_ids).to(state.device)

    def after_forward(self, state: LoopState) -> None:
        if self._protos is not None and self._targets is not None and self.weight > 0:
            loss = prototype_replay_loss(
                state.model.classifier, self._protos, self._targets, self.reduction, unit=self._unit
            )
            state.losses[self.name] = self.weight * loss
