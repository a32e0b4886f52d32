"""The data types every layer shares: a split of samples and a session's data.

Arrays are NumPy (or lazy array-likes with the same indexing, for datasets on
disk; :mod:`jascl.data.real`). Labels are global class ids: 0 = background,
255 = ignore (:data:`jascl.data.datasets.IGNORE_INDEX`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jascl.protocols.schema import SessionSpec


class LazySequence:
    """Array-like indexing for samples produced one at a time (subclasses give ``__len__`` and ``_one``):
    an integer (negative counts from the end) gives one sample, a slice a stacked array when the shapes
    agree (else a list), iteration yields every sample."""

    def __len__(self) -> int:
        raise NotImplementedError

    def _one(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            items = [self._one(i) for i in range(*index.indices(len(self)))]
            if items and all(a.shape == items[0].shape for a in items):
                return np.stack(items)
            return items
        if isinstance(index, (int, np.integer)):
            i = int(index)
            if i < 0:
                i += len(self)
            if not 0 <= i < len(self):
                raise IndexError(index)
            return self._one(i)
        raise TypeError(f"lazy splits take an integer or a slice, not {type(index).__name__}")

    def __iter__(self):
        for i in range(len(self)):
            yield self._one(i)


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
