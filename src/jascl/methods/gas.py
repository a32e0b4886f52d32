"""Gradient-adaptive stabilization (GAS), paper eq. 1.

GAS perturbs one layer's weight in training forwards with Gaussian noise whose
per-element scale is the min-max normalised *inverse* squared gradient::

    G        = (dL/dW)^2                       (stored after each backward pass)
    G^-1     = 1 / (G + eps)
    G~^-1    = (1 + G^-1 - min G^-1) / (1 + max G^-1 - min G^-1)   in (0, 1]
    W~       = W + G~^-1 * N(0, sigma^2)      (training forwards only)

Parameters with large gradients (actively learning) get little noise; those
with small gradients (candidates for overfitting) get the most. Evaluation uses
W itself.

Notes on the authors' code (``ProbabilisticClassifier``):
    * It never switches the noise off, so its evaluation, prototype extraction
      and teacher predictions are stochastic. Here noise exists only while the
      layer is in training mode; evaluation is deterministic unless Monte-Carlo
      evaluation is asked for.
    * Noise std is exactly G~^-1 there (sigma^2 = 1, the paper's default); the
      paper's sensitivity table varies the noise variance sigma^2, so we expose it.
    * The buffer is overwritten with the latest squared gradient every iteration
      (no running average) and starts at zero, as here.
    * The first step of a session: with G = 0 everywhere, eq. 1 read literally
      gives G~^-1 = (1 + 1e8 - 1e8) / (1 + 1e8 - 1e8) = 1, full noise everywhere,
      and that is what jascl computes (in float64, subtracting before adding the
      1). The authors' float32 code adds first: 1 + 1e8 rounds to 1e8, so the
      numerator is 0 and their first step is noise-free. From the second session
      on, their imprinting also copies the old rows' last gradient buffer, so old
      rows start with small noise and new rows with scale 1 (both found by
      running their code and this one on identical tensors). jascl follows eq. 1
      (the paper is the specification); the difference concerns the first step
      of each session. ``method_args.jascl.gas.variant=authors`` gives the
      authors' behaviour: their float32 operation order
      (:func:`gas_noise_scale_authors`) and the old rows' buffer carried into the
      next session (:class:`jascl.methods.gas_plugin.GASPlugin`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


def gas_noise_scale(sq_grad: torch.Tensor, eps: float = 1e-8, out: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised inverse-gradient noise scale of eq. 1, elementwise in (0, 1].

    Args:
        sq_grad: squared gradient G of the layer's weight, any shape.
        eps: stabiliser in G^-1 = 1 / (G + eps).
        out: optional tensor (the shape of ``sq_grad``) to write the result into.

    Returns:
        Tensor like ``sq_grad``: (1 + G^-1 - min G^-1) / (1 + max G^-1 - min G^-1).
        Computed in float64 because G^-1 spans many orders of magnitude, and
        rounded once to ``out``'s (or ``sq_grad``'s) dtype. Ten kernels, all
        on the device, none waiting for the host: it runs after every backward pass.
    """
    inv = sq_grad.double().add_(eps).reciprocal_()
    lo, hi = torch.aminmax(inv)
    numerator = (inv - lo).add_(1.0)
    if out is None:
        out = torch.empty_like(sq_grad)
    return torch.div(numerator, (hi - lo) + 1.0, out=out)


