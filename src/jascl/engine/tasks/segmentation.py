"""The segmentation task: dense labels, a segmenter (:mod:`jascl.networks`), DiceCE, Dice / IoU per class."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from jascl import distributed
from jascl.data.datasets import LabelledDataset, collate_items
from jascl.data.sampling import derive_seed
from jascl.data.types import dense
from jascl.engine.defaults import (
    ClassifierGrowth,
    Evaluation,
    ModelSelection,
    SessionCheckpoint,
    StorePrototypes,
    SupervisedLoss,
)
from jascl.engine.prototypes import PrototypeAccumulator, PrototypeRequest
from jascl.engine.tasks.base import Task
from jascl.errors import ConfigError
from jascl.evaluation.evaluator import MAX_BLOCK_ELEMENTS, Block, plan_blocks
from jascl.networks.base import (
    Segmenter,
    SegmenterOutput,
    create_segmenter,
    encoder_modules,
    eval_mode,
    whole_sample_features,
    windowed,
)
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.plugin import Plugin
    from jascl.engine.state import LoopState


class _TrainForward(nn.Module):
    """``forward_features`` as a module returning a tuple, the form DistributedDataParallel wraps."""

    def __init__(self, model: Segmenter) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.forward_features(x)
        return out.logits, out.features


class SegmentationTask(Task):
    """Dense segmentation (every protocol without ``task: detection``): the behaviour the loop always had."""

    name = "segmentation"

    #: training batches: the store's patches are read into the batch itself (no stacking copy)
    collate = staticmethod(collate_items)

    def new_model(self, num_classes: int) -> Segmenter:
        run = self.context
        cfg, protocol = run.config, run.protocol
        torch.manual_seed(run.seed)
        model = create_segmenter(
            cfg.backbone,
            protocol.spatial_dims,
            protocol.in_channels,
            num_classes,
            cosine=cfg.classifier == "cosine",
            temperature=cfg.temperature,
            **cfg.backbone_args,
        )
        if cfg.patch_size is not None:
            if len(cfg.patch_size) != protocol.spatial_dims:
                raise ConfigError(
                    f"patch_size={cfg.patch_size}: needs {protocol.spatial_dims} entries for this protocol"
                )
            model.backbone.check_input_size(tuple(cfg.patch_size), "patch_size")
        else:
            model.backbone.check_input_size(
                tuple(dense(run.data[0].train).images.shape[2:]), "image size (patch_size=null)"
            )
        model = model.to(run.device)
        if cfg.sync_batchnorm:
            distributed.sync_batchnorm(model, run.device)
        if run.memory_format is not None:
            model = model.to(memory_format=run.memory_format)
        if cfg.compile:
            # in place, so parameter names (and checkpoints) stay the same; static shapes: one graph per input
            # shape (batch remainders, evaluation sizes) is more robust than symbolic shapes
            model.backbone.compile(dynamic=False)
        return model

    def load_weights(self, model: nn.Module, path: str) -> None:
        from jascl.networks.weights import load_backbone_weights

        assert isinstance(model, Segmenter)
        load_backbone_weights(model.backbone, path)

    def frozen_modules(self, model: nn.Module, t: int, policy: str) -> list[nn.Module]:
        assert isinstance(model, Segmenter)
        frozen = list(model.backbone.frozen_modules(t))  # e.g. SAM's image encoder after session 0
        if t > 0 and policy == "all_but_classifier":
            frozen = [model.backbone]
        elif t > 0 and policy == "encoder":  # partially frozen: the decoder and classifier train
            frozen += encoder_modules(model.backbone)
        return frozen

    def labelled_dataset(self, t: int, augment: bool, crop: bool) -> LabelledDataset:
        run = self.context
        session = run.protocol.sessions[t]
        patch = run.config.patch_size
        return LabelledDataset(
            dense(run.data[t].train),
            session.classes,
            session.other_classes,
            augment=augment,
            patch_size=patch if crop else None,
            seed=derive_seed(run.seed, "augment", t),
            # training crops travel as uint8 (an eighth of int64's bytes through the loader workers' shared
            # memory and the host-to-device copy); :meth:`training_batch` widens them on the device
            label_dtype=torch.uint8 if crop else torch.int64,
        )

    def training_batch(self, batch: Any) -> Any:
        """The loader's batch with its uint8 labels moved to the run's device and widened there to int64
        (the dtype every loss and plugin indexes with): the same values, converted where it is cheapest."""
        if (
            isinstance(batch, dict)
            and isinstance(batch.get("label"), torch.Tensor)
            and batch["label"].dtype == torch.uint8
        ):
            batch = {**batch, "label": batch["label"].to(self.context.device, non_blocking=True).long()}
        return batch

    def model_inputs(self, state: LoopState) -> tuple[Any, ...]:
        run, batch = self.context, state.batch
        assert batch is not None, "the loop sets the batch before the closure runs"
        x = batch["image"].to(run.device, non_blocking=True)
        if run.memory_format is not None:
            x = x.contiguous(memory_format=run.memory_format)
        labels = batch["label"]
        if "ignore" in batch:  # flagged per sample by the dataset
            state.has_ignore = bool(batch["ignore"].any())
        else:  # a batch a plugin made: check on the host if it is there
            state.has_ignore = bool((labels == IGNORE_INDEX).any()) if labels.device.type == "cpu" else None
        state.target = state.class_index(labels.to(run.device, non_blocking=True))
        return (x,)

    def training_forward(self, model: nn.Module) -> Callable[..., Any]:
        assert isinstance(model, Segmenter)
        return model.forward_features

    def ddp_forward(self, model: nn.Module, find_unused: bool) -> Callable[..., Any]:
        assert isinstance(model, Segmenter)
        ddp = distributed.wrap(_TrainForward(model), self.context.device, find_unused)
        return lambda x: SegmenterOutput(*ddp(x))

    def default_plugins(self) -> list[Plugin]:
        run = self.context
        return [
            ClassifierGrowth(),
            SupervisedLoss(),
            ModelSelection(run.data, run.autocast),
            StorePrototypes(),
            Evaluation(run.data, run.autocast, run.progress),
            SessionCheckpoint(run.method, run.checkpoint_meta),
        ]

    @torch.no_grad()
    def compute_prototypes(
        self,
        model: nn.Module,
        t: int,
        classes: list[int],
        normalize_pixels: bool = False,
        per_sample: bool = False,
        complement: bool = False,
        form: str = "eq2",
    ) -> dict[int, torch.Tensor]:
        request = PrototypeRequest(tuple(classes), normalize_pixels, per_sample, complement, form)
        return self.compute_prototype_requests(model, t, [request])[0]

    @torch.no_grad()
    def compute_prototype_requests(
        self, model: nn.Module, t: int, requests: Sequence[PrototypeRequest]
    ) -> list[dict[int, torch.Tensor]]:
        """One pass over session ``t``'s labelled samples (whole, eval mode) for every request: each batch's
        features go to every request's accumulator, so each result is the one its own pass would give."""
        assert isinstance(model, Segmenter)
        run = self.context
        accs = [r.accumulator() for r in requests]
        dataset = self.labelled_dataset(t, augment=False, crop=False)
        # whole samples: batch them only when they all have one size (real datasets vary)
        uniform = getattr(run.data[t].train.images, "uniform", True)
        loader = DataLoader(
            Subset(dataset, distributed.shard(range(len(dataset)))), batch_size=run.config.batch_size if uniform else 1
        )
        cfg = run.config
        with eval_mode(model), run.autocast():
            for batch in loader:
                images, labels = batch["image"].to(run.device), batch["label"].to(run.device)
                accumulate_prototypes(model, images, labels, accs, cfg.patch_size, cfg.sw_batch_size, cfg.sw_overlap)
        for acc in accs:
            acc.all_reduce(model.backbone.feature_channels)
        return [r.result(acc) for r, acc in zip(requests, accs)]


