"""Dropout before the classifier and a stronger weight decay: the static regularisers Goodfellow et al. (2013)
and Mirzadeh et al. (NeurIPS 2020) found to reduce forgetting (dropout: Srivastava et al., JMLR 2014)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.plugin import Method, Plugin
from jascl.methods.common import SessionGate
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def l2_penalty(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """sum ||theta||^2 (weight decay as a loss: d/dtheta (wd/2)||theta||^2 = wd * theta, SGD's weight_decay)."""
    return sum((p**2).sum() for p in params)


class DropoutWeightDecayPlugin(SessionGate, Plugin):
    """Dropout on the features entering the classifier, and a stronger weight decay.

    The static regularisers Goodfellow et al. (2013) and Mirzadeh et al. (2020)
    found to reduce forgetting: (inverted) dropout with rate ``p`` on the
    (B, C, *spatial) features in training forwards (Srivastava et al., JMLR 2014),
    and an L2 penalty ``(weight_decay / 2) * ||theta||^2`` on the trainable
    parameters, logged as the loss term ``wd``; the plugin's SGD has no
    built-in weight decay, so the decay is exactly ``weight_decay``.

    Args:
        p: dropout rate.
        weight_decay: L2 coefficient (replaces the run's ``weight_decay``).
        in_base: also in session 0 (then the method trains its own base model).
        freeze: incremental freezing policy.
    """

    name = "dropout-wd"
    loss_terms = ("wd",)

    def __init__(
        self, p: float = 0.5, weight_decay: float = 5e-4, in_base: bool = False, freeze: str | None = None
    ) -> None:
        self.p = p
        self.weight_decay = weight_decay
        self.in_base = in_base
        self.changes_base_session = in_base
        self.freeze_incremental = freeze
        self._hook = None
        self._params: list[nn.Parameter] = []

    def _dropout(self, module: nn.Module, args: tuple) -> tuple:
        return (F.dropout(args[0], self.p, training=module.training), *args[1:])

    def before_session(self, state: LoopState) -> None:
        if self.active(state):
            self._hook = state.model.classifier.register_forward_pre_hook(self._dropout)

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if not self.active(state):
            return None
        self._params = list(params)
        cfg = state.config
        return torch.optim.SGD(
            params, lr=lr, momentum=cfg.momentum, weight_decay=0.0, nesterov=cfg.nesterov and cfg.momentum > 0
        )

    def after_forward(self, state: LoopState) -> None:
        if self.active(state) and self.weight_decay > 0 and self._params:
            state.losses["wd"] = 0.5 * self.weight_decay * l2_penalty(self._params)

    def after_session(self, state: LoopState) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._params = []


@dataclass
class DropoutWDOptions:
    """Dropout + weight-decay options.

    Attributes:
        p: dropout rate; 0.5, Srivastava et al. (2014)'s rate for hidden units, used by Goodfellow et al. (2013).
        weight_decay: 5e-4, a common CNN value and 5x the run's default 1e-4 (no source fixes it for this setting).
        in_base: also regularise session 0.
    """

    p: float = option(0.5, ge=0, lt=1)
    weight_decay: float = option(5e-4, ge=0)
    in_base: bool = False
    freeze: str = freeze_option()


@METHODS.register(
    "dropout-wd",
    options=DropoutWDOptions,
    paper="Srivastava et al., JMLR 2014; Goodfellow et al. 2013; Mirzadeh et al., NeurIPS 2020",
    doc="baseline: dropout before the classifier + stronger weight decay",
    fidelity="faithful",
)
def dropout_wd(o: DropoutWDOptions, config: RunConfig) -> Method:
    """Dropout on the classifier's input features and an L2 penalty on the trainable parameters."""
    plugin = DropoutWeightDecayPlugin(o.p, o.weight_decay, o.in_base, freeze_policy(o.freeze))
    return Method("dropout-wd", [plugin], "dropout on classifier inputs + L2 weight decay")
