"""EWC, online EWC, LwF and MiB on the detection task (:mod:`jascl.engine.tasks.detection`): the segmentation
baselines' pure functions (:mod:`jascl.methods.baselines.regularization.ewc`,
:mod:`jascl.methods.baselines.distillation`) on a detector, under the same names and ``method_args`` blocks.

What carries over, and how. The segmentation baselines act on a classifier applied at every *position* (a pixel)
and on an old model scoring the same positions. On a Faster R-CNN the positions of the classification loss are the
*RoIs* sampled for the box head (:attr:`jascl.networks.detector.DetectorOutput.class_logits`, (R, K), one row per
RoI, and ``roi_targets``, the row torchvision assigns to each RoI: its ground-truth box's class when IoU >= 0.5,
else 0 = background). So:

* **the old model scores the student's RoIs**: at the start of an incremental session the previous session's
  detector is frozen (:func:`jascl.methods.common.frozen_copy`); at each step it computes its own box-head features
  of the RoIs the student's loss sampled (``DetectorOutput.roi_boxes``, through :meth:`Detector.box_features` on the
  same images) and its classifier's logits over the old rows (:func:`teacher_roi_logits`). Teacher and student
  thus see exactly the same regions; the old model's own RPN is not used (its proposals would be other regions,
  with no student logits to compare).
* **distillation** (LwF, MiB) is the segmentation loss on (R, K) logits (a batch of R positions with no spatial
  dimensions), averaged over RoIs as it is over pixels.
* **the RPN and the box regression** keep torchvision's losses; only the RoI classification term is what
  MiB changes, and LwF / EWC add a term.

Methods that need dense structure (PLOP's pooled feature maps, pixel pseudo-labels, mask copy-paste) are not here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from jascl.data.sampling import derive_seed
from jascl.engine.plugin import Method
from jascl.engine.tasks.detection import detection_split, taught_targets
from jascl.errors import ConfigError
from jascl.methods.baselines.distillation._shared import (
    TeacherPlugin,
    absorbed_rows,
    unbiased_cross_entropy,
    unbiased_kd_loss,
)
from jascl.methods.baselines.distillation.lwf import LwFOptions, kd_loss
from jascl.methods.baselines.distillation.mib import MiBOptions
from jascl.methods.baselines.regularization.ewc import EWCOptions, EWCPlugin, OnlineEWCPlugin
from jascl.methods.options import freeze_policy
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from torch import nn

    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.detector import Detector, DetectorOutput

TASK = "detection"

#: the RoI classification term of torchvision's losses (the one MiB replaces)
ROI_CLASSIFICATION = "loss_classifier"


# ---------------------------------------------------------------------------------------------- pure functions


@torch.no_grad()
def teacher_roi_logits(
    teacher: Detector, images: Sequence[torch.Tensor], roi_boxes: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The old model's class logits on given RoIs: its box-head features of ``roi_boxes`` then its classifier.

    Args:
        teacher: the frozen previous-session detector (in the mode it should score in: eval).
        images: B tensors (C, H, W), the student's images.
        roi_boxes: B tensors (M_i, 4) xyxy in input-image pixels (``DetectorOutput.roi_boxes``).

    Returns:
        (sum M_i, K_old) logits, rows in the order of the boxes (image 0's first), as ``class_logits``' rows.
    """
    features = teacher.box_features(list(images), list(roi_boxes))
    return teacher.classifier(torch.cat(features))


def supervised_without_roi_classification(losses: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Sum of torchvision's Faster R-CNN losses except the RoI classification (RPN objectness, RPN and RoI box
    regression): what MiB keeps of the detector's supervised loss."""
    terms = [v for k, v in losses.items() if k != ROI_CLASSIFICATION]
    if not terms:
        raise ValueError(f"no detection loss besides {ROI_CLASSIFICATION!r} in {sorted(losses)}")
    return torch.stack([t.float() for t in terms]).sum()


