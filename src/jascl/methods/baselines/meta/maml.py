"""MAML and MAML + regulariser: first-order meta-learning episodes on each incremental batch.

Second look (issue 36): a new search found the paper's abstract (arXiv 2010.01992 on ar5iv, ECCV proceedings
pages, OpenReview) and the authors' ICLR 2022 blog post's introduction, and no official code; the regulariser's
exact form and weight below are still this implementation's reading of "a new spectral-based regularization term"
(condition number of the normalised predictors), not checked against the full text.

Source: Bouniot, Redko, Audigier, Loesch, Habrard, "Improving Few-Shot Learning
through Multi-task Representation Learning Theory", ECCV 2022 (arXiv
2010.01992), the paper the JASCL paper cites for both rows ("MAML" and "MAML +
regularizer"). MAML itself is Finn, Abbeel, Levine, "Model-Agnostic
Meta-Learning for Fast Adaptation of Deep Networks", ICML 2017; Bouniot et al.
train it with the regulariser added to the meta-objective.

What it does here (incremental sessions only; session 0 is vanilla's shared base):

* Every training step is one episode. The session's labelled batch is split
  into a *support* and a *query* split of whole images (:func:`support_query_split`:
  the first ``round(B * support_fraction)`` images, at least one and at most
  B - 1; the loader is seeded-shuffled, so the split is a random one without
  drawing random numbers).
* Inner loop (:func:`first_order_adapt`): ``inner_steps`` plain SGD steps with
  step ``inner_lr`` on the support split's segmentation loss (the run's
  DiceCE), applied to the trainable parameters through
  ``torch.func.functional_call`` (the model's own weights are not touched).
* Outer loss ``losses["maml"]``: the same segmentation loss of the adapted
  parameters on the query split. The update is **first-order MAML**: each
  adapted parameter is ``theta - inner_lr * sum(g_k)`` with the inner gradients
  ``g_k`` detached, so d(adapted)/d(theta) = I and the loop's backward gives the
  query gradient at the adapted parameters, applied to theta by the run's
  optimiser (the outer step, learning rate ``lr_incremental``).
* ``maml-reg`` adds ``losses["maml_reg"] = reg_weight * kappa(W')``, the
  condition number sigma_max / sigma_min of the adapted linear predictor W'
  (the classifier weight after the inner loop, one row per seen class,
  :func:`condition_number`). Bouniot et al. derive from multi-task
  representation theory that the matrix of the tasks' last-layer predictors
  should be well conditioned (kappa close to 1, "task diversity") and of
  bounded norm; they enforce the first with this penalty and the second by
  normalising the predictors, which ``normalize_predictors`` does (row-wise L2
  normalisation before the singular values; the cosine classifier of this
  project applies exactly those normalised rows). The full text of the paper
  could not be consulted when this was written (only its abstract: "a new
  spectral-based regularization term"); kappa of the normalised predictors is
  this implementation's reading of the paper's two assumptions, and the
  paper's own weight and exact form (kappa or its square, a Frobenius-norm
  penalty instead of the normalisation) remain to be checked.

Adaptations for dense segmentation and continual sessions:

* A task is the session's labelled batch (one episode per step, no meta-batch
  of several tasks); support and query are images, not pixels, because
  neighbouring pixels of one image are not independent samples. A batch of one
  image (a remainder batch, or one image per process) has no query split: the
  image is then both support and query (a degenerate episode, documented
  rather than skipped so every step has a loss).
* The predictors of the regulariser are the rows of the one shared classifier
  (K seen classes, background included) after adaptation, not the stacked
  heads of several N-way tasks of a meta-batch.
* The inner loop adapts whatever the session trains (with the run's default
  ``freeze_incremental = all_but_classifier`` that is the classifier alone, as
  in ANIL); ``freeze`` can open the backbone.

Deviations from the papers, with reasons:

* First-order MAML (Finn et al. also report it) instead of second-order: the
  second-order term needs a Hessian-vector product through a whole 2D/3D
  segmentation network per inner step, and the JASCL paper gives no sign of
  having used it.
* The outer optimiser is the run's (``optimizer``, ``lr_incremental``), not
  MAML's Adam with 1e-3, so that every baseline of the comparison is trained
  with the same optimiser and learning rate.
* Inner-loop defaults from Finn et al.'s miniImageNet setting (5 steps, step
  0.01); the regulariser's weight 1.0 is a neutral choice, not the paper's
  (which could not be checked here).
* The loop's own forward of the whole batch (``state.output``) is not used by
  the loss; it still runs, and in train mode it updates batch-norm running
  statistics, as the inner and query forwards do.
* Several processes (DDP): the episode's forwards go through
  ``functional_call`` on the bare model; gradients reach the same parameters,
  but this path has not been run with several processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import functional_call

from jascl.engine.defaults import default_supervised_loss
from jascl.engine.losses import SegmentationLoss
from jascl.engine.plugin import Method, Plugin
from jascl.methods.options import check_options, freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState


def support_query_split(batch_size: int, support_fraction: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the support and query images of a batch.

    The first ``round(batch_size * support_fraction)`` images, clamped to [1, batch_size - 1],
    are the support; the rest the query. One image is both (a degenerate episode).

    Args:
        batch_size: B, images in the batch (>= 1).
        support_fraction: share of the images in the support split, in (0, 1).

    Returns:
        (support, query) index tensors (long).
    """
    if batch_size < 1:
        raise ValueError(f"support_query_split: batch_size must be >= 1 (got {batch_size})")
    if batch_size == 1:
        only = torch.zeros(1, dtype=torch.long)
        return only, only.clone()
    n_support = min(max(int(round(batch_size * support_fraction)), 1), batch_size - 1)
    index = torch.arange(batch_size)
    return index[:n_support], index[n_support:]


