"""What Saving-100x (STAR) and Adapt-Replay (Adapter) share: per-class feature statistics and the replay store,
synthetic features drawn from them, the balanced replay cross-entropy, OCFM and SAD, and Adapter's uncertainty
constraint and prototype compensation as pure functions."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from jascl.networks.base import Segmenter


log = logging.getLogger("jascl")


@dataclass
class ClassStatistics:
    """What STAR stores for one class (feature dimension D).

    Attributes:
        count: pixels of the class (at feature resolution) in its session's labelled set.
        prototype: (D,) L2-normalised sum of the L2-normalised features.
        noise: (D,) per-channel RMS of (normalised feature - prototype).
        norm_mean, norm_std: mean and (unbiased) std of the un-normalised feature norms.
    """

    count: float
    prototype: torch.Tensor
    noise: torch.Tensor
    norm_mean: float
    norm_std: float

    def merged(self, other: ClassStatistics) -> ClassStatistics:
        """Statistics of the union of both pixel sets (for a class taught again in a later session).

        Count and norm mean / std are pooled exactly; the prototype is the normalised
        count-weighted sum of both prototypes and the noise the count-weighted RMS
        (the spread between the two sets is not stored, so it is left out).
        """
        n1, n2 = self.count, other.count
        n = n1 + n2
        mean = (n1 * self.norm_mean + n2 * other.norm_mean) / n
        ss = (
            (n1 - 1) * self.norm_std**2
            + n1 * self.norm_mean**2
            + (n2 - 1) * other.norm_std**2
            + n2 * other.norm_mean**2
            - n * mean**2
        )
        std = math.sqrt(max(ss / (n - 1), 0.0)) if n > 1 else 0.0
        prototype = F.normalize(n1 * self.prototype + n2 * other.prototype, dim=0)
        noise = ((n1 * self.noise**2 + n2 * other.noise**2) / n).sqrt()
        return ClassStatistics(n, prototype, noise, mean, std)


class FeatureStatistics:
    """Streaming per-class :class:`ClassStatistics` over batches (STAR's ``compute_prototypes`` and
    ``compute_noise`` in one pass, using per-channel sums of normalised features and their squares).

    Args:
        class_ids: labels to gather (global ids, or rows -- whatever ``update`` receives).
        dim: feature channels D.
    """

    def __init__(self, class_ids: Sequence[int], dim: int) -> None:
        self.class_ids = list(class_ids)
        k = len(self.class_ids)
        self.n = torch.zeros(k, dtype=torch.float64)
        self.s1 = torch.zeros(k, dim, dtype=torch.float64)
        self.s2 = torch.zeros(k, dim, dtype=torch.float64)
        self.norm1 = torch.zeros(k, dtype=torch.float64)
        self.norm2 = torch.zeros(k, dtype=torch.float64)

    @torch.no_grad()
    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """features (B, D, *spatial), labels (B, *spatial) at the same resolution."""
        f = features.movedim(1, -1).reshape(-1, features.shape[1]).double()
        lab = labels.reshape(-1)
        norms = f.norm(dim=1)
        unit = f / norms.clamp_min(1e-12).unsqueeze(1)
        for i, cid in enumerate(self.class_ids):
            m = lab == cid
            if not m.any():
                continue
            u = unit[m]
            self.n[i] += float(m.sum())
            self.s1[i] += u.sum(0).cpu()
            self.s2[i] += (u**2).sum(0).cpu()
            self.norm1[i] += float(norms[m].sum())
            self.norm2[i] += float((norms[m] ** 2).sum())

    def compute(self) -> dict[int, ClassStatistics]:
        """Statistics of every class that had at least one pixel."""
        out = {}
        for i, cid in enumerate(self.class_ids):
            n = float(self.n[i])
            if n == 0:
                continue
            p = F.normalize(self.s1[i], dim=0)
            var = self.s2[i] / n - 2 * p * self.s1[i] / n + p**2
            mean = float(self.norm1[i]) / n
            std = math.sqrt(max((float(self.norm2[i]) - n * mean**2) / (n - 1), 0.0)) if n > 1 else 0.0
            out[cid] = ClassStatistics(n, p.float(), var.clamp_min(0).sqrt().float(), mean, std)
        return out


class ReplayStore:
    """Per-class statistics keyed by global class id, plus the accumulated true-background pixel count."""

    def __init__(self) -> None:
        self.classes: dict[int, ClassStatistics] = {}
        self.background = 0.0

    def add(self, cid: int, stats: ClassStatistics) -> None:
        """Store ``stats`` for class ``cid``, merging with what is already stored."""
        self.classes[cid] = self.classes[cid].merged(stats) if cid in self.classes else stats

    def to_tensors(self) -> dict[str, torch.Tensor]:
        ids = sorted(self.classes)
        if not ids:
            return {"background": torch.tensor([self.background])}
        s = [self.classes[c] for c in ids]
        return {
            "class_ids": torch.tensor(ids, dtype=torch.long),
            "counts": torch.tensor([x.count for x in s], dtype=torch.float64),
            "prototypes": torch.stack([x.prototype.cpu() for x in s]),
            "noise": torch.stack([x.noise.cpu() for x in s]),
            "norms": torch.tensor([[x.norm_mean, x.norm_std] for x in s], dtype=torch.float64),
            "background": torch.tensor([self.background], dtype=torch.float64),
        }

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> ReplayStore:
        store = cls()
        store.background = float(t["background"][0]) if "background" in t else 0.0
        if "class_ids" in t:
            for i, cid in enumerate(t["class_ids"].tolist()):
                store.classes[cid] = ClassStatistics(
                    float(t["counts"][i]),
                    t["prototypes"][i].float(),
                    t["noise"][i].float(),
                    float(t["norms"][i, 0]),
                    float(t["norms"][i, 1]),
                )
        return store


def sample_replay_features(
    prototype: torch.Tensor,
    noise: torch.Tensor,
    norm_mean: float,
    norm_std: float,
    n: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """STAR's synthetic old-class features: ``(p + noise * eps) * r``, eps ~ N(0, I), r ~ N(norm_mean, norm_std^2).

    One norm ``r`` per sample (the statistic is a feature norm); STAR's code draws it
    per element. Returns (n, D).
    """
    d = prototype.shape[0]
    eps = torch.randn(n, d, generator=generator, device=prototype.device, dtype=prototype.dtype)
    r = torch.randn(n, 1, generator=generator, device=prototype.device, dtype=prototype.dtype) * norm_std + norm_mean
    return (prototype + noise * eps) * r


def replay_balanced_ce(
    current_mean: torch.Tensor,
    replay_sum: torch.Tensor,
    n_replay: float,
    background_sum: torch.Tensor,
    n_background: float,
    background_ratio: float,
    n_pixels: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """STAR's class-balanced classification loss, split into its current-pixel and replay parts.

    ``(mean_cur + w_r * mean_replay + w_b * mean_bg) / (1 + w_r + w_b)`` with
    ``w_r = n_replay / n_pixels`` and ``w_b = ratio * n_background / n_pixels``
    (STAR's ``weight_fake`` and ``weight_extra_bg``; n_pixels counts the batch at
    feature resolution). Written with sums: ``w_r * mean_replay = replay_sum / n_pixels``.

    Returns:
        (current part, replay part); their sum is the loss.
    """
    denom = 1.0 + n_replay / n_pixels + background_ratio * n_background / n_pixels
    replay = (replay_sum + background_ratio * background_sum) / n_pixels
    return current_mean / denom, replay / denom


def ocfm_loss(student: torch.Tensor, teacher: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """STAR's old-class features maintaining loss: squared error on ``region`` / (pixels x channels).

    Args:
        student, teacher: (B, D, *spatial) features before the classifier.
        region: (B, *spatial) bool, pixels labelled background that the old model
            predicts as an old class. Empty region -> 0.
    """
    mask = region.unsqueeze(1).to(student.dtype)
    count = mask.sum() * student.shape[1]
    if count == 0:
        return student.sum() * 0.0
    return (((student - teacher) ** 2) * mask).sum() / count


def sad_loss(
    features: torch.Tensor, labels: torch.Tensor, new_rows: Sequence[int], old_prototypes: torch.Tensor
) -> torch.Tensor:
    """STAR's similarity-aware discriminative loss (Adapter's CPD with compensated prototypes).

    For each new class present in the batch, its centre is the L2-normalised sum
    of its L2-normalised features; the loss is the mean over those classes of
    ``1 / min_p ||centre - p||`` over the stored old prototypes. (STAR's code also
    averages in absent classes, whose zero centre contributes a constant 1 without gradient.)

    Args:
        features: (B, D, *spatial); labels: (B, *spatial) rows at the same resolution.
        new_rows: rows of the classes introduced in this session.
        old_prototypes: (P, D) stored prototypes of old classes.
    """
    if old_prototypes.numel() == 0:
        return features.sum() * 0.0
    unit = F.normalize(features, dim=1)
    terms = []
    for row in new_rows:
        mask = (labels == row).unsqueeze(1).to(unit.dtype)
        if mask.sum() == 0:
            continue
        centre = F.normalize((unit * mask).sum(dim=[0, *range(2, unit.dim())]), dim=0)
        dist = (centre.unsqueeze(0) - old_prototypes.to(centre)).norm(dim=1)
        terms.append(1.0 / dist.min().clamp_min(1e-6))
    if not terms:
        return features.sum() * 0.0
    return torch.stack(terms).mean()


def prediction_certainty(probs: torch.Tensor) -> torch.Tensor:
    """Adapter's certainty: top-1 minus top-2 probability (top-1 detached, as in its code). (B, K, *sp) -> (B, *sp)."""
    top2 = torch.topk(probs, k=2, dim=1).values
    return top2[:, 0].detach() - top2[:, 1]


