"""What the few-shot baselines share: features in eval mode (the frozen copy and the labelled loader are
:mod:`jascl.methods.common`'s)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from jascl.methods.common import whole_forward
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter


def eval_features(
    state: LoopState, model: Segmenter, loader: DataLoader, pieces: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (features (B, C, *spatial'), labels (B, *spatial)) of every batch in eval mode, no gradient, on the
    run's device; volumes larger than the training patch through sliding windows (:func:`whole_forward`).

    ``pieces``: for statistics that add up over pixels (class sums and counts, covariances); per-sample ones take
    :func:`sample_pieces`. A batch whose stitched features would pass the prototype pass's bound
    (:data:`jascl.engine.tasks.segmentation.PROTOTYPE_BLOCK_ELEMENTS`, 2 GiB) then comes one sample at a time in
    blocks (:func:`jascl.engine.tasks.segmentation.block_features`), each with the whole sample's feature values
    over its part: at the paper's scale a 288 x 288 x 224 CT at 32 channels holds 2.4 GB of features whole.
    Without, every batch comes whole, as before.

    The train/eval mode of every module is restored when the iteration ends.
    """
    for _, features, labels in _passes(state, model, loader, pieces):
        yield features, labels


def sample_pieces(
    state: LoopState, model: Segmenter, loader: DataLoader
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (sample, features (1, C, *spatial'), labels (1, *spatial)) of every sample of ``loader`` in order,
    numbered from 0, as :func:`eval_features` with ``pieces`` computes them: a sample whole, or, where its batch's
    stitched features would pass the bound, in blocks that come one after another with the sample's number.

    For statistics per sample (PIFS's per-image prototypes, GAPS's per-image scores and scene embeddings): reduce
    each piece to sums over its pixels and finish each sample when its last piece has come (:func:`per_sample`).
    """
    for first, features, labels in _passes(state, model, loader, pieces=True):
        for b in range(labels.shape[0]):
            yield first + b, features[b : b + 1], labels[b : b + 1]


def per_sample(
    pieces: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    reduce: Callable[[torch.Tensor, torch.Tensor], dict[Hashable, torch.Tensor]],
) -> Iterator[tuple[int, dict[Hashable, torch.Tensor]]]:
    """Yield (sample, totals) at the end of every sample of ``pieces`` (:func:`sample_pieces`): ``totals`` maps each
    key ``reduce(features, labels)`` gave for some piece of the sample to the sum of its values over those pieces
    (a key is left out of the pieces without it). Only one sample's totals are held at a time."""
    current: int | None = None
    totals: dict[Hashable, torch.Tensor] = {}
    for sample, features, labels in pieces:
        if sample != current:
            if current is not None:
                yield current, totals
            current, totals = sample, {}
        for key, value in reduce(features, labels).items():
            totals[key] = totals[key] + value if key in totals else value
    if current is not None:
        yield current, totals


def _passes(
    state: LoopState, model: Segmenter, loader: DataLoader, pieces: bool
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(number of the first sample, features, labels) of every batch, or of every block of one sample, for
    :func:`eval_features` (which see)."""
    from jascl.engine.tasks.segmentation import block_features, prototype_blocks

    cfg = state.config
    first = 0
    with eval_mode(model), torch.no_grad():
        for batch in loader:
            images, labels = batch["image"].to(state.device), batch["label"].to(state.device)
            channels = model.backbone.feature_channels
            blocks = prototype_blocks(images, cfg.patch_size, cfg.sw_overlap, channels) if pieces else None
            if blocks is None:
                yield first, whole_forward(state, model, images).features.float(), labels
            else:
                sample = first
                for i, features, piece in block_features(
                    model, images, labels, blocks, cfg.patch_size, cfg.sw_batch_size, cfg.sw_overlap
                ):
                    yield sample, features.float(), piece
                    sample += i == len(blocks) - 1  # the sample's last block
            first += images.shape[0]


class PixelSample:
    """A seeded uniform sample of at most ``k`` of the rows offered to it, in memory bounded by ``k`` and the
    largest offer, however many rows come: each row gets a random key from ``generator`` as it comes, and the
    ``k`` smallest keys are kept (bottom-k sampling: every set of ``k`` rows is equally likely). :meth:`result`
    gives the kept rows in the order they came; with at most ``k`` rows offered, all of them, as offered.

    For a pass over every labelled pixel of a session (BCM's), whose features (pixels x D) of a few volumes would
    not fit in memory: at the paper's scale 25 volumes of 18.6 million voxels at 32 channels are about 60 GB.
    """

    def __init__(self, k: int, generator: torch.Generator) -> None:
        self.k, self.generator = k, generator
        self.keys = torch.zeros(0, dtype=torch.float64)
        self.order = torch.zeros(0, dtype=torch.long)
        self.columns: list[torch.Tensor] | None = None
        self.offered = 0

    def offer(self, *columns: torch.Tensor) -> None:
        """Offer rows: tensors of equal first dimension (e.g. features (n, D), labels (n,))."""
        n = columns[0].shape[0]
        keys = torch.cat([self.keys, torch.rand(n, generator=self.generator, dtype=torch.float64)])
        order = torch.cat([self.order, torch.arange(self.offered, self.offered + n)])
        self.offered += n
        joined = list(columns) if self.columns is None else [torch.cat(pair) for pair in zip(self.columns, columns)]
        if len(keys) > self.k:
            kept = keys.topk(self.k, largest=False).indices
            keys, order, joined = keys[kept], order[kept], [c[kept] for c in joined]
        self.keys, self.order, self.columns = keys, order, joined

    def result(self) -> list[torch.Tensor]:
        """The kept rows of every column, in the order they were offered."""
        if self.columns is None:
            return []
        ranked = self.order.argsort()
        return [c[ranked] for c in self.columns]
