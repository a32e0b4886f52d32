"""PAS on boxes: the mean teacher's detections kept by confidence and prototype similarity (eqs. 3-5 for boxes).

Adaptation of the paper's pixel-level PAS to a detector (the paper's appendix "Detection results" says that
PAS filters the teacher's detection pseudo-labels but not how; the authors' detection code derives from Soft
Teacher):

* **pseudo-labels** are the EMA teacher's final detections on an unlabelled image (after the detector's own
  score threshold and per-class NMS), each with its predicted class c, its score and its box-head feature f;
* **eq. 4 for boxes**: a detection is kept when ``score > tau_conf`` and ``cos(f, P_c) > tau_sim``, where the
  score is the softmax probability of c (torchvision's detection score, eq. 4's ``conf``) and P_c the
  prototype of c (the best of its anchors, as for pixels): the session's RoI-feature prototypes
  (:meth:`jascl.engine.tasks.detection.DetectionTask.compute_prototypes`) recomputed at every unlabelled phase, stored
  ones for the classes the session does not teach (:func:`jascl.methods.pas.prototype_matrix`);
* **eq. 5 for boxes**: the kept boxes are the set V; at each, the student's class distribution (its box
  head and classifier on the same box, on its own view of the image, GAS noise included) is pulled towards the
  teacher's: ``L = 1/|V| sum_{b in V} ||softmax(z_s(b)) - softmax(z_t(b))||^2``. This is eq. 5 with a box in
  place of a pixel; it leaves the RPN and the box regression to the labelled data. The common alternative,
  training the student's full detection loss on the pseudo-boxes (Unbiased Teacher, Soft Teacher), would
  also regress boxes from unreliable coordinates and treat every non-kept region as background; it is not
  what eq. 5 says.

Pure function :func:`box_pas_filter` -> :func:`box_consistency_loss` -> :class:`DetectionMeanTeacherPlugin`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.ops import box_iou

from jascl import distributed
from jascl.data.datasets import BatchStream
from jascl.data.sampling import derive_seed, seeded_loader, split_key
from jascl.engine.tasks.detection import detection_split
from jascl.methods.mean_teacher import TeacherPhases, apply_view, view_transform
from jascl.methods.pas import AnchorGroups, best_anchor_similarity, prototype_matrix
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.data.types import DetectionSplit
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")

#: IoU at which a kept pseudo-box counts as correct against the pool's hidden ground truth (same class)
MATCH_IOU = 0.5


@dataclass
class BoxPseudoLabels:
    """The filter's view of one image's teacher detections (N boxes)."""

    sim: torch.Tensor  # (N,) cosine to the best anchor of the predicted class (NaN: no anchor)
    keep: torch.Tensor  # (N,) bool: score > tau_conf and sim > tau_sim
    confident: torch.Tensor  # (N,) bool: score > tau_conf (the confidence-only filter)


def box_pas_filter(
    scores: torch.Tensor,
    labels: torch.Tensor,
    features: torch.Tensor,
    anchors: AnchorGroups | torch.Tensor | None,
    tau_conf: float,
    tau_sim: float,
) -> BoxPseudoLabels:
    """Eq. 4 for boxes: keep a detection iff ``score > tau_conf`` and ``cos(feature, P_label) > tau_sim``.

    Args:
        scores: (N,) detection scores (the predicted class's probability).
        labels: (N,) predicted classifier rows.
        features: (N, D) box-head features of the detections.
        anchors: (K, D) prototype or (K, A, D) anchors per classifier row (NaN = padding), or
            :class:`~jascl.methods.pas.AnchorGroups`; None: the confidence-only filter (sim = 1).
        tau_conf, tau_sim: thresholds.
    """
    confident = scores > tau_conf
    if anchors is None or len(scores) == 0:
        sim = torch.ones_like(scores, dtype=torch.float32)
    else:
        sim = best_anchor_similarity(features.float().t()[None], anchors, labels[None]).reshape(-1)
    return BoxPseudoLabels(sim, confident & (sim > tau_sim), confident)


def box_consistency_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Eq. 5 over boxes: mean over the kept boxes of the squared L2 distance between the class distributions.

    Args:
        student_logits, teacher_logits: (|V|, K) classifier logits at the kept boxes.

    Returns:
        A scalar; 0 (with the student's graph, so every rank's backward sees the same parameters) when V is empty.
    """
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0
    p_s = torch.softmax(student_logits.float(), dim=1)
    p_t = torch.softmax(teacher_logits.float(), dim=1)
    return ((p_s - p_t) ** 2).sum(dim=1).mean()


def match_counts(
    boxes: torch.Tensor, labels: torch.Tensor, truth_boxes: torch.Tensor, truth_labels: torch.Tensor
) -> tuple[int, int]:
    """(correct, known) for pseudo-boxes against an image's hidden ground truth: a box is correct when a
    ground-truth box of its class overlaps it with IoU >= :data:`MATCH_IOU`; ``known`` is 0 for an image
    without ground truth (nothing can be judged there)."""
    if len(truth_labels) == 0 or len(boxes) == 0:
        return 0, len(boxes) if len(truth_labels) else 0
    iou = box_iou(boxes.float(), truth_boxes.float())
    same = labels[:, None] == truth_labels[None, :]
    correct = ((iou >= MATCH_IOU) & same).any(dim=1)
    return int(correct.sum()), len(boxes)


class UnlabelledDetectionDataset(Dataset):
    """The pool's images in two intensity views (student, teacher: boxes stay aligned), with the hidden ground truth
    for measurement only. Views drawn from ``(seed, view, pass, index)``."""

    def __init__(self, split: DetectionSplit, seed: int = 0) -> None:
        self.split = split
        self.seed = seed
        self.views = (view_transform(seed + 1), view_transform(seed + 2))

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        pass_index, index = split_key(key)
        image = torch.as_tensor(np.asarray(self.split.images[index], dtype=np.float32))
        target = self.split.targets[index]
        return {
            "views": [
                apply_view(t, image, derive_seed(self.seed, v, pass_index, index)) for v, t in enumerate(self.views)
            ],
            "truth_boxes": torch.as_tensor(np.asarray(target["boxes"], dtype=np.float32)).reshape(-1, 4),
            "truth_labels": torch.as_tensor(np.asarray(target["labels"], dtype=np.int64)).reshape(-1),
        }


def _collate(items: list[dict]) -> dict:
    return {key: [item[key] for item in items] for key in items[0]}


class DetectionMeanTeacherPlugin(TeacherPhases):
    """Mean teacher with PAS on detection pseudo-labels (module docstring); the schedule of the segmentation one.

    In every incremental session with an unlabelled pool the teacher starts as a copy of the student and follows
    it by EMA after every optimiser step. From ``start_epoch`` on, every ``every`` epochs is an unlabelled phase:
    one pass over the pool, each step pairing a labelled batch with an unlabelled one and adding
    ``weight * L`` (:func:`box_consistency_loss`) on the boxes :func:`box_pas_filter` keeps.
    ``state.report["pseudo_labels"]``: teacher detections, kept boxes and their precision against the pool's hidden
    ground truth (IoU >= 0.5, same class), for PAS and for the confidence-only filter on the same detections.

    Args:
        filter: "pas" or "confidence".
        tau_conf, tau_sim, weight, ema_decay, start_epoch, every, batch_size, normalize_pixels, max_anchors, ema:
            as :class:`jascl.methods.mean_teacher.MeanTeacherPlugin` (``normalize_pixels``: average unit RoI features).
    """

    name = "cons"
    loss_terms = ("cons",)

    def __init__(
        self,
        filter: str = "pas",
        tau_conf: float = 0.7,
        tau_sim: float = 0.7,
        weight: float = 0.05,
        ema_decay: float = 0.99,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        normalize_pixels: bool = False,
        max_anchors: int = 16,
        ema: str = "step",
    ) -> None:
        if filter not in ("pas", "confidence"):
            raise ValueError(f"filter must be 'pas' or 'confidence', got {filter!r}")
        if ema not in ("step", "phase"):
            raise ValueError(f"ema must be 'step' or 'phase', got {ema!r}")
        self.ema = ema
        self.filter = filter
        self.tau_conf, self.tau_sim = tau_conf, tau_sim
        self.weight = weight
        self.ema_decay = ema_decay
        self.start_epoch, self.every = start_epoch, every
        self.batch_size = batch_size
        self.normalize_pixels = normalize_pixels
        self.max_anchors = max_anchors
        self.teacher = None
        self._ema = None
        self._loader = None
        self._batches = None
        self._anchor_source: torch.Tensor | None = None
        self._anchors: AnchorGroups | None = None
        self._phase = False
        self.counts = [0, 0, 0, 0, 0, 0]  # detections, kept, kept correct, kept known, conf kept, conf correct

    def before_session(self, state: LoopState) -> None:
        if not self.start_teacher(state):
            return
        t = state.session.index
        pool = detection_split(state.data.unlabelled, "unlabelled pool")
        self._loader = seeded_loader(
            UnlabelledDetectionDataset(pool, derive_seed(state.seed, "views", t)),
            self.batch_size or state.config.batch_size,
            derive_seed(state.seed, "unlabelled", t),
            collate_fn=_collate,
            **state.loader_options,
        )
        self._batches = BatchStream(self._loader)
        self.counts = [0, 0, 0, 0, 0, 0]
        self.conf_known = 0
        self.phases = 0

    def before_epoch(self, state: LoopState) -> None:
        self._phase = self.teacher is not None and self._is_phase(state.epoch)
        if not self._phase:
            return
        self._batches = BatchStream(self._loader)
        if self.filter == "pas":
            model: Any = state.model
            current = state.compute_prototypes([0, *state.session.classes], normalize_pixels=self.normalize_pixels)
            self._anchor_source = prototype_matrix(
                state.seen, current, state.prototypes, model.feature_channels, self.max_anchors
            )
            self._anchors = AnchorGroups(self._anchor_source, state.device)
        self.phases += 1

    def resume_epoch(self, state: LoopState) -> None:
        if self._phase and self.filter == "pas" and self._anchor_source is not None:
            self._anchors = AnchorGroups(self._anchor_source, state.device)

    def after_forward(self, state: LoopState) -> None:
        if not self._phase:
            return
        assert self._batches is not None
        batch = next(self._batches)
        student: Any = state.model
        x_s = [v[0].to(state.device) for v in batch["views"]]
        x_t = [v[1].to(state.device) for v in batch["views"]]
        with torch.no_grad(), eval_mode(self.teacher):
            detections = self.teacher.predict(x_t)
        anchors = self._anchors if self.filter == "pas" else None
        kept_boxes, teacher_logits = [], []
        for i, det in enumerate(detections):
            f = box_pas_filter(det["scores"], det["labels"], det["features"], anchors, self.tau_conf, self.tau_sim)
            kept_boxes.append(det["boxes"][f.keep])
            teacher_logits.append(det["logits"][f.keep])
            self._count(det, f, batch["truth_boxes"][i], batch["truth_labels"][i], state)
        features = torch.cat(student.box_features(x_s, kept_boxes))
        logits = student.classifier(features)
        state.losses[self.name] = self.weight * box_consistency_loss(logits, torch.cat(teacher_logits))

    def _count(
        self, det: dict, f: Any, truth_boxes: torch.Tensor, truth_labels: torch.Tensor, state: LoopState
    ) -> None:
        """Pseudo-label statistics of one image (global class ids against the hidden ground truth)."""
        ids = torch.as_tensor(state.seen)[det["labels"].cpu()]
        boxes = det["boxes"].detach().cpu()
        keep, conf = f.keep.cpu(), f.confident.cpu()
        correct, known = match_counts(boxes[keep], ids[keep], truth_boxes, truth_labels)
        c_correct, c_known = match_counts(boxes[conf], ids[conf], truth_boxes, truth_labels)
        self.counts[0] += len(boxes)
        self.counts[1] += int(keep.sum())
        self.counts[2] += correct
        self.counts[3] += known
        self.counts[4] += int(conf.sum())
        self.counts[5] += c_correct
        self.conf_known += c_known

    def after_training(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        counts = [*self.counts, self.conf_known]
        if distributed.active():
            counts = [int(v) for v in distributed.all_reduce_sum(torch.tensor(counts, device=state.device)).tolist()]
        detections, kept, correct, known, conf_kept, conf_correct, conf_known = counts

        def ratio(a: int, b: int) -> float:
            return a / b if b else float("nan")

        state.report["pseudo_labels"] = {
            "filter": self.filter,
            "phases": self.phases,
            "teacher_boxes": detections,
            "kept": kept,
            "coverage": ratio(kept, detections),
            "precision": ratio(correct, known),
            "confidence_only_kept": conf_kept,
            "confidence_only_precision": ratio(conf_correct, conf_known),
        }
        log.info("session %d box pseudo-labels: %s", state.session.index, state.report["pseudo_labels"])

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self._anchor_source, self._anchors = None, None