def first_order_adapt(
    loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    params: dict[str, torch.Tensor],
    inner_lr: float,
    steps: int,
) -> dict[str, torch.Tensor]:
    """First-order MAML inner loop: ``steps`` SGD steps on ``loss_fn``, gradients detached.

    theta_{k+1} = theta_k - inner_lr * grad L_support(theta_k), with the gradient treated as a
    constant, so every adapted tensor is ``theta - (constant)``: its Jacobian with respect to
    ``theta`` is the identity, and a loss of the adapted parameters back-propagates to ``theta``
    the gradient taken at the adapted parameters (the first-order MAML outer gradient).

    Args:
        loss_fn: the support loss of a parameter dict (e.g. through ``functional_call``).
        params: name -> tensor; tensors that require grad are adapted, the rest are passed through.
        inner_lr: the inner step alpha.
        steps: number of inner steps (0 returns ``params``).

    Returns:
        name -> adapted tensor (attached to ``params``' graph with identity Jacobian).
    """
    adapted = dict(params)
    names = [n for n, p in adapted.items() if p.requires_grad]
    for _ in range(steps):
        loss = loss_fn(adapted)
        grads = torch.autograd.grad(loss, [adapted[n] for n in names], allow_unused=True)
        for name, grad in zip(names, grads):
            if grad is not None:
                adapted[name] = adapted[name] - inner_lr * grad.detach()
    return adapted


def condition_number(weight: torch.Tensor, normalize: bool = True, eps: float = 1e-12) -> torch.Tensor:
    """kappa(W) = sigma_max(W) / sigma_min(W), the Bouniot et al. regulariser of the linear predictors.

    Args:
        weight: (K, C) predictors, one row per class (any dtype; computed in float32 or float64).
        normalize: L2-normalise the rows first (the paper's normalised predictors).
        eps: lower bound of sigma_min (a rank-deficient W gives a large finite value, not inf).

    Returns:
        0-dim tensor >= 1, differentiable in ``weight``; sigma_min is the smallest of the
        min(K, C) singular values.
    """
    w = weight if weight.dtype in (torch.float32, torch.float64) else weight.float()
    if normalize:
        w = F.normalize(w, dim=1)
    sigma = torch.linalg.svdvals(w)
    return sigma.max() / sigma.min().clamp_min(eps)


@dataclass
class MAMLOptions:
    """``method_args.maml`` options (inner-loop defaults: Finn et al., ICML 2017, miniImageNet).

    Attributes:
        inner_lr: inner SGD step alpha (Finn et al.: 0.01).
        inner_steps: inner steps per episode (Finn et al.: 5 at meta-training).
        support_fraction: share of the batch's images in the support split (half: support and query
            of equal size, as the N-way K-shot episodes with K support and K query images).
        freeze: incremental-session freezing (``config``: the run's ``freeze_incremental``).
    """

    inner_lr: float = option(0.01, gt=0, doc="inner-loop SGD step alpha (Finn et al. 2017: 0.01)")
    inner_steps: int = option(5, ge=1, doc="inner-loop steps per episode (Finn et al. 2017: 5)")
    support_fraction: float = option(0.5, gt=0, lt=1, doc="share of the batch's images in the support split")
    freeze: str = freeze_option()


