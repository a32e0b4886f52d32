"""SAM ViT-B image encoder (segment-anything), trained in the base session then frozen, with a light decoder."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from jascl.errors import ConfigError
from jascl.networks.base import BACKBONES, Backbone

#: when SAM's image encoder trains: the base session only, never, or in every session
TRAIN_ENCODER = ("base", "never", "always")


def _import_sam():
    try:
        from segment_anything.modeling import ImageEncoderViT
        from segment_anything.modeling.common import LayerNorm2d
    except ImportError:
        raise ConfigError(
            "backbone 'sam-vitb' needs segment-anything; install it with: pip install 'jascl[natural]'"
        ) from None
    return ImageEncoderViT, LayerNorm2d


class SAMBackbone(Backbone):
    """SAM's ViT image encoder, trained in the base session and frozen after it, plus a light decoder.

    Following the Natural-JASCL SAM setup (a linear decoder on frozen
    vision-foundation-model features, Kerssies et al. 2024), the encoder's
    final token map (``embed_dim`` channels at 1/16 resolution, before SAM's
    prompt-oriented neck) goes through a light trainable projection
    (1x1 conv -> channel LayerNorm -> GELU, ``proj_channels`` out) whose output
    is the feature map before the classifier; the 1x1
    :class:`~jascl.networks.classifier.PixelClassifier` is the linear head.
    ``proj_channels=None`` drops the projection (features = encoder tokens,
    the classifier alone is the decoder); ``use_neck=True`` puts SAM's
    256-channel neck in front of it.

    Details:
        * The encoder is built directly from ``segment_anything``'s
          ``ImageEncoderViT`` with ViT-B hyper-parameters (embed 768, depth 12,
          heads 12, windows 14, global attention in blocks 2, 5, 8, 11, 1024
          input, relative positions). No checkpoint is loaded or downloaded;
          load the SAM ViT-B image-encoder weights from a local file with
          :func:`jascl.networks.weights.load_backbone_weights` (keys
          ``encoder.*``, or a SAM checkpoint's ``image_encoder.*`` keys).
        * ``train_encoder`` says when the encoder trains. "base" (default): in the
          base session only, as the paper's configuration table says of every
          JASCL model ("Base Frozen: No"; Natural-JASCL (SAM): incremental
          sessions frozen "all but last"). "never": frozen in every session (a
          linear probe of the pretrained features, the Kerssies et al. setup and
          jascl's behaviour before 2026-11-27). "always": trainable in every session
          unless the freezing policy freezes it. A frozen encoder has
          ``requires_grad=False`` and stays in eval mode (:meth:`frozen_modules`), so
          GAS in incremental sessions belongs on the classifier or the projection,
          not on the "encoder" alias. Training the encoder at 1024x1024 takes far more
          memory than the probe (activations of 12 ViT blocks; see ``jascl model-info``).
        * Inputs of any multiple of 16 are accepted: the absolute position
          embedding is resized (bicubic) to the token grid; the global
          attention's relative positions are interpolated by SAM itself.
        * 1-channel inputs are repeated to 3 channels, because the pretrained
          patch embedding expects RGB; other channel counts are an error.
          SAM's pixel normalisation (ImageNet mean/std on 0-255) is not applied
          here; it belongs to the data transforms.

    Args:
        spatial_dims: must be 2.
        in_channels: 1 or 3.
        img_size: the encoder's native input size (ViT-B: 1024).
        embed_dim, depth, num_heads, window_size, global_attn_indexes: ViT hyper-parameters.
        out_chans: SAM neck channels (used only with ``use_neck``).
        proj_channels: channels of the trainable projection, or None for none.
        use_neck: apply SAM's neck (conv 1x1 + LN + conv 3x3 + LN) before the projection.
        train_encoder: "base", "never" or "always" (see above).
    """

    decoder_prefix = ("decoder.",)

    size_divisor = 16

    def __init__(
        self,
        spatial_dims: int = 2,
        in_channels: int = 3,
        img_size: int = 1024,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        window_size: int = 14,
        global_attn_indexes: Sequence[int] = (2, 5, 8, 11),
        out_chans: int = 256,
        proj_channels: int | None = 256,
        use_neck: bool = False,
        train_encoder: str = "base",
    ) -> None:
        super().__init__()
        if train_encoder not in TRAIN_ENCODER:
            raise ConfigError(
                f"backbone 'sam-vitb': train_encoder={train_encoder!r}, expected one of {', '.join(TRAIN_ENCODER)}"
            )
        if spatial_dims != 2:
            raise ConfigError(f"backbone 'sam-vitb' is 2D only, got spatial_dims={spatial_dims}")
        if in_channels not in (1, 3):
            raise ConfigError(f"backbone 'sam-vitb' takes 1 (repeated to RGB) or 3 input channels, got {in_channels}")
        ImageEncoderViT, LayerNorm2d = _import_sam()
        self.spatial_dims = 2
        self.in_channels = in_channels
        self.use_neck = use_neck
        self.train_encoder = train_encoder
        self.encoder = ImageEncoderViT(
            img_size=img_size,
            patch_size=16,
            in_chans=3,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=4.0,
            out_chans=out_chans,
            qkv_bias=True,
            norm_layer=partial(nn.LayerNorm, eps=1e-6),
            act_layer=nn.GELU,
            use_abs_pos=True,
            use_rel_pos=True,
            rel_pos_zero_init=True,
            window_size=window_size,
            global_attn_indexes=tuple(global_attn_indexes),
        )
        if not use_neck:
            self.encoder.neck = nn.Identity()  # unused; keeps the parameter count honest
        self.encoder.requires_grad_(train_encoder != "never")
        channels = out_chans if use_neck else embed_dim
        self.decoder: nn.Module
        if proj_channels:
            self.decoder = nn.Sequential(nn.Conv2d(channels, proj_channels, 1), LayerNorm2d(proj_channels), nn.GELU())
            channels = proj_channels
        else:
            self.decoder = nn.Identity()
        self.feature_channels = int(channels)
        self.layer_aliases = {"encoder": f"encoder.blocks.{depth - 1}.mlp.lin2"}
        if proj_channels:
            self.layer_aliases["decoder"] = "decoder.0"
        self.train()

    def frozen_modules(self, session: int = 1) -> list[nn.Module]:
        if self.train_encoder == "never" or (self.train_encoder == "base" and session > 0):
            return [self.encoder]
        return []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, *x.shape[2:])
        enc = self.encoder
        tokens = enc.patch_embed(x)  # (B, H/16, W/16, embed_dim)
        pos = enc.pos_embed
        if pos.shape[1:3] != tokens.shape[1:3]:
            pos = F.interpolate(
                pos.permute(0, 3, 1, 2), size=tokens.shape[1:3], mode="bicubic", align_corners=False
            ).permute(0, 2, 3, 1)
        tokens = tokens + pos
        for block in enc.blocks:
            tokens = block(tokens)
        features = tokens.permute(0, 3, 1, 2)
        if self.use_neck:
            features = enc.neck(features)
        return self.decoder(features)


@BACKBONES.register(
    "sam-vitb",
    doc="SAM ViT-B image encoder (trained in session 0, then frozen) + light 1x1 decoder, 2D, features at 1/16",
)
def sam_vitb(spatial_dims: int = 2, in_channels: int = 3, **kwargs) -> Backbone:
    return SAMBackbone(spatial_dims=spatial_dims, in_channels=in_channels, **kwargs)
