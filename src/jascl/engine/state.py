"""The mutable state the loop shares with plugins."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jascl.data.types import SessionData
from jascl.engine.config import RunConfig
from jascl.engine.prototypes import PrototypeStore
from jascl.networks.base import Segmenter, SegmenterOutput
from jascl.protocols.schema import IGNORE_INDEX, Protocol, SessionSpec


def _unset(name: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"LoopState.{name} is set by the trainer; this state was built without it")

    return missing


@dataclass
class LoopState:
    """What plugins see.

    Attributes:
        method_name: the method being trained (its run-folder name).
        freeze_incremental: the method's freezing policy of incremental sessions, resolved
            ("all_but_classifier" or "none"; session 0 freezes nothing but always-frozen modules).
        frozen: the modules frozen this session (kept in eval mode while training, unless ``frozen_mode=train``).
        seen: global class ids covered by the classifier, in row order (row 0 = background).
        new_model: builds a fresh model of the same architecture with K classes (e.g. a teacher).
        compute_prototypes: eq. 2 prototypes of the given classes from the session's labelled
            data with the current model (training modes are restored afterwards); keyword
            ``normalize_pixels`` and ``complement`` as in :func:`jascl.engine.prototypes.per_sample_prototypes`.
        compute_prototype_requests: several such calls at once (a list of
            :class:`~jascl.engine.prototypes.PrototypeRequest`, their results in that order), in one pass over the
            data for those not already served (:meth:`jascl.engine.plugin.Plugin.prototype_requests`).
        losses: named loss terms of the current iteration; the loop sums them.
        output: the model output of the current training iteration.
        batch: the current batch (``image`` (B, C, *spatial), ``label`` (B, *spatial) int64 global ids; a
            segmentation training batch's label is already on the device: the loader's uint8 widened there).
        target: the current batch's labels as classifier rows (B, *spatial) on the device (255 = ignore).
        has_ignore: whether ``target`` holds ignored pixels (None = unknown without a host read).
        boxes: detection (:mod:`jascl.engine.tasks.detection`): the batch's targets, ``{"boxes", "labels"}`` per image with
            labels as classifier rows, on the device (``target`` is None there).
        metrics: in-session values plugins share (scalars are kept in resumable checkpoints);
            ``metrics["eval"]`` is the session's :class:`~jascl.evaluation.evaluator.EvalResult`.
        report: entries added to the session's record (``metrics.json``, ``results.json``), e.g.
            ``report["pseudo_labels"]``.
        record: the session's record, filled by the evaluation plugin, saved by the checkpoint plugin.
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
        fire: fires an event on every plugin of the session (the loop's defaults and the method's).
        out_dir: the session's folder in the run folder (checkpoints, metrics).
    """

    protocol: Protocol
    config: RunConfig
    method_name: str
    session: SessionSpec
    data: SessionData
    model: Segmenter
    device: torch.device
    prototypes: PrototypeStore
    seen: list[int]
    seed: int = 0
    freeze_incremental: str = "none"
    frozen: list[torch.nn.Module] = field(default_factory=list)
    new_model: Callable[[int], Segmenter] = field(default_factory=lambda: _unset("new_model"))
    compute_prototype_requests: Callable[..., list[dict[int, torch.Tensor]]] = field(
        default_factory=lambda: _unset("compute_prototype_requests")
    )
    compute_prototypes: Callable[..., dict[int, torch.Tensor]] = field(
        default_factory=lambda: _unset("compute_prototypes")
    )
    optimizer: torch.optim.Optimizer | None = None
    epoch: int = 0
    iteration: int = 0
    batch: dict[str, Any] | None = None
    output: SegmenterOutput | None = None
    target: torch.Tensor | None = None
    has_ignore: bool | None = None
    boxes: list[dict[str, torch.Tensor]] | None = None
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    closure: Callable[[], torch.Tensor] = field(default_factory=lambda: _unset("closure"))
    eval_session: int | None = None
    previous_seen: list[int] = field(default_factory=list)
    forward: Callable[[torch.Tensor], SegmenterOutput] = field(default_factory=lambda: _unset("forward"))
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext
    loader_options: dict = field(default_factory=dict)
    fire: Callable[[str], None] = lambda event: None
    out_dir: Path | None = None
    _lut: torch.Tensor | None = field(default=None, repr=False)

    def class_index(self, global_ids: torch.Tensor) -> torch.Tensor:
        """Map global class ids to classifier rows (the ignore index stays itself)."""
        if self._lut is None or self._lut.device != global_ids.device:
            lut = torch.full((256,), -1, dtype=torch.long)
            lut[IGNORE_INDEX] = IGNORE_INDEX
            for row, cid in enumerate(self.seen):
                lut[cid] = row
            self._lut = lut.to(global_ids.device)
        rows = self._lut[global_ids.long()]
        if global_ids.device.type == "cpu" and (rows < 0).any():  # a host check would stall a GPU every step
            bad = sorted(set(global_ids[rows < 0].tolist()))
            raise ValueError(f"class ids {bad} are not covered by the classifier (seen: {self.seen})")
        return rows
