"""The detection task: boxes, a Faster R-CNN (:mod:`jascl.networks.detector`), torchvision's losses, COCO mAP.

The paper's appendix "Detection results" runs JASCL on COCO-O with a Faster R-CNN. Here the loop trains a
:class:`~jascl.networks.detector.Detector` session after session as it trains a segmenter; what changes is
supplied by :class:`DetectionTask`:

* **batches**: ``{"image": [(C, H, W)], "targets": [{"boxes", "labels"}], "id": [...]}``; a session's
  targets keep the boxes of the classes it teaches (the boxes of earlier classes in its images are dropped,
  i.e. they are background, as untaught pixels are in the segmentation sessions' ``other_classes:
  background``); labels become classifier rows on the device (``state.boxes``). Augmentation: a horizontal flip
  drawn from ``(seed, pass, index)``, like the segmentation crops.
* **the supervised loss** ``losses["det"]``: the sum of torchvision's four Faster R-CNN losses (RPN objectness
  and box regression, RoI classification and box regression).
* **classifier growth**: the box predictor's classification rows grow, imprinted from the new classes'
  eq. 2 prototypes (old rows bit-exact), and its class-specific box regression grows with them.
* **eq. 2 prototypes over RoI features** (:meth:`DetectionTask.compute_prototypes`): a labelled image plays the
  role of a sample and its boxes the role of pixels. The "pixels" of an image are the box-head representations
  (the classifier's input) of its ground-truth boxes, labelled with their class, and of *background boxes*
  (:func:`background_boxes`: a fixed grid of boxes whose IoU with every ground-truth box is below 0.3,
  labelled 0). So P_c is the mean over the images showing c of the unit-normalised mean feature of their c
  boxes, class 0's prototype is that of the background boxes, and the complement of c (the per-class
  background of the replay store) is the mean feature of every other box of c's images. Eval mode, no GAS
  noise. Prototype replay (:class:`~jascl.methods.replay.PrototypeReplayPlugin`) then trains them through the
  box classifier unchanged.
* **evaluation**: COCO mAP (:class:`~jascl.evaluation.detection.DetectionMetrics`) on the test images of every
  session so far, over the seen classes (ground-truth boxes of classes not yet seen are left out); the record's
  ``all`` / ``old`` / ``new`` / ``base`` are mean per-class AP over those classes (``all`` is mAP over the
  seen classes with ground truth), plus ``map``, ``map_50``, ``per_class`` AP, and box / image counts per class.
* **model selection** on validation mAP (``best_val_new``: the session's classes; ``best_val_all``: every seen
  class).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from torchvision.ops import box_iou

from jascl import distributed
from jascl.data.sampling import derive_seed, split_key
from jascl.data.types import DetectionSplit, SessionData, Split
from jascl.engine.defaults import ClassifierGrowth, ModelSelection, SessionCheckpoint, StorePrototypes
from jascl.engine.plugin import Plugin
from jascl.engine.prototypes import PrototypeAccumulator
from jascl.engine.tasks.base import Task
from jascl.errors import DataError
from jascl.evaluation.detection import DetectionMetrics
from jascl.evaluation.metrics import harmonic_mean
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.detector import Detector, DetectorOutput
    from jascl.protocols.schema import Protocol

log = logging.getLogger("jascl")


#: background boxes (:func:`background_boxes`): at most this IoU with any ground-truth box
BACKGROUND_MAX_IOU = 0.3


def detection_split(split: Split | DetectionSplit | None, what: str) -> DetectionSplit:
    """``split`` as a detection split; a segmentation split is a TypeError naming ``what``."""
    if not isinstance(split, DetectionSplit):
        raise TypeError(f"{what}: the detection task needs box targets (a DetectionSplit), got {type(split).__name__}")
    return split


def taught_targets(target: dict[str, np.ndarray], taught: Sequence[int]) -> dict[str, torch.Tensor]:
    """The boxes of ``target`` whose class is in ``taught`` (global ids kept): ``{"boxes" (M, 4), "labels" (M,)}``,
    with ``"iscrowd"`` (M,) when the target has it (crowd boxes and the test splits' ignore regions: pycocotools
    neither rewards nor penalises detections on them)."""
    boxes = torch.as_tensor(np.asarray(target["boxes"], dtype=np.float32)).reshape(-1, 4)
    labels = torch.as_tensor(np.asarray(target["labels"], dtype=np.int64)).reshape(-1)
    keep = torch.isin(labels, torch.as_tensor(list(taught), dtype=torch.int64))
    out = {"boxes": boxes[keep], "labels": labels[keep]}
    if "iscrowd" in target:
        out["iscrowd"] = torch.as_tensor(np.asarray(target["iscrowd"], dtype=np.int64)).reshape(-1)[keep]
    return out


class DetectionDataset(Dataset):
    """The labelled images of a detection split with the session's boxes.

    Items: ``{"image": (C, H, W) float32, "boxes": (M, 4) float32 xyxy, "labels": (M,) int64 global ids,
    "id": str}`` with only the boxes of ``taught`` classes. ``augment``: a horizontal flip with probability 0.5,
    drawn from ``(seed, pass, index)`` alone (keys from a :class:`~jascl.data.sampling.SeededBatchSampler`).
    """

    def __init__(self, split: DetectionSplit, taught: Sequence[int], augment: bool = False, seed: int = 0) -> None:
        self.split = split
        self.taught = [int(c) for c in taught]
        self.augment = augment
        self.seed = seed

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        pass_index, index = split_key(key)
        image = torch.as_tensor(np.asarray(self.split.images[index], dtype=np.float32))
        target = taught_targets(self.split.targets[index], self.taught)
        if "iscrowd" in target:  # crowd boxes are no training target (torchvision's reference drops them too)
            keep = target["iscrowd"] == 0
            target = {"boxes": target["boxes"][keep], "labels": target["labels"][keep]}
        boxes = target["boxes"]
        bad = (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])
        if bool(bad.any()):  # torchvision's box losses would be NaN
            raise DataError(
                f"sample {self.split.ids[index]}: box {boxes[bad][0].tolist()} has no area (x2 <= x1 or y2 <= y1); "
                "drop or fix it in the data ('jascl data check' reports such boxes of COCO-format copies)"
            )
        if self.augment and np.random.default_rng(derive_seed(self.seed, pass_index, index)).random() < 0.5:
            width = image.shape[-1]
            image = image.flip(-1)
            boxes = torch.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1)
        return {"image": image.contiguous(), "boxes": boxes, "labels": target["labels"], "id": self.split.ids[index]}


def detection_collate(items: list[dict]) -> dict:
    """A batch of detection items: lists of images and targets (images may differ in size)."""
    return {
        "image": [item["image"] for item in items],
        "targets": [{"boxes": item["boxes"], "labels": item["labels"]} for item in items],
        "id": [item["id"] for item in items],
    }


def background_boxes(
    height: int, width: int, gt_boxes: torch.Tensor, max_iou: float = BACKGROUND_MAX_IOU, fractions=(0.25, 0.5)
) -> torch.Tensor:
    """Boxes of background: a grid of squares whose IoU with every ground-truth box is at most ``max_iou``.

    For each fraction f of the shorter side, squares of side ``s = f * min(height, width)`` at a stride of s / 2,
    clipped to the image. Deterministic (no random draw), so the prototypes of a session are a function of its
    data and model. Returns (N, 4) float32 xyxy; none when every grid box overlaps an object.
    """
    out = []
    for f in fractions:
        side = max(2.0, f * min(height, width))
        stride = side / 2
        ys = torch.arange(0.0, max(height - side, 0.0) + 1e-6, stride)
        xs = torch.arange(0.0, max(width - side, 0.0) + 1e-6, stride)
        yy, xx = torch.meshgrid(ys, xs, indexing="ij")
        grid = torch.stack([xx, yy, xx + side, yy + side], dim=-1).reshape(-1, 4)
        grid[:, 2].clamp_(max=float(width))
        grid[:, 3].clamp_(max=float(height))
        out.append(grid)
    boxes = torch.cat(out)
    gt = gt_boxes.reshape(-1, 4).float()
    if len(gt):
        boxes = boxes[box_iou(boxes, gt).amax(dim=1) <= max_iou]
    return boxes


def record_for(protocol: Protocol, t: int, seen: Sequence[int], result: dict, counts: dict) -> dict:
    """Session ``t``'s record from a :meth:`DetectionMetrics.compute` result over the seen classes."""
    session = protocol.sessions[t]
    per_class = {int(c): float(v) for c, v in result["per_class"].items()}
    fg = [c for c in seen if c != 0]
    scored = {c: per_class.get(c, math.nan) for c in fg}

    def mean(ids: Sequence[int]) -> float:
        valid = [scored[c] for c in ids if c in scored and not math.isnan(scored[c])]
        return sum(valid) / len(valid) if valid else math.nan

    new = list(session.new_classes)
    old = [c for c in fg if c not in new]
    return {
        "session": t,
        "name": session.name,
        "domains": list(session.domains),
        "all": mean(fg),
        "old": mean(old),
        "new": mean(new),
        "hm": harmonic_mean(mean(old), mean(new)),
        "base": mean(protocol.base_classes()),
        "background": math.nan,
        "map": result["map"],
        "map_50": result["map_50"],
        "per_class": {str(c): v for c, v in scored.items()},
        "support": {str(c): counts["boxes"].get(c, 0) for c in fg},
        "samples": {str(c): counts["images"].get(c, 0) for c in fg},
    }


