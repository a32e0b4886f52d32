"""A Faster R-CNN detector whose box classifier grows as new classes arrive (issue 19, the paper's COCO-O appendix).

Built from torchvision's detection components (``GeneralizedRCNNTransform``, the backbone, ``AnchorGenerator``,
``RegionProposalNetwork``, ``RoIHeads`` with ``MultiScaleRoIAlign`` and ``TwoMLPHead``, ``fastrcnn_loss``); only the
box predictor is jascl's: a :class:`~jascl.networks.classifier.PixelClassifier` (the classification layer GAS
perturbs and prototypes replay through, linear with bias by default like torchvision's ``cls_score``) next to a
growable class-specific box regressor, installed as ``roi_heads.box_predictor`` so torchvision's own code paths run
on it unchanged.

Conventions:
    * images: a list of (C, H, W) float tensors with intensities in [0, 1] (any sizes); the transform normalises
      and resizes them and every output box is in input-image pixel coordinates (x1, y1, x2, y2).
    * class rows: K rows, row 0 = background, rows 1..K-1 = the protocol's classes in order; targets' ``labels``
      are classifier rows (1..K-1), never dataset category ids.
    * features: D = the box head's representation size (128 for ``small``, 1024 for ``resnet50-fpn``): the
      classifier's input for one RoI, the representation eq. 2 prototypes and PAS use.
    * module names follow torchvision's (``backbone.*``, ``rpn.*``, ``roi_heads.box_head.*``,
      ``roi_heads.box_predictor.*``), so a torchvision Faster R-CNN state dict loads by name
      (:func:`jascl.networks.detector_weights.load_detector_weights`).

Variants (:data:`DETECTOR_VARIANTS`):
    * ``small`` (tests, CPU, the synthetic benchmark): three stride-2 conv + GroupNorm + ReLU stages of 16, 32, 64
      channels (one stride-8 feature map; GroupNorm keeps training and evaluation alike and is indifferent to the
      batch size), anchors of 1/8, 1/4 and 1/2 of ``image_size`` (8, 16, 32 px for 64x64 images, whose synthetic
      objects are 10-35 px) at aspect ratios 0.5, 1, 2, RoIAlign 7x7 with one sample per bin, a ``TwoMLPHead`` of
      size 128; images keep
      their size (``min_size = max_size = image_size``, or no resizing at all without ``image_size``) and are
      normalised with mean 0.5, std 0.25 per channel; 64 / 128 RPN / RoI samples per image, 50 detections per image.
    * ``resnet50-fpn``: torchvision's ``fasterrcnn_resnet50_fpn`` architecture (ResNet-50 with FPN built by
      ``resnet_fpn_backbone``, its default transform 800/1333 and settings), RGB only. Two choices follow
      torchvision's COCO-pretrained weights rather than its ``weights=None`` constructor: ``FrozenBatchNorm2d`` (the
      detector trains with two images per device, too few for batch statistics) with ``eps = 0`` (the value
      torchvision sets when it loads those weights; it is not in the state dict, so it is fixed at construction and
      a rebuilt model matches the trained one); every stage stays trainable (torchvision freezes conv1 and layer1
      with pretrained weights; here freezing is the loop's policy: :meth:`Detector.encoder_modules`).

Deviations from torchvision's ``FastRCNNPredictor``: the box regressor is initialised (and grown) with normal
std 0.001 weights and zero biases, as Detectron and mmdetection (from which the authors' SoftTeacher code derives)
initialise it, instead of ``nn.Linear``'s default; ``cosine=True`` swaps the linear classifier for the authors'
cosine one (no bias); under autocast the RPN and the box regressor compute in float32 (torchvision's would make
anchors, proposals and deltas in bfloat16, 4-8 px apart at 1000 px).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.models.detection.faster_rcnn import TwoMLPHead
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss
from torchvision.models.detection.rpn import RegionProposalNetwork
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops import boxes as box_ops
from torchvision.ops.misc import FrozenBatchNorm2d

from jascl.errors import ConfigError
from jascl.networks.classifier import PixelClassifier
from jascl.networks.detector_parts import (
    BoxPredictor,
    BoxRegressor,
    KeepSizeTransform,
    SmallBackbone,
    float32_features,
    rpn_context,
)

DETECTOR_VARIANTS = ("small", "resnet50-fpn")

# options a caller may pass through to torchvision (FasterRCNN's and its transform's keyword arguments)
_TORCHVISION_OPTIONS = (
    set(inspect.signature(FasterRCNN.__init__).parameters) | set(inspect.signature(GeneralizedRCNNTransform).parameters)
) - {"self", "backbone", "num_classes", "box_predictor", "kwargs", "min_size", "max_size", "image_mean", "image_std"}


class LayerNotFoundError(ConfigError, ValueError):
    """A layer name :meth:`Detector.resolve_layer` does not know (a ConfigError: one line, exit code 2)."""


@dataclass
class DetectorOutput:
    """What :meth:`Detector.forward_train` returns; R = RoIs sampled for the box head's loss over the batch.

    Attributes:
        losses: torchvision's four losses: ``loss_classifier``, ``loss_box_reg``, ``loss_objectness``,
            ``loss_rpn_box_reg`` (scalars).
        class_logits: (R, K) classifier output on the sampled RoIs (GAS noise included when attached).
        roi_features: (R, D) box-head representations of those RoIs (the classifier's input).
        roi_targets: (R,) int64 classifier row assigned to each RoI (0 = background).
        roi_batch: (R,) int64 index of the image each RoI belongs to.
        roi_boxes: per image, its sampled RoIs (M_i, 4) xyxy in input-image pixels, in the order of their rows in
            ``class_logits`` (image 0's first); what another model scores "on the same RoIs" passes to
            :meth:`Detector.box_features`. Empty when the producer did not carry them.
    """

    losses: dict[str, torch.Tensor]
    class_logits: torch.Tensor
    roi_features: torch.Tensor
    roi_targets: torch.Tensor
    roi_batch: torch.Tensor
    roi_boxes: list[torch.Tensor] = field(default_factory=list)


class Detector(nn.Module):
    """Faster R-CNN with a growable box classifier; see the module docstring for conventions and variants.

    Args:
        num_classes: K, background included (row 0 = background).
        variant: one of :data:`DETECTOR_VARIANTS`.
        in_channels: image channels (``resnet50-fpn``: 3 only).
        image_size: ``small``: the square size images come in (anchors scale with it; None = keep any size and
            use the anchors of 64x64 images); ``resnet50-fpn``: ignored (torchvision's 800 / 1333 resizing).
        cosine: a cosine classifier (the authors' segmentation classifier) instead of torchvision's linear one.
        temperature: the cosine classifier's logit scale.
        **kwargs: torchvision ``FasterRCNN`` / ``GeneralizedRCNNTransform`` options overriding the variant's
            settings, e.g. ``box_score_thresh`` (0.05), ``box_nms_thresh``, ``box_detections_per_img``,
            ``rpn_batch_size_per_image``, ``box_batch_size_per_image``.

    Raises:
        ConfigError: unknown variant or option, ``num_classes < 1``, or ``resnet50-fpn`` with ``in_channels != 3``.
    """

    def __init__(
        self,
        num_classes: int,
        variant: str = "small",
        in_channels: int = 3,
        image_size: int | None = None,
        cosine: bool = False,
        temperature: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if variant not in DETECTOR_VARIANTS:
            raise ConfigError(f"unknown detector variant {variant!r}; use one of {', '.join(DETECTOR_VARIANTS)}")
        if num_classes < 1:
            raise ConfigError(f"a detector needs at least the background row, got num_classes={num_classes}")
        unknown = sorted(set(kwargs) - _TORCHVISION_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown detector option(s) {', '.join(unknown)}; use torchvision FasterRCNN options such as "
                "box_score_thresh, box_nms_thresh, box_detections_per_img"
            )
        self.variant = variant
        self.in_channels = in_channels
        if variant == "small":
            rcnn = self._small(num_classes, in_channels, image_size, cosine, temperature, kwargs)
        else:
            if in_channels != 3:
                raise ConfigError(
                    f"the resnet50-fpn detector takes RGB images (in_channels=3), got in_channels={in_channels}; "
                    "use the 'small' detector or convert the images to RGB"
                )
            backbone = resnet_fpn_backbone(
                backbone_name="resnet50",
                weights=None,
                norm_layer=partial(FrozenBatchNorm2d, eps=0.0),
                trainable_layers=5,
            )
            predictor = BoxPredictor(1024, num_classes, cosine, temperature)  # TwoMLPHead(256 * 7 * 7, 1024)
            rcnn = FasterRCNN(backbone, num_classes=None, box_predictor=predictor, **kwargs)
        # torchvision's parts under torchvision's names (state dicts load by name); FasterRCNN's forward is not used
        self.transform: GeneralizedRCNNTransform = rcnn.transform
        self.backbone: nn.Module = rcnn.backbone
        self.rpn: RegionProposalNetwork = rcnn.rpn
        self.roi_heads: RoIHeads = rcnn.roi_heads

    @staticmethod
    def _small(
        num_classes: int, in_channels: int, image_size: int | None, cosine: bool, temperature: float, kwargs: dict
    ) -> FasterRCNN:
        backbone = SmallBackbone(in_channels)
        side = image_size or 64
        sizes = tuple(max(2, round(side * f)) for f in (0.125, 0.25, 0.5))
        representation = 128
        settings: dict[str, Any] = {
            "rpn_anchor_generator": AnchorGenerator(sizes=(sizes,), aspect_ratios=((0.5, 1.0, 2.0),)),
            # one sample per bin: the stride-8 map is coarse (a 64x64 image is 8x8 cells, its objects span 1-4
            # cells), and RoIAlign's CPU backward dominates the step (CPU time of forward + backward on 8 images,
            # one thread: 0.34 s with 2x2 samples per bin, 0.21 s with 1)
            "box_roi_pool": MultiScaleRoIAlign(featmap_names=["0"], output_size=7, sampling_ratio=1),
            "box_head": TwoMLPHead(backbone.out_channels * 7 * 7, representation),
            "rpn_pre_nms_top_n_train": 300,
            "rpn_post_nms_top_n_train": 150,
            "rpn_pre_nms_top_n_test": 300,
            "rpn_post_nms_top_n_test": 100,
            "rpn_batch_size_per_image": 64,
            "box_batch_size_per_image": 128,
            "box_detections_per_img": 50,
        }
        settings.update(kwargs)
        mean, std = [0.5] * in_channels, [0.25] * in_channels
        predictor = BoxPredictor(representation, num_classes, cosine, temperature)
        rcnn = FasterRCNN(
            backbone,
            num_classes=None,
            min_size=side,
            max_size=side,
            image_mean=mean,
            image_std=std,
            box_predictor=predictor,
            **settings,
        )
        if image_size is None:
            extra = {k: settings[k] for k in ("size_divisible", "fixed_size") if k in settings}
            rcnn.transform = KeepSizeTransform(side, side, mean, std, **extra)
        return rcnn

    # ------------------------------------------------------------------ the parts plugins use

    @property
    def predictor(self) -> BoxPredictor:
        return cast(BoxPredictor, self.roi_heads.box_predictor)

    @property
    def classifier(self) -> PixelClassifier:
        """The box predictor's classification layer (rows = classes, row 0 = background); GAS perturbs its weight.

        A view of ``roi_heads.box_predictor.classifier`` (the same object, registered once, so state dicts and
        safetensors checkpoints hold each tensor once)."""
        return self.predictor.classifier

    @property
    def box_regressor(self) -> BoxRegressor:
        return self.predictor.box_regressor

    @property
    def num_classes(self) -> int:
        """K, background included (read from the stored weight: reading a GAS-parametrized weight draws noise)."""
        classifier = self.classifier
        if parametrize.is_parametrized(classifier, "weight"):
            return int(cast(Any, classifier).parametrizations["weight"].original.shape[0])
        return classifier.num_classes

    @property
    def feature_channels(self) -> int:
        """D, the box head's representation size (the classifier's input)."""
        return self.classifier.in_channels

    def resolve_layer(self, name: str) -> nn.Module:
        """``"classifier"`` -> :attr:`classifier`; otherwise a dotted module path (e.g. ``roi_heads.box_head.fc7``).

        Raises:
            LayerNotFoundError: (a ConfigError and a ValueError) naming the top-level names.
        """
        if name == "classifier":
            return self.classifier
        try:
            return self.get_submodule(name)
        except AttributeError:
            names = ", ".join(["classifier", *(n for n, _ in self.named_children())])
            raise LayerNotFoundError(
                f"layer {name!r} not found in the detector; use one of {names} or a dotted path below them "
                "(e.g. 'roi_heads.box_head.fc7')"
            ) from None

    def grow(self, num_new: int, init: torch.Tensor | None = None) -> None:
        """Append ``num_new`` class rows: to the classifier (:meth:`PixelClassifier.grow`; ``init`` = (num_new, D)
        imprinting rows) and 4 * ``num_new`` rows to the box regressor; old rows stay bit-exact."""
        self.classifier.grow(num_new, init)
        self.box_regressor.grow(num_new)

    def frozen_modules(self, session: int) -> list[nn.Module]:
        """Modules frozen whatever the policy: none (freezing is the loop's policy)."""
        return []

    def encoder_modules(self) -> list[nn.Module]:
        """The backbone (with its FPN): what ``freeze_incremental=encoder`` freezes."""
        return [self.backbone]

    def head_modules(self) -> list[nn.Module]:
        """Everything but the backbone and the box predictor: the RPN and the box head."""
        return [self.rpn, self.roi_heads.box_head]

    # ------------------------------------------------------------------ forwards

    def _features(self, batch: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        features = self.backbone(batch)
        if isinstance(features, torch.Tensor):
            return OrderedDict([("0", features)])
        return features

    def forward(
        self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]] | None = None
    ) -> DetectorOutput | list[dict[str, torch.Tensor]]:
        """:meth:`forward_train` with targets, :meth:`predict` without (what DDP wraps)."""
        if targets is not None:
            return self.forward_train(images, targets)
        return self.predict(images)

    def forward_train(self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]) -> DetectorOutput:
        """The training forward: torchvision's transform, backbone, RPN (its losses), RoI sampling, RoIAlign, box
        head, predictor and ``fastrcnn_loss``.

        Args:
            images: B tensors (C, H, W), intensities in [0, 1].
            targets: per image ``{"boxes": (M, 4) float xyxy pixels, "labels": (M,) int64 rows 1..K-1}``; M may be 0.

        The RPN computes its losses whatever the module's mode; everything else runs in the current mode (GAS
        noise and sampling as in training when the model trains). RoI sampling draws from torch's RNG. Under
        autocast the RPN and the box regressor run in float32 (boxes in bfloat16 would be 4-8 px coarse).
        """
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        prepared = []
        for target in targets:
            labels = target["labels"]
            if labels.numel() and (int(labels.min()) < 1 or int(labels.max()) >= self.num_classes):
                raise ValueError(
                    f"target labels must be classifier rows 1..{self.num_classes - 1}, got {labels.tolist()}"
                )
            boxes = target["boxes"]
            prepared.append({"boxes": boxes if boxes.is_floating_point() else boxes.float(), "labels": labels.long()})
        image_list, transformed = self.transform(images, prepared)
        assert transformed is not None
        features = self._features(image_list.tensors)
        with rpn_context(self.rpn, True, image_list.tensors.device):
            proposals, rpn_losses = self.rpn(image_list, float32_features(features), transformed)
        heads = self.roi_heads
        proposals, _, labels, regression_targets = heads.select_training_samples(proposals, transformed)
        roi_features = heads.box_head(heads.box_roi_pool(features, proposals, image_list.image_sizes))
        class_logits, box_regression = heads.box_predictor(roi_features)
        loss_classifier, loss_box_reg = fastrcnn_loss(class_logits, box_regression, labels, regression_targets)
        roi_batch = torch.cat(
            [torch.full((len(p),), i, dtype=torch.int64, device=class_logits.device) for i, p in enumerate(proposals)]
        )
        losses = {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg, **rpn_losses}
        original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        roi_boxes = [
            resize_boxes(p, list(size), list(original))
            for p, size, original in zip(proposals, image_list.image_sizes, original_sizes)
        ]
        return DetectorOutput(losses, class_logits, roi_features, torch.cat(labels), roi_batch, roi_boxes)

    def predict(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Detections per image, in input-image coordinates, with torchvision's post-processing (score threshold
        ``roi_heads.score_thresh``, per-class NMS, ``roi_heads.detections_per_img``).

        Returns:
            per image ``{"boxes": (N, 4), "scores": (N,), "labels": (N,) rows >= 1, "features": (N, D),
            "logits": (N, K)}``. ``features`` and ``logits`` are those of the RoI each box was regressed from, the
            ones that scored it: ``softmax(logits)[n, labels[n]] == scores[n]``. (For the representation of the
            regressed box itself, pass the boxes to :meth:`box_features`.)

        Runs in the module's current mode (callers wrap it in eval mode), except the RPN, which always proposes
        with its testing counts and computes no loss. Every output is float32, also under autocast.
        """
        original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        image_list, _ = self.transform(images)
        features = self._features(image_list.tensors)
        with rpn_context(self.rpn, False, image_list.tensors.device):
            proposals, _ = self.rpn(image_list, float32_features(features))
        heads = self.roi_heads
        roi_features = heads.box_head(heads.box_roi_pool(features, proposals, image_list.image_sizes))
        class_logits, box_regression = heads.box_predictor(roi_features)
        roi_features, class_logits = roi_features.float(), class_logits.float()
        results = self.postprocess(class_logits, box_regression, proposals, image_list.image_sizes)
        for result, features_of, logits_of in zip(
            results, roi_features.split([len(p) for p in proposals]), class_logits.split([len(p) for p in proposals])
        ):
            rois = result.pop("rois")
            result["features"] = features_of[rois]
            result["logits"] = logits_of[rois]
        for result, size, original in zip(results, image_list.image_sizes, original_sizes):
            result["boxes"] = resize_boxes(result["boxes"], list(size), list(original))
        return results

    def postprocess(
        self,
        class_logits: torch.Tensor,
        box_regression: torch.Tensor,
        proposals: list[torch.Tensor],
        image_sizes: list[tuple[int, int]],
    ) -> list[dict[str, torch.Tensor]]:
        """``RoIHeads.postprocess_detections`` step for step, also returning ``rois``: the index (within its image's
        proposals) of the RoI each detection comes from. Boxes in transformed-image coordinates.

        torchvision's function drops that index, which the detections' features and logits need; the boxes, scores
        and labels equal its own (tested).
        """
        heads = self.roi_heads
        num_classes = class_logits.shape[-1]
        counts = [len(p) for p in proposals]
        pred_boxes = heads.box_coder.decode(box_regression, proposals)
        pred_scores = F.softmax(class_logits, -1)
        results = []
        for boxes, scores, image_size in zip(pred_boxes.split(counts), pred_scores.split(counts), image_sizes):
            boxes = box_ops.clip_boxes_to_image(boxes, image_size)
            labels = torch.arange(num_classes, device=scores.device).view(1, -1).expand_as(scores)
            rois = torch.arange(len(scores), device=scores.device).view(-1, 1).expand_as(scores)
            # drop the background column, then one candidate per (RoI, class)
            boxes, scores = boxes[:, 1:].reshape(-1, 4), scores[:, 1:].reshape(-1)
            labels, rois = labels[:, 1:].reshape(-1), rois[:, 1:].reshape(-1)
            keep = torch.where(scores > heads.score_thresh)[0]
            boxes, scores, labels, rois = boxes[keep], scores[keep], labels[keep], rois[keep]
            keep = box_ops.remove_small_boxes(boxes, min_size=1e-2)
            boxes, scores, labels, rois = boxes[keep], scores[keep], labels[keep], rois[keep]
            keep = box_ops.batched_nms(boxes, scores, labels, heads.nms_thresh)[: heads.detections_per_img]
            results.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep], "rois": rois[keep]})
        return results

    def box_features(self, images: list[torch.Tensor], boxes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Box-head representations of given boxes: per image (M_i, D), RoIAlign on the backbone features and the box
        head in the module's current mode.

        Args:
            images: B tensors (C, H, W).
            boxes: B tensors (M_i, 4), xyxy in input-image pixels; M_i may be 0 (a (0, D) result).
        """
        if len(images) != len(boxes):
            raise ValueError(f"{len(images)} images but {len(boxes)} box lists")
        targets = [{"boxes": b if b.is_floating_point() else b.float()} for b in boxes]
        image_list, transformed = self.transform(images, targets)
        assert transformed is not None
        features = self._features(image_list.tensors)
        heads = self.roi_heads
        rois = [t["boxes"] for t in transformed]
        pooled = heads.box_roi_pool(features, rois, image_list.image_sizes)
        return list(heads.box_head(pooled).split([len(r) for r in rois]))


def create_detector(variant: str, in_channels: int, num_classes: int, **kwargs: Any) -> Detector:
    """A :class:`Detector` (``kwargs``: ``image_size``, ``cosine``, ``temperature`` and torchvision options)."""
    return Detector(num_classes, variant=variant, in_channels=in_channels, **kwargs)


#: the ``backbone`` names of detection protocols (``training.backbone``, ``--set backbone=``) -> detector variants
DETECTOR_BACKBONES = {"fasterrcnn-small": "small", "fasterrcnn-resnet50-fpn": "resnet50-fpn"}


def detector_for_backbone(backbone: str, in_channels: int, num_classes: int, **kwargs: Any) -> Detector:
    """The detector a run's ``backbone`` names (:data:`DETECTOR_BACKBONES`); another name is a one-line ConfigError."""
    if backbone not in DETECTOR_BACKBONES:
        raise ConfigError(
            f"backbone={backbone!r}: a detection protocol trains a detector; choose one of "
            f"{', '.join(DETECTOR_BACKBONES)} (--set backbone=...)"
        )
    return create_detector(DETECTOR_BACKBONES[backbone], in_channels, num_classes, **kwargs)
