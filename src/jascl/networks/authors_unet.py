"""The 3D U-Net configuration of the JASCL authors' medical experiments.

MONAI's ``DynUNet`` cannot express it: DynUNet upsamples with transposed
convolutions (extra parameters), pads "same" for a kernel/stride pair and
rejects an even kernel on a strided level, whereas this network upsamples by
trilinear interpolation to the skip connection's size and pads ``k // 2``. So
it is written here with plain torch layers, 2D and 3D sharing one code path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from jascl.errors import ConfigError
from jascl.networks.base import BACKBONES, Backbone, resize

#: (D, H, W) kernel per level and down-scale between levels (first axis = slice direction).
AUTHORS_KERNELS_3D = ((1, 3, 3), (2, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
AUTHORS_SCALES_3D = ((1, 2, 2), (2, 2, 2), (2, 2, 2), (2, 2, 2))


def _conv(spatial_dims: int) -> type[nn.Module]:
    return nn.Conv3d if spatial_dims == 3 else nn.Conv2d


def _norm(kind: str, spatial_dims: int, channels: int) -> nn.Module:
    if kind == "batch":
        return (nn.BatchNorm3d if spatial_dims == 3 else nn.BatchNorm2d)(channels, eps=1e-4)
    if kind == "instance":
        return (nn.InstanceNorm3d if spatial_dims == 3 else nn.InstanceNorm2d)(channels, eps=1e-4, affine=True)
    raise ConfigError(f"norm={kind!r}: use 'batch' (the authors') or 'instance'")


class ConvNormAct(nn.Sequential):
    """conv (no bias, padding k // 2) -> norm -> ReLU."""

    def __init__(self, spatial_dims: int, in_ch: int, out_ch: int, kernel: Sequence[int], norm: str) -> None:
        super().__init__()
        self.conv = _conv(spatial_dims)(in_ch, out_ch, tuple(kernel), padding=tuple(k // 2 for k in kernel), bias=False)
        self.norm = _norm(norm, spatial_dims, out_ch)
        self.act = nn.ReLU(inplace=True)


class AuthorsUNet(Backbone):
    """The authors' U-Net (``networks/custom/unet.py`` with ``block='SingleConv'``).

    Levels l = 0..4 with channels ``base * (1, 2, 4, 8, 10)`` (32/64/128/256/320):

    * level 0: a plain conv (no norm) then one conv-norm-ReLU, kernel ``kernels[0]``;
    * levels 1-4: max-pool by ``scales[l-1]`` then two conv-norm-ReLU, kernel ``kernels[l]``;
    * decoder levels 3..0: upsample the deeper map (trilinear/bilinear, align_corners=True)
      to the skip's size, concatenate [skip, up], two conv-norm-ReLU with ``kernels[l]``.

    Features = the last decoder level (``base`` channels, input resolution). Convs
    have no bias; BatchNorm uses eps 1e-4, as in the authors' code. An even kernel
    (the (2, 3, 3) of level 1) with padding ``k // 2`` lengthens that axis by one
    voxel per conv; the interpolation to the skip's size absorbs it, exactly as in
    the authors' network (their class also holds an unused ``sigma`` conv and a
    ``grad_update`` buffer-as-parameter in the classifier, which are not part of the
    backbone here).

    Args:
        spatial_dims: 3 (the authors') or 2; in 2D the in-plane parts of the default
            kernels and scales are used.
        in_channels: input channels (the authors: 1).
        base_channels: channels of level 0 (the authors: 32).
        kernels: five per-level kernels (default: the authors' 3D kernels).
        scales: four down-scales between levels (default: the authors').
        norm: "batch" (the authors') or "instance".
    """

    decoder_prefix = ("up.",)

    layer_aliases = {"encoder": "down.4.2.conv", "decoder": "up.1.1.conv"}

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        base_channels: int = 32,
        kernels: Sequence[Sequence[int]] | None = None,
        scales: Sequence[Sequence[int]] | None = None,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        if spatial_dims not in (2, 3):
            raise ConfigError(f"spatial_dims={spatial_dims}: unet3d-authors supports 2 or 3")
        kernels = [list(k) for k in (kernels or [k[3 - spatial_dims :] for k in AUTHORS_KERNELS_3D])]
        scales = [list(s) for s in (scales or [s[3 - spatial_dims :] for s in AUTHORS_SCALES_3D])]
        if len(kernels) != 5 or len(scales) != 4 or any(len(k) != spatial_dims for k in kernels + scales):
            raise ConfigError(
                f"unet3d-authors needs 5 kernels and 4 scales of length {spatial_dims}, "
                f"got kernels={kernels}, scales={scales}"
            )
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.feature_channels = base_channels
        self.scales = scales
        ch = [base_channels * m for m in (1, 2, 4, 8, 10)]
        pool = nn.MaxPool3d if spatial_dims == 3 else nn.MaxPool2d
        stem = _conv(spatial_dims)(
            in_channels, ch[0], tuple(kernels[0]), padding=tuple(k // 2 for k in kernels[0]), bias=False
        )
        self.down = nn.ModuleList([nn.Sequential(stem, ConvNormAct(spatial_dims, ch[0], ch[0], kernels[0], norm))])
        for lvl in range(1, 5):
            self.down.append(
                nn.Sequential(
                    pool(tuple(scales[lvl - 1])),
                    ConvNormAct(spatial_dims, ch[lvl - 1], ch[lvl], kernels[lvl], norm),
                    ConvNormAct(spatial_dims, ch[lvl], ch[lvl], kernels[lvl], norm),
                )
            )
        # up[i] produces decoder level 3 - i from level 4 - i and the skip of level 3 - i
        self.up = nn.ModuleList()
        for lvl in range(3, -1, -1):
            self.up.append(
                nn.Sequential(
                    ConvNormAct(spatial_dims, ch[lvl + 1] + ch[lvl], ch[lvl], kernels[lvl], norm),
                    ConvNormAct(spatial_dims, ch[lvl], ch[lvl], kernels[lvl], norm),
                )
            )

    def _bottom(self) -> list[int]:
        """Per axis, the product of the four pooling factors (one voxel at the bottom level)."""
        return [int(torch.tensor([s[i] for s in self.scales]).prod()) for i in range(self.spatial_dims)]

    def smallest_patch(self, size: Sequence[int]) -> tuple[int, ...]:
        return tuple(max(int(s), 2 * n) for s, n in zip(size, self._bottom()))

    def input_size(self, size: Sequence[int]) -> tuple[int, ...]:
        # whole samples run in eval mode (BatchNorm's running statistics): one voxel at the bottom suffices
        return tuple(max(int(s), n) for s, n in zip(size, self._bottom()))

    def check_input_size(self, size: tuple[int, ...], what: str) -> None:
        # interpolation to the skip sizes accepts any size; the bottom level needs >= 2 voxels per axis
        need = list(self.smallest_patch([1] * self.spatial_dims))
        if any(s < n for s, n in zip(size, need)):
            raise ConfigError(
                f"{what}={list(size)}: unet3d-authors needs at least {need} "
                f"(four poolings by {self.scales}); set patch_size accordingly (the smallest that works here: "
                f"{list(self.smallest_patch(size))})"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        out = skips.pop()
        for block in self.up:
            skip = skips.pop()
            out = resize(out, skip.shape[2:], align_corners=True)
            out = block(torch.cat([skip, out], dim=1))
        return out


@BACKBONES.register(
    "unet3d-authors", doc="the authors' 3D U-Net (32-320 ch, BatchNorm, anisotropic first levels); 16.27 M"
)
def unet3d_authors(spatial_dims: int = 3, in_channels: int = 1, **kwargs) -> Backbone:
    return AuthorsUNet(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)
