"""The parts of :mod:`jascl.networks.detector` that are not torchvision's: the growable box predictor (classifier +
class-specific box regressor), the ``small`` variant's backbone and keep-size transform, and the float32 RPN context.

Conventions as in :mod:`jascl.networks.detector`: (N, D) RoI features, K class rows with row 0 = background, boxes
xyxy in input-image pixels.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from jascl.networks.classifier import PixelClassifier

__all__ = [
    "BOX_REGRESSOR_STD",
    "BoxPredictor",
    "BoxRegressor",
    "KeepSizeTransform",
    "SmallBackbone",
    "float32_features",
    "rpn_context",
    "training_flag",
]

#: std of the box regressor's initial weights (Detectron / mmdetection's Fast R-CNN head)
BOX_REGRESSOR_STD = 0.001


class BoxRegressor(nn.Module):
    """Class-specific box deltas: (N, D) -> (N, 4K), rows 4k..4k+3 for class row k; grows with the classifier."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(4 * num_classes, in_features).normal_(0.0, BOX_REGRESSOR_STD))
        self.bias = nn.Parameter(torch.zeros(4 * num_classes))

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0] // 4

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Deltas in float32 even under autocast: box coordinates in bfloat16 are 4-8 px apart at 1000 px."""
        with torch.autocast(features.device.type, enabled=False):
            return F.linear(features.float(), self.weight.float(), self.bias.float())

    @torch.no_grad()
    def grow(self, num_new: int) -> None:
        """Append 4 * ``num_new`` rows (normal std 0.001, bias 0); old rows are kept bit-exactly."""
        if num_new <= 0:
            return
        old_w, old_b = self.weight.data, self.bias.data
        new_w = torch.empty(4 * num_new, self.in_features, dtype=old_w.dtype, device=old_w.device)
        new_w.normal_(0.0, BOX_REGRESSOR_STD)
        self.weight = nn.Parameter(torch.cat([old_w, new_w]), requires_grad=self.weight.requires_grad)
        self.bias = nn.Parameter(
            torch.cat([old_b, old_b.new_zeros(4 * num_new)]), requires_grad=self.bias.requires_grad
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_classes={self.num_classes}"


class BoxPredictor(nn.Module):
    """torchvision's box-predictor interface ((N, D[, 1, 1]) -> (class logits (N, K), box deltas (N, 4K)))
    over a growable :class:`PixelClassifier` and :class:`BoxRegressor`."""

    def __init__(self, in_features: int, num_classes: int, cosine: bool = False, temperature: float = 10.0) -> None:
        super().__init__()
        self.classifier = PixelClassifier(in_features, num_classes, cosine=cosine, temperature=temperature)
        self.box_regressor = BoxRegressor(in_features, num_classes)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = features.flatten(start_dim=1)
        return self.classifier(features), self.box_regressor(features)


class SmallBackbone(nn.Sequential):
    """Stride-2 conv + GroupNorm + ReLU stages: (B, C, H, W) -> (B, widths[-1], H/2^n, W/2^n) (n = len(widths))."""

    def __init__(self, in_channels: int, widths: tuple[int, ...] = (16, 32, 64)) -> None:
        layers: list[nn.Module] = []
        channels = in_channels
        for width in widths:
            layers += [
                nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False),
                nn.GroupNorm(8, width),
                nn.ReLU(inplace=True),
            ]
            channels = width
        super().__init__(*layers)
        self.out_channels = channels  # what torchvision's FasterRCNN reads


class KeepSizeTransform(GeneralizedRCNNTransform):
    """torchvision's transform without the resize: images (and boxes) keep their size; normalising and batching
    (padding to a multiple of ``size_divisible``) are torchvision's."""

    def resize(
        self, image: torch.Tensor, target: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        return image, target


def float32_features(features: OrderedDict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    return OrderedDict((name, f.float()) for name, f in features.items())


@contextlib.contextmanager
def rpn_context(rpn: nn.Module, training: bool, device: torch.device) -> Iterator[None]:
    """The RPN with its flag set to ``training`` (see :func:`training_flag`) and autocast off.

    Under autocast torchvision's RPN would make its anchors, deltas and proposals in bfloat16 (the feature maps'
    dtype), whose spacing is 4-8 px at the coordinates of an 800x1333 image; run on float32 features it proposes in
    float32 at the cost of its head's convolution in float32."""
    with training_flag(rpn, training), torch.autocast(device.type, enabled=False):
        yield


@contextlib.contextmanager
def training_flag(module: nn.Module, training: bool) -> Iterator[None]:
    """Set ``module.training`` alone (not its children's) for the block.

    Used on the RPN, whose flag only chooses its training or testing proposal counts and whether it computes its
    losses (its head has no dropout or normalisation)."""
    previous = module.training
    module.training = training
    try:
        yield
    finally:
        module.training = previous
