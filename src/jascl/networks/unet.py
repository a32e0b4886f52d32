"""MONAI U-Net backbones (2D and 3D share one code path through ``spatial_dims``)."""

from __future__ import annotations

from typing import Sequence

import torch
from monai.networks.nets import BasicUNet
from torch import nn

from jascl.networks.base import BACKBONES, Backbone


class MonaiUNet(Backbone):
    """MONAI's ``BasicUNet`` with its final 1x1 convolution removed.

    The output of the last up-sampling block (conv + norm + activation, at
    input resolution, ``features[5]`` channels) is the feature map before the
    classifier, so prototypes and PAS see the same features the classifier does.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        features: six channel counts (encoder levels 0-4, last decoder level).
        norm: MONAI norm spec (instance norm has no running statistics, so a
            frozen backbone behaves the same in train and eval mode).
        dropout: dropout probability inside the blocks.
    """

    layer_aliases = {"encoder": "net.down_4.convs.conv_1.conv", "decoder": "net.upcat_1.convs.conv_0.conv"}
    size_divisor = 16  # four 2x poolings; instance norm needs more than one voxel at the bottom

    def __init__(self, spatial_dims: int = 2, in_channels: int = 1, features: Sequence[int] = (16, 16, 32, 64, 128, 16),
                 norm: str | tuple = ("instance", {"affine": True}), dropout: float = 0.0) -> None:
        super().__init__()
        if len(features) != 6:
            raise ValueError(f"features must have 6 entries, got {features!r}")
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.feature_channels = int(features[5])
        self.net = BasicUNet(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=1,
                             features=tuple(features), norm=norm, dropout=dropout)
        self.net.final_conv = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@BACKBONES.register("unet", doc="MONAI BasicUNet (2D/3D), features at input resolution")
def unet(spatial_dims: int = 2, in_channels: int = 1, **kwargs) -> Backbone:
    return MonaiUNet(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)