def gas_noise_scale_authors(sq_grad: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Eq. 1 as the authors' code evaluates it: in float32, ``((1 + G^-1) - min) / (1 + (max - min))``.

    ``1 + G^-1`` is rounded before ``min`` is subtracted, so entries whose G^-1 is large (G near 0,
    e.g. the zero buffer of a session's first step: G^-1 = 1e8, where float32 spacing is 8) lose the
    1 and get scale 0 instead of eq. 1's 1; elsewhere it agrees with :func:`gas_noise_scale` to float32
    rounding. Returns float32.
    """
    inv = 1.0 / (sq_grad.float() + eps)
    lo, hi = torch.aminmax(inv)
    return ((1.0 + inv) - lo) / (1.0 + (hi - lo))


class GASNoise(nn.Module):
    """Parametrization W -> W + G~^-1 * N(0, sigma^2), active only in training mode.

    Registered with :func:`torch.nn.utils.parametrize.register_parametrization`
    on the perturbed layer's ``weight``; because the noise is additive, the
    gradient w.r.t. the stored weight equals the gradient w.r.t. the perturbed one.
    """

    #: sampled during Monte-Carlo evaluation (:func:`jascl.evaluation.evaluator.monte_carlo`)
    monte_carlo = True

    def __init__(self, shape: torch.Size, eps: float = 1e-8, sigma2: float = 1.0, variant: str = "paper") -> None:
        super().__init__()
        if variant not in ("paper", "authors"):
            raise ValueError(f"GAS variant must be 'paper' or 'authors', got {variant!r}")
        self.eps = eps
        self.variant = variant
        self.sigma = sigma2**0.5
        self.register_buffer("sq_grad", torch.zeros(shape), persistent=False)
        # G~^-1 of the stored gradient, kept up to date by set_sq_grad: the weight is read several
        # times per step (labelled, unlabelled and replay forwards) but the gradient changes once
        self.register_buffer("noise_scale", self._scale_of(self.sq_grad), persistent=False)

    def _scale_of(self, sq_grad: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.variant == "paper":
            return gas_noise_scale(sq_grad, self.eps, out=out)
        scale = gas_noise_scale_authors(sq_grad, self.eps)
        return scale if out is None else out.copy_(scale)

    @torch.no_grad()
    def set_sq_grad(self, sq_grad: torch.Tensor) -> None:
        """Store the squared gradient G and its noise scale."""
        self.sq_grad.copy_(sq_grad)
        self._scale_of(self.sq_grad, out=self.noise_scale)

    @torch.no_grad()
    def set_grad(self, grad: torch.Tensor) -> None:
        """Store G = grad^2 (squared in place into the buffer) and its noise scale."""
        torch.square(grad, out=self.sq_grad)
        self._scale_of(self.sq_grad, out=self.noise_scale)

    def scale(self) -> torch.Tensor:
        return self.noise_scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return weight
        noise = torch.randn_like(weight)
        if self.sigma != 1.0:  # the paper's default skips a kernel
            noise = noise * self.sigma
        return weight + self.noise_scale.to(weight.dtype) * noise


def attach_gas(layer: nn.Module, eps: float = 1e-8, sigma2: float = 1.0, variant: str = "paper") -> GASNoise:
    """Put GAS on ``layer.weight``; returns the parametrization (holds the gradient buffer)."""
    if is_gas_attached(layer):
        raise ValueError("GAS is already attached to this layer")
    noise = GASNoise(layer.weight.shape, eps, sigma2, variant).to(layer.weight.device)
    parametrize.register_parametrization(layer, "weight", noise)
    return noise


def detach_gas(layer: nn.Module) -> None:
    """Remove GAS, leaving the clean (unperturbed) weight as a plain parameter."""
    if is_gas_attached(layer):
        parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)


def is_gas_attached(layer: nn.Module) -> bool:
    return parametrize.is_parametrized(layer, "weight") and any(
        isinstance(p, GASNoise) for p in layer.parametrizations["weight"]
    )


def clean_weight(layer: nn.Module) -> torch.Tensor:
    """The stored weight W of a layer, with or without GAS attached."""
    if parametrize.is_parametrized(layer, "weight"):
        return layer.parametrizations["weight"].original
    return layer.weight


@torch.no_grad()
def record_sq_grad(layer: nn.Module) -> None:
    """Store (dL/dW)^2 from the last backward pass in the layer's GAS buffer."""
    grad = clean_weight(layer).grad
    if grad is None:
        raise RuntimeError("GAS layer received no gradient; is it frozen? Choose a trainable layer for GAS")
    for p in layer.parametrizations["weight"]:
        if isinstance(p, GASNoise):
            p.set_grad(grad)


def clean_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with GAS removed from the keys (``x.parametrizations.weight.original`` -> ``x.weight``)."""
    return {k.replace("parametrizations.weight.original", "weight"): v for k, v in model.state_dict().items()}
