"""The data types every layer shares: a split of samples and a session's data.

Arrays are NumPy (or lazy array-likes with the same indexing, for datasets on
disk; :mod:`jascl.data.real`). Labels are global class ids: 0 = background,
255 = ignore (:data:`jascl.data.datasets.IGNORE_INDEX`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jascl.protocols.schema import SessionSpec


@dataclass
class Split:
    """One split of a session.

    Attributes:
        images: (N, C, *spatial) float32 intensities.
        labels: (N, *spatial) uint8 full ground truth in global class ids (0 = background).
        ids: stable sample ids (used in K-shot manifests).
    """

    images: np.ndarray
    labels: np.ndarray
    ids: list[str]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class SessionData:
    """The data of one session: labelled ``train``, ``test``, an optional ``unlabelled`` pool and optional
    labelled ``validation`` samples (``SessionSpec.validation`` per class; model selection only, never trained on)."""

    session: SessionSpec
    train: Split
    test: Split
    unlabelled: Split | None = None
    validation: Split | None = None
