"""SAM: sharpness-aware minimisation (Foret et al., ICLR 2021), the two-step update."""

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


class SAMPlugin(SessionGate, Plugin):
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
    """SAM options.

    Attributes:
        rho: the neighbourhood radius; 0.05, Foret et al.'s default.
        in_base: also session 0.
    """

    rho: float = option(0.05, gt=0)
    in_base: bool = False
    freeze: str = freeze_option()


@METHODS.register(
    "sam",
    options=SAMOptions,
    paper="Foret et al., ICLR 2021",
    doc="baseline: sharpness-aware minimisation, two-step update",
    fidelity="faithful",
)
def sam(o: SAMOptions, config: RunConfig) -> Method:
    """SAM: the gradient is taken at the worst-case neighbour within radius ``rho``."""
    return Method(
        "sam",
        [SAMPlugin(o.rho, o.in_base, freeze_policy(o.freeze))],
        "SAM: gradient taken at the worst-case neighbour within radius rho",
    )
