"""STAR (M. Eskandar, T. Imtiaz, D. Hill, Z. Wang, J. Dy, "STAR: Stability-Inducing Weight Perturbation for
Continual Learning", ICLR 2025; arXiv 2503.01595; official code github.com/Gnomy17/STAR_CL, ``models/er_star.py`` and
``models/utils/star_perturber.py``, also part of Mammoth).

STAR is a loss added to a *rehearsal* method: on samples x of a replay buffer that the model classifies correctly,
it penalises the change of the model's predictions under the worst-case weight perturbation of a given size::

    L_STAR = lambda * mean_{x correct} KL( f(x; w) || f(x; w + dw) ),
    dw = argmax_{||dw_l|| <= gamma ||w_l||} KL(...)   (one normalised ascent step per layer from a small random start)

and its gradient is taken at the perturbed point w + dw (the official code adds dw to the weights, back-propagates,
and removes it). Here, as the official ``er_star.py`` (ER + STAR), every incremental step:

1. draws ``replay_batch`` samples from a labelled replay memory of ``memory_size`` samples of earlier sessions
   (:mod:`jascl.methods.labelled_memory`: **STAR stores real images of earlier sessions** -- flagged "uses
   exemplars" in its fidelity label), and adds ``STAR`` on them (``star``): per pixel, the mask keeps the pixels
   whose label the model predicts (labels of the memory: the sessions' training labels, 255 = ignored); dw perturbs
   every weight tensor of rank >= 2 of the model (biases and norm parameters are left alone, as the official
   ``normalize_grad``), ``steps`` ascent steps of size ``gamma / steps * ||w_l|| * g_l / ||g_l||``;
2. ER (``er``): draws another ``replay_batch`` memory samples and appends them to the training batch, so the
   loop's segmentation loss covers them (the official concatenation of buffer and current samples).

Defaults: lambda = 0.1, gamma = 0.01, one step: the README's best arguments for ER + STAR (``--p-lam=0.1
--p-gamma=0.01``; the code's own defaults are 0.01 and 0.05); the whole network trains (``freeze: none``), as in
the paper.

Deviations: dense prediction (the KL and the correct-prediction mask are per pixel); the buffer is the
class-balanced labelled memory (20 samples by default; the paper's buffers hold 100-500 classification images;
STAR's reservoir sampling is replaced by the memory's balanced selection) filled at session ends, so the current
session's samples are not in it; the random start has norm ``init_scale * ||w_l||`` per layer (the official
``randn * ||w|| * 1e-20`` vanishes in float32, so its direction comes from rounding; the paper describes a small
random start); the extra forwards leave BatchNorm statistics untouched; at least one correctly predicted pixel is
required (the official code skips a batch with fewer than two correct samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from jascl.data.sampling import derive_seed
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.baselines.sharpness._shared import frozen_bn_statistics
from jascl.methods.labelled_memory import LabelledMemory, LabelledMemoryPlugin
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def star_kl(clean_logits: torch.Tensor, perturbed_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of KL(softmax(clean) || softmax(perturbed)) (Eskandar et al., ICLR 2025).

    Args:
        clean_logits: (N, K, *spatial) logits at the current weights (treated as constant targets).
        perturbed_logits: (N, K, *spatial) logits at the perturbed weights.
        mask: (N, *spatial) 1 where the model currently predicts the label, else 0.
    """
    target = clean_logits.detach().softmax(1)
    kl = F.kl_div(perturbed_logits.log_softmax(1), target, reduction="none").sum(1)
    return (kl * mask).sum() / mask.sum().clamp_min(1)


def star_layer_step(
    weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], gamma: float, eps: float = 1e-20
) -> list[torch.Tensor]:
    """STAR's per-layer normalised ascent step: gamma * ||w_l|| * g_l / ||g_l|| for each layer l."""
    return [gamma * w.norm() * g / (g.norm() + eps) for w, g in zip(weights, grads)]


def perturbed_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors STAR perturbs: every parameter of rank >= 2 (convolution and linear weights), by name."""
    return {n: p for n, p in model.named_parameters() if p.dim() >= 2}


def worst_case_perturbation(
    model: nn.Module,
    inputs: torch.Tensor,
    clean: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    steps: int,
    init_scale: float,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """dw for every tensor of :func:`perturbed_weights`: a random start of norm ``init_scale * ||w_l||``, then
    ``steps`` ascent steps on the masked KL of ``model``'s logits (``model(inputs)`` must return logits) at w + dw."""
    weights = {n: p.detach() for n, p in perturbed_weights(model).items()}
    delta = {}
    for n, w in weights.items():
        z = torch.randn(w.shape, generator=generator, device=w.device, dtype=w.dtype)
        delta[n] = z * (init_scale * w.norm() / z.norm().clamp_min(1e-12))
    for _ in range(steps):
        probe = {n: (w + delta[n]).requires_grad_(True) for n, w in weights.items()}
        with torch.enable_grad():
            kl = star_kl(clean, functional_call(model, probe, (inputs,)), mask)
            grads = torch.autograd.grad(kl, list(probe.values()), allow_unused=True)
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(weights.values(), grads)]
        step = star_layer_step(list(weights.values()), grads, gamma / steps)
        delta = {n: delta[n] + s for n, s in zip(weights, step)}
    return delta


