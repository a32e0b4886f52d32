"""SoftNet's pure functions and weight masking: major/minor masks from scores, the straight-through estimator,
the minor-only gradient, the prototype metric loss, and the per-weight mask attached with
``torch.nn.utils.parametrize`` (:mod:`.softnet` holds the method and its docstring)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    pass


def major_count(numel: int, capacity: float) -> int:
    """Weights of a layer with ``numel`` weights in its major subnetwork: round(c * n), half up, in [0, n]."""
    return max(0, min(numel, math.floor(capacity * numel + 0.5)))


def major_mask(scores: torch.Tensor, capacity: float) -> torch.Tensor:
    """The major subnetwork of one layer: its top-c share of weights by |score|.

    Args:
        scores: the layer's scores s, any shape (that of its weight).
        capacity: c in (0, 1].

    Returns:
        Boolean tensor like ``scores``: True for the round(c n) largest |s| (ties at the
        threshold stay False).
    """
    n = scores.numel()
    k = major_count(n, capacity)
    if k >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    magnitude = scores.detach().abs()
    threshold = magnitude.reshape(-1).kthvalue(n - k).values  # the largest |s| left out
    return magnitude > threshold


def soft_subnetwork_mask(
    scores: torch.Tensor, capacity: float, soft: torch.Tensor | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The soft mask m_soft of one layer (paper section 4): 1 on the major subnetwork, U[0, 1) values elsewhere.

    Args:
        scores: the layer's scores s, any shape.
        capacity: c in (0, 1].
        soft: the minor values (shape of ``scores``, in [0, 1)); None: drawn from U[0, 1) with ``generator``
            (a CPU generator draws on the CPU; the result is moved to ``scores``' device).
        generator: random generator for the draw (None: the global stream).

    Returns:
        Float tensor like ``scores`` (no gradient; see :func:`straight_through`).
    """
    if soft is None:
        soft = torch.rand(scores.shape, generator=generator, dtype=scores.dtype)
    soft = soft.to(device=scores.device, dtype=scores.dtype)
    return torch.where(major_mask(scores, capacity), torch.ones_like(soft), soft)


