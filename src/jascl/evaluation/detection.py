"""Detection metrics: COCO mAP for the detection sessions (the paper's COCO-O appendix, Table
``det:methods_session1``, reports session 1 "mAP").

Conventions used throughout this module:

* Boxes are ``(N, 4)`` float tensors in absolute pixels, ``xyxy`` (``x1, y1, x2, y2``), as torchvision's detection
  models output them and :class:`jascl.data.coco.CocoDetection` serves them.
* Labels are ``(N,)`` int64 *class ids* (global ids of the protocol, or COCO category ids); no background id is
  ever scored (a detector's background label 0 never appears in its output boxes).
* A prediction is ``{"boxes", "scores": (N,) float, "labels"}`` per image; a target is ``{"boxes", "labels"}``
  (optionally ``"iscrowd": (N,) int64``: crowd boxes are ignore regions, as in pycocotools).
* The scores are COCO's (pycocotools' ``COCOeval`` through torchmetrics' ``MeanAveragePrecision``): AP per class
  is the area under the precision-recall curve at 101 recall points (``0, 0.01, ..., 1``), precision made
  monotone (the maximum precision at any higher recall), at most 100 detections per image, boxes of every
  area. ``map`` averages it over IoU thresholds ``0.50:0.05:0.95`` and over classes, ``map_50`` at IoU 0.5.
* A class without ground truth has an undefined AP, reported as ``NaN`` (absent), even if it has predictions
  (pycocotools skips it: its false positives count nowhere). Every mean -- ``map``, ``map_50``, ``old``,
  ``new``, ``all`` -- is over the classes that have ground truth, so ``all`` equals ``map`` when ``old`` and
  ``new`` cover every class with ground truth.
* Total Drop on mAP is :func:`jascl.evaluation.metrics.total_drop` on the per-session ``map`` values.

Backend: pycocotools (torchmetrics' default, the reference implementation); ``backend="faster_coco_eval"``
selects torchmetrics' other COCO-compatible backend (a faster reimplementation of pycocotools' ``COCOeval``,
not a dependency of jascl).

Several processes: torchmetrics syncs a metric by itself once ``torch.distributed`` is initialised, but
``MeanAveragePrecision`` keeps one tensor per image and gathers them one collective call per image, so ranks
holding different numbers of images (what :func:`jascl.distributed.shard` gives whenever the test set does not
divide evenly) call it a different number of times and hang. :class:`DetectionMetrics` therefore turns that
sync off and gathers every rank's images itself (one ``all_gather_object``); each rank then scores the union.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from jascl import distributed
from jascl.errors import ConfigError, DataError
from jascl.evaluation.metrics import total_drop

__all__ = ["DetectionMetrics", "map_total_drop"]

Backend = Literal["pycocotools", "faster_coco_eval"]


def map_total_drop(maps: Sequence[float]) -> float:
    """Total Drop (%) of mAP over sessions (base session first): :func:`jascl.evaluation.metrics.total_drop`."""
    return total_drop(maps)


def _cpu(item: Mapping[str, torch.Tensor], keys: tuple[str, ...], what: str, index: int) -> dict[str, torch.Tensor]:
    missing = [k for k in keys if k not in item]
    if missing:
        raise DataError(f"detection {what} {index} lacks key(s) {', '.join(missing)} (needs {', '.join(keys)})")
    out = {k: torch.as_tensor(item[k]).detach().cpu() for k in keys}
    if "iscrowd" in item:
        out["iscrowd"] = torch.as_tensor(item["iscrowd"]).detach().cpu().to(torch.int64)
    out["boxes"] = out["boxes"].to(torch.float32).reshape(-1, 4)
    out["labels"] = out["labels"].to(torch.int64).reshape(-1)
    if "scores" in out:
        out["scores"] = out["scores"].to(torch.float32).reshape(-1)
    n = {k: int(v.shape[0]) for k, v in out.items()}
    if len(set(n.values())) != 1:
        raise DataError(f"detection {what} {index}: box, label (and score) counts differ: {n}")
    return out


class DetectionMetrics:
    """COCO mAP, mAP@0.5, per-class AP and old / new / all means of a detector, streamed over batches.

    Args:
        old: class ids learned in earlier sessions.
        new: class ids introduced in the current session.
        backend: the COCO evaluation torchmetrics runs ("pycocotools" or "faster_coco_eval").

    Raises:
        ConfigError: the backend's package is not installed.
    """

    def __init__(self, old: Iterable[int] = (), new: Iterable[int] = (), backend: Backend = "pycocotools") -> None:
        self.old = sorted({int(c) for c in old})
        self.new = sorted({int(c) for c in new})
        self.backend = backend
        self._preds: list[dict[str, torch.Tensor]] = []
        self._targets: list[dict[str, torch.Tensor]] = []
        self._metric()  # fail now, not after a whole evaluation, if the backend is missing

    def _metric(self) -> Any:
        try:
            from torchmetrics.detection import MeanAveragePrecision

            return MeanAveragePrecision(
                iou_type="bbox", box_format="xyxy", class_metrics=True, backend=self.backend, sync_on_compute=False
            )
        except ModuleNotFoundError as exc:
            package = "pycocotools" if self.backend == "pycocotools" else "faster-coco-eval"
            raise ConfigError(
                f"detection mAP needs torchmetrics and {package} ({exc}); pip install torchmetrics {package}"
            ) from exc

    def update(
        self, preds: Sequence[Mapping[str, torch.Tensor]], targets: Sequence[Mapping[str, torch.Tensor]]
    ) -> None:
        """Adds one batch: a prediction and a target per image (kept on the CPU).

        Raises:
            DataError: the lists differ in length, a key is missing or counts within an image differ.
        """
        if len(preds) != len(targets):
            raise DataError(f"detection update: {len(preds)} predictions for {len(targets)} targets")
        start = len(self._preds)
        self._preds += [_cpu(p, ("boxes", "scores", "labels"), "prediction", start + i) for i, p in enumerate(preds)]
        self._targets += [_cpu(t, ("boxes", "labels"), "target", start + i) for i, t in enumerate(targets)]

    def reset(self) -> None:
        self._preds, self._targets = [], []

    def __len__(self) -> int:
        """Images added on this rank."""
        return len(self._preds)

    def compute(self) -> dict[str, Any]:
        """Scores over every image added on every rank (collective: every rank must call it).

        Returns:
            ``{"map", "map_50", "per_class": {class id: AP}, "old", "new", "all"}``: ``map`` is AP averaged over
            IoU 0.50:0.95 and the classes with ground truth, ``map_50`` the same at IoU 0.5, ``per_class`` the
            IoU-averaged AP of every class seen in the predictions or targets (NaN without ground truth), and
            ``old`` / ``new`` / ``all`` the means of ``per_class`` over the old, new and old + new classes with
            ground truth (``all`` is over every class with ground truth when neither ``old`` nor ``new`` is
            given). NaN where a mean has no class, and everywhere when no image has ground truth.
        """
        shares = distributed.all_gather_object((self._preds, self._targets))
        preds = [p for share in shares for p in share[0]]
        targets = [t for share in shares for t in share[1]]
        nan = math.nan
        if not any(len(t["labels"]) for t in targets):
            return {"map": nan, "map_50": nan, "per_class": {}, "old": nan, "new": nan, "all": nan}
        metric = self._metric()
        metric.update(preds, targets)
        res = metric.compute()
        classes = [int(c) for c in torch.as_tensor(res["classes"]).reshape(-1)]
        aps = [float(a) for a in torch.as_tensor(res["map_per_class"]).reshape(-1)]
        per_class = {c: (a if a >= 0 else nan) for c, a in zip(classes, aps)}

        def mean(ids: Iterable[int]) -> float:
            valid = [a for a in (per_class.get(c, nan) for c in ids) if not math.isnan(a)]
            return sum(valid) / len(valid) if valid else nan

        seen = sorted(set(self.old) | set(self.new)) if self.old or self.new else sorted(per_class)

        def score(value: Any) -> float:
            v = float(value)
            return v if v >= 0 else nan

        return {
            "map": score(res["map"]),
            "map_50": score(res["map_50"]),
            "per_class": per_class,
            "old": mean(self.old),
            "new": mean(self.new),
            "all": mean(seen),
        }