@dataclass
class MAMLRegOptions(MAMLOptions):
    """``method_args.maml-reg`` options: MAML's, plus the Bouniot et al. regulariser.

    Attributes:
        reg_weight: weight of kappa(W') in the loss.
        normalize_predictors: L2-normalise the classifier rows before kappa (the paper normalises the predictors).
    """

    reg_weight: float = option(1.0, gt=0, doc="weight of the condition number kappa(W') of the adapted classifier")
    normalize_predictors: bool = option(True, doc="L2-normalise the predictors (classifier rows) before kappa")


class MAMLPlugin(Plugin):
    """First-order MAML episodes on every incremental batch; optionally the kappa regulariser (module docstring)."""

    name = "maml"
    replaces = ("supervised-loss",)  # the query loss after adaptation is the method's segmentation loss
    snapshot_exclude = ("_loss",)

    def __init__(self, options: MAMLOptions | None = None, key: str = "maml") -> None:
        o = self.options = options or MAMLOptions()
        check_options(o, f"method_args.{key}")
        self.regularised = isinstance(o, MAMLRegOptions)
        self.name = key
        self.loss_terms = ("maml", "maml_reg") if self.regularised else ("maml",)
        self.freeze_incremental = freeze_policy(o.freeze)
        self._loss: SegmentationLoss | None = None

    def before_session(self, state: LoopState) -> None:
        self._loss = SegmentationLoss.for_session(state.config, state.session.index, state.model.num_classes)

    def after_forward(self, state: LoopState) -> None:
        if state.session.index == 0:
            state.losses["seg"] = default_supervised_loss(state)
            return
        assert state.batch is not None and state.target is not None and self._loss is not None
        o, model, loss = self.options, state.model, self._loss
        x = state.batch["image"].to(state.device, non_blocking=True)
        target = state.target
        support, query = (i.to(state.device) for i in support_query_split(x.shape[0], o.support_fraction))
        x_s, y_s, x_q, y_q = x[support], target[support], x[query], target[query]
        # a subset of a batch without ignored pixels has none; otherwise let the loss find out
        has_ignore = False if state.has_ignore is False else None
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}

        def support_loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return loss(functional_call(model, p, (x_s,)), y_s, has_ignore)

        adapted = first_order_adapt(support_loss, params, o.inner_lr, o.inner_steps)
        state.losses["maml"] = loss(functional_call(model, adapted, (x_q,)), y_q, has_ignore)
        if self.regularised:
            assert isinstance(o, MAMLRegOptions)
            weight = adapted.get("classifier.weight", model.classifier.weight)
            state.losses["maml_reg"] = o.reg_weight * condition_number(weight, o.normalize_predictors)


@METHODS.register(
    "maml",
    options=MAMLOptions,
    paper="Bouniot et al., ECCV 2022",
    doc="baseline: first-order MAML episodes (support/query images) on incremental batches",
    fidelity="simplified: first-order MAML, one episode per incremental batch",
)
def maml(options: MAMLOptions, config: RunConfig) -> Method:
    return Method("maml", [MAMLPlugin(options, "maml")], "MAML: first-order episodes on each incremental batch")


@METHODS.register(
    "maml-reg",
    options=MAMLRegOptions,
    paper="Bouniot et al., ECCV 2022",
    doc="baseline: first-order MAML + condition-number regulariser of the classifier",
    fidelity=(
        "reconstructed: the regulariser from the abstract of Bouniot et al., ECCV 2022 (no full text or code found): "
        "condition number of the normalised adapted classifier"
    ),
)
def maml_reg(options: MAMLRegOptions, config: RunConfig) -> Method:
    return Method(
        "maml-reg",
        [MAMLPlugin(options, "maml-reg")],
        "MAML + regulariser: first-order episodes plus kappa of the adapted classifier (Bouniot et al.)",
    )