def straight_through(values: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``values`` in the forward pass, identity gradient to ``scores`` in the backward pass.

    The straight-through estimator of the official ``GetSubnetFaster``: the top-c selection has no
    gradient, so dL/ds = dL/dm. ``scores - scores.detach()`` is exactly zero, so the forward value is
    ``values`` bit for bit.

    Args:
        values: the mask (no gradient), any shape.
        scores: the scores, same shape.
    """
    return values.detach() + (scores - scores.detach())


def minor_only_gradient(grad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The gradient of a masked weight with its major entries zeroed (incremental sessions).

    Args:
        grad: dL/dW, any shape.
        mask: the layer's fixed soft mask (same shape): exactly 1 on the major subnetwork (soft values are
            drawn in [0, 1), so a value of 1 marks a major weight).

    Returns:
        ``grad`` where ``mask < 1``, 0 where ``mask == 1``.
    """
    return grad.masked_fill(mask == 1, 0.0)


def prototype_metric_loss(
    features: torch.Tensor,
    target: torch.Tensor,
    prototypes: torch.Tensor,
    batch_rows: list[int] | tuple[int, ...] = (),
    tau: float = 0.1,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """SoftNet's incremental metric loss (official ``IncrementalCPTFixPNLoss``, ``cos_temp``), per pixel.

    For every labelled pixel i with class row y_i and feature z_i::

        L = mean_i -log softmax_k( cos(z_i, p_k) / tau )[y_i]

    with p_k the batch mean of the L2-normalised features of the pixels of class k for
    k in ``batch_rows`` present in the batch (differentiable), else the fixed ``prototypes[k]``.

    Args:
        features: (B, C, *spatial) pixel features.
        target: (B, *spatial) class rows (``ignore_index`` = unlabelled).
        prototypes: (K, C) fixed prototypes (any norm; no gradient flows into them).
        batch_rows: rows whose prototype is taken from the batch (the session's new classes).
        tau: temperature (official 0.1).
        ignore_index: label of ignored pixels.

    Returns:
        Scalar loss (0 if no pixel is labelled).
    """
    c = features.shape[1]
    k = prototypes.shape[0]
    z = F.normalize(features.float().movedim(1, -1).reshape(-1, c), dim=1)
    t = target.reshape(-1)
    keep = t != ignore_index
    z, t = z[keep], t[keep]
    if t.numel() == 0:
        return features.sum() * 0.0
    fixed = prototypes.detach().to(z.dtype)
    if batch_rows:
        sums = z.new_zeros(k, c).index_add(0, t, z)
        counts = torch.bincount(t, minlength=k)
        use = torch.zeros(k, dtype=torch.bool, device=z.device)
        use[list(batch_rows)] = True
        use &= counts > 0
        batch = sums / counts.clamp_min(1).to(z.dtype)[:, None]
        protos = torch.where(use[:, None], batch, fixed)
    else:
        protos = fixed
    logits = z @ F.normalize(protos, dim=1).t() / tau
    return F.cross_entropy(logits, t)


# ------------------------------------------------------------------------------------------------ parametrization


class SoftSubnetwork(nn.Module):
    """Parametrization W -> W * m_soft of one layer's weight.

    Learning mode (session 0): ``scores`` is a parameter; the mask is recomputed from it at every
    forward (straight-through to the scores), with fresh U[0, 1) minor values in training mode and the
    fixed draw ``soft`` in eval mode. Fixed mode (after :meth:`fix`, and in incremental sessions):
    the stored ``mask`` is used.

    Args:
        weight: the layer's weight (shape, device, dtype).
        capacity: c.
        generator: CPU generator for the scores' initialisation and the fixed draw (None: fixed mode,
            ``mask`` must be given).
        mask: the fixed mask (fixed mode).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        capacity: float,
        generator: torch.Generator | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.capacity = capacity
        if mask is not None:
            self.register_parameter("scores", None)
            self.register_buffer("soft", None)
            self.register_buffer("mask", mask.to(device=weight.device, dtype=torch.float32))
            return
        if generator is None:
            raise ValueError("a SoftSubnetwork without a mask needs a generator for its scores")
        shape = weight.shape
        # the official scores' initialisation (kaiming_uniform_ with a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(weight)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 1.0
        scores = (torch.rand(shape, generator=generator) * 2.0 - 1.0) * bound
        self.scores = nn.Parameter(scores.to(weight.device))
        self.register_buffer("soft", torch.rand(shape, generator=generator).to(weight.device))
        self.register_buffer("mask", None)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            return weight * self.mask.to(weight.dtype)
        soft = torch.rand_like(self.soft) if self.training else self.soft
        mask = straight_through(soft_subnetwork_mask(self.scores, self.capacity, soft), self.scores)
        return weight * mask.to(weight.dtype)

    @torch.no_grad()
    def fix(self) -> None:
        """Freeze the mask: the current top-c selection of the scores, with the fixed draw as minor values."""
        self.mask = soft_subnetwork_mask(self.scores.float(), self.capacity, self.soft)
        self.scores.requires_grad_(False)


def attach_learnable(
    layers: dict[str, nn.Module], capacity: float, generator: torch.Generator
) -> dict[str, tuple[nn.Module, SoftSubnetwork]]:
    """Put a learning-mode :class:`SoftSubnetwork` on every layer's ``weight`` (session 0); path -> (layer, it)."""
    out = {}
    for path, module in layers.items():
        soft = SoftSubnetwork(module.weight, capacity, generator).train(module.training)
        parametrize.register_parametrization(module, "weight", soft, unsafe=True)
        out[path] = (module, soft)
    return out


def attach_fixed(
    layers: dict[str, nn.Module], masks: dict[str, torch.Tensor], minor: dict[str, torch.Tensor]
) -> dict[str, tuple[nn.Module, SoftSubnetwork]]:
    """Put a fixed-mask :class:`SoftSubnetwork` on every layer whose weight holds W * m (incremental sessions).

    The raw minor weights ``minor[path]`` (1-D, in the order of ``mask < 1``) are written back first, so the
    parametrized weight is W * m again (the major entries of W * m are W itself). Path -> (layer, it).
    """
    out = {}
    for path, module in layers.items():
        mask = masks[path].to(module.weight.device)
        with torch.no_grad():
            module.weight.masked_scatter_(mask != 1, minor[path].to(module.weight))
        fixed = SoftSubnetwork(module.weight, 1.0, mask=mask).train(module.training)
        parametrize.register_parametrization(module, "weight", fixed, unsafe=True)
        out[path] = (module, fixed)
    return out


def detach_all(attached: dict[str, tuple[nn.Module, SoftSubnetwork]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Remove the parametrizations, leaving the effective weight W * m; path -> (mask, raw minor weights), on the CPU.

    Every mask must be fixed (:meth:`SoftSubnetwork.fix`).
    """
    out = {}
    for path, (module, soft) in attached.items():
        if soft.mask is None:
            raise RuntimeError(f"softnet: the mask of {path} is not fixed yet")
        raw = module.parametrizations["weight"].original.detach()
        out[path] = (soft.mask.detach().float().cpu().clone(), raw[soft.mask != 1].float().cpu().clone())
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return out


def masked_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Backbone modules with their own ``weight`` parameter of rank >= 2 (convolutions, linear layers), by path.

    Modules the backbone freezes in incremental sessions (``frozen_modules``, e.g. SAM's encoder) are left out.
    """
    backbone = model.backbone
    frozen = {id(p) for m in backbone.frozen_modules() for p in m.parameters()}
    out = {}
    for path, module in backbone.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            weight = module.parametrizations["weight"].original
        else:
            weight = module._parameters.get("weight")
        if isinstance(weight, nn.Parameter) and weight.dim() >= 2 and id(weight) not in frozen:
            out[f"backbone.{path}" if path else "backbone"] = module
    return out


# ------------------------------------------------------------------------------------------------ plugin
