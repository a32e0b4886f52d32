"""UaD-CE (Cui, Deng, Chen and Liu, "Uncertainty-Aware Distillation for Semi-Supervised Few-Shot
Class-Incremental Learning", IEEE TNNLS 2023; arXiv 2301.09964; code github.com/yawencui/UaD-ClE): class-balanced
self-training (ClE) and uncertainty-aware, adaptively weighted distillation (UaD)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from jascl.engine.plugin import Method
from jascl.methods.gas import clean_state_dict
from jascl.methods.mean_teacher import UnlabelledDataset
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.pas import pool_pseudo_label_report
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter
from jascl.methods.baselines.semi._shared import PoolPhasesPlugin, _eval_logits, _schedule


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

    base_lambda: float = option(2.0, ge=0)
    u_t: float = option(0.6, gt=0, le=1)
    adapt_lambda: bool = True
    temperature: float = option(2.0, gt=0)
    beta: float = 0.25
    noise_passes: int = option(10, ge=2)
    noise_std: float = option(0.01, ge=0)
    noise_clip: float = option(0.02, ge=0)
    round_fraction: float = option(10 / 300, ge=0, le=1)
    max_fraction: float = option(160 / 300, ge=0, le=1)
    st_weight: float = option(1.0, ge=0)
    freeze: str = freeze_option()


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
        state.report["pseudo_labels"] = pool_pseudo_label_report(
            state.data.unlabelled.labels, self.pseudo, state.seen, "uad-ce", self.rounds
        )

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self.teacher, self.pseudo = None, None


@METHODS.register(
    "uad-ce",
    options=UaDCEOptions,
    paper="Cui et al., IEEE TNNLS 2023",
    doc="baseline: class-balanced self-training + uncertainty-aware distillation",
    fidelity="simplified: pixels instead of images; no exemplar memory; the distillation carries gradient",
)
def uad_ce(o: UaDCEOptions, config: RunConfig) -> Method:
    """UaD-CE on the unlabelled pool, on the unlabelled-phase schedule of ``method_args.jascl.pas``."""
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
        freeze=freeze_policy(o.freeze),
        **_schedule(config),
    )
    return Method("uad-ce", [plugin], "UaD-CE: class-balanced self-training + uncertainty-aware distillation")