class _Logits(nn.Module):
    """A segmenter seen as ``images -> logits`` (what :func:`functional_call` evaluates)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x).logits  # type: ignore[operator]


class STARPlugin(Plugin):
    """ER + STAR on a labelled replay memory (see the module docstring).

    Args:
        memory: the replay memory (filled by a :class:`LabelledMemoryPlugin`).
        weight: lambda. gamma: perturbation size relative to each layer's weight norm. steps: ascent steps.
        init_scale: norm of the random start relative to each layer's weight norm.
        replay_batch: memory samples per draw (0: the run's batch size).
        er: append memory samples to every training batch (ER, the rehearsal method STAR is added to).
        freeze: incremental freezing policy.
    """

    name = "star"
    loss_terms = ("star",)

    def __init__(
        self,
        memory: LabelledMemory,
        weight: float = 0.1,
        gamma: float = 0.01,
        steps: int = 1,
        init_scale: float = 1e-3,
        replay_batch: int = 0,
        er: bool = True,
        freeze: str | None = "none",
    ) -> None:
        self.memory = memory
        self.weight, self.gamma, self.steps, self.init_scale = weight, gamma, steps, init_scale
        self.replay_batch, self.er = replay_batch, er
        self.freeze_incremental = freeze
        self.skipped = 0  # steps without a correctly predicted memory pixel

    def before_session(self, state: LoopState) -> None:
        self.skipped = 0

    def after_training(self, state: LoopState) -> None:
        if state.session.index > 0:
            state.report["star"] = {"memory": len(self.memory), "steps_without_a_correct_pixel": self.skipped}

    def _draw(self, state: LoopState, salt: str) -> dict[str, torch.Tensor] | None:
        if state.session.index == 0:
            return None
        n = self.replay_batch or state.config.batch_size
        seed = derive_seed(state.seed, state.session.index, state.epoch, state.iteration, salt)
        return self.memory.sample(n, torch.Generator().manual_seed(seed))

    def before_iteration(self, state: LoopState) -> None:
        if not self.er:
            return
        drawn = self._draw(state, "star-er")
        if drawn is None:
            return
        batch = state.batch
        if tuple(drawn["image"].shape[1:]) != tuple(batch["image"].shape[1:]):
            raise ConfigError(
                f"method star: memory samples of shape {tuple(drawn['image'].shape[1:])} cannot join training batches "
                f"of shape {tuple(batch['image'].shape[1:])}; set patch_size so that both are training crops"
            )
        labels = torch.cat([batch["label"], drawn["label"].to(batch["label"].dtype)])
        state.batch = {
            "image": torch.cat([batch["image"], drawn["image"].to(batch["image"].dtype)]),
            "label": labels,
            "id": [*batch.get("id", [""] * len(batch["image"])), *(["star-memory"] * len(drawn["image"]))],
            "ignore": (labels == IGNORE_INDEX).flatten(1).any(dim=1),
        }

    def after_forward(self, state: LoopState) -> None:
        if self.weight <= 0:
            return
        drawn = self._draw(state, "star")
        if drawn is None:
            return
        x = drawn["image"].to(state.device)
        target = state.class_index(drawn["label"].to(state.device))
        net = _Logits(state.model)
        with frozen_bn_statistics(state.model):
            with torch.no_grad():
                clean = net(x)
            mask = ((clean.argmax(1) == target) & (target != IGNORE_INDEX)).float()
            if mask.sum() < 1:  # nothing predicted right: nothing to stabilise
                self.skipped += 1
                return
            generator = torch.Generator(device=state.device).manual_seed(
                derive_seed(state.seed, state.session.index, state.epoch, state.iteration, "star-start")
            )
            delta = worst_case_perturbation(net, x, clean, mask, self.gamma, self.steps, self.init_scale, generator)
            params = perturbed_weights(net)
            shifted = {n: params[n] + d for n, d in delta.items()}
            perturbed = functional_call(net, shifted, (x,))
        state.losses[self.name] = self.weight * star_kl(clean, perturbed, mask)


@dataclass
class STAROptions:
    """STAR options; defaults: the official README's best arguments for ER + STAR (lambda 0.1, gamma 0.01), one
    ascent step (``--p-steps`` default), the whole network trained.

    Attributes:
        weight: lambda, weight of the KL term.
        gamma: the perturbation radius, relative to each layer's weight norm.
        steps: ascent steps of the perturbation.
        init_scale: relative norm of the random start (see the module docstring).
        memory_size: labelled samples the replay memory keeps, over all sessions.
        replay_batch: memory samples per draw (0: the run's batch size, as the official ``minibatch_size``).
        er: ER, the rehearsal base: memory samples join every training batch.
        freeze: incremental-session freezing ("none": the paper trains the whole network).
    """

    weight: float = option(0.1, ge=0)
    gamma: float = option(0.01, gt=0)
    steps: int = option(1, ge=1)
    init_scale: float = option(1e-3, gt=0)
    memory_size: int = option(20, ge=1)
    replay_batch: int = option(0, ge=0)
    er: bool = True
    freeze: str = freeze_option("none")


@METHODS.register(
    "star",
    options=STAROptions,
    paper="Eskandar et al., ICLR 2025",
    doc="baseline: ER + STAR, KL stability under worst-case weight perturbation on a labelled replay memory",
    fidelity=(
        "simplified: ER + STAR on a class-balanced labelled memory of 20 samples filled at session ends, not a "
        "reservoir buffer; per-pixel KL"
    ),
    flags=("uses exemplars",),
)
def star(o: STAROptions, config: RunConfig) -> Method:
    """ER + STAR over a labelled memory of ``memory_size`` samples of earlier sessions."""
    store = LabelledMemoryPlugin(o.memory_size)
    plugin = STARPlugin(
        store.memory, o.weight, o.gamma, o.steps, o.init_scale, o.replay_batch, o.er, freeze_policy(o.freeze)
    )
    return Method("star", [store, plugin], "STAR: ER + KL stability under worst-case weight perturbation (memory)")
