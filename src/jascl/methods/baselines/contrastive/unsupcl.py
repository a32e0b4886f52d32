"""UnSupCL and UnSupCL-HNM: self-supervised contrastive losses between two views' pixel embeddings.

* ``unsupcl`` -- SimCLR's NT-Xent loss: Chen, Kornblith, Norouzi, Hinton, "A Simple Framework for
  Contrastive Learning of Visual Representations", ICML 2020, eq. 1::

      l(i, j) = -log( exp(sim(z_i, z_j) / tau) / sum_{k != i} exp(sim(z_i, z_k) / tau) )

  over the 2N embeddings of N samples seen in two augmented views, (i, j) the two views of a sample;
  the loss averages l over all 2N anchors.
* ``unsupcl-hnm`` -- the hard-negative objective of Robinson, Chuang, Sra, Jegelka, "Contrastive
  Learning with Hard Negative Samples", ICLR 2021 (eqs. 3-4 with the importance-sampling estimators of
  sec. 3.3): the negatives are reweighted by q_beta(x-) ∝ exp(beta * s(x, x-)), and the debiasing of
  Chuang et al. (2020) with class prior tau+ removes the expected share of false negatives::

      Ng = max( (Q * E_w[exp(s-)] - tau+ * Q * exp(s+)) / (1 - tau+),  Q * exp(-1/tau) )
      l  = -log( exp(s+) / (exp(s+) + Ng) ),   E_w[e] = sum_k w_k e_k,  w_k = exp(beta s_k) / sum_k exp(beta s_k)

  with s = sim / tau and Q the number of negatives. beta = 0, tau+ = 0 give NT-Xent exactly.

Adapted to segmentation (the JASCL paper "re-implemented and adapted" them, without details):

* A sample is a pixel of the pre-classifier feature map. The first view is the training batch as the
  loop augmented it (its forward is the one the segmentation loss uses); the second is the same images
  after a random photometric transformation (intensity scale, contrast / gamma, Gaussian blur, each image
  drawn independently, seeded per step). Geometric augmentations (SimCLR's crop-and-resize, flips) are
  left out so that a pixel's two views are at the same position; SimCLR's colour distortion becomes an
  intensity distortion, which also fits single-channel medical images.
* Each step draws ``pixels`` positions uniformly from the batch's feature maps; their embeddings in both
  views are the 2N samples; all other drawn pixels are negatives, including pixels of the same class --
  the false negatives Robinson et al.'s tau+ accounts for.
* The loss is *added* to the loop's Dice + CE with weight ``weight`` (0.1, Wang et al., ICCV 2021)
  instead of SimCLR's pre-training followed by a linear classifier; incremental sessions only (the base
  model is the shared vanilla base, as the JASCL paper's tables show); the whole network trains
  (``freeze: none``), since the loss acts on the representation.
* The views come from the session's labelled images (the training batch), not from an unlabelled pool.
* Defaults: tau = 0.5 (SimCLR's CIFAR-10 setting and Robinson et al.'s; the small-batch regime closest to
  a few hundred pixels per step), beta = 1 and tau+ = 0.1 (Robinson et al.'s CIFAR-10 values), a
  128-dimensional projection head (SimCLR).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from monai.transforms import Compose, RandAdjustContrast, RandGaussianSmooth, RandScaleIntensity

from jascl.data.sampling import derive_seed
from jascl.engine.plugin import Method
from jascl.methods.baselines.contrastive._shared import ContrastivePlugin, pixel_vectors, sample_uniform, step_generator
from jascl.methods.mean_teacher import apply_view
from jascl.methods.options import check_options, freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def _two_view_scores(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(2N, 2N) scores s = z z^T / tau of the stacked views and the (2N,) index of each anchor's positive."""
    n = z1.shape[0]
    z = torch.cat([z1, z2])
    scores = (z @ z.t()) / temperature
    positive = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return scores, positive


def nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.5, reduction: str = "mean") -> torch.Tensor:
    """SimCLR's NT-Xent loss (Chen et al. 2020, eq. 1) over the 2N anchors of two views.

    Args:
        z1, z2: (N, D) L2-normalised embeddings of the same N samples in two views (row i <-> row i).
        temperature: tau.
        reduction: "mean" over the 2N anchors, or "none" for the (2N,) per-anchor losses (view 1 first).
    """
    scores, positive = _two_view_scores(z1, z2, temperature)
    eye = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    per_anchor = F.cross_entropy(scores.masked_fill(eye, float("-inf")), positive, reduction="none")
    return per_anchor.mean() if reduction == "mean" else per_anchor


def hard_negative_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    temperature: float = 0.5,
    beta: float = 1.0,
    tau_plus: float = 0.1,
    reduction: str = "mean",
) -> torch.Tensor:
    """Robinson et al. (ICLR 2021) hard-negative contrastive loss over the 2N anchors of two views.

    Per anchor i with positive p and the Q = 2N - 2 other embeddings as negatives (s = sim / tau)::

        w_k = exp(beta s_ik) / mean_k exp(beta s_ik)                 (importance weights of q_beta)
        Ng  = max((sum_k w_k exp(s_ik) - tau+ Q exp(s_ip)) / (1 - tau+), Q exp(-1/tau))
        l_i = log(exp(s_ip) + Ng) - s_ip

    Args:
        z1, z2: (N, D) L2-normalised embeddings, N >= 2 (an anchor needs a negative).
        temperature: tau; beta: concentration of q_beta (0 = uniform negatives); tau_plus: class prior tau+ in [0, 1).
        reduction: "mean" over anchors or "none" for the (2N,) per-anchor losses.
    """
    scores, positive = _two_view_scores(z1, z2, temperature)
    m = scores.shape[0]
    rows = torch.arange(m, device=scores.device)
    s_pos = scores[rows, positive]
    negative = torch.ones_like(scores, dtype=torch.bool)
    negative[rows, rows] = False
    negative[rows, positive] = False
    s_neg = scores[negative].reshape(m, m - 2)
    q = m - 2
    weights = torch.softmax(beta * s_neg, dim=1) * q  # exp(beta s) / mean(exp(beta s))
    reweighted = (weights * s_neg.exp()).sum(dim=1)
    ng = (reweighted - tau_plus * q * s_pos.exp()) / (1.0 - tau_plus)
    ng = ng.clamp(min=q * math.exp(-1.0 / temperature))
    per_anchor = torch.log(s_pos.exp() + ng) - s_pos
    return per_anchor.mean() if reduction == "mean" else per_anchor


def photometric_view() -> Compose:
    """The second view's transformation: SimCLR's colour distortion (p 0.8) and blur (p 0.5, sigma 0.1-2)
    as intensity operations that keep every pixel in place, for any number of channels, 2D or 3D."""
    return Compose(
        [
            RandScaleIntensity(factors=0.8, prob=0.8),
            RandAdjustContrast(gamma=(0.5, 2.0), prob=0.8, retain_stats=True),
            RandGaussianSmooth(sigma_x=(0.1, 2.0), sigma_y=(0.1, 2.0), sigma_z=(0.1, 2.0), prob=0.5),
        ]
    )


