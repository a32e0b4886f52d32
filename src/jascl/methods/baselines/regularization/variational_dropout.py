"""Variational dropout on one layer's weight (Kingma, Salimans & Welling, NeurIPS 2015; Molchanov, Ashukha &
Vetrov, ICML 2017), the JASCL paper's "Variational Dropout" regulariser (appendix "GAS vs. Dropout and Variational
Dropout"; its footnote cites the continual use of Hai et al., Machine Learning 2024, "Continual variational
dropout").

Gaussian (multiplicative) dropout with a learned rate per weight: the weight seen by a training forward is

    w_i = theta_i * (1 + sqrt(alpha_i) * eps_i),   eps_i ~ N(0, 1),   i.e.  w_i ~ N(theta_i, alpha_i theta_i^2)

which is the paper's static-regulariser variance sigma^2_{q,i} = alpha_i (theta_i)^2 (its Definition "Static
Regularization Methods", item 3). Evaluation uses theta itself. The ELBO adds the KL divergence of q(w) from the
log-uniform prior, approximated as in Molchanov et al. (eq. 14):

    -KL_i ~= k1 * sigmoid(k2 + k3 * log alpha_i) - 0.5 * log(1 + 1 / alpha_i) - k1,
    k1 = 0.63576, k2 = 1.87320, k3 = 1.48695.

Molchanov's additive reparameterisation: the learned tensor is log sigma^2 (per weight), the noise is theta +
sigma * eps, and log alpha = log sigma^2 - log theta^2 (clipped to [-8, 8] as in their code), so the gradient of
theta does not carry the multiplicative noise; noise, variance and KL are all computed from the clipped log alpha,
hence the variance of a drawn weight is exactly alpha * theta^2.

Deviations, for dense segmentation and the paper's comparison with GAS:
    * One layer only, the one GAS perturbs (``layer``, the classifier by default), so the two compare like for
      like; the originals put variational dropout on every layer.
    * No local reparameterisation trick: one weight sample per training forward, shared by every pixel of the
      batch, as GAS draws its noise. The trick needs the layer's output to be linear in the noisy weight, and the
      authors' cosine classifier normalises each weight row.
    * The KL term is divided by the session's labelled pixels (N images x P pixels), since the loop's
      segmentation loss is a per-pixel mean (Molchanov et al. divide by N images for classification).
    * Evaluation uses theta without Molchanov et al.'s sparsification (weights with log alpha > 3 set to 0):
      the paper uses variational dropout as a regulariser, not for pruning.
    * Hai et al.'s continual variational dropout puts the learned multiplicative noise on each layer's input
      (task-specific local variables on top of a VCL/EWC-style prior); the paper's formula (variance
      alpha_i theta_i^2 per parameter) is weight noise, which is what is implemented here, without a prior
      anchored at the previous session (the appendix compares it with GAS as a static regulariser).
    * "Learned but fixed": see :class:`VariationalDropoutPlugin`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from jascl.engine.optim import make_optimizer
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.common import SessionGate
from jascl.methods.options import option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

#: Molchanov et al. (2017), eq. 14
K1, K2, K3 = 0.63576, 1.87320, 1.48695
#: log alpha is clipped to this range (Molchanov et al.'s code); theta^2 gets this floor before the log
LOG_ALPHA_MIN, LOG_ALPHA_MAX, THETA2_EPS = -8.0, 8.0, 1e-8


def log_alpha(theta: torch.Tensor, log_sigma2: torch.Tensor) -> torch.Tensor:
    """Per-weight log alpha = clip(log sigma^2 - log(theta^2 + 1e-8), -8, 8) (same shape as ``theta``)."""
    return torch.clamp(log_sigma2 - torch.log(theta.pow(2) + THETA2_EPS), LOG_ALPHA_MIN, LOG_ALPHA_MAX)


def vd_kl(log_alpha: torch.Tensor) -> torch.Tensor:
    """KL(q(w | theta, alpha) || log-uniform prior), Molchanov et al.'s approximation (eq. 14), summed over weights.

    Per weight ``k1 - k1 * sigmoid(k2 + k3 * log alpha) + 0.5 * log1p(1 / alpha)``: positive, decreasing in
    alpha, 0 as alpha -> inf (the weight is dropped), ~ -0.5 log alpha + const for small alpha.
    """
    neg_kl = K1 * torch.sigmoid(K2 + K3 * log_alpha) - 0.5 * F.softplus(-log_alpha) - K1
    return -neg_kl.sum()


class VariationalDropoutNoise(nn.Module):
    """Parametrization theta -> theta + sqrt(alpha) * |theta| * N(0, 1) in training mode, theta in eval mode.

    Holds the learned ``log_sigma2`` (the shape of the weight). Rows below ``frozen_rows`` get no
    gradient: their log sigma^2 is the one learned in an earlier session ("learned but fixed").
    """

    def __init__(self, log_sigma2: torch.Tensor, frozen_rows: int = 0) -> None:
        super().__init__()
        self.log_sigma2 = nn.Parameter(log_sigma2.detach().clone().float())
        self.frozen_rows = frozen_rows
        if frozen_rows:
            self.log_sigma2.register_hook(self._mask_frozen)

    def _mask_frozen(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[: self.frozen_rows] = 0
        return grad

    def log_alpha(self, theta: torch.Tensor) -> torch.Tensor:
        return log_alpha(theta, self.log_sigma2)

    def forward(self, theta: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return theta
        std = torch.exp(0.5 * self.log_alpha(theta)).to(theta.dtype) * theta.abs()
        return theta + std * torch.randn_like(theta)


def attach_variational_dropout(
    layer: nn.Module, log_sigma2: torch.Tensor, frozen_rows: int = 0
) -> VariationalDropoutNoise:
    """Put variational dropout on ``layer.weight`` with the given per-weight log sigma^2; returns the parametrization."""
    if parametrize.is_parametrized(layer, "weight"):
        raise ConfigError("variational-dropout: the layer's weight is already parametrized (GAS, UCL, ...)")
    noise = VariationalDropoutNoise(log_sigma2, frozen_rows).to(layer.weight.device)
    parametrize.register_parametrization(layer, "weight", noise)
    return noise


def initial_log_sigma2(
    theta: torch.Tensor, carried: torch.Tensor | None, log_alpha_init: float
) -> tuple[torch.Tensor, int]:
    """The session's starting log sigma^2 and the number of its rows carried from the previous session.

    Rows with no carried value start at log alpha = ``log_alpha_init`` for the current theta
    (log sigma^2 = log_alpha_init + log(theta^2 + 1e-8)). ``carried`` (K_old, ...) fills the first rows when it
    matches the weight's shape except for a growing dim 0; otherwise nothing is carried.
    """
    out = log_alpha_init + torch.log(theta.detach().float().pow(2) + THETA2_EPS)
    if carried is None or carried.shape[1:] != theta.shape[1:] or carried.shape[0] > theta.shape[0]:
        return out, 0
    out[: carried.shape[0]] = carried.to(out)
    return out, carried.shape[0]


class VariationalDropoutPlugin(SessionGate, Plugin):
    """Variational dropout on ``layer`` (the layer GAS perturbs; the classifier by default).

    The loss adds ``kl`` = ``kl_weight * KL / (N * P)``: the ELBO of Kingma et al. divided by the number of
    labelled pixels of the session (N training images of P pixels), because the loop's segmentation loss is a mean
    over pixels while the ELBO's likelihood is a sum over them.

    "Learned but fixed" (the paper's item): the variance is alpha_i theta_i^2 for alpha_i that is learned, then
    no longer follows the data. Here log sigma^2 is learned with the weights, with the KL term, in the first session
    the method acts (session 1: the paper's session-0 score, 0.700, is the shared base's); at the session's end it
    is kept, and in later sessions those rows are fixed (sigma^2_i = alpha_i theta_i^(t)^2 with alpha_i and
    theta^(t) of the session that learned them), only rows new to the layer (new classes' classifier rows) learn
    theirs. ``freeze_alpha=False`` learns every row again in every session (plain variational dropout per session).

    Args:
        layer: "classifier", "encoder", "decoder" or a module path.
        log_alpha_init: log alpha of a weight that starts learning (0: alpha = 1, Gaussian dropout of rate 0.5).
        kl_weight: multiplies the per-pixel KL term.
        freeze_alpha: keep the log sigma^2 learned in earlier sessions fixed.
        in_base: also act in session 0 (then the method trains its own base).
    """

    name = "variational-dropout"
    loss_terms = ("kl",)
    snapshot_exclude = ("_noise", "_layer")  # inside the model, restored with it

    def __init__(
        self,
        layer: str = "classifier",
        log_alpha_init: float = 0.0,
        kl_weight: float = 1.0,
        freeze_alpha: bool = True,
        in_base: bool = False,
    ) -> None:
        self.layer_name = layer
        self.log_alpha_init = log_alpha_init
        self.kl_weight = kl_weight
        self.freeze_alpha = freeze_alpha
        self.in_base = in_base
        self.changes_base_session = in_base
        self.base_loss_terms = ("kl",) if in_base else ()
        self.carried: torch.Tensor | None = None  # log sigma^2 at the end of the last session it acted in
        self._layer: nn.Module | None = None
        self._noise: VariationalDropoutNoise | None = None

    def before_session(self, state: LoopState) -> None:
        if not self.active(state):
            return
        layer = state.model.resolve_layer(self.layer_name)
        if not layer.weight.requires_grad:
            raise ConfigError(
                f"method_args.variational-dropout.layer={self.layer_name!r} is frozen in session "
                f"{state.session.index}; choose a trainable layer or set freeze_incremental=none"
            )
        start, carried_rows = initial_log_sigma2(layer.weight, self.carried, self.log_alpha_init)
        self._noise = attach_variational_dropout(layer, start, carried_rows if self.freeze_alpha else 0)
        if self.freeze_alpha and carried_rows == start.shape[0]:
            self._noise.log_sigma2.requires_grad_(False)  # nothing new to learn: no parameter for the optimiser
        self._layer = layer

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if self._noise is None:
            return None
        mine = {id(self._noise.log_sigma2)}
        rest = [p for p in params if id(p) not in mine]
        own = [p for p in params if id(p) in mine]
        # no weight decay on log sigma^2 (it would pull sigma^2 towards 1)
        groups = [{"params": rest}] + ([{"params": own, "weight_decay": 0.0}] if own else [])
        return make_optimizer(state.config, groups, lr)

    def kl_term(self, state: LoopState) -> torch.Tensor:
        """``kl_weight * KL / (N * P)`` of the layer's current log alpha."""
        assert self._noise is not None and self._layer is not None
        theta = self._layer.parametrizations["weight"].original
        pixels = math.prod(state.batch["label"].shape[1:])
        n = max(len(state.data.train), 1)
        return self.kl_weight * vd_kl(self._noise.log_alpha(theta)) / (n * pixels)

    def after_forward(self, state: LoopState) -> None:
        if self._noise is not None:
            state.losses["kl"] = self.kl_term(state)

    def after_session(self, state: LoopState) -> None:
        if self._noise is None or self._layer is None:
            return
        self.carried = self._noise.log_sigma2.detach().cpu().clone()
        parametrize.remove_parametrizations(self._layer, "weight", leave_parametrized=False)
        self._noise = None
        self._layer = None

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {"log_sigma2": self.carried} if self.carried is not None else {}

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.carried = tensors.get("log_sigma2")


@dataclass
class VariationalDropoutOptions:
    """Variational dropout options.

    Attributes:
        layer: the perturbed layer, as GAS's ``layer`` ("classifier", "encoder", "decoder" or a module path).
        log_alpha_init: starting log alpha of a learning weight; 0 = alpha 1, the Gaussian-dropout equivalent of
            rate p = 0.5 (alpha = p / (1 - p), Kingma et al. 2015), the rate of the dropout-wd baseline.
        kl_weight: weight of the per-pixel KL term (1 = the ELBO).
        freeze_alpha: rows learned in an earlier session keep their log sigma^2 ("learned but fixed").
        in_base: also act in session 0 (the paper's table starts from the shared base).
    """

    layer: str = "classifier"
    log_alpha_init: float = option(0.0, ge=LOG_ALPHA_MIN, le=LOG_ALPHA_MAX)
    kl_weight: float = option(1.0, ge=0)
    freeze_alpha: bool = True
    in_base: bool = False


@METHODS.register(
    "variational-dropout",
    options=VariationalDropoutOptions,
    paper="Kingma et al., NeurIPS 2015; Molchanov et al., ICML 2017",
    doc="baseline: per-weight learned Gaussian dropout (variational dropout) on the GAS layer",
    fidelity="faithful",
)
def variational_dropout(o: VariationalDropoutOptions, config: RunConfig) -> Method:
    """Variational dropout with per-weight learned alpha on one layer (see the module docstring)."""
    plugin = VariationalDropoutPlugin(o.layer, o.log_alpha_init, o.kl_weight, o.freeze_alpha, o.in_base)
    return Method("variational-dropout", [plugin], "variational dropout: learned per-weight Gaussian dropout")