def fisher_from_losses(losses: Iterable[torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empirical diagonal Fisher: the mean over samples of the squared gradient of each sample's loss.

    The loss is minus the log-likelihood, so its gradient squared is the log-likelihood's (Kirkpatrick et al. 2017,
    as :func:`jascl.methods.baselines.regularization.ewc.fisher_diagonal` for a segmenter).

    Args:
        losses: one scalar per sample (computed lazily: each is differentiated, then dropped).
        params: name -> parameter (``requires_grad`` True).

    Returns:
        name -> tensor shaped like the parameter (float32; zeros without samples).
    """
    names = list(params)
    tensors = [params[n] for n in names]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    count = 0
    for loss in losses:
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        for acc, g in zip(total, grads):
            if g is not None:
                acc += g.detach().float() ** 2
        count += 1
    return {n: t / max(count, 1) for n, t in zip(names, total)}


def trainable_detector_parameters(model: Detector, policy: str) -> dict[str, nn.Parameter]:
    """The parameters a detector trains in incremental sessions under a freezing policy (as
    :meth:`jascl.engine.tasks.detection.DetectionTask.frozen_modules`): ``all_but_classifier`` -> the box predictor's
    (classifier and box regressor); ``encoder`` -> all but the backbone's; ``none`` -> all."""
    frozen: list[nn.Module] = list(model.frozen_modules(1))
    if policy == "all_but_classifier":
        frozen += list(model.encoder_modules()) + list(model.head_modules())
    elif policy == "encoder":
        frozen += list(model.encoder_modules())
    skip = {id(p) for m in frozen for p in m.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) not in skip}


# ---------------------------------------------------------------------------------------------- the old model


class DetectionTeacherPlugin(TeacherPlugin):
    """The frozen previous-session detector (:class:`TeacherPlugin`) and its logits on the student's RoIs.

    MiB's initialisation (``init="mib"``) grows the detector through :meth:`Detector.grow` (classifier rows copying
    the background row, and the matching box-regression rows), then :func:`mib_init_new_rows` as for segmentation.
    """

    def setup_model(self, state: LoopState) -> None:
        if self.init != "mib":
            return
        model: Any = state.model
        new = len(state.seen) - model.num_classes
        if new > 0:  # rows copying the background row for now; mib_init_new_rows sets them after the teacher copy
            model.grow(new, model.classifier.weight.detach()[:1].expand(new, -1))

    def teacher_logits(self, state: LoopState) -> torch.Tensor:
        """(R, K_old): the teacher's logits on the RoIs of ``state.output`` (rows aligned with its class logits)."""
        out: DetectorOutput = state.output  # type: ignore[assignment]
        assert self.teacher is not None and state.batch is not None
        if len(out.roi_boxes) == 0 and out.class_logits.shape[0] > 0:
            raise RuntimeError(
                f"{self.name}: the detector's training output carries no roi_boxes (DetectorOutput.roi_boxes), "
                "so the old model cannot score the same RoIs; the training forward (e.g. the DDP wrapper of "
                "jascl.engine.tasks.detection) must pass them on"
            )
        images = [image.to(state.device, non_blocking=True) for image in state.batch["image"]]
        logits = teacher_roi_logits(self.teacher, images, out.roi_boxes)  # type: ignore[arg-type]
        return logits[:, : self.num_old]


class DetectionLwFPlugin(DetectionTeacherPlugin):
    """LwF on the detector's RoIs: ``weight * kd_loss(student old rows, teacher, T)`` per RoI (module docstring)."""

    name = "lwf"
    loss_terms = ("lwf_kd",)

    def __init__(self, weight: float = 1.0, temperature: float = 2.0, freeze: str | None = "none") -> None:
        super().__init__(freeze)
        self.weight = weight
        self.temperature = temperature

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        out: DetectorOutput = state.output  # type: ignore[assignment]
        state.losses["lwf_kd"] = self.weight * kd_loss(out.class_logits, self.teacher_logits(state), self.temperature)


class DetectionMiBPlugin(DetectionTeacherPlugin):
    """MiB on the detector's RoIs: the detector's loss with its RoI classification term replaced by the unbiased
    cross-entropy, plus ``kd_weight *`` the unbiased distillation on the same RoIs (module docstring)."""

    name = "mib"
    loss_terms = ("mib_kd",)
    replaces = ("supervised-loss",)  # the RoI classification term becomes the unbiased cross-entropy

    def __init__(
        self, kd_weight: float = 10.0, alpha: float = 1.0, init: str = "mib", freeze: str | None = "none"
    ) -> None:
        super().__init__(freeze, init)
        self.kd_weight, self.alpha = kd_weight, alpha
        self._absorbed: list[int] = [0]

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self._absorbed = absorbed_rows(state)

    def after_forward(self, state: LoopState) -> None:
        out: DetectorOutput = state.output  # type: ignore[assignment]
        if self.teacher is None:  # session 0: the task's supervised loss (sum of torchvision's four)
            state.losses["det"] = sum(out.losses.values(), torch.zeros((), device=state.device))
            return
        logits = out.class_logits
        state.losses["det"] = supervised_without_roi_classification(out.losses) + unbiased_cross_entropy(
            logits, out.roi_targets, self._absorbed
        )
        state.losses["mib_kd"] = self.kd_weight * unbiased_kd_loss(logits, self.teacher_logits(state), self.alpha)


