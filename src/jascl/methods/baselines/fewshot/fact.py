"""FACT: forward-compatible training with virtual prototypes that reserve embedding space for future classes.

Zhou, Wang, Ye, Ma, Pu, Zhan, "Forward Compatible Few-Shot Class-Incremental
Learning", CVPR 2022 (arXiv 2203.06953; official code
github.com/zhoudw-zdw/CVPR22-Fact, ``models/fact``).

What it does:

* **Base session (trains its own base model).** Besides the K real classifier
  rows, V *virtual prototypes* P_v (extra cosine-classifier rows for classes
  that do not exist yet) are trained with the model. With f_v(x) = [W, P_v]^T
  phi(x) the logits over real and virtual rows, each labelled instance (here:
  each labelled pixel) gets, on top of the supervised loss, the second term of
  the paper's L_v::

      L_virtual = CE(Mask(f_v(x), y), y_hat),   y_hat = K + argmax_v p_v^T phi(x)

  where Mask sets the ground-truth logit to -1e9: with its own class out of the
  way, the instance is pushed towards its most likely virtual class, which
  squeezes the known classes and reserves room around them.
* **Forecasting virtual instances (manifold mixup).** Instances of two
  different classes are mixed, z = lam h_i + (1 - lam) h_j with
  lam ~ Beta(alpha, alpha) (one draw per step, pairs from a random
  permutation, pairs of one class dropped, as the official ``base_train``),
  and the mixture is treated as an instance of a new class, symmetrically::

      L_forecast = CE(f_v(z), y_v) + CE(Mask(f_v(z), y_v), y_r),
      y_v = K + argmax_v f_v(z)_v,   y_r = argmax_{k < K} f_v(z)_k

  Both terms are weighted by ``balance`` (official ``--balance``) and added
  from epoch ``start_epoch`` on (official ``--loss_iter``).
* **End of the base session.** The real rows are replaced by the classes'
  prototypes (official ``replace_base_fc``, on by default); the virtual rows
  are kept as plugin state (``extra_state``: ``virtual``), outside the model,
  whose checkpoint keeps the standard layout.
* **Incremental sessions.** The backbone is frozen and nothing is trained
  (official ``avg_cos``; here the optimiser's learning rate is 0): the new
  classes' rows are their prototypes from the support set (the loop's
  classifier growth imprints exactly that).
* **Bimodal prediction (incremental sessions).** The virtual prototypes also
  serve at inference: a pixel's similarities to the (unit) virtual prototypes,
  kept for its ``topk`` most similar ones, are carried to the classes through
  the prototype-to-class similarities P_v W^T, and the two classifiers'
  softmaxes are mixed (official ``test_intergrate``)::

      s = topk(n(phi(x)) n(P_v)^T) n(P_v) n(W)^T,    p(y|x) = eta softmax(s) + (1 - eta) softmax(f(x))

  with f(x) the cosine prototype classifier over the seen classes. The
  classifier is swapped for a :class:`FACTHead` (log p(y|x) as logits)
  between ``before_eval`` and ``after_eval``. The base session predicts with
  the prototype classifier alone, as the official code.

Adaptation to dense segmentation: instances are pixels of the feature map
(labels resized to it, ignored pixels left out); the background is a known
class like any other. V defaults to the number of classes the protocol adds
after session 0 (the official code pre-allocates exactly the classes of the
later sessions), at least 1.

Deviations, with reasons:

* **Manifold mixup at the pre-classifier layer.** The official code mixes the
  output of ResNet stage 2 and runs stages 3-4 on the mixture. The backbones
  here expose features only right before the classifier
  (``Segmenter.forward_features``), and a mixture of two images at an
  intermediate layer of a U-Net would meet unmixed skip connections; so the
  mixed instances are convex combinations of two *pixel features* of
  different classes (from anywhere in the batch) at the pre-classifier layer.
  The mixture still lies between two class clusters and is classified by the
  same f_v; gradients reach the backbone through both pixels' features.
  ``max_pairs`` can cap the number of mixed pixel pairs per step (default: every
  labelled pixel is an anchor once, as every instance of the official batch is).
* **First term of L_v.** The paper writes CE over real and virtual rows with
  the ground truth; the official code uses CE over the real rows only. Here the
  loop's supervised loss (DiceCE over the real rows) stands for it.
* The official code lets each virtual class attract instances of only 3 random
  base classes (``mask``, not in the paper); not reproduced (segmentation
  protocols have few base classes, so 3 of them would be most or all).
* Virtual rows are orthogonally initialised on their own (the official code
  initialises real and virtual rows together); the real rows keep the
  model's initialisation.
* The cosine temperature is the run's ``temperature`` (official 16), shared by
  real and virtual rows; optimiser and schedule are the run's.
* A class taught again in a later session (a recurring class in a new domain)
  keeps its base row (FSCIL has no recurring classes; the loop's growth adds
  rows only for new classes).
* With several processes, the virtual rows are parameters of the (temporarily
  wrapped) model but are used outside its forward, in ``after_forward``.
* FACT needs the cosine classifier (official ``ft_cos`` / ``avg_cos``): with
  ``classifier: linear`` the method refuses to start.
* Its loss terms exist in the base session only (incremental sessions are
  training-free), so :attr:`FACTPlugin.loss_terms` is empty and the terms are
  listed in :attr:`FACTPlugin.base_loss_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import align_labels
from jascl.errors import ConfigError
from jascl.methods.options import check_options, option
from jascl.methods.registry import METHODS
from jascl.networks.classifier import PixelClassifier
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

#: the logit a masked class gets (official ``masked_fill(..., -1e9)``)
MASKED_LOGIT = -1e9


def _flat(logits: torch.Tensor) -> torch.Tensor:
    """(B, K, *spatial) -> (B * prod(spatial), K); (N, K) unchanged."""
    if logits.dim() == 2:
        return logits
    return logits.movedim(1, -1).reshape(-1, logits.shape[1])


def mask_logits(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Mask(f, y): ``logits`` (N, K) with entry ``index[n]`` of row n set to -1e9 (a new tensor)."""
    hit = F.one_hot(index, logits.shape[1]).bool()
    return logits.masked_fill(hit, MASKED_LOGIT)


