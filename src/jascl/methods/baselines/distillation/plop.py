"""PLOP: entropy-thresholded pseudo-labels for the background and Local POD distillation.

Source: A. Douillard, Y. Chen, A. Dapogny, M. Cord, "PLOP: Learning without
Forgetting for Continual Semantic Segmentation", CVPR 2021 (official code:
github.com/arthurdouillard/CVPR2021_PLOP, ``--method PLOP``). Conventions as in
:mod:`jascl.methods.baselines.distillation` (row 0 = background, 255 = ignore,
old rows = the first ``len(previous_seen)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.defaults import default_supervised_loss
from jascl.engine.plugin import Method
from jascl.errors import ConfigError
from jascl.methods.baselines.distillation._shared import FeatureTap, TeacherPlugin, soft_dice_loss, taught_rows
from jascl.methods.common import labelled_loader, whole_forward
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

# ============================================================================ pure functions


def normalized_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy over dim 1 divided by log K, in [0, 1]: (B, K, *spatial) -> (B, *spatial)."""
    k = probs.shape[1]
    h = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=1)
    return h / math.log(k) if k > 1 else torch.zeros_like(h)


class EntropyHistogram:
    """Per-class histograms of uncertainty values in [0, 1] (streaming; for medians over a whole set).

    Args:
        num_classes: K (classes are indexed 0..K-1).
        bins: equal-width bins over [0, 1] (PLOP's code: 100 for entropy).
    """

    def __init__(self, num_classes: int, bins: int = 100) -> None:
        self.bins = bins
        self.counts = torch.zeros(num_classes, bins, dtype=torch.float64)

    def update(self, values: torch.Tensor, classes: torch.Tensor) -> None:
        """Add values (N,) in [0, 1] of predicted classes (N,)."""
        index = (values.detach().double().clamp(0, 1) * self.bins).long().clamp(max=self.bins - 1)
        flat = classes.long().cpu() * self.bins + index.cpu()
        self.counts += torch.bincount(flat, minlength=self.counts.numel()).view_as(self.counts).double()

    def medians(self) -> torch.Tensor:
        """(K,) median per class, linearly interpolated inside its bin; NaN for classes without values."""
        out = torch.full((self.counts.shape[0],), float("nan"), dtype=torch.float64)
        width = 1.0 / self.bins
        for c, hist in enumerate(self.counts):
            total = float(hist.sum())
            if total <= 0:
                continue
            cum = torch.cumsum(hist, 0)
            b = int(torch.searchsorted(cum, torch.tensor(total / 2, dtype=torch.float64)))
            before = float(cum[b - 1]) if b > 0 else 0.0
            out[c] = b * width + (total / 2 - before) / float(hist[b]) * width
        return out


def entropy_thresholds(medians: torch.Tensor, min_threshold: float = 0.001) -> torch.Tensor:
    """PLOP's per-class uncertainty thresholds: ``tau_c = max(median_c, min_threshold)``.

    Classes the old model never predicted on background pixels get ``min_threshold``
    (the official code starts from 0 and applies the same floor).
    """
    filled = torch.where(torch.isnan(medians), torch.zeros_like(medians), medians)
    return filled.clamp_min(min_threshold).float()


