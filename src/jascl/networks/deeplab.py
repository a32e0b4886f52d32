"""DeepLabV3+ (segmentation-models-pytorch) as a 2D backbone, never downloading weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from jascl.errors import ConfigError
from jascl.networks.base import BACKBONES, Backbone


def _import_smp():
    try:
        import segmentation_models_pytorch as smp
    except ImportError:
        raise ConfigError(
            "backbone 'deeplabv3plus' needs segmentation-models-pytorch; install it with: pip install 'jascl[natural]'"
        ) from None
    return smp


class DeepLabV3PlusBackbone(Backbone):
    """smp ``DeepLabV3Plus`` with a ResNet encoder; features = the decoder output.

    Features are the 256-channel output of the DeepLabV3+ decoder (ASPP on the
    stride-16 map, upsampled x4, concatenated with the 48-channel projection of
    the stride-4 map, then a separable 3x3 conv + BN + ReLU), at 1/4 of the
    input resolution, before smp's segmentation head (which is removed). The
    segmenter upsamples the logits to the input size; prototypes resize the
    labels to the features (nearest).

    Differences from the authors' DeepLab (``deeplab_gaps_meanT``): there the
    features before the classifier are the 304-channel concatenation and the
    classifier is a 3x3 conv; here the classifier is the shared 1x1
    :class:`~jascl.networks.classifier.PixelClassifier` on the fused 256-channel
    map. Encoder weights are random: ``encoder_weights=None`` always, nothing is
    downloaded; load ImageNet or other weights from a local file with
    :func:`jascl.networks.weights.load_backbone_weights`.

    The ASPP image-pooling branch holds a BatchNorm over a 1x1 map, so training
    needs batches of at least 2 images.

    Args:
        spatial_dims: must be 2 (DeepLabV3+ is a 2D network).
        in_channels: input channels (the first conv is built for it).
        encoder_name: smp/timm ResNet name ("resnet50" default, "resnet18" for small runs).
        output_stride: 16 (paper setting) or 8.
        atrous_rates: ASPP rates; (6, 12, 18) for output stride 16 as in the DeepLabV3+ paper
            (smp's default (12, 24, 36) suits output stride 8).
        decoder_channels: ASPP/decoder channels (= feature channels).
        aspp_dropout: dropout after the ASPP projection.
    """

    decoder_prefix = ("net.decoder.",)

    size_divisor = 16

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 3,
        encoder_name: str = "resnet50",
        output_stride: int = 16,
        atrous_rates: Sequence[int] = (6, 12, 18),
        decoder_channels: int = 256,
        aspp_dropout: float = 0.5,
    ) -> None:
        super().__init__()
        if spatial_dims != 2:
            raise ConfigError(
                f"backbone 'deeplabv3plus' is 2D only, got spatial_dims={spatial_dims}; "
                "use unet3d-authors, monai-unet, swinunetr or medformer for 3D"
            )
        smp = _import_smp()
        self.spatial_dims = 2
        self.in_channels = in_channels
        self.feature_channels = int(decoder_channels)
        self.size_divisor = output_stride
        self.net = smp.DeepLabV3Plus(
            encoder_name=encoder_name,
            encoder_weights=None,
            in_channels=in_channels,
            classes=1,
            encoder_output_stride=output_stride,
            decoder_atrous_rates=tuple(atrous_rates),
            decoder_channels=decoder_channels,
            decoder_aspp_dropout=aspp_dropout,
        )
        self.net.segmentation_head = nn.Identity()  # replaced by the segmenter's classifier
        last_encoder_conv = [
            n
            for n, m in self.net.encoder.named_modules()
            if n.startswith("layer4") and isinstance(m, nn.Conv2d) and "downsample" not in n
        ][-1]
        self.layer_aliases = {"encoder": f"net.encoder.{last_encoder_conv}", "decoder": "net.decoder.aspp.0.project.0"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.decoder(self.net.encoder(x))


@BACKBONES.register("deeplabv3plus", doc="DeepLabV3+ (smp, ResNet encoder, OS 16), 2D only, 256-ch features at 1/4")
def deeplabv3plus(spatial_dims: int = 2, in_channels: int = 3, **kwargs) -> Backbone:
    return DeepLabV3PlusBackbone(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)