def accumulate_prototypes(
    model: Segmenter,
    images: torch.Tensor,
    labels: torch.Tensor,
    accs: Sequence[PrototypeAccumulator],
    roi: Sequence[int] | None,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
) -> None:
    """Add a batch of whole samples (B, C, *spatial) and their labels to every accumulator (the caller sets eval
    mode, autocast and ``no_grad``): their features in one pass (:func:`jascl.networks.base.whole_sample_features`,
    sliding windows of ``roi`` over volumes larger than it), or, where those would exceed
    :data:`PROTOTYPE_BLOCK_ELEMENTS`, one sample at a time in :func:`prototype_blocks`, whose pieces add up to
    the same prototypes."""
    blocks = prototype_blocks(images, roi, overlap, model.backbone.feature_channels)
    if blocks is None:
        features = whole_sample_features(model, images, roi, sw_batch_size, overlap)
        for acc in accs:
            acc.update(features, labels)
        return
    pieces = block_features(model, images, labels, blocks, roi, sw_batch_size, overlap)
    for b, features, piece in pieces:
        for acc in accs:
            acc.add_piece(features, piece)
        del features
        if b == len(blocks) - 1:  # the sample's last block
            for acc in accs:
                acc.end_sample()


def block_features(
    model: Segmenter,
    images: torch.Tensor,
    labels: torch.Tensor,
    blocks: Sequence[Block],
    roi: Sequence[int] | None,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(block index, features (1, D, *target), labels (1, *target)) of every block of every sample of a batch
    (B, C, *spatial), one sample after another: the stitched features of each block's target, those of the whole
    sample there (:func:`prototype_blocks`), without ever holding the whole sample's."""
    for b in range(images.shape[0]):
        for i, block in enumerate(blocks):
            source: tuple[Any, ...] = (slice(b, b + 1), slice(None), *block.source)
            local: tuple[Any, ...] = (..., *block.local)
            target: tuple[Any, ...] = (slice(b, b + 1), *block.target)
            yield i, whole_sample_features(model, images[source], roi, sw_batch_size, overlap)[local], labels[target]


#: stitched feature elements a prototype pass holds at once over one volume (the evaluator's bound, 2 GiB in float32)
PROTOTYPE_BLOCK_ELEMENTS = MAX_BLOCK_ELEMENTS


def prototype_blocks(
    images: torch.Tensor, roi: Sequence[int] | None, overlap: float, channels: int
) -> list[Block] | None:
    """The blocks a prototype pass takes ``images`` (B, C, *spatial) in, one sample at a time, or None to take the
    batch whole: None unless the samples go through sliding windows and their stitched features (B x ``channels``
    per voxel) exceed :data:`PROTOTYPE_BLOCK_ELEMENTS`. The blocks are the evaluator's
    (:func:`jascl.evaluation.evaluator.plan_blocks`): each block's source holds every window that touches its
    target, so the target's stitched features are those of the whole volume, and the sample's pieces add up to
    its prototypes (:meth:`jascl.engine.prototypes.PrototypeAccumulator.add_piece`)."""
    if not windowed(images, roi):
        return None
    assert roi is not None
    spatial = tuple(images.shape[2:])
    if images.shape[0] * channels * math.prod(spatial) <= PROTOTYPE_BLOCK_ELEMENTS:
        return None
    return plan_blocks(spatial, roi, overlap, channels, PROTOTYPE_BLOCK_ELEMENTS)
