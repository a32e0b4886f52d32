"""L2-SP as a jascl method: a complete example of a method written with the public API alone.

L2-SP (Li, Grandvalet & Davoine, "Explicit inductive bias for transfer learning with
convolutional networks", ICML 2018) keeps a network close to its starting point by adding
``alpha / 2 * ||w - w0||^2`` to the loss. As a continual method, ``w0`` is the model at the end
of the previous session, so each session is pulled back towards what the last one learned.

Run it with ``jascl run --import docs/examples/l2_sp.py --methods vanilla,l2-sp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jascl.engine.config import RunConfig
from jascl.engine.state import LoopState
from jascl.methods import METHODS, Method, Plugin
from jascl.methods.options import freeze_option, freeze_policy, option


# 1. a pure function, testable on bare tensors
def l2_sp_penalty(params: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor], alpha: float) -> torch.Tensor:
    """``alpha / 2 * sum ||p - a||^2`` over the anchored parameters (rows a classifier gained since are free)."""
    total = sum(((params[k][: len(a)] - a) ** 2).sum() for k, a in anchors.items())
    return 0.5 * alpha * total


# 2. the options: defaults and ranges declared once (``--set method_args.l2-sp.alpha=0.1``)
@dataclass
class L2SPOptions:
    """Options of ``l2-sp``.

    Attributes:
        alpha: weight of the penalty (the paper's alpha).
        scope: "classifier" (the classifier's weights) or "all" (every trainable parameter).
        freeze: incremental-session freezing.
    """

    alpha: float = option(0.01, ge=0)
    scope: str = option("all", choices=("all", "classifier"))
    freeze: str = freeze_option()


# 3. a plugin wiring the function into the loop's events
class L2SPPlugin(Plugin):
    """Adds ``l2sp``: the penalty towards the weights the previous session ended with."""

    name = "l2-sp"
    loss_terms = ("l2sp",)

    def __init__(self, options: L2SPOptions) -> None:
        self.options = options
        self.freeze_incremental = freeze_policy(options.freeze)
        self.anchors: dict[str, torch.Tensor] = {}

    def _module(self, state: LoopState) -> torch.nn.Module:
        return state.model.classifier if self.options.scope == "classifier" else state.model

    def before_session(self, state: LoopState) -> None:
        # before training: the previous session's weights; the loop's default plugin has grown the classifier
        # already, and the rows of this session's new classes have no earlier value to be pulled to
        old_rows = len(state.previous_seen) or state.model.num_classes
        classifier = {id(p) for p in state.model.classifier.parameters()}
        self.anchors = {
            name: (p[:old_rows] if id(p) in classifier else p).detach().clone()
            for name, p in self._module(state).named_parameters()
            if p.requires_grad
        }

    def after_forward(self, state: LoopState) -> None:
        if state.session.index == 0:
            return
        params = dict(self._module(state).named_parameters())
        state.losses["l2sp"] = l2_sp_penalty(params, self.anchors, self.options.alpha)


# 4. registration: the name, the options class, the paper, how close it is to that paper
@METHODS.register(
    "l2-sp",
    options=L2SPOptions,
    doc="example: L2-SP, a pull towards the previous session's weights",
    paper="Li, Grandvalet & Davoine, ICML 2018",
    fidelity="faithful",
)
def l2_sp(options: L2SPOptions, config: RunConfig) -> Method:
    """L2-SP with the previous session's weights as the starting point; every other policy is the loop's."""
    return Method("l2-sp", [L2SPPlugin(options)], "L2-SP towards the previous session")
