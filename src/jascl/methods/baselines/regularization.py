"""Regularisation baselines: EWC, online EWC, UCL, dropout + weight decay, Adagrad.

The JASCL paper compares GAS with these in its appendix "GAS vs. existing
regularization-based continual learning methods" (memory-based penalties: EWC,
UCL; static regularisers: dropout, weight decay; adaptive optimisers: Adagrad).
Each method here is a pure function tested on bare tensors, a plugin on the
training loop, and a registered factory reading its options from
``--set method_args.<method>.<option>=value``.

Conventions shared by every method in this module:

* Session 0 is the shared base model unless a method says otherwise (``in_base``
  options, UCL): the paper's appendix table starts every regularisation baseline
  from the same session-0 score. End-of-session statistics (Fisher information,
  uncertainties) of a reused session are computed on ``session_restored``.
* ``freeze`` ("config" | "none" | "all_but_classifier"): the incremental-session
  freezing policy. Default "config" = the protocol's policy (``all_but_classifier``
  in the paper's medical setting, so only the classifier -- its old rows included
  -- is regularised); "none" lets the method act on the backbone as in the
  original papers.
* Classifier rows grow with new classes; a penalty anchored at an earlier
  session applies to that session's rows (the first rows) only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")

FREEZE_OPTIONS = ("config", "none", "all_but_classifier")


# ---------------------------------------------------------------------------- shared helpers


def check_freeze(method: str, value: str) -> str | None:
    """Validate a ``freeze`` option; returns the plugin's ``freeze_incremental`` (None = the run's policy)."""
    if value not in FREEZE_OPTIONS:
        raise ConfigError(f"method_args.{method}.freeze: must be one of {', '.join(FREEZE_OPTIONS)} (got {value!r})")
    return None if value == "config" else value


def check_range(
    method: str, key: str, value: float, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    """One-line ConfigError unless ``low <= value <= high`` (``low < value`` if ``low_open``)."""
    ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        lo = "(" if low_open else "["
        raise ConfigError(f"method_args.{method}.{key}: must be in {lo}{low}, {high}] (got {value!r})")


def always_frozen(model: nn.Module) -> set[int]:
    """ids of parameters frozen in every session (e.g. SAM's image encoder)."""
    backbone = getattr(model, "backbone", None)
    frozen = backbone.frozen_modules() if backbone is not None else []
    return {id(p) for m in frozen for p in m.parameters()}


def incremental_parameters(state: LoopState) -> dict[str, nn.Parameter]:
    """The parameters that can train in incremental sessions under the method's freezing policy.

    ``all_but_classifier``: the classifier's; ``none``: every parameter except
    the backbone's always-frozen modules.
    """
    model = state.model
    if state.freeze_incremental == "all_but_classifier":
        return {f"classifier.{n}": p for n, p in model.classifier.named_parameters()}
    skip = always_frozen(model)
    return {n: p for n, p in model.named_parameters() if id(p) not in skip}


def leading_rows(current: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``current`` restricted to the shape of ``reference``, allowing growth along dim 0 only.

    Classifier weights (K, C) and biases (K,) gain rows as classes arrive; a
    quantity anchored at an earlier session covers its first rows.
    """
    if current.shape == reference.shape:
        return current
    if (
        current.dim() != reference.dim()
        or current.shape[1:] != reference.shape[1:]
        or current.shape[0] < reference.shape[0]
    ):
        raise ValueError(
            f"parameter of shape {tuple(current.shape)} cannot be matched to an anchor of shape "
            f"{tuple(reference.shape)} (only growth along dim 0 is supported)"
        )
    return current[: reference.shape[0]]


def pad_rows(tensor: torch.Tensor, shape: torch.Size, value: float = 0.0) -> torch.Tensor:
    """``tensor`` extended along dim 0 to ``shape`` with ``value`` (inverse of :func:`leading_rows`)."""
    if tensor.shape == shape:
        return tensor
    leading_rows(torch.empty(shape), tensor)  # validates the shapes
    out = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.shape[0]] = tensor
    return out


class _SessionGate:
    """Mixin deciding whether a plugin acts in a session (incremental only, or also session 0)."""

    in_base = False

    def active(self, state: LoopState) -> bool:
        return self.in_base or state.session.index > 0


# ---------------------------------------------------------------------------- EWC / online EWC


def ewc_penalty(
    params: Mapping[str, torch.Tensor], anchors: Mapping[str, torch.Tensor], fisher: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Sum_i F_i (theta_i - theta*_i)^2 over the parameters named in ``fisher`` (Kirkpatrick et al. 2017, eq. 3
    without the lambda/2 factor).

    Args:
        params: name -> current parameter (any shape; may have more leading rows than its anchor).
        anchors: name -> theta* (the parameter at the end of the anchored session).
        fisher: name -> diagonal Fisher information, shaped like the anchor.

    Returns:
        0-dim tensor, differentiable w.r.t. ``params``.
    """
    total = None
    for name, f in fisher.items():
        theta = leading_rows(params[name], anchors[name])
        term = (f * (theta - anchors[name]) ** 2).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total


def segmentation_log_likelihood(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image log-likelihood used for the Fisher: minus the mean cross-entropy over labelled pixels.

    Args:
        logits: (1, K, *spatial).
        target: (1, *spatial) classifier rows, 255 = ignore.
    """
    return -F.cross_entropy(logits, target, ignore_index=255)


def fisher_diagonal(
    model: Callable[[torch.Tensor], torch.Tensor],
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
    params: Mapping[str, torch.Tensor],
    labels: str = "empirical",
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Diagonal Fisher information: the mean over samples of the squared per-sample gradient of the log-likelihood.

    A "sample" is one image/volume; its log-likelihood is minus the mean pixel
    cross-entropy (:func:`segmentation_log_likelihood`). Kirkpatrick et al. (2017)
    use the Fisher at theta*; "empirical" takes the gradient at the ground-truth
    labels, "sampled" at labels drawn per pixel from the model's own softmax (the
    true Fisher, estimated with one draw per image).

    Args:
        model: maps (1, C_in, *spatial) to logits (1, K, *spatial'); put it in the
            mode you want (eval mode keeps BatchNorm statistics untouched).
        samples: (image (1, C_in, *spatial), target (1, *spatial) classifier rows, 255 = ignore).
        params: name -> parameter to measure (``requires_grad`` must be True).
        labels: "empirical" or "sampled".
        generator: random stream for "sampled".

    Returns:
        name -> tensor shaped like the parameter (zeros if no sample had a labelled pixel).
    """
    if labels not in ("empirical", "sampled"):
        raise ValueError(f"labels must be 'empirical' or 'sampled' (got {labels!r})")
    names = list(params)
    tensors = [params[n] for n in names]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    count = 0
    for image, target in samples:
        logits = model(image)
        if logits.shape[2:] != target.shape[1:]:
            raise ValueError(f"logits {tuple(logits.shape)} do not match target {tuple(target.shape)}")
        if labels == "sampled":
            probs = logits.detach().softmax(1).movedim(1, -1).reshape(-1, logits.shape[1])
            drawn = torch.multinomial(probs.cpu(), 1, generator=generator).view(target.shape).to(target.device)
            target = drawn
        elif not (target != IGNORE_INDEX).any():
            continue
        grads = torch.autograd.grad(segmentation_log_likelihood(logits, target), tensors, allow_unused=True)
        for acc, g in zip(total, grads):
            if g is not None:
                acc += g.detach().float() ** 2
        count += 1
    return {n: t / max(count, 1) for n, t in zip(names, total)}


def online_fisher_update(
    accumulated: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor], gamma: float
) -> dict[str, torch.Tensor]:
    """Online EWC's running Fisher F~ <- gamma * F~ + F_t (Schwarz et al. 2018, online EWC).

    Parameters that grew since the last update (classifier rows) get zero
    accumulated Fisher in their new rows; parameters new to ``new`` start at F_t.
    """
    out = {}
    for name, f in new.items():
        prev = (accumulated or {}).get(name)
        out[name] = f.clone() if prev is None else gamma * pad_rows(prev.to(f), f.shape) + f
    return out


class _FisherSessions:
    """Fisher computation at the end of a session, shared by EWC and online EWC."""

    fisher_labels = "empirical"
    fisher_samples = 0

    def session_fisher(self, state: LoopState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(Fisher, anchors) at the current parameters on the session's labelled training data (eval mode)."""
        from jascl.data.datasets import LabelledDataset

        model = state.model
        targets = incremental_parameters(state)
        flags = {n: p.requires_grad for n, p in targets.items()}
        modes = {m: m.training for m in model.modules()}
        dataset = LabelledDataset(state.data.train, state.session.classes, state.session.other_classes)
        limit = len(dataset) if self.fisher_samples <= 0 else min(self.fisher_samples, len(dataset))

        def samples():
            for i in range(limit):
                item = dataset[i]
                yield (item["image"][None].to(state.device), state.class_index(item["label"][None].to(state.device)))

        generator = torch.Generator().manual_seed(state.seed * 1000 + state.session.index)
        try:
            model.eval()
            for p in targets.values():
                p.requires_grad_(True)
            with torch.enable_grad():
                fisher = fisher_diagonal(model, samples(), targets, self.fisher_labels, generator)
        finally:
            for n, p in targets.items():
                p.requires_grad_(flags[n])
            for module, mode in modes.items():
                module.train(mode)
        anchors = {n: p.detach().clone() for n, p in targets.items()}
        return fisher, anchors


class EWCPlugin(_FisherSessions, Plugin):
    """Elastic weight consolidation: one quadratic penalty per earlier session.

    loss += (lambda / 2) * sum_{k < t} sum_i F_{k,i} (theta_i - theta*_{k,i})^2
    (Kirkpatrick et al., PNAS 2017, eq. 3, with one penalty per earlier task as
    the paper does for more than two tasks). F_k is the diagonal Fisher at the
    end of session k on its labelled training images (:func:`fisher_diagonal`).

    Args:
        weight: lambda.
        fisher_labels: "empirical" (ground-truth labels) or "sampled" (model's own predictions).
        fisher_samples: images used for the Fisher (0 = the whole labelled set).
        freeze: incremental freezing policy (see the module docstring).
    """

    name = "ewc"
    loss_terms = ("ewc",)

    def __init__(
        self,
        weight: float = 500.0,
        fisher_labels: str = "empirical",
        fisher_samples: int = 0,
        freeze: str | None = None,
    ) -> None:
        self.weight = weight
        self.fisher_labels = fisher_labels
        self.fisher_samples = fisher_samples
        self.freeze_incremental = freeze
        #: per consolidated session: (fisher, anchors)
        self.sessions: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.consolidated = -1

    def penalty(self, state: LoopState) -> torch.Tensor | None:
        if not self.sessions:
            return None
        params = dict(state.model.named_parameters())
        return sum(ewc_penalty(params, anchors, fisher) for fisher, anchors in self.sessions)

    def after_forward(self, state: LoopState) -> None:
        if state.session.index > 0:
            penalty = self.penalty(state)
            if penalty is not None:
                state.losses[self.name] = 0.5 * self.weight * penalty

    def consolidate(self, state: LoopState) -> None:
        fisher, anchors = self.session_fisher(state)
        self.sessions.append((fisher, anchors))
        self.consolidated = state.session.index

    def after_session(self, state: LoopState) -> None:
        self.consolidate(state)

    def session_restored(self, state: LoopState) -> None:
        if self.consolidated != state.session.index:  # not loaded from this session's saved state
            self.consolidate(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {"consolidated": torch.tensor(self.consolidated)}
        for k, (fisher, anchors) in enumerate(self.sessions):
            out.update({f"s{k}.fisher.{n}": v for n, v in fisher.items()})
            out.update({f"s{k}.anchor.{n}": v for n, v in anchors.items()})
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.consolidated = int(tensors["consolidated"])
        sessions: dict[int, tuple[dict, dict]] = {}
        for key, value in tensors.items():
            if key == "consolidated":
                continue
            index, kind, name = key.split(".", 2)
            fisher, anchors = sessions.setdefault(int(index[1:]), ({}, {}))
            (fisher if kind == "fisher" else anchors)[name] = value
        self.sessions = [sessions[k] for k in sorted(sessions)]


class OnlineEWCPlugin(_FisherSessions, Plugin):
    """Online EWC: one running Fisher and one anchor (the latest session's parameters).

    F~_t = gamma * F~_{t-1} + F_t;  loss += (lambda / 2) * sum_i F~_{t-1,i} (theta_i - theta*_{t-1,i})^2
    (Schwarz et al., ICML 2018, "Progress & Compress", online EWC).

    Args:
        weight: lambda.
        gamma: decay of earlier sessions' Fisher (gamma = 1: plain sum).
        fisher_labels, fisher_samples, freeze: as :class:`EWCPlugin`.
    """

    name = "online-ewc"
    loss_terms = ("online-ewc",)

    def __init__(
        self,
        weight: float = 500.0,
        gamma: float = 1.0,
        fisher_labels: str = "empirical",
        fisher_samples: int = 0,
        freeze: str | None = None,
    ) -> None:
        self.weight = weight
        self.gamma = gamma
        self.fisher_labels = fisher_labels
        self.fisher_samples = fisher_samples
        self.freeze_incremental = freeze
        self.fisher: dict[str, torch.Tensor] | None = None
        self.anchors: dict[str, torch.Tensor] | None = None
        self.consolidated = -1

    def after_forward(self, state: LoopState) -> None:
        if self.fisher is not None and state.session.index > 0:
            penalty = ewc_penalty(dict(state.model.named_parameters()), self.anchors, self.fisher)
            state.losses[self.name] = 0.5 * self.weight * penalty

    def consolidate(self, state: LoopState) -> None:
        fisher, self.anchors = self.session_fisher(state)
        self.fisher = online_fisher_update(self.fisher, fisher, self.gamma)
        self.consolidated = state.session.index

    def after_session(self, state: LoopState) -> None:
        self.consolidate(state)

    def session_restored(self, state: LoopState) -> None:
        if self.consolidated != state.session.index:
            self.consolidate(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {"consolidated": torch.tensor(self.consolidated)}
        if self.fisher is not None:
            out.update({f"fisher.{n}": v for n, v in self.fisher.items()})
            out.update({f"anchor.{n}": v for n, v in self.anchors.items()})
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.consolidated = int(tensors["consolidated"])
        fisher = {k[len("fisher.") :]: v for k, v in tensors.items() if k.startswith("fisher.")}
        anchors = {k[len("anchor.") :]: v for k, v in tensors.items() if k.startswith("anchor.")}
        self.fisher, self.anchors = (fisher, anchors) if fisher else (None, None)


@dataclass
class EWCOptions:
    """EWC / online EWC options.

    weight: lambda = 500, the value MiB's code (Cermelli et al., CVPR 2020) uses
        for EWC on segmentation. gamma: online EWC's decay, 1.0 as in the
        reference configurations of Mammoth and van de Ven et al.'s code.
    fisher_labels: "empirical" (ground truth) or "sampled" (model's predictions).
    fisher_samples: images per session for the Fisher (0 = all).
    freeze: "config" | "none" | "all_but_classifier".
    """

    weight: float = 500.0
    gamma: float = 1.0
    fisher_labels: str = "empirical"
    fisher_samples: int = 0
    freeze: str = "config"


def _ewc_options(config: RunConfig, name: str) -> EWCOptions:
    from jascl.engine.config import method_options

    opts = method_options(config, name, EWCOptions())
    check_range(name, "weight", opts.weight, 0.0)
    check_range(name, "gamma", opts.gamma, 0.0, 1.0)
    check_range(name, "fisher_samples", opts.fisher_samples, 0)
    if opts.fisher_labels not in ("empirical", "sampled"):
        raise ConfigError(
            f"method_args.{name}.fisher_labels: must be 'empirical' or 'sampled' (got {opts.fisher_labels!r})"
        )
    check_freeze(name, opts.freeze)
    return opts


@METHODS.register(
    "ewc",
    doc="baseline: elastic weight consolidation, one Fisher penalty per earlier session "
    "(Kirkpatrick et al., PNAS 2017)",
)
def ewc(config: RunConfig) -> Method:
    o = _ewc_options(config, "ewc")
    plugin = EWCPlugin(o.weight, o.fisher_labels, o.fisher_samples, check_freeze("ewc", o.freeze))
    return Method("ewc", [plugin], "EWC: quadratic penalty weighted by the diagonal Fisher of every earlier session")


@METHODS.register(
    "online-ewc", doc="baseline: online EWC, one running Fisher and the latest anchor (Schwarz et al., ICML 2018)"
)
def online_ewc(config: RunConfig) -> Method:
    o = _ewc_options(config, "online-ewc")
    plugin = OnlineEWCPlugin(o.weight, o.gamma, o.fisher_labels, o.fisher_samples, check_freeze("online-ewc", o.freeze))
    return Method("online-ewc", [plugin], "online EWC: decayed running Fisher, anchored at the previous session")


# ---------------------------------------------------------------------------- UCL


def ucl_std_init(weight_shape: torch.Size, ratio: float) -> float:
    """UCL's initial (prior) node standard deviation sigma_init = sqrt(ratio * 2 / fan).

    As in the official code (``bayes_layer.py``): fan = fan_in for a (out, in)
    linear weight, fan_out = out * receptive field for a convolution.
    """
    if len(weight_shape) == 2:
        fan = weight_shape[1]
    else:
        fan = weight_shape[0] * math.prod(weight_shape[2:])
    return math.sqrt(ratio * 2.0 / fan)


def ucl_layer_terms(
    mu: torch.Tensor,
    mu_old: torch.Tensor,
    sigma: torch.Tensor,
    sigma_old: torch.Tensor,
    std_init: float,
    node_dim: int = 0,
    bias: torch.Tensor | None = None,
    bias_old: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three UCL regularisers of one layer (Ahn et al., NeurIPS 2019; official ``custom_regularization``).

    Uncertainty is per output node n (sigma_n shared by all weights into n); its
    strength is s_n = sigma_init / sigma_old_n.

    * l2 = sum_n s_n^2 (||mu_n - mu_old_n||^2 + (b_n - b_old_n)^2)
    * l1 = sigma_init^2 * sum (mu_old^2 / sigma_old_n^2) * |mu - mu_old|  (+ the same for biases)
    * sigma = sum_n (sigma_n^2/sigma_old_n^2 - log(sigma_n^2/sigma_old_n^2)) + (sigma_n^2 - log sigma_n^2)

    Args:
        mu, mu_old: weight means (out, in, *k); ``mu`` may have extra leading rows
            (new classifier rows), which are left out of l2/l1.
        sigma, sigma_old: (n_nodes,) node standard deviations (``sigma_old`` may be shorter, as ``mu_old``).
        std_init: sigma_init of the layer.
        node_dim: dim of ``mu`` indexing output nodes (0; 1 for transposed convolutions).
        bias, bias_old: (n_nodes,) biases or None.

    Returns:
        (l2, l1, sigma) 0-dim tensors.
    """
    n_old = sigma_old.shape[0]
    shape = [1] * mu.dim()
    shape[node_dim] = n_old
    mu_kept = mu.narrow(node_dim, 0, n_old)
    s_old = sigma_old.view(shape)
    delta = mu_kept - mu_old
    l2 = ((std_init / s_old) ** 2 * delta**2).sum()
    l1 = std_init**2 * (mu_old**2 / s_old**2 * delta.abs()).sum()
    if bias is not None and bias_old is not None:
        db = bias[:n_old] - bias_old
        l2 = l2 + ((std_init / sigma_old) ** 2 * db**2).sum()
        l1 = l1 + std_init**2 * (bias_old**2 / sigma_old**2 * db.abs()).sum()
    prior = torch.cat([sigma_old, sigma_old.new_full((sigma.shape[0] - n_old,), std_init)])
    ratio = sigma**2 / prior**2
    sig = (ratio - torch.log(ratio)).sum() + (sigma**2 - torch.log(sigma**2)).sum()
    return l2, l1, sig


class NodeGaussian(nn.Module):
    """Parametrization mu -> mu + sigma_node * N(0, 1) in training mode, mu in eval mode (UCL's Bayesian layer).

    ``rho`` holds one value per output node; sigma = softplus(rho) = log(1 + e^rho)
    as in the official ``Gaussian``. One weight sample per forward pass.
    """

    def __init__(self, sigma: torch.Tensor, node_dim: int, ndim: int) -> None:
        super().__init__()
        self.node_dim = node_dim
        self.ndim = ndim
        self.rho = nn.Parameter(torch.log(torch.expm1(sigma.detach().clone().float())))

    def sigma(self) -> torch.Tensor:
        """(n_nodes,) standard deviations."""
        return F.softplus(self.rho)

    def forward(self, mu: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return mu
        shape = [1] * self.ndim
        shape[self.node_dim] = -1
        return mu + self.sigma().to(mu.dtype).view(shape) * torch.randn_like(mu)


def _node_dim(module: nn.Module) -> int:
    return 1 if isinstance(module, nn.modules.conv._ConvTransposeNd) else 0


def _mean_weight(module: nn.Module) -> torch.Tensor:
    """The stored weight (UCL's mu), without drawing a sample when the layer is Bayesian."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations["weight"].original
    return module.weight


class UCLPlugin(Plugin):
    """Uncertainty-regularised continual learning (UCL) on the segmenter.

    Every trainable layer with a weight of rank >= 2 (convolutions, linear
    layers, the classifier) becomes a Bayesian layer with node-wise Gaussian
    weights (mean mu, std sigma per output node, one sample per forward pass;
    the mean at evaluation). The loss adds, per mini-batch of B images,

        [alpha/2 * L2 + saved * L1 + beta/2 * L_sigma] / B       (:func:`ucl_layer_terms`)

    against the previous session's (mu_old, sigma_old), with alpha = ``alpha``
    in session 0 (a pull towards the initialisation, sigma_old = sigma_init) and
    1 afterwards, and saved = 0 in session 0 and 1 afterwards -- as the official
    code does. sigma is trained by the loop's SGD in its own parameter group
    (learning rate ``lr_rho``, no weight decay).

    UCL needs the uncertainties learned in session 0, so it trains its own
    base session (``changes_base_session``).

    Args:
        alpha, beta, ratio, lr_rho: UCL's hyper-parameters.
        freeze: incremental freezing policy (see the module docstring).
    """

    name = "ucl"
    loss_terms = ("ucl",)
    changes_base_session = True

    def __init__(
        self,
        alpha: float = 0.3,
        beta: float = 0.0002,
        ratio: float = 0.125,
        lr_rho: float = 0.01,
        freeze: str | None = None,
    ) -> None:
        self.alpha = alpha
        self.beta = beta
        self.ratio = ratio
        self.lr_rho = lr_rho
        self.freeze_incremental = freeze
        self.sigmas: dict[str, torch.Tensor] = {}  # module path -> (n_nodes,) sigma at the end of its last session
        self.anchors: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # path -> (mu_old, bias_old)
        self.layers: dict[str, tuple[nn.Module, NodeGaussian]] = {}
        self.saved = False
        #: the three weighted terms of the last iteration (for logging and tests)
        self.last_terms: dict[str, float] = {}

    # -- which layers are Bayesian

    @staticmethod
    def candidate_layers(model: nn.Module) -> dict[str, nn.Module]:
        """Modules with their own ``weight`` of rank >= 2 that are not always frozen."""
        skip = always_frozen(model)
        out = {}
        for path, module in model.named_modules():
            weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
            if isinstance(weight, nn.Parameter) and weight.dim() >= 2 and id(weight) not in skip:
                out[path] = module
        return out

    def _prior_sigma(self, path: str, module: nn.Module) -> torch.Tensor:
        """sigma_old of every current node: the saved one, sigma_init for nodes without one."""
        weight = _mean_weight(module)
        node_dim = _node_dim(module)
        n = weight.shape[node_dim]
        std = ucl_std_init(weight.shape, self.ratio)
        saved = self.sigmas.get(path)
        if saved is None:
            return torch.full((n,), std, device=weight.device)
        return pad_rows(saved.to(weight.device), torch.Size([n]), std)

    # -- events

    def before_session(self, state: LoopState) -> None:
        model = state.model
        if state.session.index == 0 or not self.anchors:
            # session 0 (or nothing consolidated yet): the prior is the initialisation, sigma_old = sigma_init
            self.anchors = {
                p: (m.weight.detach().clone(), None if getattr(m, "bias", None) is None else m.bias.detach().clone())
                for p, m in self.candidate_layers(model).items()
            }
        self.layers = {}
        for path, module in self.candidate_layers(model).items():
            if not module.weight.requires_grad:
                continue
            sigma0 = self._prior_sigma(path, module)
            noise = NodeGaussian(sigma0, _node_dim(module), module.weight.dim()).to(module.weight.device)
            parametrize.register_parametrization(module, "weight", noise)
            self.layers[path] = (module, noise)
        if not self.layers:
            raise ConfigError(
                "method ucl: no trainable layer with a weight to make Bayesian in session "
                f"{state.session.index}; set method_args.ucl.freeze=none or another freeze_incremental"
            )

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer:
        cfg = state.config
        rho_ids = {id(noise.rho) for _, noise in self.layers.values()}
        rho = [p for p in params if id(p) in rho_ids]
        rest = [p for p in params if id(p) not in rho_ids]
        groups = [{"params": rest}, {"params": rho, "lr": self.lr_rho, "weight_decay": 0.0}]
        return torch.optim.SGD(
            groups,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )

    def regulariser(self, batch_size: int, session: int) -> torch.Tensor:
        """The UCL terms of the Bayesian layers, scaled as in the official code."""
        l2 = l1 = sig = 0.0
        for path, (module, noise) in self.layers.items():
            mu = _mean_weight(module)
            mu_old, bias_old = self.anchors[path]
            sigma_old = self._prior_sigma(path, module)[: mu_old.shape[_node_dim(module)]]
            bias = getattr(module, "bias", None)
            a, b, c = ucl_layer_terms(
                mu,
                mu_old,
                noise.sigma(),
                sigma_old,
                ucl_std_init(mu.shape, self.ratio),
                _node_dim(module),
                bias if bias_old is not None else None,
                bias_old,
            )
            l2, l1, sig = l2 + a, l1 + b, sig + c
        alpha = self.alpha if session == 0 else 1.0
        saved = 1.0 if self.saved else 0.0
        terms = {
            "l2": alpha * l2 / 2 / batch_size,
            "l1": saved * l1 / batch_size,
            "sigma": self.beta * sig / 2 / batch_size,
        }
        self.last_terms = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in terms.items()}
        return terms["l2"] + terms["l1"] + terms["sigma"]

    def after_forward(self, state: LoopState) -> None:
        if self.layers:
            batch = state.batch["image"].shape[0]
            state.losses[self.name] = self.regulariser(batch, state.session.index)

    def after_session(self, state: LoopState) -> None:
        for path, (module, noise) in self.layers.items():
            self.sigmas[path] = noise.sigma().detach().clone()
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        self.layers = {}
        self._consolidate(state.model)

    def _consolidate(self, model: nn.Module) -> None:
        """The end-of-session model becomes (mu_old, sigma_old) of the next session."""
        self.anchors = {
            p: (m.weight.detach().clone(), None if getattr(m, "bias", None) is None else m.bias.detach().clone())
            for p, m in self.candidate_layers(model).items()
        }
        self.saved = True

    def session_restored(self, state: LoopState) -> None:
        if not self.sigmas:
            log.warning(
                "ucl: session %d was reused without saved uncertainties; sigma_old = sigma_init", state.session.index
            )
        self._consolidate(state.model)

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {f"sigma.{p}": s for p, s in self.sigmas.items()}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.sigmas = {k[len("sigma.") :]: v for k, v in tensors.items() if k.startswith("sigma.")}


@dataclass
class UCLOptions:
    """UCL options; defaults are the official code's split CIFAR-10/100 (conv-net) command
    (``--beta 0.0002 --ratio 0.125 --lr_rho 0.01 --alpha 0.3``).

    alpha: strength of the session-0 pull towards the initialisation.
    beta: weight of the sigma regulariser.
    ratio: share of the He variance 2/fan given to the initial node noise (sigma_init^2).
    lr_rho: learning rate of the uncertainty parameters.
    freeze: "config" | "none" | "all_but_classifier".
    """

    alpha: float = 0.3
    beta: float = 0.0002
    ratio: float = 0.125
    lr_rho: float = 0.01
    freeze: str = "config"


@METHODS.register(
    "ucl",
    doc="baseline: uncertainty-regularised CL with node-wise Bayesian weights, trains its own "
    "base session (Ahn et al., NeurIPS 2019)",
)
def ucl(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "ucl", UCLOptions())
    check_range("ucl", "alpha", o.alpha, 0.0)
    check_range("ucl", "beta", o.beta, 0.0)
    check_range("ucl", "ratio", o.ratio, 0.0, 1.0, low_open=True)
    check_range("ucl", "lr_rho", o.lr_rho, 0.0)
    plugin = UCLPlugin(o.alpha, o.beta, o.ratio, o.lr_rho, check_freeze("ucl", o.freeze))
    return Method("ucl", [plugin], "UCL: node-wise uncertainty-weighted penalties on Bayesian layers")


# ---------------------------------------------------------------------------- dropout + weight decay


def l2_penalty(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """sum ||theta||^2 (weight decay as a loss: d/dtheta (wd/2)||theta||^2 = wd * theta, SGD's weight_decay)."""
    return sum((p**2).sum() for p in params)


class DropoutWeightDecayPlugin(_SessionGate, Plugin):
    """Dropout on the features entering the classifier, and a stronger weight decay.

    The static regularisers Goodfellow et al. (2013) and Mirzadeh et al. (2020)
    found to reduce forgetting: (inverted) dropout with rate ``p`` on the
    (B, C, *spatial) features in training forwards (Srivastava et al., JMLR 2014),
    and an L2 penalty ``(weight_decay / 2) * ||theta||^2`` on the trainable
    parameters, logged as the loss term ``wd``; the plugin's SGD has no
    built-in weight decay, so the decay is exactly ``weight_decay``.

    Args:
        p: dropout rate.
        weight_decay: L2 coefficient (replaces the run's ``weight_decay``).
        in_base: also in session 0 (then the method trains its own base model).
        freeze: incremental freezing policy.
    """

    name = "dropout-wd"
    loss_terms = ("wd",)

    def __init__(
        self, p: float = 0.5, weight_decay: float = 5e-4, in_base: bool = False, freeze: str | None = None
    ) -> None:
        self.p = p
        self.weight_decay = weight_decay
        self.in_base = in_base
        self.changes_base_session = in_base
        self.freeze_incremental = freeze
        self._hook = None
        self._params: list[nn.Parameter] = []

    def _dropout(self, module: nn.Module, args: tuple) -> tuple:
        return (F.dropout(args[0], self.p, training=module.training), *args[1:])

    def before_session(self, state: LoopState) -> None:
        if self.active(state):
            self._hook = state.model.classifier.register_forward_pre_hook(self._dropout)

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if not self.active(state):
            return None
        self._params = list(params)
        cfg = state.config
        return torch.optim.SGD(
            params, lr=lr, momentum=cfg.momentum, weight_decay=0.0, nesterov=cfg.nesterov and cfg.momentum > 0
        )

    def after_forward(self, state: LoopState) -> None:
        if self.active(state) and self.weight_decay > 0 and self._params:
            state.losses["wd"] = 0.5 * self.weight_decay * l2_penalty(self._params)

    def after_session(self, state: LoopState) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._params = []


@dataclass
class DropoutWDOptions:
    """Dropout + weight-decay options.

    p: dropout rate, 0.5 (Srivastava et al. 2014's rate for hidden units, used by
        Goodfellow et al. 2013). weight_decay: 5e-4, a common CNN value and 5x the
        run's default 1e-4 (no source fixes it for this setting). in_base: also
        regularise session 0. freeze: "config" | "none" | "all_but_classifier".
    """

    p: float = 0.5
    weight_decay: float = 5e-4
    in_base: bool = False
    freeze: str = "config"


@METHODS.register(
    "dropout-wd",
    doc="baseline: dropout before the classifier + stronger weight decay (Srivastava "
    "et al., JMLR 2014; Goodfellow et al. 2013; Mirzadeh et al., NeurIPS 2020)",
)
def dropout_wd(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "dropout-wd", DropoutWDOptions())
    check_range("dropout-wd", "p", o.p, 0.0, 1.0)
    if o.p >= 1.0:
        raise ConfigError(f"method_args.dropout-wd.p: must be < 1 (got {o.p})")
    check_range("dropout-wd", "weight_decay", o.weight_decay, 0.0)
    plugin = DropoutWeightDecayPlugin(o.p, o.weight_decay, o.in_base, check_freeze("dropout-wd", o.freeze))
    return Method("dropout-wd", [plugin], "dropout on classifier inputs + L2 weight decay")


# ---------------------------------------------------------------------------- Adagrad


class AdagradPlugin(_SessionGate, Plugin):
    """Adagrad (Duchi et al., JMLR 2011) as the optimiser of the regularised sessions.

    theta <- theta - lr * g / (sqrt(sum_s g_s^2) + eps). With ``keep_state`` the
    per-parameter sum of squared gradients carries over from one session to the
    next (the "accumulated gradient statistics" the JASCL appendix contrasts with
    GAS); new classifier rows start at ``initial_accumulator_value``.

    Args:
        lr: learning rate (None = the run's lr_base / lr_incremental).
        eps, initial_accumulator_value: Adagrad's (PyTorch defaults).
        keep_state: carry the accumulator across sessions.
        in_base: also in session 0 (then the method trains its own base model).
        freeze: incremental freezing policy.
    """

    name = "adagrad"

    def __init__(
        self,
        lr: float | None = None,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        keep_state: bool = True,
        in_base: bool = False,
        freeze: str | None = None,
    ) -> None:
        self.lr = lr
        self.eps = eps
        self.initial = initial_accumulator_value
        self.keep_state = keep_state
        self.in_base = in_base
        self.changes_base_session = in_base
        self.freeze_incremental = freeze
        self.sums: dict[str, torch.Tensor] = {}
        self._optimizer: torch.optim.Adagrad | None = None

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if not self.active(state):
            self._optimizer = None
            return None
        opt = torch.optim.Adagrad(
            params,
            lr=self.lr if self.lr is not None else lr,
            eps=self.eps,
            weight_decay=state.config.weight_decay,
            initial_accumulator_value=self.initial,
        )
        if self.keep_state and self.sums:
            wanted = {id(p) for p in params}
            for name, p in state.model.named_parameters():
                if id(p) in wanted and name in self.sums:
                    opt.state[p]["sum"].copy_(pad_rows(self.sums[name].to(p), p.shape, self.initial))
        self._optimizer = opt
        return opt

    def after_session(self, state: LoopState) -> None:
        if self._optimizer is None or not self.keep_state:
            return
        for name, p in state.model.named_parameters():
            if p in self._optimizer.state and "sum" in self._optimizer.state[p]:
                self.sums[name] = self._optimizer.state[p]["sum"].detach().clone()
        self._optimizer = None

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {f"sum.{n}": v for n, v in self.sums.items()}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.sums = {k[len("sum.") :]: v for k, v in tensors.items() if k.startswith("sum.")}


@dataclass
class AdagradOptions:
    """Adagrad options.

    lr: null = the run's learning rate (lr_incremental; PyTorch's Adagrad default
        is also 0.01). eps, initial_accumulator_value: PyTorch defaults.
    keep_state: carry the squared-gradient sums across sessions.
    in_base: also optimise session 0 with Adagrad. freeze: "config" | "none" | "all_but_classifier".
    """

    lr: float | None = None
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    keep_state: bool = True
    in_base: bool = False
    freeze: str = "config"


@METHODS.register(
    "adagrad",
    doc="baseline: Adagrad optimiser with squared-gradient sums kept across sessions (Duchi et al., JMLR 2011)",
)
def adagrad(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "adagrad", AdagradOptions())
    if o.lr is not None:
        try:  # YAML 1.1 reads "1e-2" as a string
            o.lr = float(o.lr) if not isinstance(o.lr, bool) else None
        except (TypeError, ValueError):
            o.lr = None
        if o.lr is None:
            raise ConfigError(
                f"method_args.adagrad.lr: must be a number or null (got {config.method_args['adagrad']['lr']!r})"
            )
        check_range("adagrad", "lr", o.lr, 0.0, low_open=True)
    check_range("adagrad", "eps", o.eps, 0.0, low_open=True)
    check_range("adagrad", "initial_accumulator_value", o.initial_accumulator_value, 0.0)
    plugin = AdagradPlugin(
        None if o.lr is None else float(o.lr),
        o.eps,
        o.initial_accumulator_value,
        o.keep_state,
        o.in_base,
        check_freeze("adagrad", o.freeze),
    )
    return Method("adagrad", [plugin], "Adagrad optimiser in the incremental sessions")
