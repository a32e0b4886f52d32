"""Distillation baselines for class-incremental segmentation: LwF, ILT and MiB.

Each method is three layers, as everywhere in jascl: pure losses on bare
tensors (tested on hand-computed values), a plugin wiring them into the loop,
and a registered factory. This module also holds the pieces every
old-model-based baseline shares (the frozen teacher, forward-hook feature taps,
MiB's classifier initialisation, the background-merged loss); ``plop`` and
``prototype_replay`` import them.

Conventions (see ``jascl.methods.baselines``): classifier rows follow
``state.seen`` (row 0 = background); the teacher is the model at the end of the
previous session and only its first ``len(state.previous_seen)`` rows are used
("old rows": background + old classes). Labels are classifier rows, 255 = ignore.
In incremental sessions, pixels of old classes not taught again appear as
background (the *background shift*); classes taught again in a new domain
("recurring") keep their own labels, so only *untaught* old classes are
treated as hidden in the background ("absorbed" rows below).

Sources:
    LwF: Z. Li, D. Hoiem, "Learning without Forgetting", TPAMI 2017.
    ILT: U. Michieli, P. Zanuttigh, "Incremental Learning Techniques for Semantic
        Segmentation", ICCV Workshops 2019.
    MiB: F. Cermelli, M. Mancini, S. Rota Bulo, E. Ricci, B. Caputo, "Modeling the
        Background for Incremental Learning in Semantic Segmentation", CVPR 2020
        (official code: github.com/fcdl94/MiB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from monai.losses import DiceLoss, MaskedDiceLoss
from torch import nn
from torch.utils.data import DataLoader

from jascl.data.datasets import LabelledDataset
from jascl.engine.defaults import default_supervised_loss
from jascl.engine.plugin import Method, Plugin
from jascl.errors import ConfigError
from jascl.methods.gas import clean_state_dict
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter
    from jascl.networks.classifier import PixelClassifier

FREEZE_CHOICES = ("config", "none", "all_but_classifier")
INIT_CHOICES = ("mib", "imprint")

# ============================================================================ pure losses and rules


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


def feature_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """ILT's L''_D: mean squared error between student and teacher features (any shape)."""
    return F.mse_loss(student, teacher)


def _row_lut(num_rows: int, merged: Sequence[int], device: torch.device) -> torch.Tensor:
    """Lookup table row -> merged index: absorbed rows -> 0, the rest -> 1.. in order; 255 stays."""
    lut = torch.full((256,), IGNORE_INDEX, dtype=torch.long)
    keep = [r for r in range(num_rows) if r not in set(merged)]
    lut[list(merged)] = 0
    for i, r in enumerate(keep, start=1):
        lut[r] = i
    return lut.to(device)


def _check_absorbed(absorbed: Sequence[int]) -> list[int]:
    rows = list(absorbed)
    if not rows or rows[0] != 0:
        raise ValueError(f"absorbed rows must start with the background row 0 (got {rows})")
    return rows


def unbiased_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, absorbed: Sequence[int], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """MiB's unbiased cross-entropy (Cermelli et al. 2020, eq. 4).

    A background-labelled pixel may show any class hidden in the background, so
    its probability is that of the union: ``log(sum_{r in absorbed} p_r)``.
    Pixels of other classes use their own ``log p_c``. MiB absorbs background
    and every old class; here ``absorbed`` is background plus the old classes
    *not taught again* in this session (recurring classes keep their labels).

    Args:
        logits: (B, K, *spatial).
        target: (B, *spatial) rows; absorbed rows other than 0 are counted as 0; 255 = ignore.
        absorbed: rows merged into background, starting with 0.

    Returns:
        Mean over non-ignored pixels.
    """
    rows = _check_absorbed(absorbed)
    den = torch.logsumexp(logits, dim=1, keepdim=True)
    merged_bg = torch.logsumexp(logits[:, rows], dim=1, keepdim=True)
    log_p = torch.cat([merged_bg, logits[:, 1:]], dim=1) - den
    lut = torch.arange(256, device=target.device)
    lut[rows] = 0
    return F.nll_loss(log_p, lut[target], ignore_index=ignore_index)


