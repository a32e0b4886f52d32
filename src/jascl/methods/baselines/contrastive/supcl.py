"""SupCL: the supervised contrastive loss on pixel embeddings, added to the segmentation loss.

Khosla, Teterwak, Wang, Sarna, Tian, Isola, Maschinot, Liu, Krishnan, "Supervised Contrastive
Learning", NeurIPS 2020. The loss is the paper's L^sup_out (eq. 2)::

    L = sum_{i in I} -1/|P(i)| sum_{p in P(i)} log( exp(z_i . z_p / tau) / sum_{a in A(i)} exp(z_i . z_a / tau) )

with z the L2-normalised output of the projection head, A(i) every other sample of the batch and P(i)
the samples of A(i) with i's label; it is averaged over the anchors (the official code averages too).

Adapted to segmentation (the JASCL paper "re-implemented and adapted" it, without details):

* A sample is a pixel of the pre-classifier feature map; its label is the training label resized to
  the feature map (nearest), as a classifier row (background = row 0; untaught pixels ignored).
* Every training step draws up to ``pixels_per_class`` pixels of each class present in the batch
  (uniformly, without replacement; the class-balanced anchor sampling of pixel-contrastive
  segmentation, Wang et al., ICCV 2021), so that the (M x M) similarity matrix stays small and
  frequent classes do not swamp rare ones. Anchors without a positive among the drawn pixels are
  left out of the mean (their term is undefined).
* The loss is *added* to the loop's Dice + CE with weight ``weight`` (0.1, the weight Wang et al.
  give the pixel contrastive term), instead of SupCon's two stages (contrastive pre-training, then a
  linear classifier): the segmenter must keep predicting during a continual session.
* It acts in incremental sessions only (the base model is the shared vanilla base, as the JASCL
  paper's tables show with session 0 = Vanilla's); the whole network trains (``freeze: none``),
  since with a frozen backbone the loss would only train the projection head and change nothing.
* tau = 0.1, the paper's best temperature (sec. 4); the projection head is SimCLR's MLP with a
  128-dimensional output (the paper's head), its hidden width the feature width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jascl.engine.plugin import Method
from jascl.engine.prototypes import align_labels
from jascl.methods.baselines.contrastive._shared import (
    ContrastivePlugin,
    pixel_vectors,
    sample_per_class,
    step_generator,
)
from jascl.methods.options import check_options, freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def supcon_loss(z: torch.Tensor, labels: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """Supervised contrastive loss L^sup_out (Khosla et al. 2020, eq. 2), averaged over anchors.

    Args:
        z: (N, D) L2-normalised embeddings.
        labels: (N,) class labels.
        temperature: tau.

    Returns:
        Scalar; 0 (with a gradient path) when no anchor has a positive.
    """
    n = z.shape[0]
    sim = (z @ z.t()) / temperature
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
    # log( exp(s_ip) / sum_{a != i} exp(s_ia) ) for every pair (the diagonal is excluded from the sum)
    log_prob = sim - torch.logsumexp(sim.masked_fill(self_mask, float("-inf")), dim=1, keepdim=True)
    positive = (labels[:, None] == labels[None, :]) & ~self_mask
    n_pos = positive.sum(dim=1)
    has = n_pos > 0
    if not bool(has.any()):
        return z.sum() * 0.0
    mean_log_prob = (log_prob * positive).sum(dim=1)[has] / n_pos[has]
    return -mean_log_prob.mean()


@dataclass
class SupCLOptions:
    """``method_args.supcl`` options.

    Attributes:
        weight: weight of the contrastive term beside the segmentation loss (0.1, Wang et al. 2021).
        temperature: tau (0.1, Khosla et al. 2020).
        pixels_per_class: the most pixels drawn per class and step.
        proj_dim: output width of the projection head (128, Khosla et al. 2020).
        hidden: hidden width of the head (0 = the backbone's feature width).
        freeze: incremental-session freezing (none: the representation is what the loss acts on).
    """

    weight: float = option(0.1, ge=0)
    temperature: float = option(0.1, gt=0)
    pixels_per_class: int = option(64, ge=2, doc="pixels drawn per class and step (at least 2 for a positive)")
    proj_dim: int = option(128, ge=1)
    hidden: int = option(0, ge=0, doc="hidden width of the projection head; 0 = the feature width")
    freeze: str = freeze_option("none")


class SupCLPlugin(ContrastivePlugin):
    """Adds ``weight * supcon_loss`` over sampled pixels of the current batch in incremental sessions."""

    name = "supcl"
    loss_terms = ("supcl",)

    def __init__(self, options: SupCLOptions | None = None) -> None:
        o = self.options = options or SupCLOptions()
        check_options(o, "method_args.supcl")
        super().__init__(o.hidden, o.proj_dim, freeze_policy(o.freeze))

    def after_forward(self, state: LoopState) -> None:
        if self.head is None:
            return
        features = state.output.features
        rows = align_labels(state.target, features.shape[2:]).reshape(-1)
        idx = sample_per_class(rows, self.options.pixels_per_class, step_generator(state, self.name))
        z = self.project(pixel_vectors(features)[idx])
        state.losses["supcl"] = self.options.weight * supcon_loss(z, rows[idx], self.options.temperature)


@METHODS.register(
    "supcl",
    options=SupCLOptions,
    paper="Khosla et al., NeurIPS 2020",
    doc="baseline: supervised contrastive loss on sampled pixel embeddings + segmentation loss",
    fidelity=(
        "simplified: the supervised contrastive term added to the segmentation loss instead of contrastive pre-"
        "training + a linear classifier"
    ),
)
def supcl(options: SupCLOptions, config: RunConfig) -> Method:
    return Method("supcl", [SupCLPlugin(options)], "SupCL: supervised pixel contrastive loss beside Dice + CE")
