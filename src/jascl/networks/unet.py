"""MONAI U-Net backbones (2D and 3D share one code path through ``spatial_dims``)."""

from __future__ import annotations

from collections.abc import Sequence

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

    decoder_prefix = ("net.upcat_",)

    layer_aliases = {"encoder": "net.down_4.convs.conv_1.conv", "decoder": "net.upcat_1.convs.conv_0.conv"}
    size_divisor = 16  # four 2x poolings; instance norm needs more than one voxel at the bottom

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        features: Sequence[int] = (16, 16, 32, 64, 128, 16),
        norm: str | tuple = ("instance", {"affine": True}),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if len(features) != 6:
            raise ValueError(f"features must have 6 entries, got {features!r}")
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.feature_channels = int(features[5])
        self.net = BasicUNet(
            spatial_dims=spatial_dims,
            in_channels=in_channels,
            out_channels=1,
            features=tuple(features),
            norm=norm,
            dropout=dropout,
        )
        self.net.final_conv = nn.Identity()

    def input_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """BasicUNet pads odd sizes itself; it needs every axis >= 16 (four 2x poolings leave one voxel) and
        more than one voxel in all at the bottom (instance norm), so only such inputs are padded."""
        d = self.size_divisor
        out = [max(int(s), d) for s in size]
        if all(s // d == 1 for s in out):  # a 1 x 1 (x 1) bottom level: the shortest axis doubles
            shortest = min(range(len(out)), key=lambda i: out[i])
            out[shortest] = 2 * d
        return tuple(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@BACKBONES.register("unet", doc="MONAI BasicUNet (2D/3D), features at input resolution")
def unet(spatial_dims: int = 2, in_channels: int = 1, **kwargs) -> Backbone:
    return MonaiUNet(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)


class MonaiResUNet(Backbone):
    """MONAI's ``UNet`` (residual units, strided-conv down-sampling) with a norm + activation on its output.

    MONAI's ``UNet`` ends in a bare (transposed) convolution meant to produce
    logits. Here it produces ``feature_channels`` maps instead, and an
    instance norm + PReLU (MONAI's ``ADN``, the network's own defaults) follows
    so that the features before the classifier are normalised, activated
    features like every other backbone's, not a bare linear map that the
    classifier would simply compose with.

    Args:
        spatial_dims: 2 or 3 (passed through).
        in_channels: input channels.
        feature_channels: channels of the output features (MONAI's ``out_channels``).
        channels: channels per level (MONAI's ``channels``).
        strides: down-sampling stride between levels (MONAI's ``strides``).
        num_res_units: residual units per block.
        norm: MONAI norm spec, also used for the output norm.
        act: MONAI activation spec, also used for the output activation.
        dropout: dropout probability inside the blocks.
    """

    def decoder_prefixes(self) -> tuple[str, ...]:
        """MONAI's nested UNet: the up-path block of every level, and the output norm."""
        found, prefix = ["out_norm."], "net.model."
        while _has_module(self, prefix + "2"):
            found.append(prefix + "2.")
            prefix += "1.submodule."
        return tuple(found)

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 1,
        feature_channels: int = 32,
        channels: Sequence[int] = (32, 64, 128, 256, 320),
        strides: Sequence[int] = (2, 2, 2, 2),
        num_res_units: int = 2,
        norm: str | tuple = ("instance", {"affine": True}),
        act: str | tuple = "prelu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        from monai.networks.blocks import ADN
        from monai.networks.nets import UNet

        if len(strides) != len(channels) - 1:
            raise ValueError(f"strides needs {len(channels) - 1} entries for {len(channels)} channels, got {strides!r}")
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.feature_channels = int(feature_channels)
        self.size_divisor = 2 * int(torch.tensor(list(strides)).prod())  # bottom level keeps >= 2 voxels for the norm
        self.net = UNet(
            spatial_dims=spatial_dims,
            in_channels=in_channels,
            out_channels=self.feature_channels,
            channels=tuple(channels),
            strides=tuple(strides),
            num_res_units=num_res_units,
            norm=norm,
            act=act,
            dropout=dropout,
        )
        self.out_norm = ADN(ordering="NA", in_channels=self.feature_channels, act=act, norm=norm, norm_dim=spatial_dims)
        convs = [
            name
            for name, m in self.net.named_modules()
            if isinstance(m, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d))
        ]
        # the deepest encoder conv (last conv of the bottom block) and a conv halfway up the decoder
        bottom = [
            name for name in convs if ".unit" in name and self.net.get_submodule(name).out_channels == channels[-1]
        ]
        self.layer_aliases = {"encoder": f"net.{bottom[-1]}", "decoder": f"net.{_middle_up_conv(convs, len(channels))}"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.net(x))


def _middle_up_conv(convs: list[str], levels: int) -> str:
    """The first conv of an up-sampling layer halfway up MONAI UNet's decoder.

    MONAI nests level l of the UNet as ``model.1.submodule`` repeated l times;
    its up layer is the ``.2`` child at that nesting depth.
    """
    depth = max(1, (levels - 1) // 2)
    prefix = "model." + "1.submodule." * depth + "2."
    if depth == levels - 1 or not any(n.startswith(prefix) for n in convs):
        prefix = "model.2."
    return next(n for n in convs if n.startswith(prefix))


@BACKBONES.register("monai-unet", doc="MONAI UNet with residual units (2D/3D), normalised features at input resolution")
def monai_unet(spatial_dims: int = 2, in_channels: int = 1, **kwargs) -> Backbone:
    return MonaiResUNet(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)


def _has_module(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False
