"""PIFS: prototype-based incremental few-shot segmentation.

Cermelli, Mancini, Xian, Akata, Caputo, "Prototype-based Incremental Few-Shot
Semantic Segmentation", BMVC 2021 (arXiv 2012.01415; official code
github.com/fcdl94/FSS, method ``PIFS``).

What it does, per incremental session:

1. *Prototype initialisation* (the official ``WeightImprinting.warm_up_``): the
   cosine-classifier row of every new class c becomes

       w_c = n( sum_i n( sum_{p in image i, y_p = c} n(f_p) ) )

   with n(v) = v / |v|: pixel features are L2-normalised, summed over the
   class's pixels of an image, the per-image sums normalised, summed over the
   images and normalised again.
2. *Prototype-based distillation* ("warm start"): the teacher is a frozen copy
   of the model taken *after* the initialisation, so its scores cover both the
   old classes and the new classes' prototypes. The loss is the official
   ``KnowledgeDistillationLoss`` over all of the teacher's classes,

       L_kd = - mean_pixels (1/K) sum_k softmax(z_t / a)_k log softmax(z_s)_k * a^2,

   added with weight 10 (official ``loss_kd = 10``, ``alpha`` = 1). As in the
   official trainer, a distillation value above ``clip`` (10) is dropped for
   that iteration (it spikes occasionally).
3. The whole network is fine-tuned (official: body, head and classifier, one
   learning rate), so ``freeze`` defaults to "none".

Deviations needed to fit this library:

* The segmentation loss of the loop (DiceCE, shared by every method) replaces
  PIFS's plain cross-entropy; optimiser, learning rate and iterations are the
  run configuration's (official: SGD lr 1e-3, 1000 iterations, poly schedule).
* Batch renormalisation (PIFS's answer to non-i.i.d. few-shot batches) is not
  applied: the backbone's own normalisation layers are kept.
* Only classes introduced in the session are re-initialised; a recurring class
  (taught again in a new domain) keeps its row, as PIFS has no such case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method, Plugin
from jascl.methods.baselines.fewshot._shared import per_sample, sample_pieces
from jascl.methods.common import frozen_copy, labelled_loader
from jascl.methods.options import freeze_option, freeze_policy
from jascl.methods.registry import METHODS
from jascl.networks.base import resize

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def pifs_piece_sums(features: torch.Tensor, labels: torch.Tensor, classes: list[int]) -> dict[int, torch.Tensor]:
    """The inner sums of PIFS's initialisation over one sample, or one piece of it.

    Args:
        features: (1, C, *spatial') features before the classifier; resized to
            the labels' size (bilinear/trilinear, as the official code upsamples).
        labels: (1, *spatial) class ids (global ids or rows; matched against ``classes``).
        classes: the classes to collect.

    Returns:
        class -> (C,) sum over the class's pixels of n(f_p); classes absent from the piece are left out.
    """
    features = F.normalize(resize(features.float(), labels.shape[1:]), dim=1)
    flat, lab = features.flatten(2)[0], labels.flatten(1)[0]
    out: dict[int, torch.Tensor] = {}
    for c in classes:
        mask = lab == c
        if mask.any():
            out[c] = flat[:, mask].sum(dim=1)
    return out


def pifs_prototypes(pieces, classes: list[int]) -> dict[int, torch.Tensor]:
    """PIFS classifier initialisation w_c = n(sum_i n(sum_p n(f_p))) over the (sample, features, labels) pieces of
    :func:`jascl.methods.baselines.fewshot._shared.sample_pieces`: the inner sum adds up over a sample's pieces
    (a volume too large to hold whole comes in blocks), and is normalised once the sample's last piece has come.

    Returns:
        class -> (C,) unit vector, for the classes that occur.
    """
    sums: dict[int, torch.Tensor] = {}
    for _, totals in per_sample(pieces, lambda f, lab: pifs_piece_sums(f, lab, classes)):
        for c, v in totals.items():
            assert isinstance(c, int)
            v = F.normalize(v, dim=0)
            sums[c] = sums[c] + v if c in sums else v
    return {c: F.normalize(v, dim=0) for c, v in sums.items()}


def pifs_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """PIFS / official ``KnowledgeDistillationLoss`` (reduction "mean").

    Args:
        student_logits: (B, K_s, *spatial) with K_s >= K_t; its first K_t classes are compared.
        teacher_logits: (B, K_t, *spatial) logits of the frozen warm-started teacher.
        alpha: distillation temperature applied to the teacher (official default 1).

    Returns:
        Scalar - mean over pixels of (1/K_t) sum_k softmax(z_t/alpha)_k log softmax(z_s)_k, times alpha^2.
        (The student's log-softmax is over its first K_t classes only.)
    """
    k = teacher_logits.shape[1]
    log_p = torch.log_softmax(student_logits.narrow(1, 0, k), dim=1)
    q = torch.softmax(teacher_logits / alpha, dim=1)
    return -(log_p * q).mean(dim=1).mean() * alpha**2


@dataclass
class PIFSOptions:
    """``method_args.pifs`` options (defaults: official code ``argparser.py``, method PIFS).

    Attributes:
        weight: distillation weight (official ``loss_kd`` = 10).
        alpha: distillation temperature (official ``kd_alpha`` = 1).
        clip: drop the distillation term of an iteration when it exceeds this (official CLIP = 10; 0 = never).
        freeze: "none" (official: the whole network is fine-tuned), "all_but_classifier" or
            "config" (the run configuration's ``freeze_incremental``).
    """

    weight: float = 10.0
    alpha: float = 1.0
    clip: float = 10.0
    freeze: str = freeze_option("none")


class PIFSPlugin(Plugin):
    """Prototype initialisation of new classes + warm-started distillation (see module docstring)."""

    name = "pifs"
    loss_terms = ("pifs_kd",)

    def __init__(self, options: PIFSOptions | None = None) -> None:
        self.options = options or PIFSOptions()
        self.freeze_incremental = freeze_policy(self.options.freeze)
        self.teacher = None

    def before_session(self, state: LoopState) -> None:
        self.teacher = None
        if state.session.index == 0:
            return
        new = state.seen[len(state.previous_seen) :]
        if new:
            loader = labelled_loader(state)
            protos = pifs_prototypes(sample_pieces(state, state.model, loader), new)
            with torch.no_grad():
                for row, c in enumerate(state.seen):
                    if c in protos:  # a class without labelled pixels keeps the loop's initialisation
                        state.model.classifier.weight[row] = protos[c].to(state.model.classifier.weight)
        self.teacher = frozen_copy(
            state, keep_random_stream=False
        )  # warm start: the teacher already knows the new prototypes

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None or self.options.weight == 0:
            return
        with torch.no_grad():
            teacher_logits = self.teacher(state.batch["image"].to(state.device))
        kd = self.options.weight * pifs_distillation(state.output.logits, teacher_logits, self.options.alpha)
        if self.options.clip > 0 and float(kd.detach()) > self.options.clip:
            kd = kd.detach() * 0.0  # the official trainer ignores spiking regularisation terms
        state.losses["pifs_kd"] = kd

    def after_session(self, state: LoopState) -> None:
        self.teacher = None


@METHODS.register(
    "pifs",
    options=PIFSOptions,
    paper="Cermelli et al., BMVC 2021",
    doc="baseline: prototype init + warm-started distillation",
    fidelity="simplified: the loop's Dice + CE instead of plain CE; no batch renormalisation",
)
def pifs(options: PIFSOptions, config: RunConfig) -> Method:
    return Method(
        "pifs",
        [PIFSPlugin(options)],
        "PIFS: prototype-initialised classifier, distillation from the warm-started model",
    )
