"""JASCL's base session: the pixel classifier with learned Gaussian weight noise (the authors' session 0).

The paper does not say how JASCL's session 0 differs from Vanilla's, but its tables do: JASCL's
session-0 Dice is not the shared base's (Med-Disjoint U-Net 0.736 vs 0.700; MedFormer on Med-SS
0.640 vs 0.659). The authors' base-session code (``Med_FoSSIL-Disjoint/base/codu_run``,
``networks/custom/unet.py``, ``ProbabilisticClassifier``) trains the cosine classifier with a
stochastic weight: a second weight tensor ``s`` of the classifier's shape, and in every forward

    W~ = W + softplus(s - 4) * N(0, 1)            (element-wise; reparameterised, so ``s`` is learned)

with no prior or KL term, i.e. Gaussian weight noise whose per-weight scale the loss itself tunes
(``softplus(-4) = 0.018`` at ``s = 0``). ``s`` starts from PyTorch's default initialisation of a
1x1 convolution (uniform in ``±1/sqrt(C)``), as theirs does. From session 1 on, their incremental code
replaces this noise by GAS (eq. 1); ``s`` is dropped at the end of session 0 (the saved base holds
the clean weight ``W``).

Differences from the authors' code, on purpose: their noise is never switched off, so their
evaluation and prototypes are stochastic; here it acts in training forwards only, like GAS.

Layers: :func:`learned_noise_weight` (pure) -> :class:`LearnedWeightNoise` (a parametrization of the
classifier's weight) -> :class:`StochasticBasePlugin` (session 0 only; the presets of the JASCL family
add it unless ``method_args.jascl.base=shared``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from jascl.engine.plugin import Plugin

if TYPE_CHECKING:
    from jascl.engine.state import LoopState

#: the authors' offset: the noise scale is softplus(s - 4)
OFFSET = 4.0


def learned_noise_weight(
    weight: torch.Tensor, s: torch.Tensor, noise: torch.Tensor, offset: float = OFFSET
) -> torch.Tensor:
    """``weight + softplus(s - offset) * noise`` (all of one shape): the perturbed classifier weight."""
    return weight + F.softplus(s - offset) * noise


class LearnedWeightNoise(nn.Module):
    """Parametrization ``W -> W + softplus(s - offset) * N(0, 1)`` in training mode, ``W`` in eval mode.

    ``s`` is a parameter of this module, so it is trained with the model (the optimiser sees it
    among the model's parameters) and saved in in-session checkpoints.
    """

    monte_carlo = True  # sampled by Monte-Carlo evaluation, like GAS

    def __init__(self, shape: torch.Size, offset: float = OFFSET) -> None:
        super().__init__()
        self.offset = offset
        self.s = nn.Parameter(torch.empty(shape))
        bound = 1.0 / math.sqrt(shape[1]) if len(shape) > 1 else 1.0
        nn.init.uniform_(self.s, -bound, bound)

    def scale(self) -> torch.Tensor:
        return F.softplus(self.s - self.offset)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return weight
        return learned_noise_weight(weight, self.s.to(weight.dtype), torch.randn_like(weight), self.offset)


def attach_learned_noise(layer: nn.Module, offset: float = OFFSET) -> LearnedWeightNoise:
    """Put the learned noise on ``layer.weight``; returns the parametrization (holds ``s``)."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    noise = LearnedWeightNoise(weight.shape, offset).to(weight.device)
    parametrize.register_parametrization(layer, "weight", noise)
    return noise


def detach_learned_noise(layer: nn.Module) -> None:
    """Remove it, leaving the clean weight ``W`` as a plain parameter (``s`` is dropped)."""
    if parametrize.is_parametrized(layer, "weight"):
        parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)


class StochasticBasePlugin(Plugin):
    """Session 0 with the learned weight noise on the pixel classifier (the authors' JASCL base).

    Methods that carry this plugin (and nothing else that changes session 0) share one base model,
    ``<run>/base-stochastic-classifier/``, so the JASCL presets and ablations start from the same base.
    """

    name = "stochastic-base"
    changes_base_session = True
    base_key = "stochastic-classifier"

    def __init__(self, offset: float = OFFSET) -> None:
        self.offset = offset
        self._layer: nn.Module | None = None

    def before_session(self, state: LoopState) -> None:
        if state.session.index != 0:
            return
        self._layer = state.model.resolve_layer("classifier")
        attach_learned_noise(self._layer, self.offset)

    def after_training(self, state: LoopState) -> None:
        # before evaluation and prototypes: the base is evaluated and saved with its clean weight
        if self._layer is not None:
            detach_learned_noise(self._layer)
            self._layer = None
