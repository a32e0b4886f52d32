"""UCL: uncertainty-regularised continual learning with node-wise Bayesian weights (Ahn et al., NeurIPS 2019)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.regularization._shared import always_frozen, log, pad_rows


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

    Attributes:
        alpha: strength of the session-0 pull towards the initialisation.
        beta: weight of the sigma regulariser.
        ratio: share of the He variance 2/fan given to the initial node noise (sigma_init^2).
        lr_rho: learning rate of the uncertainty parameters.
    """

    alpha: float = option(0.3, ge=0)
    beta: float = option(0.0002, ge=0)
    ratio: float = option(0.125, gt=0, le=1)
    lr_rho: float = option(0.01, ge=0)
    freeze: str = freeze_option()


@METHODS.register(
    "ucl",
    options=UCLOptions,
    paper="Ahn et al., NeurIPS 2019",
    doc="baseline: uncertainty-regularised CL with node-wise Bayesian weights, trains its own base session",
    fidelity="faithful",
)
def ucl(o: UCLOptions, config: RunConfig) -> Method:
    """UCL: node-wise uncertainty-weighted penalties on Bayesian layers (see the plugin for the deviations)."""
    plugin = UCLPlugin(o.alpha, o.beta, o.ratio, o.lr_rho, freeze_policy(o.freeze))
    return Method("ucl", [plugin], "UCL: node-wise uncertainty-weighted penalties on Bayesian layers")
