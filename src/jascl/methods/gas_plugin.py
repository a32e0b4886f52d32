"""Plugin wiring GAS (``jascl.methods.gas``) into the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from jascl.engine.plugin import Plugin
from jascl.methods.gas import GASNoise, attach_gas, detach_gas, record_sq_grad

if TYPE_CHECKING:
    from jascl.engine.state import LoopState


class GASPlugin(Plugin):
    """Perturbs one layer with gradient-adaptive noise during training forwards.

    Args:
        layer: "classifier" (the paper's choice), "encoder", "decoder" or a module path.
        eps: stabiliser of the inverse gradient (paper default 1e-8).
        sigma2: variance of the Gaussian noise (paper default 1).
        in_base: also perturb in session 0 (the authors apply GAS in incremental sessions only).
        variant: "paper" (eq. 1 in float64; a session starts from a zero buffer, scale 1 everywhere) or
            "authors" (their float32 operation order, :func:`~jascl.methods.gas.gas_noise_scale_authors`, and
            the last squared gradient of the old rows carried into the next session, as their imprinting
            copies ``fc.grad_update``: old rows start with small noise and new rows with scale 1; in the first
            GAS session, whose buffer is all zero, the first step is noise-free).
    """

    name = "gas"
    snapshot_exclude = ("_noise",)  # the parametrization inside _layer, restored with it

    def __init__(
        self,
        layer: str = "classifier",
        eps: float = 1e-8,
        sigma2: float = 1.0,
        in_base: bool = False,
        variant: str = "paper",
    ) -> None:
        if variant not in ("paper", "authors"):
            raise ValueError(f"GAS variant must be 'paper' or 'authors', got {variant!r}")
        self.layer_name = layer
        self.eps = eps
        self.sigma2 = sigma2
        self.in_base = in_base
        self.variant = variant
        self.changes_base_session = in_base
        self._layer: torch.nn.Module | None = None
        self._noise: GASNoise | None = None
        self.carried: torch.Tensor | None = None  # authors: the last session's squared gradient (its rows)

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
        self._noise = attach_gas(self._layer, self.eps, self.sigma2, self.variant)
        if self.variant == "authors" and self.carried is not None:
            sq_grad = self._noise.sq_grad
            assert isinstance(sq_grad, torch.Tensor)
            self._noise.set_sq_grad(carried_buffer(self.carried, sq_grad))

    def after_backward(self, state: LoopState) -> None:
        if self._layer is not None:
            record_sq_grad(self._layer)

    def after_session(self, state: LoopState) -> None:
        if self._layer is not None:
            if self.variant == "authors" and self._noise is not None:
                sq_grad = self._noise.sq_grad
                assert isinstance(sq_grad, torch.Tensor)
                self.carried = sq_grad.detach().cpu().clone()
            detach_gas(self._layer)
            self._layer = None
            self._noise = None

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"carried_sq_grad": self.carried} if self.carried is not None else {}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.carried = tensors.get("carried_sq_grad")


def carried_buffer(carried: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The first session step's squared-gradient buffer of the authors' variant: the old rows' last squared
    gradient (``carried``, K_old rows) in the first rows, zero in the new classes' rows."""
    out = torch.zeros_like(buffer)
    if carried.shape[1:] != buffer.shape[1:] or carried.shape[0] > buffer.shape[0]:
        return out  # another layer or shape: nothing to carry
    out[: carried.shape[0]] = carried.to(out)
    return out
