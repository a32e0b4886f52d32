"""STAR (Eskandar et al., ICLR 2025): a KL stability term under worst-case weight perturbation, on stored
prototypes instead of a replay buffer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from jascl.engine.plugin import Method, Plugin
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def star_kl(clean_logits: torch.Tensor, perturbed_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of KL(softmax(clean) || softmax(perturbed)) over samples (Eskandar et al., ICLR 2025).

    Args:
        clean_logits: (N, K) logits at the current weights (treated as constant targets).
        perturbed_logits: (N, K) logits at the perturbed weights.
        mask: (N,) 1 for samples the model currently classifies correctly, else 0.
    """
    target = clean_logits.detach().softmax(1)
    kl = F.kl_div(perturbed_logits.log_softmax(1), target, reduction="none").sum(1)
    return (kl * mask).sum() / mask.sum().clamp_min(1)


def star_layer_step(
    weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], gamma: float, eps: float = 1e-20
) -> list[torch.Tensor]:
    """STAR's per-layer normalised ascent step: gamma * ||w_l|| * g_l / ||g_l|| for each layer l."""
    return [gamma * w.norm() * g / (g.norm() + eps) for w, g in zip(weights, grads)]


class STARPlugin(Plugin):
    """STAR: penalise the change of the classifier's predictions on past data under a worst-case weight perturbation.

    loss += lambda * KL(f(x; w) || f(x; w + dw)) over correctly classified past
    samples x, where dw maximises that KL: from a small random start, ``steps``
    gradient-ascent steps of per-layer normalised size gamma * ||w_l|| (Eskandar
    et al., ICLR 2025; official ``Perturber``). Evaluating the KL at w + dw with dw held
    constant makes its gradient w.r.t. w the gradient at the perturbed point,
    as in the original (which adds dw in place, back-propagates and removes it).

    Buffer-free adaptation: the original draws x from a replay buffer of past
    images. Here x are the stored prototypes of earlier sessions (eq. 2 class
    means of the decoder features, background included), so f is the classifier
    and dw perturbs the classifier's weight (its only parameter of rank >= 2;
    STAR ignores biases and norm parameters). Under the default freezing policy
    (only the classifier trains) the past features are exactly those the
    prototypes summarise. With ``freeze=none`` STAR still regularises only the
    classifier (prototypes carry no gradient to the backbone).

    Other deviations: the random start has norm ``init_scale * ||w_l||`` per
    layer. The official code adds ``N(0, 1) * ||w_l|| * 1e-20``, which vanishes
    in float32, so its ascent direction comes from rounding differences; the
    paper describes a small random start, which this realises. At least one
    correctly classified prototype is required (the official code skips batches
    with fewer than two buffer samples; a prototype buffer is much smaller).

    Args:
        weight: lambda.
        gamma: perturbation size relative to each layer's weight norm.
        steps: ascent steps.
        init_scale: norm of the random start relative to each layer's weight norm.
        freeze: incremental freezing policy.
    """

    name = "star"
    loss_terms = ("star",)

    def __init__(
        self,
        weight: float = 0.01,
        gamma: float = 0.05,
        steps: int = 1,
        init_scale: float = 1e-3,
        freeze: str | None = None,
    ) -> None:
        self.weight = weight
        self.gamma = gamma
        self.steps = steps
        self.init_scale = init_scale
        self.freeze_incremental = freeze
        self._inputs: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None

    def before_session(self, state: LoopState) -> None:
        self._inputs = None
        if state.session.index == 0:
            return
        protos, class_ids = state.prototypes.before(state.session.index).tensors()
        if len(class_ids):
            self._inputs = protos.to(state.device)
            self._targets = state.class_index(class_ids).to(state.device)

    def perturbation(
        self, classifier: nn.Module, inputs: torch.Tensor, clean: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """dw for every parameter of rank >= 2 of ``classifier`` (worst case for the masked KL)."""
        weights = {n: p.detach() for n, p in classifier.named_parameters() if p.dim() >= 2}
        delta = {}
        for n, w in weights.items():
            z = torch.randn_like(w)
            delta[n] = z * (self.init_scale * w.norm() / z.norm().clamp_min(1e-12))
        for _ in range(self.steps):
            probe = {n: (w + delta[n]).requires_grad_(True) for n, w in weights.items()}
            with torch.enable_grad():
                kl = star_kl(clean, functional_call(classifier, probe, (inputs,)), mask)
                grads = torch.autograd.grad(kl, list(probe.values()))
            step = star_layer_step(list(weights.values()), grads, self.gamma / self.steps)
            delta = {n: delta[n] + s for n, s in zip(weights, step)}
        return delta

    def after_forward(self, state: LoopState) -> None:
        if self._inputs is None or self.weight <= 0:
            return
        classifier = state.model.classifier
        with torch.no_grad():
            clean = classifier(self._inputs)
        mask = (clean.argmax(1) == self._targets).float()
        if mask.sum() < 1:  # nothing correctly classified: nothing to stabilise
            return
        delta = self.perturbation(classifier, self._inputs, clean, mask)
        params = dict(classifier.named_parameters())
        shifted = {n: params[n] + d for n, d in delta.items()}
        perturbed = functional_call(classifier, shifted, (self._inputs,))
        state.losses[self.name] = self.weight * star_kl(clean, perturbed, mask)


@dataclass
class STAROptions:
    """STAR options; defaults lambda = 0.01 (``p_lam``), gamma = 0.05 (``p_gamma``), 1 step (``p_steps``) are the
    official implementation's (Mammoth ``star_perturber.py``).

    Attributes:
        weight: lambda, weight of the KL term.
        gamma: the perturbation radius.
        steps: ascent steps of the perturbation.
        init_scale: relative norm of the random start (see STARPlugin).
    """

    weight: float = option(0.01, ge=0)
    gamma: float = option(0.05, gt=0)
    steps: int = option(1, ge=1)
    init_scale: float = option(1e-3, gt=0)
    freeze: str = freeze_option()


@METHODS.register(
    "star",
    options=STAROptions,
    paper="Eskandar et al., ICLR 2025",
    doc="baseline: STAR worst-case weight-perturbation KL on stored prototypes instead of a replay buffer",
)
def star(o: STAROptions, config: RunConfig) -> Method:
    """STAR: KL stability under a worst-case classifier perturbation, on the prototypes of past sessions."""
    return Method(
        "star",
        [STARPlugin(o.weight, o.gamma, o.steps, o.init_scale, freeze_policy(o.freeze))],
        "STAR: KL stability under worst-case classifier perturbation, on past prototypes",
    )
