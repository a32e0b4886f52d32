"""MedFormer (Gao et al. 2022, "A data-scalable transformer for medical image segmentation"), compact version.

No maintained package provides MedFormer (there is none on PyPI), so this is
written from the paper's description, 2D and 3D through ``spatial_dims``.

Architecture (paper section 3):
    * a convolutional stem and four down stages (max-pool x2, ``conv_num``
      residual BasicBlocks, ``trans_num`` B-MHA transformer blocks), then four
      up stages (upsample to the skip's size, concatenate, BasicBlocks,
      B-MHA blocks);
    * **B-MHA** (bidirectional multi-head attention): the feature map X (N
      positions) is summarised by a small *semantic map* S of ``map_size^d``
      tokens; S attends to X (the map gathers global context), then X attends
      to the updated S (each position reads it back), so attention costs
      O(N * map tokens) instead of O(N^2). Q/K/V of the feature map come from
      depthwise-separable convolutions ("depthwise projection"), those of the
      map from linear layers; both streams have a feed-forward block of
      width ``expansion * C``;
    * **semantic map fusion**: the maps of all down stages that have
      transformer blocks are projected to ``fusion_dim``, concatenated and
      mixed by ``fusion_depth`` transformer layers (``fusion_heads`` heads),
      projected back and added to each stage's map; an up stage's B-MHA
      blocks use the fused map of its skip level.

Simplifications (stated so that results are not mistaken for the reference
implementation's):
    * no relative position bias in B-MHA and no positional encoding of the
      feature map (the depthwise convolutions give local position); the
      fusion transformer uses a learned embedding per map token;
    * the initial semantic map of a stage is an adaptive average pool of a
      depthwise conv of its features (a learned-kernel pooling);
    * down-sampling is max-pooling by 2 on every axis (no anisotropic first
      stage); up-sampling is interpolation to the skip's size;
    * pre-norm: instance norm (``norm``) on the feature stream, LayerNorm on
      map tokens; one activation (``act``, ReLU by default) throughout;
    * no deep supervision / auxiliary heads.

Features = the last up stage's output (``channels[-1]`` channels, input resolution).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from jascl.errors import ConfigError
from jascl.networks.base import BACKBONES, Backbone, resize


def _conv(dims: int):
    return nn.Conv3d if dims == 3 else nn.Conv2d


def _norm(dims: int, channels: int, kind: str) -> nn.Module:
    if kind == "instance":
        return (nn.InstanceNorm3d if dims == 3 else nn.InstanceNorm2d)(channels, affine=True)
    if kind == "batch":
        return (nn.BatchNorm3d if dims == 3 else nn.BatchNorm2d)(channels)
    raise ConfigError(f"norm={kind!r}: use 'instance' (the authors') or 'batch'")


def _act(kind: str) -> nn.Module:
    acts = {"relu": nn.ReLU, "gelu": nn.GELU, "lrelu": nn.LeakyReLU}
    if kind not in acts:
        raise ConfigError(f"act={kind!r}: use one of {', '.join(acts)}")
    return acts[kind]()


class BasicBlock(nn.Module):
    """Residual block: (norm, act, conv3) x 2 (pre-activation) + 1x1 shortcut when channels change."""

    def __init__(self, dims: int, in_ch: int, out_ch: int, norm: str, act: str) -> None:
        super().__init__()
        conv = _conv(dims)
        self.body = nn.Sequential(
            _norm(dims, in_ch, norm),
            _act(act),
            conv(in_ch, out_ch, 3, padding=1, bias=False),
            _norm(dims, out_ch, norm),
            _act(act),
            conv(out_ch, out_ch, 3, padding=1, bias=False),
        )
        self.shortcut = nn.Identity() if in_ch == out_ch else conv(in_ch, out_ch, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.shortcut(x)


class DepthwiseProjection(nn.Sequential):
    """Depthwise k=3 conv + pointwise 1x1 conv (MedFormer's "depthwise" Q/K/V projection)."""

    def __init__(self, dims: int, in_ch: int, out_ch: int) -> None:
        conv = _conv(dims)
        super().__init__(conv(in_ch, in_ch, 3, padding=1, groups=in_ch, bias=False), conv(in_ch, out_ch, 1, bias=False))


class BidirectionalBlock(nn.Module):
    """One B-MHA transformer block updating the feature map X and the semantic map S.

    Shapes: x (B, C, *spatial), s (B, M, C) -> same shapes.
    """

    def __init__(self, dims: int, channels: int, heads: int, expansion: int, norm: str, act: str) -> None:
        super().__init__()
        if channels % heads:
            raise ConfigError(f"medformer: {channels} channels are not divisible by {heads} heads")
        conv = _conv(dims)
        self.heads = heads
        self.norm_x = _norm(dims, channels, norm)
        self.norm_s = nn.LayerNorm(channels)
        self.qkv_x = DepthwiseProjection(dims, channels, 3 * channels)
        self.qkv_s = nn.Linear(channels, 3 * channels)
        self.out_x = conv(channels, channels, 1)
        self.out_s = nn.Linear(channels, channels)
        self.mlp_x = nn.Sequential(
            _norm(dims, channels, norm),
            conv(channels, expansion * channels, 1),
            _act(act),
            conv(expansion * channels, channels, 1),
        )
        self.mlp_s = nn.Sequential(
            nn.LayerNorm(channels),
            nn.Linear(channels, expansion * channels),
            _act(act),
            nn.Linear(expansion * channels, channels),
        )

    def _split(self, t: torch.Tensor) -> torch.Tensor:  # (B, L, C) -> (B, heads, L, C / heads)
        b, n, c = t.shape
        return t.view(b, n, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, *spatial = x.shape
        qx, kx, vx = (self._split(t) for t in self.qkv_x(self.norm_x(x)).flatten(2).transpose(1, 2).chunk(3, dim=-1))
        qs, ks, vs = (self._split(t) for t in self.qkv_s(self.norm_s(s)).chunk(3, dim=-1))
        # S attends to X: the map gathers context from every position
        s_upd = F.scaled_dot_product_attention(qs, kx, vx).transpose(1, 2).reshape(b, -1, c)
        s = s + self.out_s(s_upd)
        # X attends to the updated S: every position reads the map back (keys/values from the new map)
        _, ks, vs = (self._split(t) for t in self.qkv_s(self.norm_s(s)).chunk(3, dim=-1))
        x_upd = F.scaled_dot_product_attention(qx, ks, vs).transpose(1, 2).reshape(b, -1, c)
        x = x + self.out_x(x_upd.transpose(1, 2).reshape(b, c, *spatial))
        return x + self.mlp_x(x), s + self.mlp_s(s)


class Stage(nn.Module):
    """Conv blocks then B-MHA blocks at one resolution; returns (features, semantic map or None)."""

    def __init__(
        self,
        dims: int,
        in_ch: int,
        out_ch: int,
        conv_num: int,
        trans_num: int,
        heads: int,
        map_size: int,
        expansion: int,
        norm: str,
        act: str,
        own_map: bool = True,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = [
            BasicBlock(dims, in_ch if i == 0 else out_ch, out_ch, norm, act) for i in range(conv_num)
        ]
        if not conv_num:  # channels still change: a 1x1 projection (norm + act)
            blocks = [nn.Sequential(_conv(dims)(in_ch, out_ch, 1, bias=False), _norm(dims, out_ch, norm), _act(act))]
        self.convs = nn.Sequential(*blocks)
        self.transformer = nn.ModuleList(
            [BidirectionalBlock(dims, out_ch, heads, expansion, norm, act) for _ in range(trans_num)]
        )
        self.map_size = map_size
        # an up stage that receives a fused map from its skip level needs no map of its own
        self.map_init = (
            _conv(dims)(out_ch, out_ch, 3, padding=1, groups=out_ch, bias=False) if trans_num and own_map else None
        )
        self._pool = F.adaptive_avg_pool3d if dims == 3 else F.adaptive_avg_pool2d

    def initial_map(self, x: torch.Tensor) -> torch.Tensor:
        return self._pool(self.map_init(x), self.map_size).flatten(2).transpose(1, 2)

    def forward(self, x: torch.Tensor, semantic_map: torch.Tensor | None = None):
        x = self.convs(x)
        if not len(self.transformer):
            return x, None
        s = self.initial_map(x) if semantic_map is None else semantic_map
        for block in self.transformer:
            x, s = block(x, s)
        return x, s


class SemanticMapFusion(nn.Module):
    """Mixes the semantic maps of several levels with a small transformer (paper: "semantic map fusion")."""

    def __init__(
        self, level_channels: Sequence[int], tokens: int, dim: int, heads: int, depth: int, expansion: int
    ) -> None:
        super().__init__()
        self.inp = nn.ModuleList([nn.Linear(c, dim) for c in level_channels])
        self.out = nn.ModuleList([nn.Linear(dim, c) for c in level_channels])
        self.pos = nn.Parameter(torch.zeros(1, tokens * len(level_channels), dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, expansion * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)

    def forward(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        tokens = torch.cat([proj(m) for proj, m in zip(self.inp, maps)], dim=1) + self.pos
        mixed = self.encoder(tokens).split([m.shape[1] for m in maps], dim=1)
        return [m + proj(t) for m, proj, t in zip(maps, self.out, mixed)]


class MedFormer(Backbone):
    """Compact MedFormer backbone (see the module docstring for what is simplified).

    Index i of the eight-entry lists: 0-3 = down stages (1/2 ... 1/16 resolution),
    4-7 = up stages (1/8 ... 1/1). The stem has ``channels[7]`` channels.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        channels: per-stage channels (authors: 64,128,256,320,256,128,64,32).
        conv_num: BasicBlocks per stage (authors: 2,1,0,0,0,1,2,2).
        trans_num: B-MHA blocks per stage (authors: 0,1,4,6,4,1,0,0).
        num_heads: attention heads per stage (authors: 1,4,8,10,8,4,1,1).
        map_size: semantic-map tokens per axis (authors: 4, i.e. 4x4x4).
        fusion_depth, fusion_dim, fusion_heads: semantic map fusion (authors: 2, 320, 10).
        expansion: feed-forward expansion (authors: 4).
        norm: "instance" (authors) or "batch".
        act: "relu" (authors), "gelu" or "lrelu".
    """

    decoder_prefix = ("up.", "map_proj.")

    size_divisor = 16  # four 2x poolings; the bottom keeps >= 2 voxels for instance norm

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        channels: Sequence[int] = (64, 128, 256, 320, 256, 128, 64, 32),
        conv_num: Sequence[int] = (2, 1, 0, 0, 0, 1, 2, 2),
        trans_num: Sequence[int] = (0, 1, 4, 6, 4, 1, 0, 0),
        num_heads: Sequence[int] = (1, 4, 8, 10, 8, 4, 1, 1),
        map_size: int = 4,
        fusion_depth: int = 2,
        fusion_dim: int = 320,
        fusion_heads: int = 10,
        expansion: int = 4,
        norm: str = "instance",
        act: str = "relu",
    ) -> None:
        super().__init__()
        if spatial_dims not in (2, 3):
            raise ConfigError(f"spatial_dims={spatial_dims}: medformer supports 2 or 3")
        if not all(len(v) == 8 for v in (channels, conv_num, trans_num, num_heads)):
            raise ConfigError("medformer: channels, conv_num, trans_num and num_heads need 8 entries each")
        d = spatial_dims
        self.spatial_dims = d
        self.in_channels = in_channels
        self.feature_channels = int(channels[7])
        stem_ch = channels[7]
        self.stem = nn.Sequential(
            _conv(d)(in_channels, stem_ch, 3, padding=1, bias=False), BasicBlock(d, stem_ch, stem_ch, norm, act)
        )
        self.pool = (nn.MaxPool3d if d == 3 else nn.MaxPool2d)(2)
        args = dict(map_size=map_size, expansion=expansion, norm=norm, act=act)
        ins = [stem_ch, *channels[:3]]
        self.down = nn.ModuleList(
            [Stage(d, ins[i], channels[i], conv_num[i], trans_num[i], num_heads[i], **args) for i in range(4)]
        )
        skips = [channels[2], channels[1], channels[0], stem_ch]  # skip of up stage j
        has_map = [0 <= 2 - j and bool(trans_num[2 - j]) for j in range(4)]  # skip level of up stage j has a map
        self.up = nn.ModuleList(
            [
                Stage(
                    d,
                    channels[3 + j] + skips[j],
                    channels[4 + j],
                    conv_num[4 + j],
                    trans_num[4 + j],
                    num_heads[4 + j],
                    own_map=not has_map[j],
                    **args,
                )
                for j in range(4)
            ]
        )
        self.fused_levels = [i for i in range(4) if trans_num[i]]
        self.fusion = None
        if self.fused_levels and fusion_depth:
            self.fusion = SemanticMapFusion(
                [channels[i] for i in self.fused_levels], map_size**d, fusion_dim, fusion_heads, fusion_depth, expansion
            )
        # an up stage with B-MHA reads the (fused) map of its skip level, projected if the channels differ
        self.map_proj = nn.ModuleDict()
        for j in range(4):
            if trans_num[4 + j] and has_map[j] and channels[2 - j] != channels[4 + j]:
                self.map_proj[str(j)] = nn.Linear(channels[2 - j], channels[4 + j])
        self.layer_aliases = {"encoder": _last_weighted(self, "down.3"), "decoder": _last_weighted(self, "up.1")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips, maps = [x], {}
        for i, stage in enumerate(self.down):
            x, s = stage(self.pool(x))
            skips.append(x)
            if s is not None:
                maps[i] = s
        if self.fusion is not None:
            maps = dict(zip(self.fused_levels, self.fusion([maps[i] for i in self.fused_levels])))
        out = skips.pop()
        for j, stage in enumerate(self.up):
            skip = skips.pop()
            out = resize(out, skip.shape[2:])
            s = maps.get(2 - j)
            if s is not None and str(j) in self.map_proj:
                s = self.map_proj[str(j)](s)
            out, _ = stage(torch.cat([skip, out], dim=1), s if len(stage.transformer) else None)
        return out


def _last_weighted(module: nn.Module, prefix: str) -> str:
    """A representative layer of a stage for the GAS layer-choice aliases.

    The last B-MHA block's feature-MLP output conv if the stage has B-MHA
    blocks, else its last convolution.
    """
    stage = module.get_submodule(prefix)
    if len(stage.transformer):
        return f"{prefix}.transformer.{len(stage.transformer) - 1}.mlp_x.3"
    names = [n for n, m in stage.convs.named_modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    return f"{prefix}.convs.{names[-1]}"


@BACKBONES.register("medformer", doc="MedFormer (compact re-implementation, 2D/3D), B-MHA + semantic map fusion")
def medformer(spatial_dims: int = 3, in_channels: int = 1, **kwargs) -> Backbone:
    return MedFormer(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)
