"""What the old-model baselines share (LwF, ILT, MiB, PLOP, Saving-100x, Adapt-Replay): the frozen teacher of the
previous session, forward-hook feature taps, the rows hidden in the background, MiB's unbiased losses and
classifier initialisation, and the background-merged loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from monai.losses import DiceLoss, MaskedDiceLoss
from torch import nn

from jascl.engine.plugin import Plugin
from jascl.methods.common import frozen_copy
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter
    from jascl.networks.classifier import PixelClassifier


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


def absorbed_rows(state: LoopState) -> list[int]:
    """Background plus the rows of old classes not taught in this session (hidden in the background)."""
    taught = set(state.session.classes)
    return [0] + [row for row, cid in enumerate(state.previous_seen) if row > 0 and cid not in taught]


def taught_rows(state: LoopState) -> list[int]:
    """Rows of the classes labelled in this session (new and recurring)."""
    return [state.seen.index(c) for c in state.session.classes]


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
