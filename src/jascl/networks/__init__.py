"""Backbones behind one interface, the growable classifier and the segmenter.

Importing this package imports neither torch nor any backbone: :data:`BACKBONES` lists the backbones from the
registry index, and the torch-backed names below are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jascl.networks.registry import BACKBONES

if TYPE_CHECKING:
    from jascl.networks.base import Backbone, Segmenter, SegmenterOutput, create_segmenter
    from jascl.networks.classifier import PixelClassifier

#: the names this package exports from its torch-backed modules, imported when first asked for
_LAZY = {
    "Backbone": "jascl.networks.base",
    "Segmenter": "jascl.networks.base",
    "SegmenterOutput": "jascl.networks.base",
    "create_segmenter": "jascl.networks.base",
    "PixelClassifier": "jascl.networks.classifier",
}

__all__ = ["BACKBONES", "Backbone", "PixelClassifier", "Segmenter", "SegmenterOutput", "create_segmenter"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