def uncertainty_constraint_loss(logits: torch.Tensor, target: torch.Tensor, tau: float = 0.7) -> torch.Tensor:
    """Adapter's uncertainty-aware constraint (UAC).

    On pixels that are neither correctly classified nor confidently predicted
    (max probability <= tau), ``mean over all pixels of ((1 - certainty) * mask)^2``:
    it widens the gap between the two most probable classes. Softmax
    probabilities replace Adapter's per-class sigmoids.

    Args:
        logits: (B, K, *spatial); target: (B, *spatial) rows or 255 (255 never counts as correct).
    """
    probs = F.softmax(logits, dim=1)
    certainty = prediction_certainty(probs)
    top, pred = probs.max(dim=1)
    settled = (pred == target) | (top > tau)
    return (((1 - certainty) * (~settled).to(certainty.dtype)) ** 2).mean()


def compensate_prototypes(
    prototypes: torch.Tensor,
    noise: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    confident: torch.Tensor,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapter's adaptive deviation compensation (ADC) of stored prototypes.

    The representation shift of class c is estimated on pixels both models
    confidently assign to c: ``delta_c = normalize(after_c) - normalize(before_c)``
    (centres under the new and the old model). Each prototype moves by
    ``r_c * delta_c`` with ``r_c = confident_c / counts_c`` clipped to [0, 1],
    and its noise grows by the size of the move, ``|p'_c - p_c|``
    (Adapter's ``refine_prototypes``).

    Args:
        prototypes, noise: (K, D) stored statistics.
        before, after: (K, D) sums of normalised features of the confident pixels
            under the old / new model (rows of classes without confident pixels are ignored).
        confident: (K,) confident pixel counts; counts: (K,) stored pixel counts.

    Returns:
        (prototypes, noise) after compensation.
    """
    ratio = (confident / counts.clamp_min(1e-12)).clamp(0, 1).to(prototypes)
    delta = F.normalize(after, dim=1) - F.normalize(before, dim=1)
    delta = torch.where((confident > 0).unsqueeze(1), delta.to(prototypes), torch.zeros_like(prototypes))
    moved = prototypes + ratio.unsqueeze(1) * delta
    return moved, noise + (moved - prototypes).abs()


def _small_logits(model: Segmenter, out) -> torch.Tensor:
    """Logits at the resolution of the features (re-applying the classifier if the logits were upsampled)."""
    if out.logits.shape[2:] == out.features.shape[2:]:
        return out.logits
    return model.classifier(out.features)
