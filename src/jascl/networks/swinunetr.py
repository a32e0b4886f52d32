"""MONAI SwinUNETR as a backbone (2D and 3D through ``spatial_dims``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.networks.nets import SwinUNETR
from torch import nn

from jascl.networks.base import BACKBONES, Backbone


class SwinUNETRBackbone(Backbone):
    """MONAI's ``SwinUNETR`` with its final 1x1 convolution removed.

    Features = the output of the last decoder block (``decoder1``: a residual
    conv block, instance norm + leaky ReLU), ``feature_size`` channels at input
    resolution. MONAI 1.6 no longer takes ``img_size``; inputs must be
    multiples of ``patch_size ** 5`` (32), and at least twice that so the
    bottleneck's instance norm sees more than one voxel.

    The authors' medical runs used ``feature_size=48``, depths (2, 2, 2, 2),
    heads (3, 6, 12, 24), window 7, on 96^3 patches (MONAI defaults), which
    are the defaults here.

    Args:
        spatial_dims: 2 or 3.
        in_channels: input channels.
        feature_size: channels of the first stage and of the features.
        depths: Swin blocks per stage.
        num_heads: attention heads per stage.
        window_size: attention window (per axis).
        drop_rate, attn_drop_rate, dropout_path_rate: dropout rates.
        use_v2: SwinUNETR-v2 (residual conv blocks at each stage).
    """

    decoder_prefix = ("net.decoder",)

    layer_aliases = {
        "encoder": "net.swinViT.layers4.0.blocks.0.mlp.linear2",
        "decoder": "net.decoder3.conv_block.conv2.conv",
    }

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        feature_size: int = 48,
        depths: Sequence[int] = (2, 2, 2, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int = 7,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        dropout_path_rate: float = 0.0,
        use_v2: bool = False,
    ) -> None:
        super().__init__()
        self.spatial_dims = spatial_dims
        self.in_channels = in_channels
        self.feature_channels = int(feature_size)
        self.size_divisor = 32  # patch_size 2, to the power 5 (MONAI's own input check)
        self.net = SwinUNETR(
            in_channels=in_channels,
            out_channels=1,
            spatial_dims=spatial_dims,
            feature_size=feature_size,
            depths=tuple(depths),
            num_heads=tuple(num_heads),
            window_size=window_size,
            drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate,
            dropout_path_rate=dropout_path_rate,
            use_v2=use_v2,
        )
        self.net.out = nn.Identity()  # type: ignore[assignment]  # MONAI declares it a UnetOutBlock
        # a full SwinUNETR checkpoint's output block (e.g. the CLIP-driven universal model's body) is not loaded
        self.ignored_weight_prefixes = ("net.out.",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@BACKBONES.register("swinunetr", doc="MONAI SwinUNETR (2D/3D), decoder features at input resolution")
def swinunetr(spatial_dims: int = 3, in_channels: int = 1, **kwargs) -> Backbone:
    return SwinUNETRBackbone(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)