@torch.no_grad()
def score_detector(
    model: Detector,
    splits: Sequence[DetectionSplit],
    seen: Sequence[int],
    device: torch.device,
    batch_size: int,
    autocast: Callable[[], AbstractContextManager] | None = None,
    old: Sequence[int] = (),
    new: Sequence[int] = (),
) -> tuple[dict, dict]:
    """COCO mAP of ``model`` on ``splits`` over the ``seen`` classes (eval mode; each rank scores its share of the
    images, the metric gathers them). Returns the :meth:`DetectionMetrics.compute` result and the ground-truth
    counts ``{"boxes": {class: n}, "images": {class: n}}`` over every rank's images."""
    rows = torch.as_tensor(list(seen), dtype=torch.int64)
    fg = [c for c in seen if c != 0]
    metrics = DetectionMetrics(old=old or [c for c in fg if c not in new], new=new)
    boxes: dict[int, int] = {}
    images: dict[int, int] = {}
    with eval_mode(model):
        for split in splits:
            indices = distributed.shard(range(len(split)))
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                batch = [torch.as_tensor(np.asarray(split.images[i], dtype=np.float32)).to(device) for i in chunk]
                with autocast() if autocast is not None else _null():
                    preds = model.predict(batch)
                targets = [taught_targets(split.targets[i], fg) for i in chunk]
                for target in targets:
                    crowd = target.get("iscrowd")
                    scored = target["labels"] if crowd is None else target["labels"][crowd == 0]
                    for c in scored.tolist():
                        boxes[c] = boxes.get(c, 0) + 1
                    for c in set(scored.tolist()):
                        images[c] = images.get(c, 0) + 1
                metrics.update(
                    [
                        {"boxes": p["boxes"].float(), "scores": p["scores"].float(), "labels": rows[p["labels"].cpu()]}
                        for p in preds
                    ],
                    targets,
                )
    result = metrics.compute()
    counts = {"boxes": boxes, "images": images}
    if distributed.active():
        shares = distributed.all_gather_object(counts)
        counts = {key: _sum_counts([s[key] for s in shares]) for key in ("boxes", "images")}
    return result, counts


