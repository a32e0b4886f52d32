"""CSL (Liu and Liu, "When Confidence Fails: Revisiting Pseudo-Label Selection in Semi-supervised Semantic
Segmentation", arXiv 2509.16704, 2025; code github.com/ljs11528, pseudo-label-selection/CSL): per-image spectral
separation of pixels in (max confidence, residual-class variance) space, Gaussian weights, on a UniMatch-style
weak/strong/feature-perturbed student, plus random masking of reliable pixels."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method
from jascl.methods.mean_teacher import view_transform
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.pas import FilterCounters
from jascl.methods.registry import METHODS
from jascl.networks.base import resize

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.semi._shared import PoolPhasesPlugin, _schedule


def confidence_features(probs: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """CSL's per-pixel features: max confidence m and scaled residual-class variance v.

    v = g(m) * Var_{k != argmax}(p_k), with g(m) = (K - 1)^2 / (2 (1 - m + eps))
    (the confidence-dependent scale of the authors' code); the variance is over
    the K - 1 non-maximum classes, around their mean (1 - m) / (K - 1).

    Args:
        probs: (B, K, *spatial) softmax outputs, K >= 2.

    Returns:
        m, v: (B, *spatial) each.
    """
    k = probs.shape[1]
    m, pred = probs.max(dim=1)
    rest_mean = (1.0 - m) / (k - 1)
    is_max = F.one_hot(pred, k).movedim(-1, 1).bool()
    sq = torch.where(is_max, torch.zeros_like(probs), (probs - rest_mean.unsqueeze(1)) ** 2)
    variance = sq.sum(dim=1) / (k - 1)
    return m, (k - 1) ** 2 / (2.0 * (1.0 - m + eps)) * variance


def spectral_two_clusters(features: torch.Tensor) -> torch.Tensor:
    """CSL's spectral relaxation: split N points of (N, 2) features in two clusters.

    The top-2 right singular vectors of the (uncentred) feature matrix give
    each point two coordinates; a point joins the cluster of the larger
    absolute coordinate (the authors' ``_class_assignment``).

    Returns:
        (N,) int64 in {0, 1}.
    """
    _, _, vh = torch.linalg.svd(features.T.double(), full_matrices=False)
    return vh[:2].abs().argmax(dim=0)


def reliable_cluster(features: torch.Tensor, assignment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance (each (2,)) of the cluster with the larger mean confidence.

    A cluster with one point has variance 0; an empty one has mean and
    variance 0 (as in the authors' code).
    """
    means, variances = [], []
    for c in (0, 1):
        pts = features[assignment == c]
        if len(pts) == 0:
            means.append(features.new_zeros(2))
            variances.append(features.new_zeros(2))
        else:
            means.append(pts.mean(dim=0))
            variances.append(pts.var(dim=0) if len(pts) > 1 else features.new_zeros(2))
    best = int(torch.stack(means)[:, 0].argmax())
    return means[best], variances[best]


def csl_weights_from_features(
    m: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None, alpha: float = 2.0, eps: float = 1e-8
) -> torch.Tensor:
    """CSL's per-pixel weights for one image from its (m, v) features.

    With the reliable cluster's means (mu_m, mu_v) and variances (s_m, s_v):
    z_m = (m - mu_m) / sqrt(s_m + eps), z_v = (mu_v - v) / sqrt(s_v + eps),
    w = exp(-z_m^2 / alpha) * exp(-z_v^2 / alpha), and w = 1 where z_m > 0 or
    z_v > 0 (at least as reliable as the cluster's centre on one axis).
    Invalid pixels get 0; an image without valid pixels gets all zeros.

    Args:
        m, v: (*spatial) features of one image.
        valid: (*spatial) bool or None (all valid).
        alpha: width of the Gaussian weighting.
    """
    valid = torch.ones_like(m, dtype=torch.bool) if valid is None else valid
    feats = torch.stack([m[valid], v[valid]], dim=-1).double()
    if len(feats) == 0:
        return torch.zeros_like(m)
    if len(feats) == 1:
        mean, var = feats[0], feats.new_zeros(2)
    else:
        mean, var = reliable_cluster(feats, spectral_two_clusters(feats))
    z_m = (m.double() - mean[0]) / torch.sqrt(var[0] + eps)
    z_v = (mean[1] - v.double()) / torch.sqrt(var[1] + eps)
    w = torch.exp(-(z_m**2) / alpha) * torch.exp(-(z_v**2) / alpha)
    w = torch.where((z_m > 0) | (z_v > 0), torch.ones_like(w), w)
    return torch.where(valid, w, torch.zeros_like(w)).to(m.dtype)


def csl_weights(probs: torch.Tensor, valid: torch.Tensor | None = None, alpha: float = 2.0) -> torch.Tensor:
    """(B, *spatial) CSL weights of a batch of softmax outputs (B, K, *spatial); statistics per image."""
    m, v = confidence_features(probs)
    return torch.stack(
        [
            csl_weights_from_features(m[b], v[b], None if valid is None else valid[b], alpha)
            for b in range(probs.shape[0])
        ]
    )


def csl_loss(
    logits: torch.Tensor, pseudo: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """sum(CE(logits, pseudo) * w) / number of valid pixels (the authors' ``semi_loss``).

    Args:
        logits: (B, K, *spatial) student logits.
        pseudo: (B, *spatial) pseudo-label rows.
        weights: (B, *spatial) CSL weights.
        valid: (B, *spatial) bool or None (all valid).
    """
    ce = F.cross_entropy(logits.float(), pseudo, reduction="none")
    count = ce.numel() if valid is None else int(valid.sum())
    return (ce * weights).sum() / max(count, 1)


def cutmix_box(spatial: tuple[int, ...], prob: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random box mask (UniMatch's CutMix): with probability ``prob`` a box of 2-40 % of the volume.

    Every side is the image side times area**(1/D), D = number of axes, with
    the area fraction uniform in [0.02, 0.4] (UniMatch draws a 2D box with a
    random aspect ratio; a cube keeps 2D and 3D on one path).

    Returns:
        (*spatial) bool.
    """
    box = torch.zeros(spatial, dtype=torch.bool)
    if torch.rand((), generator=generator) >= prob:
        return box
    area = 0.02 + 0.38 * float(torch.rand((), generator=generator))
    slices = []
    for size in spatial:
        side = max(1, min(size, round(size * area ** (1 / len(spatial)))))
        start = int(torch.randint(0, size - side + 1, (), generator=generator))
        slices.append(slice(start, start + side))
    box[tuple(slices)] = True
    return box


def block_mask(
    spatial: tuple[int, ...], block: int, ratio: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random blocks of side ``block``, each covered with probability ``ratio``; (*spatial) bool."""
    grid = [math.ceil(s / block) for s in spatial]
    cover = torch.rand(grid, generator=generator) < ratio
    for axis in range(len(spatial)):
        cover = cover.repeat_interleave(block, dim=axis)
    return cover[tuple(slice(0, s) for s in spatial)]


def channel_dropout(features: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout of whole feature channels (UniMatch's feature perturbation, Dropout2d/3d)."""
    if p <= 0:
        return features
    keep = (torch.rand(features.shape[:2], device=features.device) >= p).to(features.dtype) / (1 - p)
    return features * keep.view(*features.shape[:2], *([1] * (features.dim() - 2)))


@dataclass
class CSLOptions:
    """``method_args.csl`` options (defaults: the authors' code and Pascal config).

    Attributes:
        weight: weight of the unlabelled term against the supervised one (code: (loss_x + loss_u) / 2, i.e. 1).
        alpha: Gaussian width (the code's ``get_weight`` default 2.0, which is what runs:
            the config's ``alpha: 8`` is stored but never passed to it).
        cover_ratio: fraction of blocks masked in the masked view (config ``cover_radio: 0.7``).
        block_fraction: block side / image side (config ``block_size: 32`` on 321-pixel crops).
        fp_dropout: feature-perturbation channel dropout (UniMatch: 0.5).
        cutmix_prob: probability of a CutMix box per strong view (UniMatch: 0.5).
        freeze: "config" (default), "none" or "all_but_classifier".
    """

    weight: float = option(1.0, ge=0)
    alpha: float = option(2.0, gt=0)
    cover_ratio: float = option(0.7, ge=0, le=1)
    block_fraction: float = option(0.1, gt=0, le=1)
    fp_dropout: float = option(0.5, ge=0, lt=1)
    cutmix_prob: float = option(0.5, ge=0, le=1)
    freeze: str = freeze_option()


class CSLPlugin(PoolPhasesPlugin):
    """CSL on the pool: ``csl`` = weight * (0.25 L_s + 0.25 L_m + 0.5 L_fp) in unlabelled phases.

    Per pool batch (UniMatch-style, the student labels its own weak view): the
    weak view is the image itself; its prediction gives pseudo-labels and CSL
    weights (:func:`csl_weights`, statistics per image). L_s: a strong view
    (intensity augmentation + CutMix with the next image of the batch, whose
    pseudo-labels and weights are pasted with it); L_m: a second strong view
    whose reliable pixels (weight 1) are zeroed in randomly covered blocks
    (CSL's random masking of reliable pixels, so they must be inferred from
    context); L_fp: the weak view's features with channel dropout through the
    classifier. Each L is :func:`csl_loss`.

    Deviations: intensity augmentations (``mean_teacher.view_transform``)
    instead of colour jitter / grayscale / blur, and a cube CutMix box (2D and
    3D); the mixing partner is the next image of the same batch, not a second
    batch; feature perturbation on the features before the classifier (UniMatch
    drops encoder features before its decoder); the masking follows the
    paper's description (the released code has it commented out and trains the
    masked slot as a second CutMix view); residual-class variance over the
    non-maximum classes only (the released code also counts the zeroed maximum
    slot in the sum).
    """

    name = "csl"
    loss_terms = ("csl",)

    def __init__(
        self,
        weight: float = 1.0,
        alpha: float = 2.0,
        cover_ratio: float = 0.7,
        block_fraction: float = 0.1,
        fp_dropout: float = 0.5,
        cutmix_prob: float = 0.5,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        freeze: str | None = None,
    ) -> None:
        super().__init__(start_epoch, every, batch_size)
        self.weight, self.alpha = weight, alpha
        self.cover_ratio, self.block_fraction = cover_ratio, block_fraction
        self.fp_dropout, self.cutmix_prob = fp_dropout, cutmix_prob
        self.freeze_incremental = freeze

    def before_session(self, state: LoopState) -> None:
        if self._setup_pool(state, salt=2):
            self._views = (view_transform(state.seed + 11), view_transform(state.seed + 12))
            self.counters = FilterCounters()

    def _view(self, images: torch.Tensor, which: int) -> torch.Tensor:
        t = self._views[which]
        # plain tensors: MONAI's MetaTensor would slow every later operation down
        return torch.stack([torch.as_tensor(t(img)).as_subclass(torch.Tensor) for img in images]).float()

    def after_forward(self, state: LoopState) -> None:
        if not self._phase:
            return
        batch = self._pool_batch()
        x = batch["image"]
        device = state.device
        model = state.model
        weak = model.forward_features(x.to(device))
        probs = torch.softmax(weak.logits.detach().float(), dim=1)
        pseudo = probs.argmax(dim=1)
        weights = csl_weights(probs, alpha=self.alpha)
        partner = torch.roll(torch.arange(x.shape[0]), -1)
        spatial = tuple(x.shape[2:])
        block = max(1, round(self.block_fraction * min(spatial)))

        views, targets, view_weights = [], [], []
        for which in (0, 1):
            strong = self._view(x, which)
            boxes = torch.stack([cutmix_box(spatial, self.cutmix_prob) for _ in range(x.shape[0])]).to(device)
            strong = strong.to(device)
            mixed = torch.where(boxes.unsqueeze(1), strong[partner], strong)
            target = torch.where(boxes, pseudo[partner], pseudo)
            w = torch.where(boxes, weights[partner], weights)
            if which == 1:  # random masking of reliable pixels
                cover = torch.stack([block_mask(spatial, block, self.cover_ratio) for _ in range(x.shape[0])])
                hidden = cover.to(device) & (w == 1)
                mixed = mixed.masked_fill(hidden.unsqueeze(1), 0.0)
            views.append(mixed)
            targets.append(target)
            view_weights.append(w)
        logits_s, logits_m = model(torch.cat(views)).chunk(2)
        fp = model.classifier(channel_dropout(weak.features, self.fp_dropout))
        fp = resize(fp, weak.logits.shape[2:])
        loss = (
            0.25 * csl_loss(logits_s, targets[0], view_weights[0])
            + 0.25 * csl_loss(logits_m, targets[1], view_weights[1])
            + 0.5 * csl_loss(fp, pseudo, weights)
        )
        state.losses[self.name] = self.weight * loss
        seen = torch.as_tensor(state.seen, device=device)
        self.counters.update(weights == 1, seen[pseudo], batch["truth"].to(device))  # measurement only

    def after_training(self, state: LoopState) -> None:
        if self._loader is not None and self.counters.total:
            stats = self.counters.stats()
            state.report["pseudo_labels"] = {"method": "csl", "coverage": stats.coverage, "precision": stats.precision}


@METHODS.register(
    "csl",
    options=CSLOptions,
    paper="Liu & Liu, arXiv 2509.16704, 2025",
    doc="baseline: confidence-separable pseudo-label weighting on a UniMatch-style student",
    fidelity="faithful",
)
def csl(o: CSLOptions, config: RunConfig) -> Method:
    """CSL on the unlabelled pool, on the unlabelled-phase schedule of ``method_args.jascl.pas``."""
    plugin = CSLPlugin(
        weight=o.weight,
        alpha=o.alpha,
        cover_ratio=o.cover_ratio,
        block_fraction=o.block_fraction,
        fp_dropout=o.fp_dropout,
        cutmix_prob=o.cutmix_prob,
        freeze=freeze_policy(o.freeze),
        **_schedule(config),
    )
    return Method("csl", [plugin], "CSL: confidence-separable pseudo-label selection")
