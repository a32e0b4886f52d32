"""MiB (F. Cermelli, M. Mancini, S. Rota Bulo, E. Ricci, B. Caputo, "Modeling the Background for Incremental
Learning in Semantic Segmentation", CVPR 2020; official code github.com/fcdl94/MiB): unbiased cross-entropy,
unbiased distillation and its classifier initialisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jascl.engine.defaults import default_supervised_loss
from jascl.engine.plugin import Method
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.distillation._shared import (
    TeacherPlugin,
    absorbed_rows,
    background_merged_loss,
    unbiased_kd_loss,
)


@dataclass
class MiBOptions:
    """Options of ``mib`` (defaults: MiB's official code, ``--method MiB``: loss_kd = 10, alpha = 1, init_balanced).

    Attributes:
        kd_weight: weight of the unbiased distillation.
        alpha: scale of the teacher logits in the distillation.
        init: "mib" (new rows copy the background row, biases shifted by
            -log(N_new + 1)) or "imprint" (keep the loop's prototype imprinting).
        dice: add the run's ``lambda_dice`` x soft Dice on background-merged
            probabilities to the unbiased CE (false: MiB's CE-only objective).
        freeze: incremental-session freezing ("none": MiB fine-tunes the network).
    """

    kd_weight: float = option(10.0, ge=0)
    alpha: float = 1.0
    init: str = option("mib", choices=("mib", "imprint"))
    dice: bool = True
    freeze: str = freeze_option("none")


class MiBPlugin(TeacherPlugin):
    """MiB (Cermelli et al., CVPR 2020): unbiased CE, unbiased KD and balanced initialisation.

    In incremental sessions it *replaces* the loop's segmentation loss
    ``state.losses["seg"]`` with :func:`background_merged_loss` (unbiased CE,
    plus Dice on merged probabilities unless ``dice`` is false) and adds
    ``mib_kd = kd_weight * unbiased_kd_loss``. At the start of each incremental
    session the new classifier rows are re-initialised MiB's way (overriding the
    loop's prototype imprinting) unless ``init=imprint``.

    Deviations: background absorbs only the old classes not taught again in the
    session (classes recurring in a new domain are labelled, so they are not
    hidden in the background); with the cosine classifier (no bias) MiB's
    initialisation cannot keep the old probabilities exactly (see
    :func:`mib_init_new_rows`); the Dice half of "seg" (see ``dice``).
    """

    name = "mib"
    loss_terms = ("mib_kd",)
    replaces = ("supervised-loss",)  # the unbiased cross-entropy

    def __init__(
        self,
        kd_weight: float = 10.0,
        alpha: float = 1.0,
        init: str = "mib",
        dice: bool = True,
        freeze: str | None = "none",
    ) -> None:
        super().__init__(freeze, init)
        self.kd_weight, self.alpha = kd_weight, alpha
        self.dice = dice
        self._absorbed: list[int] = [0]

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self._absorbed = absorbed_rows(state)

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            state.losses["seg"] = default_supervised_loss(state)
            return
        cfg = state.config
        logits = state.output.logits
        target = state.target
        state.losses["seg"] = background_merged_loss(
            logits, target, self._absorbed, cfg.lambda_ce, cfg.lambda_dice if self.dice else 0.0
        )
        old = self.teacher_outputs(state).logits[:, : self.num_old]
        state.losses["mib_kd"] = self.kd_weight * unbiased_kd_loss(logits, old, self.alpha)


@METHODS.register(
    "mib",
    options=MiBOptions,
    paper="Cermelli et al., CVPR 2020",
    doc="baseline: unbiased CE + unbiased distillation + balanced init",
    fidelity="faithful",
)
def mib(o: MiBOptions, config: RunConfig) -> Method:
    """MiB: background-aware cross-entropy and distillation, new rows initialised from the background's."""
    plugin = MiBPlugin(o.kd_weight, o.alpha, o.init, o.dice, freeze_policy(o.freeze))
    return Method("mib", [plugin], "MiB: background-aware CE and distillation")