def _sum_counts(parts: Sequence[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for part in parts:
        for c, n in part.items():
            out[c] = out.get(c, 0) + n
    return out


class _null(AbstractContextManager):
    def __exit__(self, *exc: object) -> None:
        return None


class DetectorGrowth(ClassifierGrowth):
    """``classifier-growth`` for a detector: new classification rows imprinted from the new classes' RoI-feature
    prototypes (random rows, with a warning, when a class has no labelled box), and their box-regression rows."""

    def setup_model(self, state: LoopState) -> None:
        model: Any = state.model
        new = state.seen[model.num_classes :]
        if not new:
            return
        protos = state.compute_prototypes(new)
        init = torch.stack([protos[c] for c in new]) if all(c in protos for c in new) else None
        if init is None:
            log.warning(
                "session %d: some new classes have no labelled box; random classifier rows", state.session.index
            )
        model.grow(len(new), init)


class DetectionLoss(Plugin):
    """``supervised-loss`` for a detector: ``losses["det"]``, the sum of torchvision's four Faster R-CNN losses."""

    name = "supervised-loss"

    def state_dict(self) -> dict:
        return {}

    def after_forward(self, state: LoopState) -> None:
        out: DetectorOutput = state.output  # type: ignore[assignment]
        state.losses["det"] = sum(out.losses.values(), torch.zeros((), device=state.device))


class DetectionEvaluation(Plugin):
    """``evaluation`` for a detector: COCO mAP on the test images of every session so far (the record)."""

    name = "evaluation"

    def __init__(self, data: Sequence[SessionData], autocast: Callable[[], AbstractContextManager]) -> None:
        self.data = data
        self.autocast = autocast

    def state_dict(self) -> dict:
        return {}

    def evaluate(self, state: LoopState) -> None:
        t = state.session.index
        splits = [detection_split(d.test, f"session {d.session.index} test split") for d in self.data[: t + 1]]
        new = list(state.session.new_classes)
        result, counts = score_detector(
            state.model,  # type: ignore[arg-type]
            splits,
            state.seen,
            state.device,
            state.config.batch_size,
            self.autocast,
            new=new,
        )
        state.metrics["eval"] = result
        state.record = record_for(state.protocol, t, state.seen, result, counts)


class DetectionModelSelection(ModelSelection):
    """``model-selection`` for a detector: validation mAP (``best_val_new``: mean AP of the session's classes;
    ``best_val_all``: of every seen class) instead of Dice; otherwise :class:`ModelSelection`."""

    def score(self, state: LoopState, splits: list) -> float:
        fg = [c for c in state.seen if c != 0]
        result, _ = score_detector(
            state.model,  # type: ignore[arg-type]
            [detection_split(s, "validation split") for s in splits],
            state.seen,
            state.device,
            state.config.batch_size,
            state.autocast,
        )
        ids = list(state.session.classes) if state.config.model_selection == "best_val_new" else fg
        values = [result["per_class"].get(c, math.nan) for c in ids]
        valid = [v for v in values if not math.isnan(v)]
        return sum(valid) / len(valid) if valid else math.nan


def build_detector(protocol: Protocol, config: RunConfig, num_classes: int) -> Detector:
    """The run's detector with ``num_classes`` rows, on the CPU (:func:`jascl.engine.checkpoint.detector_for_run`)."""
    from jascl.engine.checkpoint import detector_for_run

    return detector_for_run(protocol, config, num_classes)


class _DetectionTrainForward(nn.Module):
    """``forward_train`` as a module returning tensors, the form DistributedDataParallel wraps."""

    def __init__(self, model: Detector) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]) -> tuple:
        out = self.model.forward_train(images, targets)
        names = tuple(sorted(out.losses))
        return (names, *[out.losses[k] for k in names]), (
            out.class_logits,
            out.roi_features,
            out.roi_targets,
            out.roi_batch,
            list(out.roi_boxes),
        )


