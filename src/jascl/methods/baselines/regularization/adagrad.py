"""Adagrad (Duchi et al., JMLR 2011) as a continual baseline: the squared-gradient sums are kept across sessions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jascl.engine.plugin import Method, Plugin
from jascl.methods.common import SessionGate
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.regularization._shared import pad_rows


class AdagradPlugin(SessionGate, Plugin):
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

    Attributes:
        lr: learning rate; null = the run's (lr_incremental; PyTorch's Adagrad default is also 0.01).
        eps: PyTorch's default.
        initial_accumulator_value: PyTorch's default.
        keep_state: carry the squared-gradient sums across sessions.
        in_base: also optimise session 0 with Adagrad.
    """

    lr: float | None = option(None, gt=0)
    eps: float = option(1e-10, gt=0)
    initial_accumulator_value: float = option(0.0, ge=0)
    keep_state: bool = True
    in_base: bool = False
    freeze: str = freeze_option()


@METHODS.register(
    "adagrad",
    options=AdagradOptions,
    paper="Duchi et al., JMLR 2011",
    doc="baseline: Adagrad optimiser with squared-gradient sums kept across sessions",
    fidelity="faithful",
)
def adagrad(o: AdagradOptions, config: RunConfig) -> Method:
    """Adagrad as the optimiser of the incremental sessions, its sums carried over (``keep_state``)."""
    plugin = AdagradPlugin(o.lr, o.eps, o.initial_accumulator_value, o.keep_state, o.in_base, freeze_policy(o.freeze))
    return Method("adagrad", [plugin], "Adagrad optimiser in the incremental sessions")
