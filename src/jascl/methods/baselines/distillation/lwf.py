"""LwF: Learning without Forgetting (Z. Li, D. Hoiem, TPAMI 2017), output distillation on the old classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.distillation._shared import TeacherPlugin


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, class_mean: bool = False
) -> torch.Tensor:
    """Output distillation on the old rows (LwF's L_old; ILT's L'_D).

    Per pixel ``-sum_c q_c log p_c`` with ``q = softmax(teacher / T)`` and
    ``p = softmax(student[:, :K_old] / T)`` -- the student's softmax is taken over
    the old rows only, as LwF does with its old-task head (Li & Hoiem 2017,
    eq. 2, with T = 2 in the paper). Averaged over pixels.

    Args:
        student_logits: (B, K, *spatial), K >= K_old; only the first K_old rows are used.
        teacher_logits: (B, K_old, *spatial) of the previous model.
        temperature: T, applied to both models.
        class_mean: divide by K_old (MiB's re-implementation of LwF/ILT averages
            over classes instead of summing).

    Returns:
        Scalar loss; it equals the teacher's entropy (not 0) when student == teacher.
    """
    k_old = teacher_logits.shape[1]
    log_p = F.log_softmax(student_logits[:, :k_old] / temperature, dim=1)
    q = F.softmax(teacher_logits / temperature, dim=1)
    per_pixel = -(q * log_p).sum(dim=1)
    if class_mean:
        per_pixel = per_pixel / k_old
    return per_pixel.mean()


@dataclass
class LwFOptions:
    """Options of ``lwf`` (defaults: Li & Hoiem 2017, lambda_o = 1, T = 2).

    Attributes:
        weight: lambda_o, weight of the distillation term.
        temperature: T of both softmaxes.
        freeze: incremental-session freezing ("none": LwF fine-tunes the whole
            network; "config": the run's ``freeze_incremental``; "all_but_classifier").
    """

    weight: float = option(1.0, ge=0)
    temperature: float = option(2.0, gt=0)
    freeze: str = freeze_option("none")


class LwFPlugin(TeacherPlugin):
    """Learning without Forgetting (Li & Hoiem, TPAMI 2017) for segmentation.

    Adds ``weight * kd_loss(student old rows, teacher, T)`` per pixel in
    incremental sessions; the segmentation loss stays the loop's DiceCE.

    Deviations: the old-task "head" is the old rows of the shared pixel
    classifier; LwF's warm-up step (training only the new head first) is left
    out -- new rows are already imprinted from the new classes' prototypes by the
    loop; LwF's recorded responses of the old model are computed on the fly on
    each batch (same values, no augmentation mismatch).
    """

    name = "lwf"
    loss_terms = ("lwf_kd",)

    def __init__(self, weight: float = 1.0, temperature: float = 2.0, freeze: str | None = "none") -> None:
        super().__init__(freeze)
        self.weight = weight
        self.temperature = temperature

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        old = self.teacher_outputs(state).logits[:, : self.num_old]
        state.losses["lwf_kd"] = self.weight * kd_loss(state.output.logits, old, self.temperature)


@METHODS.register(
    "lwf",
    options=LwFOptions,
    paper="Li & Hoiem, TPAMI 2017",
    doc="baseline: output distillation on old classes",
    fidelity="faithful",
)
def lwf(o: LwFOptions, config: RunConfig) -> Method:
    """LwF: the old rows distilled from the previous session's model; the segmentation loss is the loop's."""
    plugin = LwFPlugin(o.weight, o.temperature, freeze_policy(o.freeze))
    return Method("lwf", [plugin], "Learning without Forgetting: distillation of the old rows")