class DetectionTask(Task):
    """Detection (``task: detection``): see the module docstring."""

    name = "detection"
    collate = staticmethod(detection_collate)

    def new_model(self, num_classes: int) -> nn.Module:
        run = self.context
        torch.manual_seed(run.seed)
        return build_detector(run.protocol, run.config, num_classes).to(run.device)

    def load_weights(self, model: nn.Module, path: str) -> None:
        from jascl.networks.detector_weights import load_detector_weights

        report = load_detector_weights(model, path)
        log.info("detector weights %s: %d tensors loaded, %d skipped", path, report["loaded"], len(report["skipped"]))

    def frozen_modules(self, model: nn.Module, t: int, policy: str) -> list[nn.Module]:
        detector: Any = model
        frozen = list(detector.frozen_modules(t))
        if t > 0 and policy == "all_but_classifier":  # everything but the box predictor
            frozen += list(detector.encoder_modules()) + list(detector.head_modules())
        elif t > 0 and policy == "encoder":
            frozen += list(detector.encoder_modules())
        return frozen

    def labelled_dataset(self, t: int, augment: bool, crop: bool) -> DetectionDataset:
        run = self.context
        session = run.protocol.sessions[t]
        return DetectionDataset(
            detection_split(run.data[t].train, f"session {t} training split"),
            session.classes,
            augment=augment,
            seed=derive_seed(run.seed, "augment", t),
        )

    def model_inputs(self, state: LoopState) -> tuple[Any, ...]:
        batch, device = state.batch, self.context.device
        assert batch is not None, "the loop sets the batch before the closure runs"
        images = [image.to(device, non_blocking=True) for image in batch["image"]]
        targets = [
            {"boxes": t["boxes"].to(device), "labels": state.class_index(t["labels"]).to(device)}
            for t in batch["targets"]
        ]
        state.boxes = targets
        state.target = None
        state.has_ignore = False
        return images, targets

    def training_forward(self, model: nn.Module) -> Callable[..., Any]:
        return model.forward_train  # type: ignore[return-value]

    def ddp_forward(self, model: nn.Module, find_unused: bool) -> Callable[..., Any]:
        from jascl.networks.detector import DetectorOutput

        ddp = distributed.wrap(_DetectionTrainForward(model), self.context.device, find_unused)  # type: ignore[arg-type]

        def forward(images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]) -> DetectorOutput:
            (names, *losses), (logits, features, rows, batch, boxes) = ddp(images, targets)
            return DetectorOutput(dict(zip(names, losses)), logits, features, rows, batch, boxes)

        return forward

    def default_plugins(self) -> list[Plugin]:
        run = self.context
        return [
            DetectorGrowth(),
            DetectionLoss(),
            DetectionModelSelection(run.data, run.autocast),
            StorePrototypes(),
            DetectionEvaluation(run.data, run.autocast),
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
        """Eq. 2 over RoI features: an image is a sample, its ground-truth boxes (label: their class) and its
        :func:`background_boxes` (label 0) are its pixels; see the module docstring."""
        run = self.context
        detector: Any = model
        session = run.protocol.sessions[t]
        split = detection_split(run.data[t].train, f"session {t} training split")
        acc = PrototypeAccumulator(classes, normalize_pixels, keep_samples=per_sample, complement=complement, form=form)
        batch_size = run.config.batch_size
        indices = distributed.shard(range(len(split)))
        with eval_mode(detector), run.autocast():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                images = [torch.as_tensor(np.asarray(split.images[i], dtype=np.float32)) for i in chunk]
                boxes, labels = [], []
                for i, image in zip(chunk, images):
                    target = taught_targets(split.targets[i], session.classes)
                    bg = background_boxes(int(image.shape[-2]), int(image.shape[-1]), target["boxes"])
                    boxes.append(torch.cat([target["boxes"], bg]).to(run.device))
                    labels.append(torch.cat([target["labels"], torch.zeros(len(bg), dtype=torch.int64)]))
                feats = detector.box_features([im.to(run.device) for im in images], boxes)
                for f, lab in zip(feats, labels):
                    if len(lab):  # one image = one sample: (1, D, M) features, (1, M) labels
                        acc.update(f.float().t()[None], lab.to(run.device)[None])
        acc.all_reduce(detector.feature_channels)
        return acc.samples() if per_sample else acc.compute()
