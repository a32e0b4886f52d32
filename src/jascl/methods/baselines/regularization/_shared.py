"""What the regularisation baselines share: the parameters a method may act on, and anchors that
follow a growing classifier (a quantity anchored at an earlier session covers its first rows)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


log = logging.getLogger("jascl")


def always_frozen(model: nn.Module) -> set[int]:
    """ids of parameters the backbone freezes in incremental sessions (e.g. SAM's image encoder)."""
    backbone = getattr(model, "backbone", None)
    frozen = backbone.frozen_modules() if backbone is not None else []
    return {id(p) for m in frozen for p in m.parameters()}


def incremental_parameters(state: LoopState) -> dict[str, nn.Parameter]:
    """The parameters that can train in incremental sessions under the method's freezing policy.

    ``all_but_classifier``: the classifier's; ``none``: every parameter except
    the backbone's always-frozen modules.
    """
    model = state.model
    if state.freeze_incremental == "all_but_classifier":
        return {f"classifier.{n}": p for n, p in model.classifier.named_parameters()}
    skip = always_frozen(model)
    return {n: p for n, p in model.named_parameters() if id(p) not in skip}


def leading_rows(current: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``current`` restricted to the shape of ``reference``, allowing growth along dim 0 only.

    Classifier weights (K, C) and biases (K,) gain rows as classes arrive; a
    quantity anchored at an earlier session covers its first rows.
    """
    if current.shape == reference.shape:
        return current
    if (
        current.dim() != reference.dim()
        or current.shape[1:] != reference.shape[1:]
        or current.shape[0] < reference.shape[0]
    ):
        raise ValueError(
            f"parameter of shape {tuple(current.shape)} cannot be matched to an anchor of shape "
            f"{tuple(reference.shape)} (only growth along dim 0 is supported)"
        )
    return current[: reference.shape[0]]


def pad_rows(tensor: torch.Tensor, shape: torch.Size, value: float = 0.0) -> torch.Tensor:
    """``tensor`` extended along dim 0 to ``shape`` with ``value`` (inverse of :func:`leading_rows`)."""
    if tensor.shape == shape:
        return tensor
    leading_rows(torch.empty(shape), tensor)  # validates the shapes
    out = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    return out
