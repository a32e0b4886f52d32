"""Sharpness / perturbation baselines: SAM, C-Flat and STAR.

The JASCL appendix ("GAS vs. sharpness-based methods", "GAS vs. perturbation-based
stability methods") contrasts GAS's parameter-wise, gradient-adaptive noise with
these methods' worst-case perturbations of the whole parameter vector (SAM,
C-Flat) or of each layer (STAR).

SAM and C-Flat change the *update* (the gradient the optimiser sees), not the
loss: they re-evaluate the loss of the current batch at perturbed weights with
``state.closure()`` in ``before_update`` and so declare no loss term. STAR adds a
loss term (the KL divergence at the perturbed weights). By default all three act
in incremental sessions only, on the parameters the freezing policy leaves
trainable (``freeze`` option, see :mod:`jascl.methods.baselines.regularization`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from jascl.engine.plugin import Method, Plugin
from jascl.methods.baselines.regularization import _SessionGate, check_freeze, check_range
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


# ---------------------------------------------------------------------------- shared


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """||(t_1, ..., t_n)||_2 over all elements of all tensors."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def ascent_step(grads: Sequence[torch.Tensor], rho: float, eps: float = 1e-12) -> list[torch.Tensor]:
    """SAM's first-order worst-case perturbation e = rho * g / ||g||_2 (Foret et al., ICLR 2021).

    The norm is taken over the whole parameter vector (all tensors together).
    """
    scale = rho / (global_norm(grads) + eps)
    return [g * scale for g in grads]


