"""Plugin wiring GAS (``jascl.methods.gas``) into the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from jascl.engine.plugin import Plugin
from jascl.methods.gas import attach_gas, detach_gas, record_sq_grad

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


class GASPlugin(Plugin):
    """Perturbs one layer with gradient-adaptive noise during training forwards.

    Args:
        layer: "classifier" (the paper's choice), "encoder", "decoder" or a module path.
        eps: stabiliser of the inverse gradient (paper default 1e-8).
        sigma2: variance of the Gaussian noise (paper default 1).
        in_base: also perturb in session 0 (the authors apply GAS in incremental sessions only).
    """

    name = "gas"

    def __init__(
        self, layer: str = "classifier", eps: float = 1e-8, sigma2: float = 1.0, in_base: bool = False
    ) -> None:
        self.layer_name = layer
        self.eps = eps
        self.sigma2 = sigma2
        self.in_base = in_base
        self.changes_base_session = in_base
        self._layer: torch.nn.Module | None = None

    def _active(self, state: LoopState) -> bool:
        return self.in_base or state.session.index > 0

    def before_session(self, state: LoopState) -> None:
        if not self._active(state):
            return
        self._layer = state.model.resolve_layer(self.layer_name)
        if not self._layer.weight.requires_grad:
            from jascl.errors import ConfigError

            raise ConfigError(
                f"method_args.jascl.gas.layer={self.layer_name!r} is frozen in session {state.session.index} "
                f"(freeze policy {state.config.freeze_incremental!r}); choose a trainable layer or "
                "set freeze_incremental=none"
            )
        attach_gas(self._layer, self.eps, self.sigma2)

    def after_backward(self, state: LoopState) -> None:
        if self._layer is not None:
            record_sq_grad(self._layer)

    def after_session(self, state: LoopState) -> None:
        if self._layer is not None:
            detach_gas(self._layer)
            self._layer = None