def plop_pseudo_labels(
    teacher_logits: torch.Tensor, target: torch.Tensor, thresholds: torch.Tensor, taught: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """PLOP's pseudo-labelling of background pixels (Douillard et al. 2021, sec. 3.2).

    For every pixel labelled background, the old model's prediction
    ``c = argmax q`` replaces the label if its normalised entropy ``u`` is below
    ``thresholds[c]``; otherwise the pixel is ignored (255). Labelled
    foreground pixels are kept. ``nu`` per image is the fraction of background
    pixels that received a confident label (1 where an image has no background
    pixel; PLOP's code gives 0 there, dropping the whole image's loss).

    Old-model predictions of a class *taught* in this session are ignored as
    pseudo-labels (the ground truth says the pixel is not that class): such
    pixels keep their background label and count as confident.

    Args:
        teacher_logits: (B, K_old, *spatial) of the old model.
        target: (B, *spatial) rows (0 = background, 255 = ignore).
        thresholds: (K_old,) uncertainty thresholds in [0, 1].
        taught: rows of the classes labelled in this session.

    Returns:
        labels (B, *spatial) and nu (B,).
    """
    probs = F.softmax(teacher_logits, dim=1)
    pred = probs.argmax(dim=1)
    confident = normalized_entropy(probs) < thresholds.to(probs.device)[pred]
    if len(taught):
        from_taught = torch.isin(pred, torch.as_tensor(list(taught), device=pred.device))
        pred = pred.masked_fill(from_taught, 0)
        confident = confident | from_taught
    background = target == 0
    labels = torch.where(background & confident, pred, target)
    labels = labels.masked_fill(background & ~confident, IGNORE_INDEX)
    dims = tuple(range(1, target.dim()))
    n_bg = background.sum(dim=dims).float()
    n_ok = (background & confident).sum(dim=dims).float()
    nu = torch.where(n_bg > 0, n_ok / n_bg.clamp_min(1), torch.ones_like(n_bg))
    return labels, nu


def weighted_pseudo_label_ce(logits: torch.Tensor, labels: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
    """``mean over all pixels of nu_b * CE`` (ignored pixels count as 0), PLOP's L_pseudo.

    Args:
        logits: (B, K, *spatial); labels: (B, *spatial) rows or 255; nu: (B,).
    """
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    return (nu.view(-1, *([1] * (ce.dim() - 1))) * ce).mean()


def local_pod(x: torch.Tensor, scales: Sequence[int] = (1, 2, 4)) -> torch.Tensor:
    """Local POD embedding (Douillard et al. 2021, eq. 2), for 2D or 3D maps.

    At each scale s every spatial axis is cut into s equal parts (sizes ``n // s``,
    remainders dropped as in PLOP's code); for every sub-region and every spatial
    axis, the features are averaged over the *other* spatial axes (2D: width- and
    height-pooling). Scales whose parts would be empty are skipped.

    Args:
        x: (B, C, *spatial) features (PLOP squares them first, see :func:`pod_distance`).
        scales: numbers of parts per axis.

    Returns:
        (B, E) concatenated embedding.
    """
    b = x.shape[0]
    spatial = x.shape[2:]
    axes = list(range(2, x.dim()))
    parts = []
    for s in scales:
        sizes = [n // s for n in spatial]
        if min(sizes) == 0:
            continue
        for corner in torch.cartesian_prod(*[torch.arange(s)] * len(spatial)).view(-1, len(spatial)).tolist():
            region = x[(slice(None), slice(None)) + tuple(slice(i * k, (i + 1) * k) for i, k in zip(corner, sizes))]
            for axis in axes:
                others = [a for a in axes if a != axis]
                parts.append(region.mean(dim=others).reshape(b, -1))
    if not parts:
        return x.new_zeros(b, 0)
    return torch.cat(parts, dim=1)


def pod_distance(student: torch.Tensor, teacher: torch.Tensor, scales: Sequence[int] = (1, 2, 4)) -> torch.Tensor:
    """Mean over the batch of ``|| local_pod(student^2) - local_pod(teacher^2) ||_2`` (PLOP's code: prepro "pow",
    Frobenius distance, no normalisation). Zero when student == teacher."""
    diff = local_pod(student.pow(2), scales) - local_pod(teacher.pow(2), scales)
    return diff.norm(dim=1).mean()


def merge_new_logits(student_logits: torch.Tensor, num_old: int) -> torch.Tensor:
    """The student's logits shaped like the old model's: new-class logits summed into background
    (PLOP's ``extra_channels="sum"`` for POD on logits). (B, K, *sp) -> (B, num_old, *sp)."""
    bg = student_logits[:, :1] + student_logits[:, num_old:].sum(dim=1, keepdim=True)
    return torch.cat([bg, student_logits[:, 1:num_old]], dim=1)


# ============================================================================ plugin


@dataclass
class PLOPOptions:
    """Options of ``plop`` (defaults: PLOP's official ``--method PLOP``).

    Attributes:
        pod_weight: factor of Local POD on intermediate features (pod_factor 0.01).
        pod_logits_weight: factor of Local POD on the logits (0.0005).
        pod_scales: parts per axis of the Local POD pyramid (spp_scales [1, 2, 4]).
        pod_layers: intermediate layers distilled ("encoder"/"decoder" aliases or
            module paths). PLOP uses the four ResNet stages; our backbones expose the
            deepest encoder layer and one decoder layer (aliases the backbone lacks are
            skipped), plus the logits.
        pod_schedule: multiply POD by sqrt(classes seen / classes taught in the session).
        min_threshold: floor of the per-class entropy thresholds (0.001).
        bins: histogram bins for the per-class median entropy (100).
        adaptive_factor: weight the CE of each image by nu (classif_adaptive_factor).
        init: "mib" (PLOP uses MiB's initialisation, init_balanced) or "imprint".
        dice: add the run's ``lambda_dice`` x soft Dice on the pseudo-labelled target.
        freeze: incremental-session freezing ("none": PLOP fine-tunes the network).
    """

    pod_weight: float = option(0.01, ge=0)
    pod_logits_weight: float = option(0.0005, ge=0)
    pod_scales: list = option([1, 2, 4])
    pod_layers: list = option(["encoder", "decoder"])
    pod_schedule: bool = True
    min_threshold: float = option(0.001, ge=0)
    bins: int = option(100, ge=2)
    adaptive_factor: bool = True
    init: str = option("mib", choices=("mib", "imprint"))
    dice: bool = True
    freeze: str = freeze_option("none")


class PLOPPlugin(TeacherPlugin):
    """PLOP (Douillard et al., CVPR 2021) on the jascl loop.

    At the start of each incremental session the old model labels every
    background pixel of the labelled set; per class c, the threshold tau_c is
    the median normalised entropy of the pixels it predicts as c (floored at
    ``min_threshold``). In training, :func:`plop_pseudo_labels` relabels the
    background and the loop's segmentation loss ``state.losses["seg"]`` is
    *replaced* by ``lambda_ce * nu-weighted CE`` on the pseudo-labels (+ Dice);
    ``plop_pod`` adds Local POD between student and old model on ``pod_layers``
    (factor ``pod_weight``) and on the logits (new logits summed into background,
    factor ``pod_logits_weight``), averaged over layers.

    Deviations: fewer distilled layers (see ``pod_layers``), taken by forward
    hooks, and a 3D generalisation of POD's pooling (:func:`local_pod`);
    uncertainty is entropy / log K_old (the official code divides once more by
    K_old * log K_all, which changes what the 0.001 floor means); medians from a
    histogram computed once per session on the non-augmented labelled set; old
    predictions of classes taught in the session are not used as pseudo-labels;
    nu = 1 for images without background; the Dice half of "seg" (see ``dice``).
    """

    name = "plop"
    loss_terms = ("plop_pod",)
    replaces = ("supervised-loss",)  # "seg" is the method's own in incremental sessions

    def __init__(self, options: PLOPOptions | None = None, freeze: str | None = "none") -> None:
        o = options or PLOPOptions()
        super().__init__(freeze, o.init)
        self.o = o
        self.thresholds: torch.Tensor | None = None
        self._taps: tuple[FeatureTap, FeatureTap] | None = None
        self._layers: list[str] = []
        self._schedule = 1.0
        self._taught: list[int] = []

    def _pod_layers(self, state: LoopState) -> list[str]:
        if self.o.pod_layers == ["encoder", "decoder"]:  # the default: keep the aliases this backbone has
            return [n for n in self.o.pod_layers if n in state.model.backbone.layer_aliases]
        return list(self.o.pod_layers)

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        if self.teacher is None:
            return
        self._taught = taught_rows(state)
        self.thresholds = self.compute_thresholds(state)
        self._layers = self._pod_layers(state)
        if self._layers:
            self._taps = (FeatureTap(state.model, self._layers), FeatureTap(self.teacher, self._layers))
        taught = max(len(state.session.classes), 1)
        self._schedule = math.sqrt(len(state.seen) / taught) if self.o.pod_schedule else 1.0

    @torch.no_grad()
    def compute_thresholds(self, state: LoopState) -> torch.Tensor:
        """(K_old,) thresholds from the old model's predictions on the labelled set's background pixels."""
        hist = EntropyHistogram(self.num_old, self.o.bins)
        for batch in labelled_loader(state):
            logits = whole_forward(state, self.teacher, batch["image"].to(state.device)).logits
            probs = F.softmax(logits[:, : self.num_old], dim=1)
            background = state.class_index(batch["label"].to(state.device)) == 0
            hist.update(normalized_entropy(probs)[background], probs.argmax(dim=1)[background])
        return entropy_thresholds(hist.medians(), self.o.min_threshold).to(state.device)

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            state.losses["seg"] = default_supervised_loss(state)
            return
        cfg = state.config
        out, out_t = state.output, self.teacher_outputs(state)
        target = state.target
        labels, nu = plop_pseudo_labels(out_t.logits[:, : self.num_old], target, self.thresholds, self._taught)
        if not self.o.adaptive_factor:
            nu = torch.ones_like(nu)
        seg = cfg.lambda_ce * weighted_pseudo_label_ce(out.logits, labels, nu)
        if self.o.dice and cfg.lambda_dice:
            seg = seg + cfg.lambda_dice * soft_dice_loss(F.softmax(out.logits, dim=1), labels)
        state.losses["seg"] = seg

        terms = []
        for name in self._layers:
            terms.append(self.o.pod_weight * pod_distance(self._taps[0][name], self._taps[1][name], self.o.pod_scales))
        small, small_t = out.logits, out_t.logits
        if small.shape[2:] != out.features.shape[2:]:  # PLOP distils the logits before upsampling
            small, small_t = state.model.classifier(out.features), self.teacher.classifier(out_t.features)
        terms.append(
            self.o.pod_logits_weight
            * pod_distance(merge_new_logits(small, self.num_old), small_t[:, : self.num_old], self.o.pod_scales)
        )
        state.losses["plop_pod"] = self._schedule * torch.stack(terms).sum() / len(terms)

    def after_training(self, state: LoopState) -> None:
        if self._taps is not None:
            for tap in self._taps:
                tap.remove()
            self._taps = None


@METHODS.register(
    "plop",
    options=PLOPOptions,
    paper="Douillard et al., CVPR 2021",
    doc="baseline: entropy pseudo-labels of the background + Local POD",
    fidelity="simplified: Local POD on two hooked layers and the logits instead of PLOP's four ResNet stages",
)
def plop(o: PLOPOptions, config: RunConfig) -> Method:
    """PLOP: the old model's confident background pixels as pseudo-labels, and Local POD distillation."""
    if not o.pod_scales or not all(isinstance(s, int) and s > 0 for s in o.pod_scales):
        raise ConfigError(f"method_args.plop.pod_scales={o.pod_scales!r}: must be a list of positive integers")
    if not all(isinstance(s, str) for s in o.pod_layers):
        raise ConfigError(f"method_args.plop.pod_layers={o.pod_layers!r}: must be a list of layer names")
    return Method("plop", [PLOPPlugin(o, freeze_policy(o.freeze))], "PLOP: pseudo-labels + Local POD")
