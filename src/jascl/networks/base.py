"""The backbone interface and the segmenter (backbone features + growable classifier)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jascl.errors import ConfigError
from jascl.networks.classifier import PixelClassifier
from jascl.networks.registry import BACKBONES


class Backbone(nn.Module):
    """A feature extractor for segmentation.

    Subclasses set ``spatial_dims``, ``in_channels`` and ``feature_channels``
    and map (B, in_channels, *spatial) to features (B, feature_channels,
    *spatial') -- the features right before the classifier, which prototypes
    and PAS use. ``layer_aliases`` names representative layers for the GAS
    layer-choice ablation ("encoder", "decoder").
    """

    spatial_dims: int
    in_channels: int
    feature_channels: int
    layer_aliases: dict[str, str] = {}
    #: input sizes must be multiples of this, and at least twice it (None = any size)
    size_divisor: int | None = None
    #: module-path prefixes (below the backbone) of its decoder: what methods with per-domain decoders
    #: (MDIL) duplicate; empty = the backbone does not say
    decoder_prefix: tuple[str, ...] = ()
    #: key prefixes (below the backbone) of a weights file's parts the backbone replaced, which ``--weights`` skips
    #: instead of refusing (e.g. MONAI SwinUNETR's output block)
    ignored_weight_prefixes: tuple[str, ...] = ()

    def decoder_prefixes(self) -> tuple[str, ...] | None:
        """The decoder's module-path prefixes below the backbone (None: unknown for this backbone)."""
        return tuple(self.decoder_prefix) or None

    def make_classifier(self, num_classes: int, cosine: bool = True, temperature: float = 10.0) -> PixelClassifier:
        """The classifier the segmenter puts on these features: a :class:`PixelClassifier` (a backbone whose head is
        conditioned on more than a pixel's features, e.g. ``clip-driven``, returns its own with the same interface)."""
        return PixelClassifier(self.feature_channels, num_classes, cosine, temperature)

    def frozen_modules(self, session: int = 1) -> list[nn.Module]:
        """Modules frozen in session ``session`` whatever the freezing policy (default: an incremental session).

        A pretrained foundation encoder (SAM's image encoder) is one, in every session or from
        session 1 on. The trainer's freezing policy never unfreezes them in that session, and
        :meth:`train` keeps them in eval mode while all their parameters are frozen. Default: none.
        """
        return []

    def train(self, mode: bool = True) -> Backbone:
        super().train(mode)
        for module in self.frozen_modules():
            if not any(p.requires_grad for p in module.parameters()):
                module.train(False)  # frozen means frozen: no dropout, no running-statistics updates
        return self

    def smallest_patch(self, size: Sequence[int]) -> tuple[int, ...]:
        """The smallest training patch, per axis at least ``size``, that :meth:`check_input_size` accepts."""
        d = self.size_divisor
        return tuple(int(s) for s in size) if not d else tuple(max(2 * d, -(-int(s) // d) * d) for s in size)

    def check_input_size(self, size: tuple[int, ...], what: str) -> None:
        """Raise a ConfigError if a training patch / image size does not fit this backbone."""
        d = self.size_divisor
        if d and any(s % d or s < 2 * d for s in size):
            raise ConfigError(
                f"{what}={list(size)}: the {type(self).__name__} backbone needs every size to be a "
                f"multiple of {d} and at least {2 * d}; set patch_size accordingly (the smallest that works "
                f"here: {list(self.smallest_patch(size))})"
            )

    def input_size(self, size: Sequence[int]) -> tuple[int, ...]:
        """The size (per axis, at least ``size``) a whole image or volume is zero-padded to before the forward.

        Training patches already fit (:meth:`check_input_size`); whole samples (prototypes, Fisher information,
        a teacher's pass, the authors' evaluation crops) may be smaller than the patch or of any size.
        :class:`Segmenter` pads such an input at its far end and crops the outputs back, so that every size
        goes through. Default: unchanged without a :attr:`size_divisor`, else :meth:`smallest_patch`.
        Backbones that take more sizes (MONAI's BasicUNet pads odd sizes itself) override it with their
        exact rule, so inputs that went through before are not padded.
        """
        return self.smallest_patch(size)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode for the block; every submodule's own train/eval mode is restored afterwards
    (a frozen encoder stays in eval mode, a training model goes back to training).

    The flags are restored by assignment: ``module.train(mode)`` per module would recurse into every
    submodule again (quadratic in the depth; 5 ms per call on the tests' tiny U-Net, which the prototype
    and evaluation passes call hundreds of times), and would let a ``train`` override re-decide a mode
    that was saved."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, mode in modes:
            module.training = mode


def resize(
    x: torch.Tensor, size: Sequence[int], mode: str = "linear", align_corners: bool | None = False
) -> torch.Tensor:
    """(B, C, *spatial) resized to ``size`` in 2D or 3D alike: "linear" (bilinear / trilinear) or "nearest".

    Returns ``x`` itself when it has that size already.
    """
    if tuple(x.shape[2:]) == tuple(size):
        return x
    if mode == "nearest":
        return nn.functional.interpolate(x, size=tuple(size), mode="nearest")
    linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[x.dim() - 2]
    return nn.functional.interpolate(x, size=tuple(size), mode=linear, align_corners=align_corners)


@dataclass
class SegmenterOutput:
    """logits: (B, K, *spatial); features: (B, C, *spatial') before the classifier."""

    logits: torch.Tensor
    features: torch.Tensor


class Segmenter(nn.Module):
    """Backbone + :class:`PixelClassifier`; logits are upsampled to the input size if needed."""

    def __init__(self, backbone: Backbone, num_classes: int, cosine: bool = True, temperature: float = 10.0) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = backbone.make_classifier(num_classes, cosine, temperature)

    @property
    def spatial_dims(self) -> int:
        return self.backbone.spatial_dims

    @property
    def num_classes(self) -> int:
        return self.classifier.num_classes

    def forward_features(self, x: torch.Tensor) -> SegmenterOutput:
        """Logits at the input's size and the backbone's features; an input the backbone cannot take as it is
        (smaller than its deepest level needs, or not a multiple of its stride: :meth:`Backbone.input_size`) is
        zero-padded at its far end, and logits and features are cropped back to the input's extent."""
        size = tuple(x.shape[2:])
        padded = self.backbone.input_size(size)
        if padded == size:
            features = self.backbone(x)
            return SegmenterOutput(resize(self.classifier(features), size), features)
        widths: list[int] = []
        for n, p in reversed(list(zip(size, padded))):
            widths += [0, p - n]
        features = self.backbone(nn.functional.pad(x, widths))
        crop: tuple[Any, ...] = (..., *(slice(0, n) for n in size))
        logits = resize(self.classifier(features), padded)[crop]
        kept: tuple[Any, ...] = (..., *(slice(0, -(-n * f // p)) for n, p, f in zip(size, padded, features.shape[2:])))
        return SegmenterOutput(logits, features[kept])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits only (what sliding-window inference calls)."""
        return self.forward_features(x).logits

    def resolve_layer(self, name: str) -> nn.Module:
        """A layer by alias ("classifier", "encoder", "decoder") or dotted module path."""
        if name == "classifier":
            return self.classifier
        path = self.backbone.layer_aliases.get(name)
        target = f"backbone.{path}" if path else name
        try:
            return self.get_submodule(target)
        except AttributeError:
            aliases = ", ".join(["classifier", *self.backbone.layer_aliases])
            raise ConfigError(
                f"layer {name!r} not found; use one of {aliases} or a module path such as 'backbone.<...>'"
            ) from None


def whole_sample_forward(
    model: Segmenter, x: torch.Tensor, roi: Sequence[int] | None, sw_batch_size: int = 1, overlap: float = 0.25
) -> SegmenterOutput:
    """Logits and features of whole samples (B, C, *spatial) for a statistics pass; gradients are tracked as the
    caller decides (``torch.no_grad`` or not).

    A volume larger than ``roi`` (the training patch) along any axis goes through MONAI's sliding windows, as
    the evaluation scores it: windows of ``roi`` with ``overlap``, ``sw_batch_size`` at a time, both outputs
    stitched at their own resolution and averaged where windows overlap. A whole-volume forward is not bounded
    in memory (the authors' 3D U-Net needs about 1.2 GB per million voxels in float32, 36 GB for a whole-body
    CT of 270 x 270 x 400), while the stitched outputs cost only their channels per voxel. Images (2D), volumes
    that fit ``roi`` and ``roi`` None go through ``model.forward_features`` whole, as before.
    """
    if not windowed(x, roi):
        return model.forward_features(x)
    stitched = _stitched(model, x, roi, sw_batch_size, overlap, ("logits", "features"))
    return SegmenterOutput(stitched["logits"], stitched["features"])


def windowed(x: torch.Tensor, roi: Sequence[int] | None) -> bool:
    """Whether a whole-sample pass over ``x`` (B, C, *spatial) goes through sliding windows: a volume larger than
    ``roi`` along some axis (:func:`whole_sample_forward`)."""
    spatial = x.shape[2:]
    return roi is not None and len(spatial) == 3 and any(s > r for s, r in zip(spatial, roi))


def whole_sample_features(
    model: Segmenter, x: torch.Tensor, roi: Sequence[int] | None, sw_batch_size: int = 1, overlap: float = 0.25
) -> torch.Tensor:
    """:func:`whole_sample_forward`'s features alone: through windows, only the features are stitched (the same
    values), so the pass holds D channels per voxel instead of D + K."""
    if not windowed(x, roi):
        return model.forward_features(x).features
    return _stitched(model, x, roi, sw_batch_size, overlap, ("features",))["features"]


def _stitched(
    model: Segmenter, x: torch.Tensor, roi: Sequence[int] | None, sw_batch_size: int, overlap: float, keys: tuple
) -> dict[str, torch.Tensor]:
    from monai.inferers import sliding_window_inference  # (imported where a volume needs it)

    assert roi is not None

    def outputs(window: torch.Tensor) -> dict[str, torch.Tensor]:
        out = model.forward_features(window)
        return {key: getattr(out, key) for key in keys}

    stitched = sliding_window_inference(x, list(roi), sw_batch_size, outputs, overlap=overlap)
    assert isinstance(stitched, dict)
    return {key: torch.as_tensor(stitched[key]) for key in keys}


def create_segmenter(
    name: str,
    spatial_dims: int,
    in_channels: int,
    num_classes: int,
    cosine: bool = True,
    temperature: float = 10.0,
    **backbone_args,
) -> Segmenter:
    """Build a registered backbone and put a classifier with ``num_classes`` rows on it."""
    factory = BACKBONES.get(name)
    try:
        backbone = factory(spatial_dims=spatial_dims, in_channels=in_channels, **backbone_args)
    except TypeError as exc:
        raise ConfigError(
            f"backbone_args {sorted(backbone_args)} do not fit backbone {name!r} ({exc}); "
            "fix them with --set backbone_args={...}"
        ) from None
    return Segmenter(backbone, num_classes, cosine=cosine, temperature=temperature)


def encoder_modules(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's modules outside its decoder (``Backbone.decoder_prefixes``): what ``freeze_incremental:
    encoder`` freezes (the paper's "partially frozen" backbones: encoder frozen, decoder trained).

    Whole subtrees whose module path is not under a decoder prefix; a module holding some decoder
    modules is split into its children.
    """
    get_prefixes = getattr(backbone, "decoder_prefixes", None)
    prefixes = get_prefixes() if callable(get_prefixes) else None
    if not prefixes:
        raise ConfigError(
            f"freeze_incremental=encoder: backbone {type(backbone).__name__} does not name its decoder "
            "(Backbone.decoder_prefix); use all_but_classifier or none"
        )

    def under_decoder(path: str) -> bool:
        return any((path + ".").startswith(p) or path.startswith(p) for p in prefixes)

    def holds_decoder(path: str) -> bool:
        return any(p.startswith(path + ".") for p in prefixes)

    out: list[nn.Module] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            child_path = f"{path}{name}"
            if under_decoder(child_path):
                continue
            if holds_decoder(child_path):
                visit(child, child_path + ".")
            else:
                out.append(child)

    visit(backbone, "")
    return out
