"""Segmentation metrics for continual segmentation.

Conventions used throughout this module:

* Label maps (predictions and targets) are integer tensors of shape
  ``(B, *spatial)``; any number of spatial dimensions is accepted (2D images
  ``(B, H, W)``, 3D volumes ``(B, D, H, W)``).
* Label values are *global* class ids. Class ``0`` is background.
* Pixels whose target equals ``ignore_index`` (default ``255``) are excluded
  from every count.
* Confusion matrices have shape ``(C, C)``, rows = ground truth, columns =
  prediction, ordered like the ``class_ids`` they were accumulated for.
* A class that has neither ground truth nor predictions has an undefined
  score, reported as ``NaN`` ("absent"); aggregation helpers ignore NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from jascl.errors import DataError
from jascl.protocols.schema import IGNORE_INDEX

__all__ = [
    "ConfusionAccumulator",
    "dice_from_confusion",
    "iou_from_confusion",
    "soft_dice_per_class",
    "total_drop",
    "harmonic_mean",
    "per_class_forgetting",
    "summarise",
]


class ConfusionAccumulator:
    """Accumulates a confusion matrix over batches for a fixed set of classes.

    Class ids need not be contiguous (e.g. ``[0, 1, 2, 5, 7]``); predictions
    and targets carry global ids, which are mapped internally to the row /
    column position of that id in ``class_ids``.

    Args:
        class_ids: Ordered, unique global class ids; defines the row/column
            order of the matrix.
        ignore_index: Target value whose pixels are skipped entirely
            (whatever the prediction there).

    Raises:
        ValueError: If ``class_ids`` is empty, has duplicates, contains
            ``ignore_index`` or a negative id.
    """

    def __init__(self, class_ids: Sequence[int], ignore_index: int = IGNORE_INDEX) -> None:
        ids = [int(c) for c in class_ids]
        if not ids:
            raise ValueError("class_ids must not be empty")
        if len(set(ids)) != len(ids):
            raise ValueError(f"class_ids contains duplicates: {ids}")
        if ignore_index in ids:
            raise ValueError(f"ignore_index {ignore_index} must not be one of class_ids")
        if min(ids) < 0:
            raise ValueError(f"class_ids must be non-negative: {ids}")
        self.class_ids: list[int] = ids
        self.ignore_index = int(ignore_index)
        # global id -> row / column of the matrix (-1: not a class); one gather per pixel, on any device
        self._positions = torch.full((max(ids) + 1,), -1, dtype=torch.int64)
        self._positions[torch.tensor(ids)] = torch.arange(len(ids))
        self._cm = torch.zeros(len(ids), len(ids), dtype=torch.int64)

    @property
    def num_classes(self) -> int:
        """Number of classes ``C`` (size of each matrix side)."""
        return len(self.class_ids)

    def _to_index(self, values: torch.Tensor, what: str, ignored: torch.Tensor) -> torch.Tensor:
        """Maps global ids ``(N,)`` to matrix positions ``(N,)``; -1 for a value that is not one of ``class_ids``
        (allowed only where ``ignored``).

        Raises:
            DataError: If a value where ``ignored`` is False is not in ``class_ids``.
        """
        table = self._positions.to(values.device)
        inside = (values >= 0) & (values < len(table))
        pos = table[values.clamp(0, len(table) - 1)].masked_fill_(~inside, -1)
        bad = (pos < 0) & ~ignored
        if bool(bad.any()):
            value = int(values[bad][0])
            raise DataError(
                f"{what} contains class id {value}, which is not in class_ids {self.class_ids} "
                f"(and is not ignore_index {self.ignore_index})"
            )
        return pos

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Adds one batch to the matrix.

        Args:
            pred: Predicted global class ids, integer tensor ``(B, *spatial)``.
            target: Ground-truth global class ids, same shape as ``pred``;
                ``ignore_index`` pixels are skipped.

        Raises:
            ValueError: If shapes differ.
            DataError: If a label map is not integer-valued, or a target (or
                non-ignored prediction) value is not in ``class_ids``.
        """
        if pred.shape != target.shape:
            raise ValueError(f"pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
        for name, t in (("pred", pred), ("target", target)):
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise DataError(f"{name} label map must be an integer tensor, got {t.dtype}")
        p = pred.reshape(-1).to(torch.int64)
        g = target.reshape(-1).to(torch.int64)
        ignored = g == self.ignore_index
        rows = self._to_index(g, "target", ignored)
        cols = self._to_index(p, "prediction", ignored)
        c = self.num_classes
        # ignored pixels go to one spare bin past the matrix (no compaction of the kept pixels)
        cells = (rows * c + cols).masked_fill_(ignored, c * c)
        counts = torch.bincount(cells, minlength=c * c + 1)[: c * c].reshape(c, c)
        self._cm += counts.cpu()

    def matrix(self) -> torch.Tensor:
        """Returns a copy of the accumulated ``(C, C)`` int64 matrix (CPU)."""
        return self._cm.clone()

    def reset(self) -> None:
        """Zeroes the accumulated counts."""
        self._cm.zero_()

    def all_reduce(self) -> None:
        """Sum the matrices of all ranks (each scored its share of the samples); no-op in one process."""
        from jascl.distributed import all_reduce_sum

        self._cm = all_reduce_sum(self._cm)


def _tp_fp_fn(cm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits a ``(C, C)`` confusion matrix into per-class TP, FP, FN (float64)."""
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1]:
        raise ValueError(f"confusion matrix must be square (C, C), got {tuple(cm.shape)}")
    m = cm.to(torch.float64)
    tp = torch.diagonal(m)
    fp = m.sum(dim=0) - tp
    fn = m.sum(dim=1) - tp
    return tp, fp, fn


def dice_from_confusion(cm: torch.Tensor) -> torch.Tensor:
    """Per-class Dice ``2TP / (2TP + FP + FN)`` from a confusion matrix.

    Args:
        cm: ``(C, C)`` confusion matrix, rows = ground truth, cols = prediction.

    Returns:
        float64 tensor ``(C,)``. Classes with no ground truth and no
        prediction (zero denominator) are ``NaN`` (absent).
    """
    tp, fp, fn = _tp_fp_fn(cm)
    den = 2 * tp + fp + fn
    return torch.where(den > 0, 2 * tp / den.clamp(min=1), torch.full_like(den, math.nan))


def iou_from_confusion(cm: torch.Tensor) -> torch.Tensor:
    """Per-class IoU (Jaccard) ``TP / (TP + FP + FN)`` from a confusion matrix.

    Args:
        cm: ``(C, C)`` confusion matrix, rows = ground truth, cols = prediction.

    Returns:
        float64 tensor ``(C,)``. Classes with no ground truth and no
        prediction (zero denominator) are ``NaN`` (absent).
    """
    tp, fp, fn = _tp_fp_fn(cm)
    den = tp + fp + fn
    return torch.where(den > 0, tp / den.clamp(min=1), torch.full_like(den, math.nan))


def soft_dice_per_class(probs: torch.Tensor, onehot_target: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """Soft Dice per class, pooled over the whole batch.

    ``(2 * sum(p * g) + smooth) / (sum(p) + sum(g) + smooth)`` with sums over
    the batch and all spatial positions. Mirrors the paper's research code
    ("authors" evaluation mode); absent classes score ~1 because of ``smooth``.

    Args:
        probs: Class probabilities ``(B, C, *spatial)``.
        onehot_target: One-hot ground truth, same shape as ``probs``.
        smooth: Additive smoothing term in numerator and denominator.

    Returns:
        Tensor ``(C,)`` of soft Dice scores.
    """
    if probs.shape != onehot_target.shape:
        raise ValueError(f"probs shape {tuple(probs.shape)} != onehot_target shape {tuple(onehot_target.shape)}")
    if probs.ndim < 2:
        raise ValueError(f"expected (B, C, *spatial), got shape {tuple(probs.shape)}")
    p = probs.float()
    g = onehot_target.to(p.dtype)
    dims = [d for d in range(p.ndim) if d != 1]
    inter = (p * g).sum(dim=dims)
    return (2 * inter + smooth) / (p.sum(dim=dims) + g.sum(dim=dims) + smooth)


def total_drop(scores: Sequence[float]) -> float:
    """The paper's Total Drop (%): cumulative session-to-session decline.

    ``100 * sum_i max(0, S_i - S_{i+1}) / S_0`` where ``S_0`` is the base-session
    score; rises between sessions are not subtracted, only falls count.

    Args:
        scores: Scores per session, base session first.

    Returns:
        Total drop in percent (unrounded). ``0.0`` for a single session.

    Raises:
        ValueError: On empty input, non-finite scores or ``S_0 <= 0``.
    """
    s = [float(x) for x in scores]
    if not s:
        raise ValueError("total_drop needs at least one score")
    if not all(math.isfinite(x) for x in s):
        raise ValueError(f"total_drop needs finite scores, got {s}")
    if s[0] <= 0:
        raise ValueError(f"total_drop needs a positive base-session score, got {s[0]}")
    falls = sum(max(0.0, a - b) for a, b in zip(s[:-1], s[1:]))
    return 100.0 * falls / s[0]


def harmonic_mean(seen: float, new: float) -> float:
    """The harmonic mean of the seen (old) and new classes' scores, ``2 S N / (S + N)``.

    The paper's Seen / New / HM figure (Figure "Performance of JASCL ...": "Seen refers to the average
    performance on classes the model has encountered in previous sessions, while New refers to the
    average performance on classes introduced in the current session. HM refers to Harmonic Mean"), the
    usual summary of the stability-plasticity balance in few-shot class-incremental learning: it is high
    only when both are, and 0 when either is 0.

    Returns:
        The harmonic mean; NaN when either score is NaN (session 0 has no seen classes); 0.0 when both are 0.
    """
    s, n = float(seen), float(new)
    if math.isnan(s) or math.isnan(n):
        return math.nan
    return 0.0 if s + n == 0 else 2.0 * s * n / (s + n)


def per_class_forgetting(history: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """Forgetting per class: best earlier score minus last score.

    Args:
        history: Class id -> its scores per session, from the session the
            class was introduced to the last session. NaN entries are ignored.

    Returns:
        Class id -> ``max(earlier scores) - last score``. ``0.0`` when only one
        valid score exists, ``NaN`` when none does. Negative when the class
        improved on its best earlier score.
    """
    out: dict[int, float] = {}
    for cls, seq in history.items():
        valid = [float(v) for v in seq if v is not None and not math.isnan(float(v))]
        if not valid:
            out[int(cls)] = math.nan
        elif len(valid) == 1:
            out[int(cls)] = 0.0
        else:
            out[int(cls)] = max(valid[:-1]) - valid[-1]
    return out


def _nanmean(values: Iterable[float]) -> float:
    """Mean of the non-NaN values; NaN when there are none."""
    valid = [v for v in values if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else math.nan


def summarise(
    per_class: Mapping[int, float], old: Iterable[int], new: Iterable[int], include_background: bool = False
) -> dict[str, float]:
    """Aggregates per-class scores into all / old / new / background.

    Args:
        per_class: Class id -> score (NaN = absent). Keys may be ints or
            numeric strings.
        old: Class ids learned in earlier sessions.
        new: Class ids introduced in the current session.
        include_background: Whether class 0 counts in ``"all"`` (it never
            counts in ``"old"``/``"new"``).

    Returns:
        ``{"all", "old", "new", "background"}``: NaN-ignoring means over the
        seen foreground classes (``old ∪ new``), old foreground, new
        foreground, and the background score (NaN if not given). A group
        without valid values is NaN; classes missing from ``per_class`` are
        treated as absent.
    """
    scores = {int(k): float(v) if v is not None else math.nan for k, v in per_class.items()}
    old_fg = {int(c) for c in old} - {0}
    new_fg = {int(c) for c in new} - {0}
    seen = old_fg | new_fg
    if include_background:
        seen = seen | {0}

    def group(ids: set[int]) -> float:
        return _nanmean(scores.get(c, math.nan) for c in sorted(ids))

    return {"all": group(seen), "old": group(old_fg), "new": group(new_fg), "background": scores.get(0, math.nan)}