def virtual_class_loss(
    logits: torch.Tensor, target: torch.Tensor, num_real: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Second term of the paper's L_v: CE(Mask(f_v(x), y), y_hat), y_hat = K + argmax of the virtual logits.

    Args:
        logits: (B, K+V, *spatial) or (N, K+V) logits f_v over the K real rows, then the V virtual rows.
        target: (B, *spatial) or (N,) real rows in [0, K), ``ignore_index`` for pixels left out.
        num_real: K.
        ignore_index: label of pixels without a class.

    Returns:
        Mean over the labelled pixels (float32); 0, still attached to ``logits``, when there is none.
    """
    flat = _flat(logits).float()
    y = target.reshape(-1)
    keep = y != ignore_index
    if not bool(keep.any()):
        return flat.sum() * 0.0
    flat, y = flat[keep], y[keep].long()
    pseudo = num_real + flat[:, num_real:].detach().argmax(dim=1)
    return F.cross_entropy(mask_logits(flat, y), pseudo)


def forecast_instances(
    features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, partners: torch.Tensor, lam: float
) -> torch.Tensor:
    """Manifold-mixup virtual instances lam * h_a + (1 - lam) * h_b for pairs (a, b) of different classes.

    Args:
        features: (N, C) instance features (here: pixel features).
        labels: (N,) their classes.
        anchors, partners: (M,) indices into the N instances; pair m is (anchors[m], partners[m]).
        lam: mixing coefficient (a Beta(alpha, alpha) draw).

    Returns:
        (M', C) mixtures of the pairs whose labels differ, in pair order.
    """
    differ = labels[anchors] != labels[partners]
    a, b = anchors[differ], partners[differ]
    return lam * features[a] + (1.0 - lam) * features[b]


def forecast_loss(logits: torch.Tensor, num_real: int) -> torch.Tensor:
    """Symmetric reserving of virtual instances: CE(f_v(z), y_v) + CE(Mask(f_v(z), y_v), y_r).

    y_v = K + argmax of the virtual logits (the virtual class z is assigned to), y_r = argmax of the
    real logits (the known class it comes closest to), as the official ``base_train``.

    Args:
        logits: (M, K+V) logits f_v of M virtual instances.
        num_real: K.

    Returns:
        Scalar (float32); 0, still attached to ``logits``, for M = 0.
    """
    flat = logits.float()
    if flat.shape[0] == 0:
        return flat.sum() * 0.0
    detached = flat.detach()
    to_virtual = num_real + detached[:, num_real:].argmax(dim=1)
    to_real = detached[:, :num_real].argmax(dim=1)
    return F.cross_entropy(flat, to_virtual) + F.cross_entropy(mask_logits(flat, to_virtual), to_real)


def virtual_estimate(features: torch.Tensor, rows: torch.Tensor, virtual: torch.Tensor, topk: int) -> torch.Tensor:
    """The virtual-prototype estimate s = topk(n(x) n(P)^T) n(P) n(W)^T (official ``test_intergrate``).

    Each pixel's cosine similarities to the virtual prototypes are kept for its ``topk`` most similar ones
    (the others set to 0) and carried to the classes by the prototype-to-class cosine similarities.

    Args:
        features: (B, C, *spatial) or (N, C) features x.
        rows: (K, C) class rows W (prototypes) of the seen classes.
        virtual: (V, C) virtual prototypes P.
        topk: how many virtual prototypes each pixel keeps (all if topk >= V).

    Returns:
        (B, K, *spatial) or (N, K) estimates (not scaled by a temperature, as the official code).
    """
    p = F.normalize(virtual.float(), dim=1)
    relation = p @ F.normalize(rows.float(), dim=1).t()  # (V, K)
    x = F.normalize(features.float(), dim=1)
    last = x if x.dim() == 2 else x.movedim(1, -1)
    similarity = last @ p.t()  # (..., V)
    k = min(topk, similarity.shape[-1])
    values, index = similarity.topk(k, dim=-1)
    sparse = torch.zeros_like(similarity).scatter(-1, index, values)
    estimate = sparse @ relation
    return estimate if x.dim() == 2 else estimate.movedim(-1, 1)


def bimodal_probabilities(estimate: torch.Tensor, logits: torch.Tensor, eta: float) -> torch.Tensor:
    """p = eta * softmax(estimate) + (1 - eta) * softmax(logits), over dim 1 of (B, K, *spatial) or (N, K)."""
    return eta * torch.softmax(estimate.float(), dim=1) + (1.0 - eta) * torch.softmax(logits.float(), dim=1)


class VirtualRowsClassifier(nn.Module):
    """The pixel classifier plus V trainable virtual rows, standing in for it during the base session.

    ``forward`` gives the real logits only (what the loop, evaluation and the supervised loss see);
    :meth:`full_logits` gives f_v, real then virtual, with the same cosine temperature.

    Args:
        real: the model's cosine :class:`PixelClassifier` (kept as it is, a submodule).
        virtual: (V, C) initial virtual rows.
    """

    def __init__(self, real: PixelClassifier, virtual: torch.Tensor) -> None:
        super().__init__()
        self.real = real
        self.virtual = nn.Parameter(virtual.clone())

    @property
    def num_classes(self) -> int:
        return self.real.num_classes

    @property
    def weight(self) -> torch.Tensor:
        return self.real.weight

    def forward(self, features: torch.Tensor, unit: bool = False) -> torch.Tensor:
        return self.real(features, unit)

    def full_logits(self, features: torch.Tensor) -> torch.Tensor:
        """f_v: (B, C, *spatial) -> (B, K+V, *spatial), or (N, C) -> (N, K+V)."""
        rows = torch.cat([self.real.weight, self.virtual.to(self.real.weight.dtype)])
        x = F.normalize(features, dim=1)
        w = F.normalize(rows, dim=1)
        if x.dim() == 2:
            return self.real.temperature * x @ w.t()
        return self.real.temperature * torch.einsum("bc...,kc->bk...", x, w)


class FACTHead(nn.Module):
    """Bimodal prediction: log(eta softmax(virtual estimate) + (1 - eta) softmax(classifier)), per pixel.

    Args:
        classifier: the model's classifier (its rows are the class prototypes; its logits the second mode).
        virtual: (V, C) virtual prototypes.
        eta: weight of the virtual-prototype estimate.
        topk: virtual prototypes kept per pixel.

    Forward: (B, C, *spatial) -> (B, K, *spatial) log-probabilities (used as logits), or (N, C) -> (N, K).
    """

    def __init__(self, classifier: nn.Module, virtual: torch.Tensor, eta: float, topk: int) -> None:
        super().__init__()
        self.classifier = classifier
        self.register_buffer("virtual", virtual.detach().float().clone(), persistent=False)
        self.eta = eta
        self.topk = topk

    @property
    def num_classes(self) -> int:
        return self.classifier.num_classes

    def forward(self, features: torch.Tensor, unit: bool = False) -> torch.Tensor:
        logits = self.classifier(features, unit)
        estimate = virtual_estimate(features, self.classifier.weight.detach(), self.virtual, self.topk)
        probs = bimodal_probabilities(estimate, logits, self.eta)
        return probs.clamp_min(torch.finfo(probs.dtype).tiny).log()


@dataclass
class FACTOptions:
    """``method_args.fact`` options (defaults: the official scripts, ``train.py`` and ``readme.md``).

    Where the three official configurations differ, the value two of them share is taken:
    balance 0.01 (CUB, miniImageNet; CIFAR 0.001), alpha 0.5 (CIFAR, miniImageNet; CUB 2.0),
    start_epoch 0 (CIFAR, CUB; miniImageNet 150 of 1000).

    Attributes:
        num_virtual: virtual prototypes V; 0 = the number of classes the protocol adds after session 0 (>= 1).
        balance: weight of the virtual-class and forecasting terms (official ``--balance``).
        alpha: the mixing coefficient is drawn from Beta(alpha, alpha) (official ``--alpha``).
        start_epoch: base-session epoch from which the FACT terms are added (official ``--loss_iter``).
        max_pairs: at most this many mixed pixel pairs per step (0 = every labelled pixel is an anchor once).
        base_prototypes: replace the real rows by the classes' prototypes after the base session
            (official data initialisation, ``replace_base_fc``).
        eta: weight of the virtual-prototype estimate in the bimodal prediction (official ``--eta``).
        topk: virtual prototypes each pixel keeps in the estimate (official code: 40).
    """

    num_virtual: int = option(0, ge=0)
    balance: float = option(0.01, ge=0)
    alpha: float = option(0.5, gt=0)
    start_epoch: int = option(0, ge=0)
    max_pairs: int = option(0, ge=0)
    base_prototypes: bool = True
    eta: float = option(0.1, ge=0, le=1)
    topk: int = option(40, ge=1)


class FACTPlugin(Plugin):
    """Virtual prototypes in the base session, prototype classifier and bimodal prediction after it."""

    name = "fact"
    changes_base_session = True
    freeze_incremental = "all_but_classifier"  # official: the embedding is frozen after the base session
    #: the terms FACT adds, in the base session only (incremental sessions are training-free)
    base_loss_terms = ("fact_virtual", "fact_forecast")
    # the wrapper's parameters are the model's (checkpointed with it); the swapped-out classifier is the model's
    snapshot_exclude = ("_wrapper", "_original")

    def __init__(self, options: FACTOptions | None = None) -> None:
        self.options = options or FACTOptions()
        check_options(self.options, "method_args.fact")
        #: (V, C) virtual prototypes after the base session (None before it)
        self.virtual: torch.Tensor | None = None
        self._wrapper: VirtualRowsClassifier | None = None
        self._original: nn.Module | None = None
        self._generator: torch.Generator | None = None
        self._rng: np.random.Generator | None = None

    # ------------------------------------------------------------- set-up

    def num_virtual(self, state: LoopState) -> int:
        """V: the option, else the classes the protocol adds after session 0 (at least 1)."""
        if self.options.num_virtual:
            return self.options.num_virtual
        protocol = state.protocol
        later = len(protocol.seen_classes(len(protocol.sessions) - 1)) - len(protocol.seen_classes(0))
        return max(later, 1)

    def before_session(self, state: LoopState) -> None:
        t = state.session.index
        self._generator = torch.Generator(device=state.device).manual_seed(state.seed * 7919 + t)
        self._rng = np.random.default_rng(state.seed * 104729 + t)
        if t > 0:
            if self.virtual is None:
                raise RuntimeError(
                    "fact: no virtual prototypes; session 0 must be trained (or restored) with this method"
                )
            return
        classifier = state.model.classifier
        if not isinstance(classifier, PixelClassifier) or not classifier.cosine:
            raise ConfigError("fact: needs the cosine pixel classifier (classifier=cosine), as the official ft_cos")
        init = torch.empty(self.num_virtual(state), classifier.in_channels)
        nn.init.orthogonal_(init, generator=torch.Generator().manual_seed(state.seed))
        self._wrapper = VirtualRowsClassifier(classifier, init.to(classifier.weight)).to(state.device)
        state.model.classifier = self._wrapper  # the loop collects its parameters (the virtual rows too) next

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if state.session.index == 0:
            return None
        return torch.optim.SGD(params, lr=0.0)  # training-free: the loop runs, nothing changes

    # ------------------------------------------------------------- base-session losses

    def after_forward(self, state: LoopState) -> None:
        o = self.options
        if state.session.index != 0 or state.epoch < o.start_epoch or self._wrapper is None:
            return
        assert state.output is not None and state.target is not None  # set by the loop before after_forward
        assert self._generator is not None and self._rng is not None  # set in before_session
        features = state.output.features
        num_real = self._wrapper.num_classes
        target = align_labels(state.target, features.shape[2:])
        full = self._wrapper.full_logits(features)
        state.losses["fact_virtual"] = o.balance * virtual_class_loss(full, target, num_real)

        y = target.reshape(-1)
        keep = y != IGNORE_INDEX
        pixels = features.movedim(1, -1).reshape(-1, features.shape[1])[keep]
        y = y[keep]
        n = pixels.shape[0]
        lam = float(self._rng.beta(o.alpha, o.alpha))
        anchors = torch.randperm(n, generator=self._generator, device=state.device)
        partners = torch.randperm(n, generator=self._generator, device=state.device)
        if o.max_pairs:
            anchors, partners = anchors[: o.max_pairs], partners[: o.max_pairs]
        mixed = forecast_instances(pixels, y, anchors, partners, lam)
        state.losses["fact_forecast"] = o.balance * forecast_loss(self._wrapper.full_logits(mixed), num_real)

    # ------------------------------------------------------------- end of the base session, evaluation

    @torch.no_grad()
    def after_training(self, state: LoopState) -> None:
        if state.session.index != 0 or not self.options.base_prototypes:
            return
        prototypes = state.compute_prototypes(list(state.seen))
        weight = state.model.classifier.weight
        for row, cid in enumerate(state.seen):
            if cid in prototypes:  # (a class without labelled pixels keeps its trained row)
                weight[row] = F.normalize(prototypes[cid].to(weight), dim=0)

    def before_eval(self, state: LoopState) -> None:
        if state.session.index == 0:
            return  # the official base session predicts with the prototype classifier alone
        assert self.virtual is not None  # checked in before_session
        self._original = state.model.classifier
        state.model.classifier = FACTHead(
            self._original, self.virtual.to(state.device), self.options.eta, self.options.topk
        )

    def after_eval(self, state: LoopState) -> None:
        if self._original is not None:
            state.model.classifier = self._original
            self._original = None

    def after_session(self, state: LoopState) -> None:
        if self._wrapper is not None:  # the base session: keep the virtual rows, put the classifier back
            self.virtual = self._wrapper.virtual.detach().float().cpu().clone()
            state.model.classifier = self._wrapper.real
            self._wrapper = None

    # ------------------------------------------------------------- state

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {} if self.virtual is None else {"virtual": self.virtual}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if "virtual" in tensors:
            self.virtual = tensors["virtual"].float()


@METHODS.register(
    "fact",
    options=FACTOptions,
    paper="Zhou et al., CVPR 2022",
    doc="baseline: virtual prototypes reserve space in the base session; prototype + virtual-prototype prediction",
    fidelity="faithful",
)
def fact(options: FACTOptions, config: RunConfig) -> Method:
    """FACT: virtual prototypes and pixel-feature mixup in the base session; training-free bimodal prediction after it."""
    if config.classifier != "cosine":
        raise ConfigError(f"fact: needs classifier=cosine (got {config.classifier!r}); FACT's classifiers are cosine")
    return Method("fact", [FACTPlugin(options)], "FACT: forward-compatible training with virtual prototypes")