def unbiased_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """MiB's unbiased knowledge distillation (Cermelli et al. 2020, eq. 5).

    The old model's background may be a new class, so the student's background
    probability is that of background *or any new class*:
    ``log p_bg = log(p_0 + sum_{new} p_n)``; old classes use ``log p_c``. The loss
    per pixel is ``-(1 / K_old) sum_{c < K_old} q_c log p_c`` with
    ``q = softmax(alpha * teacher)`` (MiB's official code; alpha = 1), averaged over pixels.

    Args:
        student_logits: (B, K, *spatial), rows >= K_old are new classes.
        teacher_logits: (B, K_old, *spatial).
        alpha: scale of the teacher logits (MiB's ``--alpha``, default 1).
    """
    k_old = teacher_logits.shape[1]
    den = torch.logsumexp(student_logits, dim=1, keepdim=True)
    bg_rows = [0, *range(k_old, student_logits.shape[1])]
    log_bg = torch.logsumexp(student_logits[:, bg_rows], dim=1, keepdim=True)
    log_p = torch.cat([log_bg, student_logits[:, 1:k_old]], dim=1) - den
    q = F.softmax(alpha * teacher_logits, dim=1)
    return (-(q * log_p).sum(dim=1) / k_old).mean()


def merge_absorbed_probabilities(
    logits: torch.Tensor, target: torch.Tensor, absorbed: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax with the absorbed rows summed into channel 0, and the target remapped to match.

    Returns:
        probs (B, K - len(absorbed) + 1, *spatial) and target (B, *spatial) in the
        merged indexing (absorbed rows -> 0, remaining rows -> 1.. in order, 255 kept).
    """
    rows = _check_absorbed(absorbed)
    probs = F.softmax(logits, dim=1)
    keep = [r for r in range(logits.shape[1]) if r not in set(rows)]
    merged = torch.cat([probs[:, rows].sum(dim=1, keepdim=True), probs[:, keep]], dim=1)
    return merged, _row_lut(logits.shape[1], rows, target.device)[target]


def soft_dice_loss(probs: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """MONAI soft Dice on given probabilities (background included, as the loop's DiceCE), ignore-aware.

    Args:
        probs: (B, K, *spatial) probabilities.
        target: (B, *spatial) indices in [0, K) or ``ignore_index``.
    """
    ignore = target == ignore_index
    safe = target.masked_fill(ignore, 0)
    if not ignore.any():
        return DiceLoss(to_onehot_y=True, softmax=False)(probs, safe.unsqueeze(1))
    # one-hot *before* masking: MONAI's MaskedDiceLoss with to_onehot_y masks the index map,
    # which turns ignored pixels into background ground truth
    onehot = F.one_hot(safe, probs.shape[1]).movedim(-1, 1).to(probs.dtype)
    return MaskedDiceLoss(softmax=False)(probs, onehot, mask=(~ignore).unsqueeze(1).to(probs.dtype))


def background_merged_loss(
    logits: torch.Tensor, target: torch.Tensor, absorbed: Sequence[int], lambda_ce: float, lambda_dice: float
) -> torch.Tensor:
    """``lambda_ce * unbiased CE + lambda_dice * soft Dice on background-merged probabilities``.

    Replaces the loop's DiceCE ("seg") for MiB and for the prototype-replay
    baselines. The Dice half is our addition (MiB trains with cross-entropy only):
    every method in jascl trains with DiceCE, and the Dice computed on the merged
    distribution is unbiased in the same sense as the CE. ``lambda_dice = 0`` gives MiB's
    original objective.
    """
    loss = lambda_ce * unbiased_cross_entropy(logits, target, absorbed)
    if lambda_dice:
        merged, mapped = merge_absorbed_probabilities(logits, target, absorbed)
        loss = loss + lambda_dice * soft_dice_loss(merged, mapped)
    return loss


@torch.no_grad()
def mib_init_new_rows(classifier: PixelClassifier, num_old: int) -> None:
    """MiB's classifier initialisation (Cermelli et al. 2020, sec. 3.3), in place.

    New rows copy the background row; with a bias (linear classifier) every new
    bias and the background bias become ``b_bg - log(N_new + 1)``, so the new
    model's background-or-new probability equals the old background probability
    and old-class probabilities are unchanged. The cosine classifier has no
    bias: new rows still copy the background row, but the old probabilities are
    not preserved exactly (the background logit is counted N_new + 1 times).

    Args:
        classifier: the grown classifier (rows ``num_old:`` are new).
        num_old: rows that existed in the previous session (background included).
    """
    n_new = classifier.num_classes - num_old
    if n_new <= 0:
        return
    classifier.weight[num_old:] = classifier.weight[0]
    if classifier.bias is not None:
        shifted = classifier.bias[0] - math.log(n_new + 1)
        classifier.bias[num_old:] = shifted
        classifier.bias[0] = shifted


# ============================================================================ shared plugin helpers


def frozen_copy(state: LoopState) -> Segmenter:
    """The previous session's model as a frozen teacher, in eval mode.

    Built with ``state.new_model`` (the model as grown this session) and the
    current weights; GAS parametrisations, if any, are dropped. The global RNG
    is left untouched (``new_model`` reseeds it).
    """
    devices = [state.device.index or 0] if state.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        teacher = state.new_model(state.model.num_classes)
    teacher.load_state_dict(clean_state_dict(state.model))
    return teacher.eval().requires_grad_(False)


class FeatureTap:
    """Forward hooks keeping the latest output of named layers of a segmenter.

    Layers are resolved with :meth:`Segmenter.resolve_layer` ("encoder",
    "decoder", or a module path). Outputs of ``nn.Linear`` layers (transformer
    MLPs, channels last) are moved to (B, C, *spatial).
    """

    def __init__(self, model: Segmenter, layers: Sequence[str]) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = []
        for name in layers:
            module = model.resolve_layer(name)
            self._handles.append(module.register_forward_hook(self._hook(name, isinstance(module, nn.Linear))))

    def _hook(self, name: str, channels_last: bool):
        def hook(module: nn.Module, inputs: tuple, output) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if channels_last and out.dim() >= 3:
                out = out.movedim(-1, 1)
            self.outputs[name] = out

        return hook

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.outputs[name]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.outputs = {}


def check_choice(method: str, key: str, value: str, choices: Sequence[str]) -> str:
    """Raise a one-line ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(
            f"method_args.{method}.{key}={value!r}: choose one of {', '.join(choices)} "
            f"(--set method_args.{method}.{key}=...)"
        )
    return value


def freeze_policy(method: str, value: str) -> str | None:
    """The plugin's ``freeze_incremental`` for option ``freeze`` ("config" -> None = the run's policy)."""
    check_choice(method, "freeze", value, FREEZE_CHOICES)
    return None if value == "config" else value


def check_non_negative(method: str, **values: float) -> None:
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"method_args.{method}.{key}={value}: must be >= 0")


def labelled_loader(state: LoopState) -> DataLoader:
    """The session's labelled training set without augmentation, in order (for statistics passes)."""
    dataset = LabelledDataset(state.data.train, state.session.classes, state.session.other_classes, augment=False)
    return DataLoader(dataset, batch_size=state.config.batch_size)


def absorbed_rows(state: LoopState) -> list[int]:
    """Background plus the rows of old classes not taught in this session (hidden in the background)."""
    taught = set(state.session.classes)
    return [0] + [row for row, cid in enumerate(state.previous_seen) if row > 0 and cid not in taught]


def taught_rows(state: LoopState) -> list[int]:
    """Rows of the classes labelled in this session (new and recurring)."""
    return [state.seen.index(c) for c in state.session.classes]


def resize_labels(labels: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """(B, *spatial) integer labels resampled (nearest) to ``size``; unchanged if already that size."""
    if tuple(labels.shape[1:]) == tuple(size):
        return labels
    return F.interpolate(labels[:, None].float(), size=tuple(size), mode="nearest")[:, 0].long()


class TeacherPlugin(Plugin):
    """Base of the old-model baselines: builds the frozen teacher in incremental sessions.

    Subclasses use ``self.teacher`` (None in session 0), ``self.num_old`` (old
    rows, background included) and :meth:`teacher_outputs`.
    """

    def __init__(self, freeze: str | None, init: str = "imprint") -> None:
        self.freeze_incremental = freeze
        self.init = init
        if init == "mib":  # MiB's own initialisation of the new rows instead of prototype imprinting
            self.replaces = (*type(self).replaces, "classifier-growth")
        self.teacher: Segmenter | None = None
        self.num_old = 0

    def setup_model(self, state: LoopState) -> None:
        if self.init != "mib":
            return
        classifier = state.model.classifier
        new = len(state.seen) - classifier.num_classes
        if new > 0:  # rows copying the background row for now; mib_init_new_rows sets them after the teacher copy
            classifier.grow(new, classifier.weight.detach()[:1].expand(new, -1))

    def before_session(self, state: LoopState) -> None:
        self.teacher = None
        if state.session.index == 0:
            return
        self.num_old = len(state.previous_seen)
        self.teacher = frozen_copy(state)  # before MiB's init, which also shifts the background bias
        if self.init == "mib":
            mib_init_new_rows(state.model.classifier, self.num_old)

    @torch.no_grad()
    def teacher_outputs(self, state: LoopState):
        """The teacher's :class:`SegmenterOutput` on the current batch (all rows; slice ``[:, :num_old]``)."""
        return self.teacher.forward_features(state.batch["image"].to(state.device))

    def after_session(self, state: LoopState) -> None:
        self.teacher = None


# ============================================================================ LwF


@dataclass
class LwFOptions:
    """Options of ``lwf`` (defaults: Li & Hoiem 2017, lambda_o = 1, T = 2).

    Attributes:
        weight: lambda_o, weight of the distillation term.
        temperature: T of both softmaxes.
        freeze: incremental-session freezing ("none": LwF fine-tunes the whole
            network; "config": the run's ``freeze_incremental``; "all_but_classifier").
    """

    weight: float = 1.0
    temperature: float = 2.0
    freeze: str = "none"


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


@METHODS.register("lwf", doc="baseline: output distillation on old classes (Li & Hoiem, TPAMI 2017)")
def lwf(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "lwf", LwFOptions())
    check_non_negative("lwf", weight=o.weight)
    if o.temperature <= 0:
        raise ConfigError(f"method_args.lwf.temperature={o.temperature}: must be > 0")
    plugin = LwFPlugin(o.weight, o.temperature, freeze_policy("lwf", o.freeze))
    return Method("lwf", [plugin], "Learning without Forgetting: distillation of the old rows")


# ============================================================================ ILT


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

    kd_weight: float = 100.0
    feature_weight: float = 100.0
    temperature: float = 1.0
    feature_layer: str = "encoder"
    freeze: str = "none"


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


@METHODS.register("ilt", doc="baseline: output + feature distillation (Michieli & Zanuttigh, ICCVW 2019)")
def ilt(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "ilt", ILTOptions())
    check_non_negative("ilt", kd_weight=o.kd_weight, feature_weight=o.feature_weight)
    if o.temperature <= 0:
        raise ConfigError(f"method_args.ilt.temperature={o.temperature}: must be > 0")
    plugin = ILTPlugin(o.kd_weight, o.feature_weight, o.temperature, o.feature_layer, freeze_policy("ilt", o.freeze))
    return Method("ilt", [plugin], "ILT: output and encoder-feature distillation")


# ============================================================================ MiB


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

    kd_weight: float = 10.0
    alpha: float = 1.0
    init: str = "mib"
    dice: bool = True
    freeze: str = "none"


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
    "mib", doc="baseline: unbiased CE + unbiased distillation + balanced init (Cermelli et al., CVPR 2020)"
)
def mib(config: RunConfig) -> Method:
    from jascl.engine.config import method_options

    o = method_options(config, "mib", MiBOptions())
    check_non_negative("mib", kd_weight=o.kd_weight)
    check_choice("mib", "init", o.init, INIT_CHOICES)
    plugin = MiBPlugin(o.kd_weight, o.alpha, o.init, o.dice, freeze_policy("mib", o.freeze))
    return Method("mib", [plugin], "MiB: background-aware CE and distillation")