# ---------------------------------------------------------------------------------------------- EWC


class _DetectionFisherSessions:
    """``session_fisher`` for a detector: the empirical Fisher of the detector's loss on the session's labelled
    images (overrides :class:`jascl.methods.baselines.regularization.ewc._FisherSessions`'s)."""

    fisher_samples = 0

    def session_fisher(self, state: LoopState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(Fisher, anchors) at the current parameters: per labelled image (the first ``fisher_samples``, 0 = all),
        the squared gradient of the sum of torchvision's four losses on that image alone, averaged (eval mode, so
        only the samplers' draws are random; they come from a stream seeded by (seed, session), leaving the
        loop's own random state untouched)."""
        model: Any = state.model
        targets = trainable_detector_parameters(model, state.freeze_incremental)
        split = detection_split(state.data.train, "the session's labelled split")
        limit = len(split) if self.fisher_samples <= 0 else min(self.fisher_samples, len(split))
        taught = list(state.session.classes)

        def losses():
            for i in range(limit):
                image = torch.as_tensor(np.asarray(split.images[i], dtype=np.float32)).to(state.device)
                target = taught_targets(split.targets[i], taught)
                rows = {"boxes": target["boxes"].to(state.device), "labels": state.class_index(target["labels"])}
                rows["labels"] = rows["labels"].to(state.device)
                with state.autocast():
                    out = model.forward_train([image], [rows])
                yield sum(v.float() for v in out.losses.values())

        flags = {n: p.requires_grad for n, p in targets.items()}
        devices = [state.device.index or 0] if state.device.type == "cuda" else []
        try:
            for p in targets.values():
                p.requires_grad_(True)
            with torch.random.fork_rng(devices=devices), eval_mode(model), torch.enable_grad():
                torch.manual_seed(derive_seed(state.seed, "fisher", state.session.index))
                fisher = fisher_from_losses(losses(), targets)
        finally:
            for n, p in targets.items():
                p.requires_grad_(flags[n])
        anchors = {n: p.detach().clone() for n, p in targets.items()}
        return fisher, anchors


class DetectionEWCPlugin(_DetectionFisherSessions, EWCPlugin):
    """EWC on a detector: :class:`EWCPlugin`'s penalty, one per earlier session, with the detector's Fisher."""


class DetectionOnlineEWCPlugin(_DetectionFisherSessions, OnlineEWCPlugin):
    """Online EWC on a detector: :class:`OnlineEWCPlugin` with the detector's Fisher."""


# ---------------------------------------------------------------------------------------------- registration


def _ewc_checked(o: EWCOptions, key: str) -> None:
    if o.fisher_labels != "empirical":
        raise ConfigError(
            f"method_args.{key}.fisher_labels={o.fisher_labels!r}: on the detection task the Fisher is taken at the "
            "ground-truth boxes only (a box-level draw from the model's own detections is not implemented); "
            "use 'empirical'"
        )


@METHODS.register("ewc", options=EWCOptions, paper="Kirkpatrick et al., PNAS 2017", task=TASK, fidelity="faithful")
def ewc(o: EWCOptions, config: RunConfig) -> Method:
    """EWC on the detector (Kirkpatrick et al., PNAS 2017): one quadratic penalty per earlier session,
    ``(lambda / 2) sum_i F_i (theta_i - theta*_i)^2`` over the parameters trained in incremental sessions, with F
    the empirical diagonal Fisher of the detector's loss (the sum of torchvision's four Faster R-CNN losses) over
    the session's labelled images, one image per sample. Detection adaptation: the per-sample log-likelihood is
    minus that loss (the segmentation EWC's minus mean pixel cross-entropy); its RPN / RoI sampling draws come
    from a (seed, session) stream. ``fisher_labels: sampled`` is refused (ConfigError); ``gamma`` is online EWC's.
    """
    _ewc_checked(o, "ewc")
    plugin = DetectionEWCPlugin(o.weight, o.fisher_labels, o.fisher_samples, freeze_policy(o.freeze))
    return Method("ewc", [plugin], "EWC: Fisher penalty of every earlier session, Fisher of the detector's loss")


@METHODS.register("online-ewc", options=EWCOptions, paper="Schwarz et al., ICML 2018", task=TASK, fidelity="faithful")
def online_ewc(o: EWCOptions, config: RunConfig) -> Method:
    """Online EWC on the detector (Schwarz et al., ICML 2018): one running Fisher ``F~ <- gamma F~ + F_t``
    anchored at the previous session, F_t the detector's Fisher as for ``ewc``."""
    _ewc_checked(o, "online-ewc")
    plugin = DetectionOnlineEWCPlugin(o.weight, o.gamma, o.fisher_labels, o.fisher_samples, freeze_policy(o.freeze))
    return Method("online-ewc", [plugin], "online EWC: decayed running Fisher of the detector's loss")


@METHODS.register(
    "lwf",
    options=LwFOptions,
    paper="Li & Hoiem, TPAMI 2017",
    task=TASK,
    fidelity=(
        "simplified: distillation of the RoI classifier's old rows on the student's RoIs (Shmelkov et al.'s Fast R-CNN"
        " form)"
    ),
)
def lwf(o: LwFOptions, config: RunConfig) -> Method:
    """LwF on the detector (Li & Hoiem, TPAMI 2017): the previous session's detector scores the RoIs the student's
    loss sampled (its box features of the same boxes, its classifier); the student's logits of those RoIs over the
    old rows are distilled towards them, ``weight * -sum_c q_c log p_c`` with both softmaxes at temperature T over
    the old rows, averaged over RoIs (LwF's L_old with an RoI as the sample). Distilling the old detector's RoI class
    scores on the same proposals is how Shmelkov et al. (ICCV 2017, "Incremental learning of object detectors
    without catastrophic forgetting") carried output distillation to Fast R-CNN; they distil bias-centred logits
    with an L2 loss, here it is LwF's own temperature cross-entropy. The detector's losses stay torchvision's.
    Deviations as the segmentation LwF (no warm-up of the new rows, teacher responses computed on the fly).
    """
    plugin = DetectionLwFPlugin(o.weight, o.temperature, freeze_policy(o.freeze))
    return Method("lwf", [plugin], "LwF: the old detector's class scores on the same RoIs distilled")


@METHODS.register(
    "mib",
    options=MiBOptions,
    paper="Cermelli et al., CVPR 2020",
    task=TASK,
    fidelity=(
        "simplified: MiB's unbiased CE and distillation on the RoI classifier only (as MMA, without RPN and box "
        "distillation)"
    ),
)
def mib(o: MiBOptions, config: RunConfig) -> Method:
    """MiB on the detector (Cermelli et al., CVPR 2020), on the RoIs of the box head, as Cermelli et al. themselves
    carried it to Faster R-CNN (MMA, CVPR-W 2022, "Modeling missing annotations for incremental learning in object
    detection"): a background RoI may show an old class whose boxes this session does not label, so the RoI
    classification term of the detector's loss becomes MiB's unbiased cross-entropy (a background RoI's
    probability is the summed probability of background and the old rows not taught again); the old detector's
    scores on the same RoIs are distilled with MiB's unbiased distillation (the student's background absorbs the
    new rows), ``kd_weight`` times. The RPN and box-regression losses stay torchvision's; new rows are initialised
    MiB's way (``init: mib``: copies of the background row, biases shifted by -log(N_new + 1) with the linear
    classifier) together with their box-regression rows. ``dice`` has no meaning here (the detector's loss has no
    Dice half): setting it true is a ConfigError. MMA also distils the RPN and the box regression; that is MMA,
    not MiB, and is left out.
    """
    if o.dice and "dice" in (config.method_args.get("mib") or {}):
        raise ConfigError(
            "method_args.mib.dice=true: the detection loss has no Dice term (torchvision's cross-entropy and box "
            "losses), so MiB on detection uses the unbiased cross-entropy alone; leave dice unset or false"
        )
    plugin = DetectionMiBPlugin(o.kd_weight, o.alpha, o.init, freeze_policy(o.freeze))
    return Method("mib", [plugin], "MiB: unbiased RoI cross-entropy and distillation on the same RoIs")
