"""ILT (U. Michieli, P. Zanuttigh, "Incremental Learning Techniques for Semantic Segmentation", ICCV Workshops
2019): output and feature distillation."""

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
from jascl.methods.baselines.distillation._shared import FeatureTap, TeacherPlugin
from jascl.methods.baselines.distillation.lwf import kd_loss


def feature_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """ILT's L''_D: mean squared error between student and teacher features (any shape)."""
    return F.mse_loss(student, teacher)


@dataclass
class ILTOptions:
    """Options of ``ilt`` (defaults: MiB's official re-implementation of ILT, loss_kd = loss_de = 100).

    Attributes:
        kd_weight: weight of the output distillation L'_D (cross-entropy on old
            rows, averaged over old classes as in MiB's code).
        feature_weight: weight of the feature distillation L''_D (MSE).
        temperature: softmax temperature of L'_D (1: ILT uses plain softmaxes).
        feature_layer: layer whose output is distilled: "encoder" (the backbone's
            deepest encoder layer, ILT's encoder output), "decoder", "features"
            (the features before the classifier) or a module path.
        freeze: incremental-session freezing; "none" (ILT fine-tunes the network;
            feature distillation needs a trainable encoder).
    """

    kd_weight: float = option(100.0, ge=0)
    feature_weight: float = option(100.0, ge=0)
    temperature: float = option(1.0, gt=0)
    feature_layer: str = "encoder"
    freeze: str = freeze_option("none")


class ILTPlugin(TeacherPlugin):
    """ILT (Michieli & Zanuttigh, ICCVW 2019): output + feature distillation.

    ``ilt_kd``: cross-entropy between the teacher's and the student's softmax
    over the old rows; ``ilt_feat``: L2 (mean squared) distance between the
    student's and the teacher's ``feature_layer`` outputs.

    Deviations: ILT distils the encoder output of DeepLab; here the layer is the
    backbone's "encoder" alias (e.g. the U-Net bottleneck convolution) captured
    by a forward hook. ILT's variants that freeze the encoder are available
    through ``freeze=all_but_classifier`` (then ``ilt_feat`` is 0).
    """

    name = "ilt"
    loss_terms = ("ilt_kd", "ilt_feat")

    def __init__(
        self,
        kd_weight: float = 100.0,
        feature_weight: float = 100.0,
        temperature: float = 1.0,
        feature_layer: str = "encoder",
        freeze: str | None = "none",
    ) -> None:
        super().__init__(freeze)
        self.kd_weight, self.feature_weight = kd_weight, feature_weight
        self.temperature = temperature
        self.feature_layer = feature_layer
        self._taps: tuple[FeatureTap, FeatureTap] | None = None

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        if self.teacher is not None and self.feature_layer != "features":
            self._taps = (FeatureTap(state.model, [self.feature_layer]), FeatureTap(self.teacher, [self.feature_layer]))

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        out_t = self.teacher_outputs(state)
        state.losses["ilt_kd"] = self.kd_weight * kd_loss(
            state.output.logits, out_t.logits[:, : self.num_old], self.temperature, class_mean=True
        )
        if self._taps is None:
            student, teacher = state.output.features, out_t.features
        else:
            student, teacher = self._taps[0][self.feature_layer], self._taps[1][self.feature_layer]
        state.losses["ilt_feat"] = self.feature_weight * feature_distillation_loss(student, teacher)

    def after_training(self, state: LoopState) -> None:
        if self._taps is not None:
            for tap in self._taps:
                tap.remove()
            self._taps = None


@METHODS.register(
    "ilt",
    options=ILTOptions,
    paper="Michieli & Zanuttigh, ICCV Workshops 2019",
    doc="baseline: output + feature distillation",
    fidelity="faithful",
)
def ilt(o: ILTOptions, config: RunConfig) -> Method:
    """ILT: output distillation on the old rows and feature distillation on ``feature_layer``."""
    plugin = ILTPlugin(o.kd_weight, o.feature_weight, o.temperature, o.feature_layer, freeze_policy(o.freeze))
    return Method("ilt", [plugin], "ILT: output and encoder-feature distillation")
