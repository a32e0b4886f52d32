"""Poincare-ball pieces of HALO: the exponential map at the origin, the distance to the origin (the
hyperbolic radius), hyperbolic multinomial logistic regression, and HALO's projection head.

Manifold operations come from geoopt (``geoopt.manifolds.stereographic.math``, curvature ``k = -c``);
the ball has radius ``1 / sqrt(c)``. Tensors are channel-first, (B, D, *spatial) with D on dim 1, in 2D
and 3D alike.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _manifold():
    """geoopt's stereographic-model math, imported on first use (its TorchScript functions warn on import
    under recent torch; the warning is about geoopt, not about the user's run, so it is not shown)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=FutureWarning)
            from geoopt.manifolds.stereographic import math as geo
    except ImportError as err:  # pragma: no cover - geoopt is a dependency; the message says what to install
        raise ImportError("HALO needs geoopt for the Poincare-ball operations: pip install geoopt") from err
    return geo


def _k(c: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(-c, dtype=like.dtype, device=like.device)


def expmap0(u: torch.Tensor, c: float = 1.0, dim: int = 1) -> torch.Tensor:
    """Exponential map at the origin onto the ball, projected strictly inside it:
    ``tanh(sqrt(c) |u|) u / (sqrt(c) |u|)``."""
    geo = _manifold()
    k = _k(c, u)
    return geo.project(geo.expmap0(u, k=k, dim=dim), k=k, dim=dim)


def dist0(x: torch.Tensor, c: float = 1.0, dim: int = 1) -> torch.Tensor:
    """Hyperbolic radius, the geodesic distance to the origin: ``2 artanh(sqrt(c) |x|) / sqrt(c)``."""
    return _manifold().dist0(x, k=_k(c, x), dim=dim)


def hyperbolic_mlr(x: torch.Tensor, offsets: torch.Tensor, normals: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """Hyperbolic multinomial logistic regression (Ganea, Becigneul, Hofmann, NeurIPS 2018, eq. 25).

    Class k has a hyperplane through the ball point ``p_k`` with normal ``a_k``, the tangent vector ``a~_k``
    at the origin moved to ``p_k`` by parallel transport, so that ``lambda_{p_k} |a_k| = 2 |a~_k|``::

        logit_k(x) = 2 |a~_k| / sqrt(c) * asinh(2 sqrt(c) <m, a~_k> / ((1 - c |m|^2) |a~_k|)),
        m = (-p_k) (+)_c x   (Mobius addition),

    i.e. ``2 |a~_k|`` times the signed geodesic distance of x to the hyperplane. ``(-p) (+) x = alpha (-p) +
    beta x`` with scalar alpha, beta, so every term is computed from the inner products <p_k, x> and
    <a~_k, x>, without a (B, K, D, *spatial) tensor (as HALO's official ``HyperMLR``).

    Args:
        x: (B, D, *spatial) points on the ball.
        offsets: (K, D) points p_k on the ball.
        normals: (K, D) tangent vectors a~_k at the origin.
        c: curvature magnitude.

    Returns:
        (B, K, *spatial) logits.
    """
    sqrt_c = math.sqrt(c)
    xx = x.pow(2).sum(dim=1, keepdim=True)  # (B, 1, *sp)
    pp = offsets.pow(2).sum(dim=1).view(1, -1, *([1] * (x.dim() - 2)))  # (1, K, 1..)
    px = torch.einsum("bd...,kd->bk...", x, offsets)  # <p_k, x>
    a_norm = normals.norm(dim=1).clamp_min(1e-15)
    a_unit = normals / a_norm.unsqueeze(1)
    ax = torch.einsum("bd...,kd->bk...", x, a_unit)  # <a^_k, x>
    pa = (offsets * a_unit).sum(dim=1).view(1, -1, *([1] * (x.dim() - 2)))  # <p_k, a^_k>
    # Mobius addition of u = -p and x: ((1 + 2c<u,x> + c|x|^2) u + (1 - c|u|^2) x) / (1 + 2c<u,x> + c^2|u|^2|x|^2)
    den = (1 - 2 * c * px + c * c * pp * xx).clamp_min(1e-15)
    alpha = (1 - 2 * c * px + c * xx) / den  # coefficient of -p
    beta = (1 - c * pp) / den  # coefficient of x
    m_a = -alpha * pa + beta * ax  # <m, a^>
    m_norm2 = alpha.pow(2) * pp - 2 * alpha * beta * px + beta.pow(2) * xx
    conformal = (1 - c * m_norm2).clamp_min(1e-15)
    scale = (2 * a_norm / sqrt_c).view(1, -1, *([1] * (x.dim() - 2)))
    return scale * torch.asinh(2 * sqrt_c * m_a / conformal)


class HyperbolicMLR(nn.Module):
    """:func:`hyperbolic_mlr` with learnt hyperplanes; offsets are ``expmap0`` of a Euclidean parameter, so
    they stay on the ball (HALO's official code keeps them Euclidean)."""

    def __init__(self, channels: int, num_classes: int, c: float = 1.0) -> None:
        super().__init__()
        self.c = c
        self.offset_tangent = nn.Parameter(torch.empty(num_classes, channels))
        self.normal = nn.Parameter(torch.empty(num_classes, channels))
        nn.init.kaiming_uniform_(self.offset_tangent, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.normal, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = expmap0(self.offset_tangent.to(x.dtype), self.c, dim=1)
        return hyperbolic_mlr(x, offsets, self.normal.to(x.dtype), self.c)


def feature_reweighting(features: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """HALO's hyperbolic feature reweighting (HFR, official ``wn_mlp``): every channel map is L2-normalised
    over the image's pixels, then scaled by a per-image weight, the mean over pixels of an MLP of the pixel
    features (clamped at 1e-5). (B, D, *spatial) -> (B, D, *spatial)."""
    b, d = features.shape[:2]
    vectors = features.movedim(1, -1).reshape(-1, d)
    weights = mlp(vectors).view(b, -1, d).mean(dim=1).clamp_min(1e-5)  # (B, D)
    unit = F.normalize(features.reshape(b, d, -1), dim=-1).view_as(features)
    return unit * weights.view(b, d, *([1] * (features.dim() - 2)))


class HyperbolicHead(nn.Module):
    """HALO's hyperbolic projection head: 1x1 channel reduction -> HFR -> expmap0 -> hyperbolic MLR.

    Args:
        in_channels: C of the decoder features.
        num_classes: K (rows of the model's classifier).
        channels: D of the embeddings (HALO's ``REDUCED_CHANNELS`` 64).
        c: curvature magnitude (``CURVATURE`` 1).
        hfr: use the feature reweighting (``HFR`` True).
    """

    def __init__(self, in_channels: int, num_classes: int, channels: int = 64, c: float = 1.0, hfr: bool = True):
        super().__init__()
        self.c = c
        self.reduce = nn.Linear(in_channels, channels)
        self.hfr = (
            nn.Sequential(
                nn.Linear(channels, channels), nn.BatchNorm1d(channels), nn.ReLU(), nn.Linear(channels, channels)
            )
            if hfr
            else None
        )
        self.mlr = HyperbolicMLR(channels, num_classes, c)

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        """(B, C, *spatial) decoder features -> (B, D, *spatial) float64 points on the ball."""
        reduced = self.reduce(features.movedim(1, -1).float()).movedim(-1, 1)
        if self.hfr is not None:
            reduced = feature_reweighting(reduced, self.hfr)
        with torch.autocast(features.device.type, enabled=False):  # the ball's maps in float64, as HALO's code
            return expmap0(reduced.double(), self.c, dim=1)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, K, *spatial) float32 and the ball embeddings (B, D, *spatial) float64."""
        z = self.embed(features)
        with torch.autocast(features.device.type, enabled=False):  # 1 - c|m|^2 would not survive bf16
            return self.mlr(z).float(), z
