"""Data: the embedded synthetic benchmark, session splits and datasets.

Importing this package imports neither torch nor MONAI (a module that needs only :mod:`jascl.data.types` does not
pay for them); the names below are imported from their modules when first asked for (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jascl.data.datasets import IGNORE_INDEX, LabelledDataset, training_labels
    from jascl.data.synthetic import load_or_generate
    from jascl.data.types import SessionData, Split

#: the names this package exports, by the module that defines them
_LAZY = {
    "IGNORE_INDEX": "jascl.data.datasets",
    "LabelledDataset": "jascl.data.datasets",
    "training_labels": "jascl.data.datasets",
    "load_or_generate": "jascl.data.synthetic",
    "SessionData": "jascl.data.types",
    "Split": "jascl.data.types",
}

__all__ = ["IGNORE_INDEX", "LabelledDataset", "SessionData", "Split", "load_or_generate", "training_labels"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