@dataclass
class UnSupCLOptions:
    """``method_args.unsupcl`` / ``method_args.unsupcl-hnm`` options.

    Attributes:
        weight: weight of the contrastive term beside the segmentation loss (0.1, Wang et al. 2021).
        temperature: tau (0.5: SimCLR on CIFAR-10, Robinson et al.).
        pixels: pixel positions drawn per step (2 x pixels embeddings).
        proj_dim: output width of the projection head (128, SimCLR).
        hidden: hidden width of the head (0 = the feature width).
        beta: hard-negative concentration (``unsupcl-hnm`` only; 1.0, Robinson et al.).
        tau_plus: class prior of the debiasing (``unsupcl-hnm`` only; 0.1, Robinson et al.).
        freeze: incremental-session freezing (none: the representation is what the loss acts on).
    """

    weight: float = option(0.1, ge=0)
    temperature: float = option(0.5, ge=0.02, doc="tau; >= 0.02 keeps exp(1/tau) finite in float32")
    pixels: int = option(256, ge=2)
    proj_dim: int = option(128, ge=1)
    hidden: int = option(0, ge=0, doc="hidden width of the projection head; 0 = the feature width")
    beta: float = option(1.0, ge=0, doc="unsupcl-hnm: concentration of the hard-negative distribution")
    tau_plus: float = option(0.1, ge=0, lt=1, doc="unsupcl-hnm: class prior of the false-negative debiasing")
    freeze: str = freeze_option("none")


class UnSupCLPlugin(ContrastivePlugin):
    """Adds ``weight`` x the two-view contrastive loss (NT-Xent, or the hard-negative loss) in incremental
    sessions; the second view is one more forward of the photometrically transformed batch."""

    def __init__(self, options: UnSupCLOptions | None = None, hard_negatives: bool = False) -> None:
        self.name = "unsupcl-hnm" if hard_negatives else "unsupcl"
        self.loss_terms = (self.name,)
        o = self.options = options or UnSupCLOptions()
        check_options(o, f"method_args.{self.name}")
        self.hard_negatives = hard_negatives
        self.view = photometric_view()
        super().__init__(o.hidden, o.proj_dim, freeze_policy(o.freeze))

    def second_view(self, state: LoopState) -> torch.Tensor:
        """The batch's images, each with its own seeded photometric draw. (B, C, *spatial) on the device."""
        assert state.batch is not None
        images = state.batch["image"]
        views = [
            apply_view(
                self.view,
                image.cpu(),
                derive_seed(state.seed, self.name, state.session.index, state.epoch, state.iteration, b),
            )
            for b, image in enumerate(images)
        ]
        return torch.stack(views).to(state.device, non_blocking=True)

    def after_forward(self, state: LoopState) -> None:
        if self.head is None:
            return
        o = self.options
        h1 = state.output.features
        h2 = state.model.forward_features(self.second_view(state)).features
        idx = sample_uniform(h1.numel() // h1.shape[1], o.pixels, step_generator(state, self.name), h1.device)
        z1 = self.project(pixel_vectors(h1)[idx])
        z2 = self.project(pixel_vectors(h2)[idx])
        if self.hard_negatives:
            loss = hard_negative_loss(z1, z2, o.temperature, o.beta, o.tau_plus)
        else:
            loss = nt_xent_loss(z1, z2, o.temperature)
        state.losses[self.name] = o.weight * loss


@METHODS.register(
    "unsupcl",
    options=UnSupCLOptions,
    paper="Chen et al. (SimCLR), ICML 2020",
    doc="baseline: NT-Xent between two photometric views' pixel embeddings + segmentation loss",
    fidelity="simplified: NT-Xent added to the segmentation loss; photometric-only second view",
)
def unsupcl(options: UnSupCLOptions, config: RunConfig) -> Method:
    return Method("unsupcl", [UnSupCLPlugin(options)], "UnSupCL: SimCLR pixel contrast beside Dice + CE")


@METHODS.register(
    "unsupcl-hnm",
    options=UnSupCLOptions,
    paper="Robinson et al., ICLR 2021",
    doc="baseline: hard-negative (debiased, beta-weighted) pixel contrast between two views + segmentation loss",
    fidelity="simplified: as unsupcl, with the hard-negative objective",
)
def unsupcl_hnm(options: UnSupCLOptions, config: RunConfig) -> Method:
    return Method(
        "unsupcl-hnm",
        [UnSupCLPlugin(options, hard_negatives=True)],
        "UnSupCL-HNM: hard-negative pixel contrast beside Dice + CE",
    )
