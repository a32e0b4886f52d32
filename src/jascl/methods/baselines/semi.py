"""Semi-supervised continual baselines on the session's unlabelled pool: UaD-CE, CSL and RETRIEVE.

All three use the unlabelled pool ``state.data.unlabelled`` on the same
schedule as the mean teacher (``config.pas.start_epoch`` / ``config.pas.every``:
an *unlabelled phase* is an epoch that makes one pass over the pool, each step
pairing a labelled batch with an unlabelled one). The pool's labels are hidden
ground truth: they ride along for measuring pseudo-label quality
(``state.report["pseudo_labels"]``) and never enter a loss.

* ``uad-ce``  -- Cui, Deng, Chen and Liu, "Uncertainty-Aware Distillation for
  Semi-Supervised Few-Shot Class-Incremental Learning", IEEE TNNLS 2023
  (arXiv 2301.09964; code github.com/yawencui/UaD-ClE): class-balanced
  self-training (ClE) + uncertainty-aware, adaptively weighted distillation (UaD).
* ``csl``     -- Liu and Liu, "When Confidence Fails: Revisiting Pseudo-Label
  Selection in Semi-supervised Semantic Segmentation" (Confidence Separable
  Learning), arXiv 2509.16704, 2025 (authors' code: github.com/ljs11528,
  ``pseudo-label-selection/CSL``): per-image spectral separation of pixels in
  (max confidence, residual-class variance) space, Gaussian weights, on a
  UniMatch-style weak/strong/feature-perturbed student, plus random masking
  of reliable pixels.
* ``retrieve`` -- Killamsetty, Zhao, Chen and Iyer, "RETRIEVE: Coreset
  Selection for Efficient and Robust Semi-Supervised Learning", NeurIPS 2021
  (code: CORDS, ``cords/selectionstrategies/SSL/retrievestrategy.py``):
  greedy bilevel coreset selection of the unlabelled pool on last-layer
  gradients, here under the repository's confidence-filtered mean teacher.

Left out: NNCSL (Kang, Fini, Nabi, Ricci and Alahari, "A Soft Nearest-Neighbor
Framework for Continual Semi-Supervised Learning", ICCV 2023 -- the brief's
title "Soft neighbors are positive supporters ..." is a different paper). Its
learner is a PAWS-style soft nearest-neighbour classifier over a support set
of labelled samples drawn from a replay buffer of every earlier task, plus
nearest-neighbour distillation through a projector. The JASCL setting keeps
no labelled samples of earlier sessions, so the support set and the
distillation targets of earlier classes do not exist; and a pixel-level
support set replacing the segmentation head has no published recipe. A
version without them would not be NNCSL, so it is not offered.

Every deviation needed for dense prediction under joint nonstationarity is
listed in each plugin's docstring.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader, Subset

from jascl.data.datasets import BatchStream, LabelledDataset
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.gas import clean_state_dict
from jascl.methods.mean_teacher import MeanTeacherPlugin, UnlabelledDataset, view_transform
from jascl.methods.pas import FilterCounters, consistency_loss, pas_filter
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter

log = logging.getLogger("jascl")

FREEZE_CHOICES = ("config", "none", "all_but_classifier")


def freeze_policy(value: str, method: str) -> str | None:
    """The plugin's ``freeze_incremental`` for a ``freeze`` option ("config" -> None = the run's policy)."""
    if value not in FREEZE_CHOICES:
        raise ConfigError(f"method_args.{method}.freeze: must be one of {', '.join(FREEZE_CHOICES)} (got {value!r})")
    return None if value == "config" else value


# ============================================================== shared machinery


@torch.no_grad()
def _eval_logits(model: Segmenter, images: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` in eval mode (train/eval modes restored afterwards)."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        return model(images)
    finally:
        for m, mode in modes.items():
            m.train(mode)


class PoolPhasesPlugin(Plugin):
    """Base for plugins that train on the unlabelled pool during unlabelled phases.

    Subclasses call :meth:`_setup_pool` in ``before_session`` and take a pool
    batch with :meth:`_pool_batch` in ``after_forward`` while ``self._phase``.
    """

    #: a phase's set-up (the pool stream's position, pseudo-labels chosen at its start) is in the checkpoint
    mid_epoch_resume = True

    def __init__(self, start_epoch: int = 25, every: int = 25, batch_size: int | None = None) -> None:
        if start_epoch < 0 or every < 1:
            raise ConfigError(f"unlabelled phases need start_epoch >= 0 and every >= 1 (got {start_epoch}, {every})")
        self.start_epoch, self.every, self.batch_size = start_epoch, every, batch_size
        self._loader: DataLoader | None = None
        self._batches: BatchStream | None = None
        self._phase = False

    def _setup_pool(self, state: LoopState, salt: int) -> bool:
        """Build the pool loader for an incremental session with a pool; False if there is none."""
        self._loader, self._batches, self._phase = None, None, False
        pool = state.data.unlabelled
        if state.session.index == 0 or pool is None or len(pool) == 0:
            return False
        generator = torch.Generator().manual_seed(state.seed * 7919 + state.session.index * 31 + salt)
        self._loader = DataLoader(
            UnlabelledDataset(pool),
            batch_size=self.batch_size or state.config.batch_size,
            shuffle=True,
            generator=generator,
        )
        self._batches = BatchStream(self._loader)
        return True

    def _is_phase(self, epoch: int) -> bool:
        return self._loader is not None and epoch >= self.start_epoch and (epoch - self.start_epoch) % self.every == 0

    def epoch_iterations(self, state: LoopState) -> int | None:
        return len(self._loader) if self._is_phase(state.epoch) else None

    def before_epoch(self, state: LoopState) -> None:
        self._phase = self._is_phase(state.epoch)
        if self._phase:
            self._batches = BatchStream(self._loader)

    def _pool_batch(self) -> dict:
        return next(self._batches)

    def after_session(self, state: LoopState) -> None:
        self._loader, self._batches, self._phase = None, None, False


# ============================================================== UaD-CE


def uncertainty_from_samples(prob_samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """UaD's uncertainty: the spread of the reference model's prediction over noisy passes.

    For each pixel, the class with the highest mean probability over the M
    passes, and the (unbiased) standard deviation over the passes of that
    class's probability (official code: ``torch.std`` over passes, gathered at
    the argmax of the mean).

    Args:
        prob_samples: (M, B, K, *spatial) softmax outputs of M noisy passes.

    Returns:
        pred (B, *spatial) rows, std (B, *spatial).
    """
    mean = prob_samples.mean(dim=0)
    pred = mean.argmax(dim=1)
    std = prob_samples.std(dim=0).gather(1, pred.unsqueeze(1)).squeeze(1)
    return pred, std


def uad_keep_mask(uncertainty: torch.Tensor, from_pool: torch.Tensor, u_t: float) -> torch.Tensor:
    """Pixels kept for distillation (UaD's uncertainty-guided refinement).

    The uncertainties of all pixels of the batch are sorted ascending and the
    value at position ``int(u_t * n)`` is the threshold; pixels from the
    unlabelled pool whose uncertainty exceeds it are dropped, labelled pixels
    are always kept (official code: only samples of unlabelled origin, flag 0,
    are deleted).

    Args:
        uncertainty: (B, *spatial).
        from_pool: (B,) or (B, *spatial) bool, True where the pixel comes from the pool.
        u_t: kept quantile in (0, 1] (official default 3/5).
    """
    flat = uncertainty.flatten()
    position = min(int(u_t * flat.numel()), flat.numel() - 1)
    threshold = flat.sort().values[position]
    if from_pool.dim() == 1:
        from_pool = from_pool.view(-1, *([1] * (uncertainty.dim() - 1))).expand_as(uncertainty)
    return ~(from_pool & (uncertainty > threshold))


def uad_distillation(
    student_old_logits: torch.Tensor, teacher_logits: torch.Tensor, keep: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Mean over kept pixels of KL(softmax(t/T) || softmax(s/T)), summed over the old classes.

    (The official ``KLDivLoss()(...) * num_old_classes``: its mean over all
    elements times the number of classes is the sum over classes, mean over
    samples.) An empty kept set gives 0, attached to the student's graph.

    Args:
        student_old_logits: (B, K_old, *spatial) the student's rows of the old classes.
        teacher_logits: (B, K_old, *spatial) the reference (previous-session) model's logits.
        keep: (B, *spatial) bool.
        temperature: T.
    """
    # float64: the divergence of a barely changed model must not drown in rounding (or turn negative)
    log_p = F.log_softmax(student_old_logits.double() / temperature, dim=1)
    log_q = F.log_softmax(teacher_logits.detach().double() / temperature, dim=1)
    per_pixel = (log_q.exp() * (log_q - log_p)).sum(dim=1)
    count = keep.sum()
    if count == 0:
        return (per_pixel.sum() * 0.0).to(student_old_logits.dtype)
    return ((per_pixel * keep).sum() / count).to(student_old_logits.dtype)


def adaptive_lambda(base: float, u_t: float, n_old: int, n_new: int, adapt: bool = True) -> float:
    """UaD's adaptive distillation weight: base / u_t * sqrt(n_old / n_new) (official ``adapt_lamda``)."""
    return base / u_t * math.sqrt(n_old / max(n_new, 1)) if adapt else base


def class_balanced_selection(
    probs: torch.Tensor, candidates: torch.Tensor, rows: list[int], quota: int
) -> torch.Tensor:
    """ClE's class-balanced self-training, per pixel: at most ``quota`` new pseudo-labels per class.

    For every class row r in ``rows``, among candidate pixels whose prediction
    (argmax over all rows) is r, the ``quota`` most confident ones (all of them
    if there are fewer, as in the official code) get pseudo-label r.

    Args:
        probs: (N, K, *spatial) softmax outputs.
        candidates: (N, *spatial) bool, pixels not yet pseudo-labelled.
        rows: class rows that may be selected.
        quota: pixels per class.

    Returns:
        (N, *spatial) int64: the selected row, 255 elsewhere.
    """
    conf, pred = probs.max(dim=1)
    out = torch.full_like(pred, IGNORE_INDEX)
    flat_out, flat_conf, flat_pred, flat_cand = out.view(-1), conf.flatten(), pred.flatten(), candidates.flatten()
    for row in rows:
        index = torch.nonzero(flat_cand & (flat_pred == row)).squeeze(1)
        if quota <= 0 or index.numel() == 0:
            continue
        if index.numel() > quota:
            index = index[flat_conf[index].topk(quota).indices]
        flat_out[index] = row
    return out


@dataclass
class UaDCEOptions:
    """``method_args.uad-ce`` options (defaults: the official code, ``train_cub.py`` and README command).

    Attributes:
        base_lambda: base distillation weight (``--base_lamda 2``).
        u_t: kept uncertainty quantile (``--u_t 3/5``).
        adapt_lambda: adaptive weight base / u_t * sqrt(K_old / K_session) (README runs ``--adapt_lamda``).
        temperature: distillation temperature T (2).
        beta: distillation factor beta (0.25).
        noise_passes: noisy passes M of the reference model (10).
        noise_std, noise_clip: Gaussian input noise std 0.01 clipped to +-0.02.
        round_fraction: pool pixels pseudo-labelled per selection round (10 of 300 samples per round).
        max_fraction: cap on pseudo-labelled pool pixels (160 of 300 samples).
        st_weight: weight of the cross-entropy on pseudo-labelled pixels (1: they join the training set).
        freeze: "config" (default), "none" or "all_but_classifier".
    """

    base_lambda: float = 2.0
    u_t: float = 0.6
    adapt_lambda: bool = True
    temperature: float = 2.0
    beta: float = 0.25
    noise_passes: int = 10
    noise_std: float = 0.01
    noise_clip: float = 0.02
    round_fraction: float = 10 / 300
    max_fraction: float = 160 / 300
    st_weight: float = 1.0
    freeze: str = "config"


class UaDCEPlugin(PoolPhasesPlugin):
    """UaD-CE: class-balanced self-training on the pool + uncertainty-aware distillation from the previous model.

    Every incremental session:

    * ``uadce_kd`` (every step): ``lambda * beta * T^2 * KD`` where KD is
      :func:`uad_distillation` of the previous session's model (frozen copy,
      its rows = ``previous_seen``) into the student's old rows, over the
      labelled batch and, in unlabelled phases, the pool batch; pool pixels
      whose uncertainty (:func:`uncertainty_from_samples` over ``noise_passes``
      noisy passes of the reference model) is above the ``u_t`` quantile of the
      batch are dropped; lambda = :func:`adaptive_lambda`.
    * ``uadce_st`` (unlabelled phases): cross-entropy on the pool pixels
      pseudo-labelled so far; at the start of every phase a selection round
      (:func:`class_balanced_selection`, current model in eval mode) labels up
      to ``round_fraction`` of the pool's pixels more, split equally over
      background and the session's classes, until ``max_fraction``.

    Deviations: pixels instead of images are selected and weighted (the
    segmentation analogue; ClE's class-balanced self-training comes from the
    segmentation CBST of Zou et al., ECCV 2018); selection is restricted to
    background + the session's classes (the official code argmaxes over the
    session's new classes only, which in segmentation would label every pixel
    foreground); one round per unlabelled phase instead of rounds of 10 extra
    epochs after the labelled training; no exemplar memory (the JASCL setting
    keeps no images), so the uncertainty filter acts on the current pool's
    pixels; the distillation carries gradient (the official code detaches the
    student's outputs when the filter is on, so its UaD term trains nothing);
    the NME classifier and partial backbone freezing of the official
    classification code do not apply.
    """

    name = "uadce"
    loss_terms = ("uadce_kd", "uadce_st")

    def __init__(
        self,
        base_lambda: float = 2.0,
        u_t: float = 0.6,
        adapt_lambda: bool = True,
        temperature: float = 2.0,
        beta: float = 0.25,
        noise_passes: int = 10,
        noise_std: float = 0.01,
        noise_clip: float = 0.02,
        round_fraction: float = 10 / 300,
        max_fraction: float = 160 / 300,
        st_weight: float = 1.0,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        freeze: str | None = None,
    ) -> None:
        super().__init__(start_epoch, every, batch_size)
        if not 0 < u_t <= 1 or noise_passes < 2 or temperature <= 0:
            raise ConfigError(
                f"method_args.uad-ce: need 0 < u_t <= 1, noise_passes >= 2 and temperature > 0 "
                f"(got {u_t}, {noise_passes}, {temperature})"
            )
        if not 0 <= round_fraction <= 1 or not 0 <= max_fraction <= 1:
            raise ConfigError("method_args.uad-ce: round_fraction and max_fraction must be in [0, 1]")
        self.base_lambda, self.u_t, self.adapt = base_lambda, u_t, adapt_lambda
        self.temperature, self.beta = temperature, beta
        self.noise_passes, self.noise_std, self.noise_clip = noise_passes, noise_std, noise_clip
        self.round_fraction, self.max_fraction, self.st_weight = round_fraction, max_fraction, st_weight
        self.freeze_incremental = freeze
        self.teacher: Segmenter | None = None
        self.pseudo: torch.Tensor | None = None

    def before_session(self, state: LoopState) -> None:
        self.teacher, self.pseudo = None, None
        if state.session.index == 0:
            return
        self.teacher = state.new_model(state.model.num_classes)
        self.teacher.load_state_dict(clean_state_dict(state.model))
        self.teacher.eval().requires_grad_(False)
        self.n_old = len(state.previous_seen)
        self.kd_weight = adaptive_lambda(self.base_lambda, self.u_t, self.n_old, len(state.session.classes), self.adapt)
        if self._setup_pool(state, salt=1):
            pool = state.data.unlabelled
            self.pseudo = torch.full((len(pool), *np.asarray(pool.labels[0]).shape), IGNORE_INDEX, dtype=torch.long)
            self.rounds = 0

    def before_epoch(self, state: LoopState) -> None:
        super().before_epoch(state)
        if self._phase:
            self.select_round(state)

    @torch.no_grad()
    def select_round(self, state: LoopState) -> int:
        """One ClE round: pseudo-label up to ``round_fraction`` more pool pixels; returns how many."""
        total = self.pseudo.numel()
        rows = [state.seen.index(c) for c in [0, *state.session.classes]]
        remaining = int(self.max_fraction * total) - int((self.pseudo != IGNORE_INDEX).sum())
        quota = min(int(self.round_fraction * total), remaining) // len(rows)
        if quota < 1:
            return 0
        probs = []
        loader = DataLoader(UnlabelledDataset(state.data.unlabelled), batch_size=self._loader.batch_size)
        for batch in loader:
            probs.append(torch.softmax(_eval_logits(state.model, batch["image"].to(state.device)).float(), 1).cpu())
        chosen = class_balanced_selection(torch.cat(probs), self.pseudo == IGNORE_INDEX, rows, quota)
        new = chosen != IGNORE_INDEX
        self.pseudo[new] = chosen[new]
        self.rounds += 1
        return int(new.sum())

    def _reference(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference model's logits on ``x`` and its uncertainty over noisy passes."""
        with torch.no_grad():
            logits = self.teacher(x)
            samples = []
            for _ in range(self.noise_passes):
                noise = torch.clamp(torch.randn_like(x) * self.noise_std, -self.noise_clip, self.noise_clip)
                samples.append(torch.softmax(self.teacher(x + noise).float(), dim=1))
            _, std = uncertainty_from_samples(torch.stack(samples))
        return logits, std

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        x = state.batch["image"].to(state.device)
        student = state.output.logits
        from_pool = torch.zeros(x.shape[0], dtype=torch.bool, device=state.device)
        if self._phase:
            batch = self._pool_batch()
            xu = batch["image"].to(state.device)
            student_u = state.model(xu)
            target = self.pseudo[batch["index"]].to(state.device)
            if (target != IGNORE_INDEX).any():
                st = F.cross_entropy(student_u, target, ignore_index=IGNORE_INDEX)
            else:
                st = student_u.sum() * 0.0
            state.losses["uadce_st"] = self.st_weight * st
            x = torch.cat([x, xu])
            student = torch.cat([student, student_u])
            from_pool = torch.cat([from_pool, torch.ones(xu.shape[0], dtype=torch.bool, device=state.device)])
        teacher, std = self._reference(x)
        keep = uad_keep_mask(std, from_pool, self.u_t)
        kd = uad_distillation(student[:, : self.n_old], teacher[:, : self.n_old], keep, self.temperature)
        state.losses["uadce_kd"] = self.kd_weight * self.beta * self.temperature**2 * kd

    def after_training(self, state: LoopState) -> None:
        if self.pseudo is None:
            return
        truth = torch.from_numpy(np.asarray(state.data.unlabelled.labels).astype("int64"))  # measurement only
        seen = torch.as_tensor(state.seen)
        counters = FilterCounters()
        chosen = self.pseudo != IGNORE_INDEX
        counters.update(chosen, seen[self.pseudo.clamp(max=len(seen) - 1)], truth)
        stats = counters.stats()
        state.report["pseudo_labels"] = {
            "method": "uad-ce",
            "rounds": self.rounds,
            "coverage": stats.coverage,
            "precision": stats.precision,
        }

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self.teacher, self.pseudo = None, None


# ============================================================== CSL


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

    weight: float = 1.0
    alpha: float = 2.0
    cover_ratio: float = 0.7
    block_fraction: float = 0.1
    fp_dropout: float = 0.5
    cutmix_prob: float = 0.5
    freeze: str = "config"


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
        if alpha <= 0 or not 0 <= cover_ratio <= 1 or not 0 < block_fraction <= 1 or not 0 <= fp_dropout < 1:
            raise ConfigError(
                "method_args.csl: need alpha > 0, cover_ratio in [0, 1], block_fraction in (0, 1], fp_dropout in [0, 1)"
            )
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
        if fp.shape[2:] != weak.logits.shape[2:]:
            fp = F.interpolate(
                fp, size=weak.logits.shape[2:], mode="bilinear" if fp.dim() == 4 else "trilinear", align_corners=False
            )
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


# ============================================================== RETRIEVE


def retrieve_greedy(
    unlabelled_grads: torch.Tensor,
    val_grad: Callable[[torch.Tensor], torch.Tensor],
    budget: int,
    eta: float,
    candidates: Callable[[list[int]], list[int]] | None = None,
) -> list[int]:
    """RETRIEVE's greedy coreset selection (Killamsetty et al. 2021, Alg. 1, last-layer version).

    Gain of adding element e to S: the one-step Taylor estimate of the drop of
    the labelled loss, ``g_e . grad L_L(theta_S)``, where
    ``theta_S = theta - eta * sum_{j in S} g_j`` (the inner step on S); after
    each choice theta_S and the labelled gradient are updated.

    Args:
        unlabelled_grads: (N, P) gradient of each element's (weighted) unlabelled loss.
        val_grad: maps a (P,) parameter step delta to the (P,) labelled-loss
            gradient at theta + delta.
        budget: elements to choose (at most N).
        eta: step size of the inner step.
        candidates: maps the remaining indices to those evaluated at this step
            (stochastic greedy); None = all (naive greedy).

    Returns:
        chosen indices in order of choice.
    """
    remaining = list(range(unlabelled_grads.shape[0]))
    chosen: list[int] = []
    step_sum = torch.zeros_like(unlabelled_grads[0])
    grad = val_grad(torch.zeros_like(step_sum))
    while len(chosen) < min(budget, unlabelled_grads.shape[0]):
        pool = candidates(remaining) if candidates is not None else remaining
        gains = unlabelled_grads[pool] @ grad
        best = pool[int(gains.argmax())]
        chosen.append(best)
        remaining.remove(best)
        step_sum = step_sum + unlabelled_grads[best]
        grad = val_grad(-eta * step_sum)
    return chosen


@dataclass
class RetrieveOptions:
    """``method_args.retrieve`` options (defaults: CORDS' SSL configs unless noted).

    Attributes:
        fraction: pool fraction in the coreset (paper: 10-30 %; 0.1).
        greedy: "stochastic" (CORDS' default for RETRIEVE) or "naive".
        epsilon: stochastic-greedy accuracy; each step evaluates N/k * ln(1/epsilon) candidates (0.01).
        tau_conf: confidence threshold of the mean teacher's pseudo-label filter
            (the repository's ``mean-teacher-conf``; -1 = ``config.pas.tau_conf``).
        freeze: "config" (default), "none" or "all_but_classifier".
    """

    fraction: float = 0.1
    greedy: str = "stochastic"
    epsilon: float = 0.01
    tau_conf: float = -1.0
    freeze: str = "config"


class RetrievePlugin(MeanTeacherPlugin):
    """RETRIEVE: the confidence-filtered mean teacher, trained on a coreset of the pool re-chosen every phase.

    At the start of every unlabelled phase the coreset (``fraction`` of the
    pool, at least one image) is chosen by :func:`retrieve_greedy`: element
    gradients are those of ``weight * L_consistency`` (eq. 5, the mean
    teacher's term) of each pool image with respect to the classifier
    parameters; the labelled loss is the cross-entropy of the session's
    labelled images (training labels, no augmentation) through the
    classifier, evaluated exactly at the stepped classifier parameters on
    cached features; eta is the optimiser's current learning rate. The
    phase's pass then runs the mean teacher over the coreset only; the loss
    key is ``retrieve``.

    Deviations: elements are whole images (their pixels' losses averaged);
    the last layer is our classifier (cosine or linear), whose stepped loss
    is recomputed exactly rather than through CORDS' linearised logits; the
    selection interval is the unlabelled-phase schedule (CORDS reselects every
    20 epochs); the underlying SSL algorithm is the repository's mean teacher
    with confidence filtering (the paper pairs RETRIEVE with VAT, Mean Teacher
    and FixMatch; FixMatch's confidence mask is the m_jt of its formulation).
    """

    name = "retrieve"
    loss_terms = ("retrieve",)

    def __init__(
        self,
        fraction: float = 0.1,
        greedy: str = "stochastic",
        epsilon: float = 0.01,
        tau_conf: float = 0.7,
        weight: float = 0.05,
        ema_decay: float = 0.99,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        freeze: str | None = None,
    ) -> None:
        super().__init__(
            filter="confidence",
            tau_conf=tau_conf,
            tau_sim=0.0,
            weight=weight,
            ema_decay=ema_decay,
            start_epoch=start_epoch,
            every=every,
            batch_size=batch_size,
        )
        if not 0 < fraction <= 1 or greedy not in ("stochastic", "naive") or not 0 < epsilon < 1:
            raise ConfigError(
                f"method_args.retrieve: need 0 < fraction <= 1, greedy 'stochastic' or 'naive', "
                f"0 < epsilon < 1 (got {fraction}, {greedy!r}, {epsilon})"
            )
        self.fraction, self.greedy, self.epsilon = fraction, greedy, epsilon
        self.freeze_incremental = freeze
        self.coresets: list[list[int]] = []

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self.coresets = []
        if self.teacher is not None:
            self._generator = torch.Generator().manual_seed(state.seed * 7919 + state.session.index)
            self._select_rng = torch.Generator().manual_seed(state.seed * 104729 + state.session.index)
            self._views = (view_transform(state.seed + 1), view_transform(state.seed + 2))

    def _coreset_loader(self, state: LoopState, coreset: list[int]) -> DataLoader:
        return DataLoader(
            Subset(UnlabelledDataset(state.data.unlabelled), coreset),
            batch_size=self.batch_size or state.config.batch_size,
            shuffle=True,
            generator=self._generator,
        )

    def before_epoch(self, state: LoopState) -> None:
        if self.teacher is not None and self._is_phase(state.epoch):
            chosen = self.select(state)
            self.coresets.append(sorted(chosen))
            self._loader = self._coreset_loader(state, self.coresets[-1])
        super().before_epoch(state)

    def resume_epoch(self, state: LoopState) -> None:
        """The phase's coreset loader again (the coreset and its stream's position are in the checkpoint)."""
        if self._phase:
            position = self._batches.state_dict()
            self._loader = self._coreset_loader(state, self.coresets[-1])
            self._batches = BatchStream(self._loader)
            self._batches.load_state_dict(position)
        super().resume_epoch(state)

    def _view(self, images: torch.Tensor, which: int) -> torch.Tensor:
        t = self._views[which]
        # plain tensors: MONAI's MetaTensor slows every later operation down
        return torch.stack([torch.as_tensor(t(img)).as_subclass(torch.Tensor) for img in images]).float()

    def _student_teacher_views(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view(batch["image"], 0), self._view(batch["image"], 1)

    def _classifier_params(self, model: Segmenter) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.classifier.named_parameters()}

    def _logits(
        self, model: Segmenter, params: dict[str, torch.Tensor], features: torch.Tensor, size: torch.Size
    ) -> torch.Tensor:
        logits = functional_call(model.classifier, params, (features,))
        if logits.shape[2:] != size:
            logits = F.interpolate(
                logits, size=size, mode="bilinear" if logits.dim() == 4 else "trilinear", align_corners=False
            )
        return logits

    def select(self, state: LoopState) -> list[int]:
        """Choose this phase's coreset of pool indices (see the class docstring)."""
        model = state.model
        base = self._classifier_params(model)
        names = list(base)
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            grads = []
            pool = UnlabelledDataset(state.data.unlabelled)
            for batch in DataLoader(pool, batch_size=1):
                images = batch["image"]
                with torch.no_grad():
                    features = model.backbone(self._view(images, 0).to(state.device))
                    out_t = self.teacher.forward_features(self._view(images, 1).to(state.device))
                params = {n: v.clone().requires_grad_(True) for n, v in base.items()}
                logits = self._logits(model, params, features, images.shape[2:])
                s = pas_filter(logits.detach(), features, None, self.tau_conf, self.tau_sim)
                t = pas_filter(out_t.logits, out_t.features, None, self.tau_conf, self.tau_sim)
                loss = self.weight * consistency_loss(logits, out_t.logits, s.valid & t.valid)
                g = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
                grads.append(
                    torch.cat(
                        [(gi if gi is not None else torch.zeros_like(params[n])).flatten() for gi, n in zip(g, names)]
                    )
                )
            labelled = DataLoader(
                LabelledDataset(state.data.train, state.session.classes, state.session.other_classes),
                batch_size=state.config.batch_size,
            )
            cached = []
            with torch.no_grad():
                for batch in labelled:
                    cached.append(
                        (
                            model.backbone(batch["image"].to(state.device)),
                            state.class_index(batch["label"].to(state.device)),
                        )
                    )
        finally:
            for m, mode in modes.items():
                m.train(mode)
        shapes = [base[n].shape for n in names]
        flat0 = torch.cat([base[n].flatten() for n in names])

        def val_grad(delta: torch.Tensor) -> torch.Tensor:
            flat = (flat0 + delta).detach().requires_grad_(True)
            params = dict(zip(names, [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]))
            total, count = 0.0, 0
            for features, target in cached:
                ce = F.cross_entropy(
                    self._logits(model, params, features, target.shape[1:]),
                    target,
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                total = total + ce
                count += int((target != IGNORE_INDEX).sum())
            return torch.autograd.grad(total / max(count, 1), flat)[0]

        n = len(grads)
        budget = max(1, math.ceil(self.fraction * n))
        size = min(n, max(1, math.ceil(n / budget * math.log(1 / self.epsilon))))

        def sample(remaining: list[int]) -> list[int]:  # stochastic greedy (Mirzasoleiman et al., AAAI 2015)
            if len(remaining) <= size:
                return remaining
            pick = torch.randperm(len(remaining), generator=self._select_rng)[:size]
            return [remaining[i] for i in pick.tolist()]

        eta = state.optimizer.param_groups[0]["lr"] if state.optimizer is not None else state.config.lr_incremental
        chooser = sample if self.greedy == "stochastic" else None
        return retrieve_greedy(torch.stack(grads), val_grad, budget, eta, chooser)

    def after_training(self, state: LoopState) -> None:
        super().after_training(state)
        if "pseudo_labels" in state.report and self.coresets:
            state.report["pseudo_labels"]["coresets"] = self.coresets


# ============================================================== registry


def _schedule(config: RunConfig) -> dict:
    """The unlabelled-phase schedule of ``method_args.jascl.pas``: every pool method follows the same one."""
    from jascl.methods.presets import jascl_options

    p = jascl_options(config).pas
    return {"start_epoch": p.start_epoch, "every": p.every, "batch_size": p.batch_size}


@METHODS.register(
    "uad-ce",
    doc="baseline: class-balanced self-training + uncertainty-aware distillation (Cui et al., IEEE TNNLS 2023)",
)
def uad_ce(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "uad-ce", UaDCEOptions())
    plugin = UaDCEPlugin(
        base_lambda=o.base_lambda,
        u_t=o.u_t,
        adapt_lambda=o.adapt_lambda,
        temperature=o.temperature,
        beta=o.beta,
        noise_passes=o.noise_passes,
        noise_std=o.noise_std,
        noise_clip=o.noise_clip,
        round_fraction=o.round_fraction,
        max_fraction=o.max_fraction,
        st_weight=o.st_weight,
        freeze=freeze_policy(o.freeze, "uad-ce"),
        **_schedule(config),
    )
    return Method("uad-ce", [plugin], "UaD-CE: class-balanced self-training + uncertainty-aware distillation")


@METHODS.register(
    "csl",
    doc="baseline: confidence-separable pseudo-label weighting on a UniMatch-style student (Liu & Liu, arXiv 2025)",
)
def csl(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "csl", CSLOptions())
    plugin = CSLPlugin(
        weight=o.weight,
        alpha=o.alpha,
        cover_ratio=o.cover_ratio,
        block_fraction=o.block_fraction,
        fp_dropout=o.fp_dropout,
        cutmix_prob=o.cutmix_prob,
        freeze=freeze_policy(o.freeze, "csl"),
        **_schedule(config),
    )
    return Method("csl", [plugin], "CSL: confidence-separable pseudo-label selection")


@METHODS.register(
    "retrieve",
    doc="baseline: greedy bilevel coreset of the unlabelled pool under a mean teacher "
    "(Killamsetty et al., NeurIPS 2021)",
)
def retrieve(config: RunConfig) -> Method:
    from jascl.engine.config import method_options
    from jascl.methods.presets import jascl_options

    o = method_options(config, "retrieve", RetrieveOptions())
    p = jascl_options(config).pas
    plugin = RetrievePlugin(
        fraction=o.fraction,
        greedy=o.greedy,
        epsilon=o.epsilon,
        tau_conf=p.tau_conf if o.tau_conf < 0 else o.tau_conf,
        weight=p.weight,
        ema_decay=p.ema_decay,
        freeze=freeze_policy(o.freeze, "retrieve"),
        **_schedule(config),
    )
    return Method("retrieve", [plugin], "RETRIEVE: coreset selection + confidence-filtered mean teacher")
