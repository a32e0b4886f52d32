"""MedFormer's building blocks (:mod:`jascl.networks.medformer` assembles them into stages and the model).

The layers of the architecture section of :mod:`jascl.networks.medformer`, 2D and 3D through ``dims``:

* convolution blocks: pre-activation convolutions (:class:`PreActConv`), residual blocks (:class:`ResBlock`),
  patch merging (:func:`space_to_depth` then a projection, :class:`PatchMerging`), the inverted-residual
  feed-forward with squeeze-and-excitation (:class:`InvertedResidual`, :class:`SqueezeExcite`);
* attention: :func:`bidirectional_attention` and the B-MHA block (:class:`BMHABlock`), O(N M) between N feature
  positions and M semantic-map tokens;
* semantic maps: their generation (:class:`SemanticMapGeneration`, a learned soft pooling) and fusion across
  stages (:class:`SemanticMapFusion`, pre-norm transformer layers :class:`FusionLayer`).

Tensors are (B, C, *spatial) feature maps and (B, C, M) map tokens unless a docstring says otherwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from jascl.errors import ConfigError


def conv_class(dims: int) -> type[nn.Conv2d] | type[nn.Conv3d]:
    """``nn.Conv3d`` or ``nn.Conv2d`` for ``dims`` spatial dimensions."""
    return nn.Conv3d if dims == 3 else nn.Conv2d


def _norm(dims: int, channels: int, kind: str, eps: float = 1e-5) -> nn.Module:
    if kind == "instance":  # the authors' nn.InstanceNorm3d(C): no affine parameters, no running statistics
        return (nn.InstanceNorm3d if dims == 3 else nn.InstanceNorm2d)(channels, eps=eps)
    if kind == "batch":
        return (nn.BatchNorm3d if dims == 3 else nn.BatchNorm2d)(channels, eps=eps)
    raise ConfigError(f"norm={kind!r}: use 'instance' (the authors') or 'batch'")


def _act(kind: str) -> nn.Module:
    acts = {"relu": nn.ReLU, "gelu": nn.GELU, "lrelu": nn.LeakyReLU, "swish": nn.SiLU}
    if kind not in acts:
        raise ConfigError(f"act={kind!r}: use one of {', '.join(acts)}")
    return acts[kind]()


class PreActConv(nn.Module):
    """norm -> activation (optional) -> convolution without bias (the authors' pre-activation unit, norm eps 1e-4)."""

    def __init__(
        self, dims: int, in_ch: int, out_ch: int, kernel: int, norm: str, act: str | None, groups: int = 1
    ) -> None:
        super().__init__()
        self.norm = _norm(dims, in_ch, norm, eps=1e-4)
        self.act = _act(act) if act else nn.Identity()
        self.conv = conv_class(dims)(in_ch, out_ch, kernel, padding=kernel // 2, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.act(self.norm(x)))


class ResBlock(nn.Module):
    """Two pre-activation k x k convolutions + shortcut (the authors' BasicBlock).

    The shortcut is the identity, or a pre-activation k x k convolution when
    the channels change (not a 1x1 projection).
    """

    def __init__(self, dims: int, in_ch: int, out_ch: int, kernel: int, norm: str, act: str) -> None:
        super().__init__()
        self.shortcut = nn.Identity() if in_ch == out_ch else PreActConv(dims, in_ch, out_ch, kernel, norm, act)
        self.conv1 = PreActConv(dims, in_ch, out_ch, kernel, norm, act)
        self.conv2 = PreActConv(dims, out_ch, out_ch, kernel, norm, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.conv1(x)) + self.shortcut(x)


def _projection(dims: int, in_ch: int, out_ch: int, kernel: int, proj_type: str) -> nn.Module:
    """A bias-free projection: depthwise k x k + pointwise 1x1 ("depthwise"), or a 1x1 convolution ("linear")."""
    conv = conv_class(dims)
    if proj_type == "linear":
        return conv(in_ch, out_ch, 1, bias=False)
    return nn.Sequential(
        conv(in_ch, in_ch, kernel, padding=kernel // 2, groups=in_ch, bias=False), conv(in_ch, out_ch, 1, bias=False)
    )


def space_to_depth(x: torch.Tensor) -> torch.Tensor:
    """(B, C, *S) -> (B, 2^d C, *S/2): the 2^d sub-grids of a stride-2 sampling stacked on channels.

    Sub-grid order: offsets (0, .., 0), (0, .., 1), ... with the last axis
    fastest, as the authors' patch merging stacks them. Sizes must be even.
    """
    dims = x.dim() - 2
    grids = []
    for offsets in itertools.product(range(2), repeat=dims):
        index: tuple[Any, ...] = (Ellipsis, *(slice(o, None, 2) for o in offsets))
        grids.append(x[index])
    return torch.cat(grids, dim=1)


class PatchMerging(nn.Module):
    """Down-sampling by 2 on every axis: :func:`space_to_depth`, norm, projection to ``out_ch``."""

    def __init__(self, dims: int, in_ch: int, out_ch: int, kernel: int, proj_type: str, norm: str) -> None:
        super().__init__()
        self.norm = _norm(dims, 2**dims * in_ch, norm)
        self.proj = _projection(dims, 2**dims * in_ch, out_ch, kernel, proj_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(space_to_depth(x)))


class SqueezeExcite(nn.Module):
    """Channel gating: global mean -> 1x1 (C -> C/ratio, bias) -> ReLU -> 1x1 (back, bias) -> sigmoid."""

    def __init__(self, dims: int, channels: int, ratio: int = 4) -> None:
        super().__init__()
        conv = conv_class(dims)
        self.reduce = conv(channels, channels // ratio, 1)
        self.expand = conv(channels // ratio, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean(dim=tuple(range(2, x.dim())), keepdim=True)
        return x * torch.sigmoid(self.expand(torch.relu(self.reduce(s))))


class InvertedResidual(nn.Module):
    """B-MHA's feed-forward block: 1x1 expansion, depthwise k x k, squeeze-excitation, 1x1 projection, + input.

    ``proj_type="linear"`` has no depthwise step (the authors' FusedMBConv with
    a 1x1 kernel). Channels in = channels out, so the residual is the identity.
    """

    def __init__(
        self, dims: int, channels: int, expansion: int, kernel: int, proj_type: str, norm: str, act: str
    ) -> None:
        super().__init__()
        hidden = expansion * channels
        depthwise = proj_type == "depthwise"
        self.expand: nn.Module = (
            nn.Identity() if depthwise and expansion == 1 else PreActConv(dims, channels, hidden, 1, norm, act)
        )
        self.spatial: nn.Module = (
            PreActConv(dims, hidden, hidden, kernel, norm, act, groups=hidden) if depthwise else nn.Identity()
        )
        self.se = SqueezeExcite(dims, hidden)
        self.project = PreActConv(dims, hidden, channels, 1, norm, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.spatial(self.expand(x))))


def bidirectional_attention(
    q_feat: torch.Tensor, q_map: torch.Tensor, v_feat: torch.Tensor, v_map: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """B-MHA's two attentions from one similarity matrix (MedFormer paper, section 3.2).

    With A = scale * q_feat q_map^T (B, heads, N, M):
    feature output = softmax_M(A) v_map, every position reading the map;
    map output = softmax_N(A)^T v_feat, every map token gathering the features.

    Args:
        q_feat, v_feat: (B, heads, N, dim_head), N feature-map positions.
        q_map, v_map: (B, heads, M, dim_head), M semantic-map tokens.
        scale: logit scale (dim_head ** -0.5).

    Returns:
        (feature output (B, heads, N, dim_head), map output (B, heads, M, dim_head)).
    """
    sim = scale * q_feat @ q_map.transpose(-1, -2)
    feat_out = sim.softmax(dim=-1) @ v_map
    map_out = sim.softmax(dim=-2).transpose(-1, -2) @ v_feat
    return feat_out, map_out


class BMHABlock(nn.Module):
    """One B-MHA transformer block, updating the feature map x and the semantic map.

    Shapes: x (B, in_ch, *S) -> (B, out_ch, *S); map (B, map_ch, *map_size) -> same.
    The feature stream: x' = out_x(attention) + shortcut(x), then the
    inverted-residual feed-forward block; the map stream: map + out_map(attention).
    ``map_out=False``: nothing reads this block's map, so it is not updated
    (and has no ``out_map``).
    """

    def __init__(
        self,
        dims: int,
        in_ch: int,
        map_ch: int,
        out_ch: int,
        heads: int,
        expansion: int,
        kernel: int,
        proj_type: str,
        norm: str,
        act: str,
        map_out: bool = True,
    ) -> None:
        super().__init__()
        if out_ch % heads:
            raise ConfigError(f"medformer: {out_ch} channels are not divisible by {heads} heads")
        conv = conv_class(dims)
        self.heads = heads
        self.scale = (out_ch // heads) ** -0.5
        self.norm_x = _norm(dims, in_ch, norm)
        self.norm_map = _norm(dims, map_ch, norm)
        self.qv_x = _projection(dims, in_ch, 2 * out_ch, kernel, proj_type)
        self.qv_map = conv(map_ch, 2 * out_ch, 1, bias=False)
        self.out_x = _projection(dims, out_ch, out_ch, kernel, proj_type)
        self.out_map = conv(out_ch, map_ch, 1, bias=False) if map_out else None
        self.shortcut = nn.Identity() if in_ch == out_ch else PreActConv(dims, in_ch, out_ch, 1, norm, act)
        self.ffn = InvertedResidual(dims, out_ch, expansion, kernel, proj_type, norm, act)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # (B, C, *S) -> (B, heads, prod(S), C / heads)
        b, c = t.shape[:2]
        return t.reshape(b, self.heads, c // self.heads, -1).transpose(-1, -2)

    def forward(self, x: torch.Tensor, semantic_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, *spatial = x.shape
        q_x, v_x = (self._heads(t) for t in self.qv_x(self.norm_x(x)).chunk(2, dim=1))
        q_m, v_m = (self._heads(t) for t in self.qv_map(self.norm_map(semantic_map)).chunk(2, dim=1))
        feat, mapped = bidirectional_attention(q_x, q_m, v_x, v_m, self.scale)
        feat = feat.transpose(-1, -2).reshape(b, -1, *spatial)
        out = self.ffn(self.out_x(feat) + self.shortcut(x))
        if self.out_map is None:
            return out, semantic_map
        mapped = mapped.transpose(-1, -2).reshape(semantic_map.shape[0], -1, *semantic_map.shape[2:])
        return out, semantic_map + self.out_map(mapped)


class SemanticMapGeneration(nn.Module):
    """A (B, C, *map_size) semantic map from (B, C_in, *S) features: softmax-weighted sums of 3x3-conv features.

    One 3x3 convolution gives the map's features (``map_ch`` channels), a
    second one prod(map_size) weight maps, each normalised by a softmax over
    the positions; token m = sum over positions of weight_m * features.
    """

    def __init__(self, dims: int, in_ch: int, map_ch: int, map_size: Sequence[int]) -> None:
        super().__init__()
        conv = conv_class(dims)
        self.map_size = tuple(map_size)
        tokens = 1
        for s in self.map_size:
            tokens *= s
        self.features = conv(in_ch, map_ch, 3, padding=1, bias=False)
        self.weights = conv(in_ch, tokens, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.features(x).flatten(2)  # (B, C, N)
        weights = self.weights(x).flatten(2).softmax(dim=-1)  # (B, M, N)
        return (feats @ weights.transpose(1, 2)).reshape(x.shape[0], -1, *self.map_size)


class FusionLayer(nn.Module):
    """Pre-norm transformer layer on (B, L, dim) tokens: MHSA (q/k/v without bias) and an MLP dim -> dim -> dim."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"medformer: fusion_dim={dim} is not divisible by fusion_heads={heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class SemanticMapFusion(nn.Module):
    """Mixes the semantic maps of several levels (MedFormer paper: "semantic map fusion").

    Each map (B, C_i, *map_size) is projected (1x1, no bias) to ``dim``; the
    tokens of all levels go through ``depth`` :class:`FusionLayer` and are
    projected back (1x1, no bias) to C_i; the results replace the maps.
    """

    def __init__(self, dims: int, level_channels: Sequence[int], dim: int, heads: int, depth: int) -> None:
        super().__init__()
        conv = conv_class(dims)
        self.inp = nn.ModuleList([conv(c, dim, 1, bias=False) for c in level_channels])
        self.layers = nn.ModuleList([FusionLayer(dim, heads) for _ in range(depth)])
        self.out = nn.ModuleList([conv(dim, c, 1, bias=False) for c in level_channels])

    def forward(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        tokens = torch.cat([proj(m).flatten(2).transpose(1, 2) for proj, m in zip(self.inp, maps)], dim=1)
        for layer in self.layers:
            tokens = layer(tokens)
        parts = tokens.split([m[0, 0].numel() for m in maps], dim=1)
        return [
            proj(t.transpose(1, 2).reshape(m.shape[0], -1, *m.shape[2:])) for proj, t, m in zip(self.out, parts, maps)
        ]
