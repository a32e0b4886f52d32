"""Prototype-replay baselines: Saving100x (STAR) and Adapt_replay (Adapter).

Sources (as cited by the JASCL paper, keys ``chen2023saving`` and ``zhu2025adaptive``;
the seed file carries no bibliography, the keys were matched to the titles and to
the links in the authors' ``baselines.md``):

* Saving100x: J. Chen, R. Cong, Y. Luo, H. H. S. Ip, S. Kwong, "Saving 100x Storage:
  Prototype Replay for Reconstructing Training Sample Distribution in
  Class-Incremental Semantic Segmentation", NeurIPS 2023 (method "STAR"; official
  code github.com/jinpeng0528/STAR). Not to be confused with the ``star`` method
  (Eskandar et al., ICLR 2025, weight perturbation).
* Adapt_replay: G. Zhu, D. Wu, C. Gao, R. Wang, W. Yang, N. Sang, "Adaptive Prototype
  Replay for Class Incremental Semantic Segmentation", AAAI 2025 (method "Adapter";
  official code github.com/zhu-gl-ux/Adapter, built on STAR's).

STAR stores, per learned class, a compact prototype plus statistics instead of
images: the pixel count, the per-channel spread of the L2-normalised features
around the prototype, and the mean / std of the feature norms; and the number of
"true background" pixels. In later sessions it replays synthetic features drawn
from these statistics through the classifier, in the numbers that make the
session's training distribution match the complete dataset's, repeats true
background pixels for the same purpose, keeps the features of pixels the old
model sees as old classes (OCFM) and pushes new-class feature centres away from
the nearest old prototype (SAD). Adapter adds adaptive deviation compensation of
the stored prototypes (ADC), an uncertainty-aware constraint (UAC) and uses the
compensated prototypes in the SAD term (CPD).

Conventions as in :mod:`jascl.methods.baselines.distillation`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.defaults import default_supervised_loss
from jascl.engine.plugin import Method
from jascl.methods.baselines.distillation import (
    TeacherPlugin,
    absorbed_rows,
    check_non_negative,
    freeze_policy,
    labelled_loader,
    merge_absorbed_probabilities,
    resize_labels,
    soft_dice_loss,
    unbiased_cross_entropy,
)
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter

log = logging.getLogger("jascl")

# ============================================================================ statistics


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


# ============================================================================ pure losses and rules


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


# ============================================================================ plugin


@dataclass
class Saving100xOptions:
    """Options of ``saving100x`` (defaults: STAR's official ``configs/config_voc.json``).

    Attributes:
        ocfm_weight: weight of the old-class features maintaining loss (``pkd`` 5).
        sad_weight: weight of the similarity-aware discriminative loss (``cont`` 0.05).
        replay: replay prototypes and repeat true background (false: only OCFM / SAD).
        max_replay_per_class: synthetic features drawn per class and iteration at
            most; larger counts are represented by importance weights (same
            expected loss, bounded memory on 3D data).
        dice: add the run's ``lambda_dice`` x soft Dice on background-merged probabilities.
        freeze: incremental-session freezing ("none": STAR trains the whole network;
            OCFM needs trainable features).
    """

    ocfm_weight: float = 5.0
    sad_weight: float = 0.05
    replay: bool = True
    max_replay_per_class: int = 4096
    dice: bool = True
    freeze: str = "none"


@dataclass
class AdaptReplayOptions(Saving100xOptions):
    """Options of ``adapt-replay`` (defaults: Adapter's official ``configs/config_voc.json``).

    Attributes:
        uac_weight: weight of the uncertainty-aware constraint (``uncer`` 0.1).
        certainty: top-1 minus top-2 threshold of the ADC pixels, and tau of UAC (0.7).
        adc: compensate the stored prototypes at the end of each session (the
            official release has this call commented out; the paper describes it).
    """

    uac_weight: float = 0.1
    certainty: float = 0.7
    adc: bool = True


def _eval_mode(model: Segmenter) -> dict:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    return modes


def _restore_modes(modes: dict) -> None:
    for module, mode in modes.items():
        module.train(mode)


def _small_logits(model: Segmenter, out) -> torch.Tensor:
    """Logits at the resolution of the features (re-applying the classifier if the logits were upsampled)."""
    if out.logits.shape[2:] == out.features.shape[2:]:
        return out.logits
    return model.classifier(out.features)


class Saving100xPlugin(TeacherPlugin):
    """STAR (Chen et al., NeurIPS 2023) on the jascl loop.

    End of every session (``after_training``; ``session_restored`` for the shared
    base): :class:`FeatureStatistics` of the session's taught classes from the
    final model on the labelled set, stored in a :class:`ReplayStore` that is
    saved with each checkpoint; the true-background pixel count accumulates.

    Incremental sessions: at the start, the old model counts, on the labelled
    set's background pixels, those it predicts as each old class and as true
    background. Each iteration replays ``(count_c - present_c) / iterations``
    synthetic features of every old class c (``present_c``: pixels of c already
    in the session's images) and repeats the true-background pixels of the batch
    ``stored background / session true background`` times, combined with the
    current pixels by :func:`replay_balanced_ce` -- the current part *replaces* the
    loop's ``state.losses["seg"]`` (+ Dice), the rest is ``<name>_replay``;
    ``<name>_ocfm`` and ``<name>_sad`` add the feature terms.

    Deviations (STAR trains one sigmoid head per class and supervises only the
    new heads with the current labels, old heads untouched): with our softmax
    classifier the current pixels use MiB's background-merged cross-entropy (a
    background pixel may be background or a hidden old class -- the softmax
    analogue of "not a new class"); replayed features are classified as their
    own class and repeated true background as background; statistics at the
    features' resolution instead of 1/16 subsampled labels; one norm per
    synthetic feature; draws capped per class with importance weights; the
    distribution-matching counts use STAR's "overlap" rule without its VOC
    constants; pixels the old model predicts as a class taught again are left out
    of OCFM; new classifier rows keep the loop's prototype imprinting (STAR:
    random); the Dice half of "seg".
    """

    name = "saving100x"
    loss_terms = ("saving100x_replay", "saving100x_ocfm", "saving100x_sad")
    replaces = ("supervised-loss",)  # "seg" is the method's own in incremental sessions
    sad_key = "sad"

    def __init__(self, options: Saving100xOptions | None = None, freeze: str | None = "none") -> None:
        super().__init__(freeze, init="imprint")
        self.o = options or Saving100xOptions()
        self.store = ReplayStore()
        self._pred_background = 0.0
        self._labelled_background = 0.0
        self._replay: list[tuple[int, int, float]] = []  # (stored class id, draws per iteration, weight per draw)
        self._bg_ratio = 0.0
        self._generator: torch.Generator | None = None

    def key(self, term: str) -> str:
        return f"{self.name}_{term}"

    # ------------------------------------------------------------------ plugin state

    def extra_state(self) -> dict[str, torch.Tensor]:
        return self.store.to_tensors()

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.store = ReplayStore.from_tensors(tensors)

    # ------------------------------------------------------------------ statistics passes

    @torch.no_grad()
    def gather_statistics(self, state: LoopState) -> dict[int, ClassStatistics]:
        """Statistics of the session's taught classes from the current model (eval mode)."""
        model = state.model
        modes = _eval_mode(model)
        acc = FeatureStatistics(state.session.classes, model.backbone.feature_channels)
        background = 0.0
        for batch in labelled_loader(state):
            features = model.forward_features(batch["image"].to(state.device)).features
            labels = resize_labels(batch["label"].to(state.device), features.shape[2:])
            acc.update(features, labels)
            background += float((labels == 0).sum())
        _restore_modes(modes)
        self._labelled_background = background
        return acc.compute()

    def _store_session(self, state: LoopState, trained: bool) -> None:
        stats = self.gather_statistics(state)
        for cid, s in stats.items():
            self.store.add(cid, s)
        if state.session.index == 0:
            self.store.background = self._labelled_background
        elif trained:
            self.store.background += self._pred_background
        else:  # a reused incremental session without saved statistics: no old model to separate true background
            self.store.background += self._labelled_background
            log.warning(
                "%s: session %d reused without saved statistics; its background count includes old classes",
                self.name,
                state.session.index,
            )

    def session_restored(self, state: LoopState) -> None:
        if any(c not in self.store.classes for c in state.session.classes):
            self._store_session(state, trained=False)

    @torch.no_grad()
    def count_present(self, state: LoopState) -> tuple[dict[int, float], float]:
        """Old-model counts on the labelled set: pixels of each stored class already present, and true background.

        Taught classes count their labelled pixels; untaught old classes the
        background-labelled pixels the old model predicts as them.
        """
        present = {cid: 0.0 for cid in self.store.classes}
        true_bg = 0.0
        for batch in labelled_loader(state):
            out = self.teacher.forward_features(batch["image"].to(state.device))
            pred = _small_logits(self.teacher, out)[:, : self.num_old].argmax(dim=1)
            labels = resize_labels(state.class_index(batch["label"].to(state.device)), out.features.shape[2:])
            background = labels == 0
            true_bg += float((background & (pred == 0)).sum())
            for cid in present:
                row = state.seen.index(cid)
                if cid in state.session.classes:
                    present[cid] += float((labels == row).sum())
                else:
                    present[cid] += float((background & (pred == row)).sum())
        return present, true_bg

    # ------------------------------------------------------------------ events

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        if self.teacher is None:
            return
        self._absorbed = absorbed_rows(state)
        self._new_rows = [state.seen.index(c) for c in state.session.new_classes]
        self._old_ids = [c for c in sorted(self.store.classes) if c in state.previous_seen]
        present, true_bg = self.count_present(state)
        self._pred_background = true_bg
        iterations = max(math.ceil(len(state.data.train) / state.config.batch_size), 1)
        self._replay = []
        for cid in self._old_ids:
            per_iter = int(max(self.store.classes[cid].count - present[cid], 0.0) / iterations)
            if per_iter > 0:
                draws = min(per_iter, self.o.max_replay_per_class)
                self._replay.append((cid, draws, per_iter / draws))
        self._bg_ratio = self.store.background / true_bg if true_bg > 0 else 0.0
        self._prototypes = (
            torch.stack([self.store.classes[c].prototype for c in self._old_ids]).to(state.device)
            if self._old_ids
            else torch.zeros(0, state.model.backbone.feature_channels, device=state.device)
        )
        self._generator = torch.Generator(device=state.device).manual_seed(state.seed * 7919 + state.session.index)
        log.info(
            "%s session %d: replay per iteration %s, background ratio %.3f",
            self.name,
            state.session.index,
            {c: n for c, n, _ in self._replay},
            self._bg_ratio,
        )

    def replay_loss_sums(self, state: LoopState) -> tuple[torch.Tensor, float]:
        """(sum of replayed CE, number of replayed features represented) for this iteration."""
        if not (self.o.replay and self._replay):
            return state.output.logits.sum() * 0.0, 0.0
        total, represented = [], 0.0
        for cid, draws, weight in self._replay:
            s = self.store.classes[cid]
            fake = sample_replay_features(
                s.prototype.to(state.device), s.noise.to(state.device), s.norm_mean, s.norm_std, draws, self._generator
            )
            target = torch.full((draws,), state.seen.index(cid), device=state.device, dtype=torch.long)
            total.append(weight * F.cross_entropy(state.model.classifier(fake), target, reduction="sum"))
            represented += weight * draws
        return torch.stack(total).sum(), represented

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            state.losses["seg"] = default_supervised_loss(state)
            return
        cfg = state.config
        out, out_t = state.output, self.teacher_outputs(state)
        target = state.target
        current = unbiased_cross_entropy(out.logits, target, self._absorbed)
        dice = 0.0
        if self.o.dice and cfg.lambda_dice:
            merged, mapped = merge_absorbed_probabilities(out.logits, target, self._absorbed)
            dice = cfg.lambda_dice * soft_dice_loss(merged, mapped)

        small = _small_logits(state.model, out)
        labels = resize_labels(target, out.features.shape[2:])
        pred_old = _small_logits(self.teacher, out_t)[:, : self.num_old].argmax(dim=1)
        background = labels == 0
        replay_sum, n_replay = self.replay_loss_sums(state)
        true_bg = background & (pred_old == 0)
        if self.o.replay and self._bg_ratio > 0 and true_bg.any():
            bg_ce = F.cross_entropy(small, torch.zeros_like(labels), reduction="none")[true_bg].sum()
        else:
            bg_ce = small.sum() * 0.0
        ratio = self._bg_ratio if self.o.replay else 0.0
        cur, rep = replay_balanced_ce(current, replay_sum, n_replay, bg_ce, float(true_bg.sum()), ratio, labels.numel())
        state.losses["seg"] = cfg.lambda_ce * cur + dice
        state.losses[self.key("replay")] = cfg.lambda_ce * rep

        hidden_old = torch.isin(pred_old, torch.as_tensor(self._absorbed[1:], device=state.device, dtype=torch.long))
        state.losses[self.key("ocfm")] = self.o.ocfm_weight * ocfm_loss(
            out.features, out_t.features, background & hidden_old
        )
        state.losses[self.key(self.sad_key)] = self.o.sad_weight * sad_loss(
            out.features, labels, self._new_rows, self._prototypes
        )

    def after_training(self, state: LoopState) -> None:
        self._store_session(state, trained=True)


class AdaptReplayPlugin(Saving100xPlugin):
    """Adapter (Zhu et al., AAAI 2025): STAR + ADC + UAC, with CPD (SAD on compensated prototypes).

    ``adapter_uac`` adds :func:`uncertainty_constraint_loss`; at the end of each
    incremental session, before the new statistics are stored, the stored
    prototypes of untaught old classes are moved by :func:`compensate_prototypes`,
    estimated on the labelled set's background pixels that the old and the new
    model both predict as that class with certainty > ``certainty``; later
    sessions replay and push away from the compensated prototypes.

    Deviations: those of :class:`Saving100xPlugin`; softmax probabilities for
    the certainty (Adapter: sigmoids); ADC's ratio clipped to [0, 1]; ADC is
    applied although the official release leaves its call commented out.
    """

    name = "adapter"
    loss_terms = ("adapter_replay", "adapter_ocfm", "adapter_cpd", "adapter_uac")
    sad_key = "cpd"

    def __init__(self, options: AdaptReplayOptions | None = None, freeze: str | None = "none") -> None:
        super().__init__(options or AdaptReplayOptions(), freeze)

    def after_forward(self, state: LoopState) -> None:
        super().after_forward(state)
        if self.teacher is None:
            return
        target = state.class_index(state.batch["label"].to(state.device))
        state.losses[self.key("uac")] = self.o.uac_weight * uncertainty_constraint_loss(
            state.output.logits, target, self.o.certainty
        )

    @torch.no_grad()
    def compensate(self, state: LoopState) -> None:
        """ADC on the stored prototypes of the old classes not taught in this session."""
        rows = self._absorbed[1:]
        ids = [state.previous_seen[r] for r in rows if state.previous_seen[r] in self.store.classes]
        if not ids:
            return
        rows = [state.seen.index(c) for c in ids]
        d = state.model.backbone.feature_channels
        before = torch.zeros(len(ids), d, dtype=torch.float64)
        after = torch.zeros_like(before)
        confident = torch.zeros(len(ids), dtype=torch.float64)
        modes = _eval_mode(state.model)
        for batch in labelled_loader(state):
            x = batch["image"].to(state.device)
            out_s, out_t = state.model.forward_features(x), self.teacher.forward_features(x)
            p_t = F.softmax(_small_logits(self.teacher, out_t)[:, : self.num_old], dim=1)
            p_s = F.softmax(_small_logits(state.model, out_s), dim=1)
            labels = resize_labels(state.class_index(batch["label"].to(state.device)), out_s.features.shape[2:])
            sure = (
                (labels == 0)
                & (prediction_certainty(p_t) > self.o.certainty)
                & (prediction_certainty(p_s) > self.o.certainty)
            )
            pred_t, pred_s = p_t.argmax(dim=1), p_s.argmax(dim=1)
            unit_t, unit_s = F.normalize(out_t.features, dim=1), F.normalize(out_s.features, dim=1)
            for i, row in enumerate(rows):
                m = (sure & (pred_t == row) & (pred_s == row)).unsqueeze(1)
                if m.any():
                    dims = [0, *range(2, unit_t.dim())]
                    before[i] += (unit_t * m).sum(dim=dims).double().cpu()
                    after[i] += (unit_s * m).sum(dim=dims).double().cpu()
                    confident[i] += float(m.sum())
        _restore_modes(modes)
        stats = [self.store.classes[c] for c in ids]
        stored = torch.stack([s.prototype for s in stats]).double()
        protos, noise = compensate_prototypes(
            stored,
            torch.stack([s.noise for s in stats]).double(),
            before,
            after,
            confident,
            torch.tensor([s.count for s in stats], dtype=torch.float64),
        )
        for i, s in enumerate(stats):
            s.prototype, s.noise = protos[i].float(), noise[i].float()
        log.info(
            "%s session %d: ADC on classes %s from %s confident pixels, prototype moves %s",
            self.name,
            state.session.index,
            ids,
            [int(v) for v in confident],
            [round(float(v), 4) for v in (protos - stored).norm(dim=1)],
        )

    def after_training(self, state: LoopState) -> None:
        if self.teacher is not None and self.o.adc:
            self.compensate(state)
        super().after_training(state)


def _validated(method: str, o: Saving100xOptions) -> None:
    from jascl.errors import ConfigError

    check_non_negative(method, ocfm_weight=o.ocfm_weight, sad_weight=o.sad_weight)
    if o.max_replay_per_class < 1:
        raise ConfigError(f"method_args.{method}.max_replay_per_class={o.max_replay_per_class}: must be >= 1")
    if isinstance(o, AdaptReplayOptions):
        check_non_negative(method, uac_weight=o.uac_weight)
        if not 0.0 <= o.certainty <= 1.0:
            raise ConfigError(f"method_args.{method}.certainty={o.certainty}: must be in [0, 1]")


@METHODS.register(
    "saving100x", doc="baseline: prototype + statistics replay, OCFM, SAD (STAR; Chen et al., NeurIPS 2023)"
)
def saving100x(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "saving100x", Saving100xOptions())
    _validated("saving100x", o)
    return Method(
        "saving100x",
        [Saving100xPlugin(o, freeze_policy("saving100x", o.freeze))],
        "STAR: prototype replay reconstructing the training distribution",
    )


@METHODS.register(
    "adapt-replay", doc="baseline: adaptive prototype replay, ADC + UAC + CPD (Adapter; Zhu et al., AAAI 2025)"
)
def adapt_replay(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "adapt-replay", AdaptReplayOptions())
    _validated("adapt-replay", o)
    return Method(
        "adapt-replay",
        [AdaptReplayPlugin(o, freeze_policy("adapt-replay", o.freeze))],
        "Adapter: STAR with compensated prototypes and an uncertainty constraint",
    )
