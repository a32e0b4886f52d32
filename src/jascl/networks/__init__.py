"""Backbones behind one interface, the growable classifier and the segmenter."""

from jascl.networks import authors_unet, deeplab, medformer, sam, swinunetr, unet  # noqa: F401  (register the backbones)
from jascl.networks.base import BACKBONES, Backbone, Segmenter, SegmenterOutput, create_segmenter
from jascl.networks.classifier import PixelClassifier
from jascl.networks.clip_driven import ClipDrivenBackbone  # noqa: F401  (registers clip-driven, see its module)

__all__ = ["BACKBONES", "Backbone", "PixelClassifier", "Segmenter", "SegmenterOutput", "create_segmenter"]