@contextlib.contextmanager
def frozen_bn_statistics(model: nn.Module) -> Iterator[None]:
    """BatchNorm running statistics left untouched by the extra forward passes (as SAM / C-Flat code does)."""
    saved = []
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
            saved.append((m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()))
            m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def _trainable_with_grad(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def gradient_at(params: Sequence[torch.Tensor], closure: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """Gradient of ``closure()`` w.r.t. ``params`` at their current values (also left in ``p.grad``)."""
    for p in params:
        p.grad = None
    with torch.enable_grad():
        closure().backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]


@contextlib.contextmanager
def displaced(params: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> Iterator[None]:
    """Parameters moved to theta + delta inside the block and restored bit-exactly afterwards.

    Restoring a saved copy (rather than subtracting delta) keeps rounding from
    drifting the weights over many steps.
    """
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, d in zip(params, deltas):
            p.add_(d)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


# ---------------------------------------------------------------------------- SAM


def sam_gradient(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], grad_fn: Callable[[], list[torch.Tensor]], rho: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SAM's update direction: the gradient at theta + rho * g/||g|| (Foret et al. 2021).

    Args:
        params: the parameters (modified in place during the call, restored on return).
        grads: their gradient g at the current point.
        grad_fn: computes the gradient at the parameters' current values.
        rho: neighbourhood radius.

    Returns:
        (gradient at the perturbed point, the perturbation e).
    """
    e = ascent_step(grads, rho)
    with displaced(params, e):
        g_sam = grad_fn()
    return g_sam, e


class SAMPlugin(_SessionGate, Plugin):
    """Sharpness-aware minimisation: min_theta max_{||e|| <= rho} L(theta + e), first-order solution.

    After the loop's backward pass, the plugin moves the trainable parameters to
    theta + rho * g/||g||, recomputes loss and gradient there with
    ``state.closure()`` (BatchNorm statistics frozen), moves back, and leaves that
    gradient for the optimiser step (Foret et al., ICLR 2021, Algorithm 1).

    Args:
        rho: neighbourhood radius.
        in_base: also in session 0 (then the method trains its own base model).
        freeze: incremental freezing policy.
    """

    name = "sam"

    def __init__(self, rho: float = 0.05, in_base: bool = False, freeze: str | None = None) -> None:
        self.rho = rho
        self.in_base = in_base
        self.changes_base_session = in_base
        self.freeze_incremental = freeze
        self.last_sharpness: float | None = None

    def before_update(self, state: LoopState) -> None:
        if not self.active(state):
            return
        params = _trainable_with_grad(state.optimizer)
        if not params:
            return
        grads = [p.grad.detach().clone() for p in params]
        before = float(sum(v.detach() for v in state.losses.values()))
        with frozen_bn_statistics(state.model):
            g_sam, _ = sam_gradient(params, grads, lambda: gradient_at(params, state.closure), self.rho)
        after = float(sum(v.detach() for v in state.losses.values()))
        for p, g in zip(params, g_sam):
            p.grad = g
        self.last_sharpness = after - before  # L(theta + e) - L(theta), logged
        state.metrics["sam_sharpness"] = self.last_sharpness


@dataclass
class SAMOptions:
    """SAM options. rho: 0.05 (Foret et al.'s default radius). in_base: also session 0.
    freeze: "config" | "none" | "all_but_classifier"."""

    rho: float = 0.05
    in_base: bool = False
    freeze: str = "config"


@METHODS.register("sam", doc="baseline: sharpness-aware minimisation, two-step update (Foret et al., ICLR 2021)")
def sam(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "sam", SAMOptions())
    check_range("sam", "rho", o.rho, 0.0, low_open=True)
    return Method(
        "sam",
        [SAMPlugin(o.rho, o.in_base, check_freeze("sam", o.freeze))],
        "SAM: gradient taken at the worst-case neighbour within radius rho",
    )


# ---------------------------------------------------------------------------- C-Flat


def c_flat_gradient(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    grad_fn: Callable[[], list[torch.Tensor]],
    rho: float,
    lamb: float,
    eps: float = 1e-12,
) -> list[torch.Tensor]:
    """C-Flat's update direction (Bian et al., NeurIPS 2024; official ``C_Flat.step``).

    Minimises L^{R_rho}(theta) + lamb * R^(1)_rho(theta): the zeroth-order
    sharpness (SAM's max over the rho-ball) plus rho * max ||grad L|| over the
    ball (first-order flatness, as in GAM). With g0 = grad L(theta):

    1. g1 = grad L(theta + e0),          e0 = rho * g0 / ||g0||     (SAM gradient)
    2. h  = g1 - g0  (~ rho * H g0/||g0||, the ascent direction of ||grad L||)
       g2 = grad L(theta + e1),          e1 = rho * h / ||h||
    3. g3 = grad L(theta + e1 + e2),     e2 = rho * g2 / ||g2||
    4. direction = g1 + lamb * (g3 - g2)  (g3 - g2 ~ rho * grad ||grad L|| at theta + e1)

    Args:
        params: the parameters (moved during the call, restored on return).
        grads: g0.
        grad_fn: gradient at the parameters' current values.
        rho: radius; lamb: weight of the first-order term.

    Returns:
        The gradient to hand to the optimiser.
    """
    e0 = ascent_step(grads, rho, eps)
    with displaced(params, e0):
        g1 = grad_fn()
    h = [a - b for a, b in zip(g1, grads)]
    e1 = ascent_step(h, rho, eps)
    with displaced(params, e1):
        g2 = grad_fn()
        e2 = ascent_step(g2, rho, eps)
        with displaced(params, e2):
            g3 = grad_fn()
    return [a + lamb * (c - b) for a, b, c in zip(g1, g2, g3)]


class CFlatPlugin(_SessionGate, Plugin):
    """C-Flat: flatter minima through zeroth- and first-order sharpness (three extra forward/backward passes).

    Args:
        rho: perturbation radius; lamb: weight of the first-order flatness term.
        in_base: also in session 0 (then the method trains its own base model).
        freeze: incremental freezing policy.
    """

    name = "c-flat"

    def __init__(self, rho: float = 0.2, lamb: float = 0.2, in_base: bool = False, freeze: str | None = None) -> None:
        self.rho = rho
        self.lamb = lamb
        self.in_base = in_base
        self.changes_base_session = in_base
        self.freeze_incremental = freeze

    def before_update(self, state: LoopState) -> None:
        if not self.active(state):
            return
        params = _trainable_with_grad(state.optimizer)
        if not params:
            return
        grads = [p.grad.detach().clone() for p in params]
        with frozen_bn_statistics(state.model):
            direction = c_flat_gradient(params, grads, lambda: gradient_at(params, state.closure), self.rho, self.lamb)
        for p, g in zip(params, direction):
            p.grad = g


@dataclass
class CFlatOptions:
    """C-Flat options; defaults rho = 0.2, lamb = 0.2 are the official code's (``main.py``).
    in_base: also session 0. freeze: "config" | "none" | "all_but_classifier"."""

    rho: float = 0.2
    lamb: float = 0.2
    in_base: bool = False
    freeze: str = "config"


@METHODS.register(
    "c-flat", doc="baseline: C-Flat, zeroth- + first-order flatness in the update (Bian et al., NeurIPS 2024)"
)
def c_flat(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "c-flat", CFlatOptions())
    check_range("c-flat", "rho", o.rho, 0.0, low_open=True)
    check_range("c-flat", "lamb", o.lamb, 0.0)
    return Method(
        "c-flat",
        [CFlatPlugin(o.rho, o.lamb, o.in_base, check_freeze("c-flat", o.freeze))],
        "C-Flat: SAM gradient plus a first-order flatness correction",
    )


# ---------------------------------------------------------------------------- STAR


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
    """STAR options; defaults lambda = 0.01 (``p_lam``), gamma = 0.05 (``p_gamma``), 1 step
    (``p_steps``) are the official implementation's (Mammoth ``star_perturber.py``).

    init_scale: relative norm of the random start (see STARPlugin).
    freeze: "config" | "none" | "all_but_classifier".
    """

    weight: float = 0.01
    gamma: float = 0.05
    steps: int = 1
    init_scale: float = 1e-3
    freeze: str = "config"


@METHODS.register(
    "star",
    doc="baseline: STAR worst-case weight-perturbation KL on stored prototypes instead of a "
    "replay buffer (Eskandar et al., ICLR 2025)",
)
def star(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "star", STAROptions())
    check_range("star", "weight", o.weight, 0.0)
    check_range("star", "gamma", o.gamma, 0.0, low_open=True)
    check_range("star", "steps", o.steps, 1)
    check_range("star", "init_scale", o.init_scale, 0.0, low_open=True)
    return Method(
        "star",
        [STARPlugin(o.weight, o.gamma, o.steps, o.init_scale, check_freeze("star", o.freeze))],
        "STAR: KL stability under worst-case classifier perturbation, on past prototypes",
    )
