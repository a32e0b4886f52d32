"""C-Flat (Bian et al., NeurIPS 2024): zeroth- and first-order flatness in the update."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jascl.engine.plugin import Method, Plugin
from jascl.methods.common import SessionGate
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.sharpness._shared import (
    _trainable_with_grad,
    ascent_step,
    displaced,
    frozen_bn_statistics,
    gradient_at,
)


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


class CFlatPlugin(SessionGate, Plugin):
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

    Attributes:
        rho: the perturbation radius.
        lamb: weight of the first-order flatness term.
        in_base: also session 0.
    """

    rho: float = option(0.2, gt=0)
    lamb: float = option(0.2, ge=0)
    in_base: bool = False
    freeze: str = freeze_option()


@METHODS.register(
    "c-flat",
    options=CFlatOptions,
    paper="Bian et al., NeurIPS 2024",
    doc="baseline: C-Flat, zeroth- + first-order flatness in the update",
    fidelity="faithful",
)
def c_flat(o: CFlatOptions, config: RunConfig) -> Method:
    """C-Flat: the SAM gradient plus a first-order flatness correction."""
    return Method(
        "c-flat",
        [CFlatPlugin(o.rho, o.lamb, o.in_base, freeze_policy(o.freeze))],
        "C-Flat: SAM gradient plus a first-order flatness correction",
    )
