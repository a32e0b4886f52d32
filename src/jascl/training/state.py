"""The mutable state the loop shares with plugins."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from jascl.data.synthetic import SessionData
from jascl.methods.base import Method
from jascl.methods.prototypes import PrototypeStore
from jascl.networks.base import Segmenter, SegmenterOutput
from jascl.protocols.schema import Protocol, SessionSpec
from jascl.training.config import RunConfig


@dataclass
class LoopState:
    """What plugins see.

    Attributes:
        seen: global class ids covered by the classifier, in row order (row 0 = background).
        new_model: builds a fresh model of the same architecture with K classes (e.g. a teacher).
        compute_prototypes: eq. 2 prototypes of the given classes from the session's labelled
            data with the current model (training modes are restored afterwards); keyword
            ``normalize_pixels`` as in :func:`jascl.methods.prototypes.per_sample_prototypes`.
        losses: named loss terms of the current iteration; the loop sums them.
        output: the model output of the current training iteration.
        batch: the current batch (``image`` (B, C, *spatial), ``label`` (B, *spatial) global ids).
        closure: re-runs the forward pass on the current batch and returns the total
            loss (segmentation + every plugin's ``after_forward`` terms), without
            zeroing or computing gradients; for sharpness-aware updates.
        eval_session: during evaluation, the session whose test split is being scored.
        previous_seen: classes of the classifier at the end of the previous session
            (its first rows; empty in session 0).
        forward: the training forward, ``x -> SegmenterOutput``: the model itself, or its
            DistributedDataParallel wrapper when several processes train.
        autocast: a context manager for forwards in the run's precision (bf16 autocast or nothing);
            the loop's training forward and ``after_forward`` already run inside it.
        loader_options: DataLoader keyword arguments of the run (workers, pinned memory) for plugins' loaders.
    """

    protocol: Protocol
    config: RunConfig
    method: Method
    session: SessionSpec
    data: SessionData
    model: Segmenter
    device: torch.device
    prototypes: PrototypeStore
    seen: list[int]
    seed: int = 0
    new_model: Callable[[int], Segmenter] | None = None
    compute_prototypes: Callable[..., dict[int, torch.Tensor]] | None = None
    optimizer: torch.optim.Optimizer | None = None
    epoch: int = 0
    iteration: int = 0
    batch: dict[str, Any] | None = None
    output: SegmenterOutput | None = None
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    closure: Callable[[], torch.Tensor] | None = None
    eval_session: int | None = None
    previous_seen: list[int] = field(default_factory=list)
    forward: Callable[[torch.Tensor], SegmenterOutput] | None = None
    autocast: Callable[[], ContextManager] = contextlib.nullcontext
    loader_options: dict = field(default_factory=dict)
    _lut: torch.Tensor | None = field(default=None, repr=False)

    def class_index(self, global_ids: torch.Tensor) -> torch.Tensor:
        """Map global class ids to classifier rows (255 stays 255)."""
        if self._lut is None or self._lut.device != global_ids.device:
            lut = torch.full((256,), -1, dtype=torch.long)
            lut[255] = 255
            for row, cid in enumerate(self.seen):
                lut[cid] = row
            self._lut = lut.to(global_ids.device)
        rows = self._lut[global_ids.long()]
        if global_ids.device.type == "cpu" and (rows < 0).any():  # a host check would stall a GPU every step
            bad = sorted(set(global_ids[rows < 0].tolist()))
            raise ValueError(f"class ids {bad} are not covered by the classifier (seen: {self.seen})")
        return rows
