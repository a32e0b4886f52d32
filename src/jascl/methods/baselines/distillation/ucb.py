"""UCB: uncertainty- and class-balance re-weighting of the old model's pseudo-labels, on PLOP.

Source: Z. Liang, Y. Hu, F. Yang, X. Liu, "Enhancing Continual Semantic Segmentation via Uncertainty and
Class Balance Re-weighting", IEEE Transactions on Image Processing, 2025 (IEEE document 11030217,
doi 10.1109/TIP.2025.3576477; official code github.com/JACK-Chen-2019/UCB: ``entropy.py``, used by
``UCB_PLOP/train_entropy.py``). UCB is class-incremental: no unlabelled pool; the pseudo-labels are the old
model's predictions of old classes on the background of the current images, as in PLOP, and UCB re-weights
the per-pixel cross-entropy on them. It is a plug-in for any pseudo-label method; the authors apply it to
PLOP, SSUL and CoinSeg. jascl has PLOP (:mod:`.plop`), so ``ucb`` is PLOP + UCB, as ``UCB_PLOP``.

Per pixel i of a batch, with label y_i after PLOP's pseudo-labelling (:func:`.plop.plop_pseudo_labels`):

* uncertainty weight (UCB's entropy weight): ``u_i`` = the old model's normalised entropy
  ``H(q_i) / log K_old``, min-max normalised over the batch; for pixels whose label is a pseudo-label
  ``w^u_i = exp(-(u_i - tau) / tau)`` if ``u_i < tau`` and 0 otherwise (tau = 0.8), and for pixels labelled
  by the ground truth ``u_i := 0``, so ``w^u_i = e``;
* class-balance weight: ``m`` = running mean over the session's batches of the class frequencies of the
  pseudo-labelled maps; for the C classes present (m_c > 0), ``w^c_c = mean_{c>0, present} m_c / m_c``,
  ``w^c_0 = 1`` (background), clamped to ``[sqrt(N_new / N_old), sqrt(N_old / N_new)]``;
* ``w_i = w^u_i * w^c_{y_i}``, divided by its mean over the batch's non-ignored pixels; the loss becomes
  ``lambda_ce * mean_i(nu_b * w_i * CE_i)`` (+ PLOP's Dice half, unweighted).

Conventions as in :mod:`jascl.methods.baselines.distillation` (row 0 = background, 255 = ignore, old rows =
the first ``len(previous_seen)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method
from jascl.errors import ConfigError
from jascl.methods.baselines.distillation._shared import soft_dice_loss
from jascl.methods.baselines.distillation.plop import PLOPOptions, PLOPPlugin, normalized_entropy, plop_pseudo_labels
from jascl.methods.options import freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

# ============================================================================ pure functions


def label_frequencies(labels: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(num_rows,) float64 fraction of the non-ignored pixels of ``labels`` in each row (zeros if none)."""
    valid = labels[labels != IGNORE_INDEX]
    counts = torch.bincount(valid.flatten().long(), minlength=num_rows).double()
    total = counts.sum()
    return counts / total if total > 0 else counts


def class_balance_weights(freq: torch.Tensor, n_old: int, n_new: int) -> torch.Tensor:
    """UCB's class-balance weights from class frequencies (official ``get_num_weight``).

    For the classes present (``freq > 0``, background included), ``w_c = mean_{c>0 present} freq_c / freq_c``
    (the mean over present foreground classes of their frequency, over the class's own); background gets 1;
    all are clamped to ``[sqrt(n_new / n_old), sqrt(n_old / n_new)]`` (bounds sorted, so the interval is
    never empty). Absent classes get the upper bound (no pixel uses it). No foreground present: all ones.

    Args:
        freq: (K,) class frequencies (any scale: only ratios matter).
        n_old: classes known before the session, background included (official ``old_classes``).
        n_new: classes labelled by the ground truth in the session.
    """
    freq = freq.double()
    present = freq > 0
    n_fg = int(present[1:].sum())
    if n_fg == 0:
        return torch.ones_like(freq)
    mean_fg = freq[1:].sum() / n_fg
    weights = torch.where(present, mean_fg / freq.clamp_min(1e-300), torch.full_like(freq, math.inf))
    weights[0] = 1.0
    bounds = sorted((math.sqrt(n_new / n_old), math.sqrt(n_old / n_new)))
    return weights.clamp(min=bounds[0], max=bounds[1])


def uncertainty_weights(uncertainty: torch.Tensor, pseudo: torch.Tensor, high: float = 0.8) -> torch.Tensor:
    """UCB's uncertainty weights (official ``get_entropy_weight``).

    ``uncertainty`` is min-max normalised over all its elements (all zero when constant); pixels not
    pseudo-labelled count as certain (0). Weight ``exp(-(u - high) / high)``, and 0 for pseudo-labelled pixels
    with ``u >= high``: in (1, e] below the threshold, e for ground-truth pixels.

    Args:
        uncertainty: (B, *spatial) the old model's normalised entropy.
        pseudo: (B, *spatial) bool, True where the label comes from the old model.
        high: threshold tau (official ``entropy_high`` 0.8).
    """
    u = uncertainty.double()
    span = u.max() - u.min()
    u = (u - u.min()) / span if span > 0 else torch.zeros_like(u)
    u = u.masked_fill(~pseudo, 0.0)
    weights = torch.exp(-(u - high) / high)
    return weights.masked_fill(pseudo & (u >= high), 0.0)


def ucb_pixel_weights(
    teacher_old_logits: torch.Tensor,
    labels: torch.Tensor,
    pseudo: torch.Tensor,
    class_weights: torch.Tensor | None,
    high: float = 0.8,
    uncertainty: bool = True,
) -> torch.Tensor:
    """Per-pixel UCB weights, mean 1 over the non-ignored pixels, 0 on ignored ones.

    Args:
        teacher_old_logits: (B, K_old, *spatial) the old model's logits.
        labels: (B, *spatial) rows after pseudo-labelling, 255 = ignore.
        pseudo: (B, *spatial) bool, labels that come from the old model.
        class_weights: (K,) :func:`class_balance_weights`, or None (no class balancing).
        high: uncertainty threshold tau.
        uncertainty: apply the uncertainty weights (False: ones).
    """
    valid = labels != IGNORE_INDEX
    weights = torch.ones(labels.shape, dtype=torch.float64, device=labels.device)
    if uncertainty:
        probs = F.softmax(teacher_old_logits.detach().double(), dim=1)
        weights = weights * uncertainty_weights(normalized_entropy(probs), pseudo & valid, high)
    if class_weights is not None:
        weights = weights * class_weights.to(weights.device)[labels.masked_fill(~valid, 0)]
    weights = weights.masked_fill(~valid, 0.0)
    count = valid.sum()
    mean = weights.sum() / count if count > 0 else weights.new_tensor(0.0)
    return weights / mean if mean > 0 else weights


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``mean over all pixels of weights * CE`` (ignored pixels count as 0; weights (B, *spatial) or (B,))."""
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    if weights.dim() == 1:
        weights = weights.view(-1, *([1] * (ce.dim() - 1)))
    return (weights.to(ce.dtype) * ce).mean()


def running_frequency(freq: torch.Tensor, images: int, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The running mean over batches of per-batch class frequencies, weighted by batch size (official ``m``).

    Args:
        freq: (K,) float64 mean over the ``images`` images seen so far.
        labels: (B, *spatial) rows of the new batch, 255 = ignore.

    Returns:
        the updated (K,) mean and image count.
    """
    batch = labels.shape[0]
    current = label_frequencies(labels, freq.numel()).to(freq.device)
    return (freq * images + current * batch) / (images + batch), images + batch


# ============================================================================ plugin


@dataclass
class UCBOptions(PLOPOptions):
    """Options of ``ucb``: PLOP's (its defaults: the official ``--method PLOP``) and UCB's.

    Attributes:
        uncertainty_high: threshold tau of the uncertainty weights (official ``entropy_high`` 0.8).
        uncertainty: apply the uncertainty weights (ablation: False).
        class_balance: apply the class-balance weights (ablation: False).
    """

    uncertainty_high: float = option(0.8, gt=0, le=1)
    uncertainty: bool = True
    class_balance: bool = True


class UCBPlugin(PLOPPlugin):
    """PLOP whose pseudo-label cross-entropy is re-weighted per pixel by UCB (Liang et al., TIP 2025).

    Everything else is PLOP's (:class:`.plop.PLOPPlugin`): per-class entropy thresholds, Local POD, MiB
    initialisation. In ``after_forward`` the loop's ``seg`` becomes ``lambda_ce * mean(nu * w * CE)`` on
    PLOP's pseudo-labelled target, w = :func:`ucb_pixel_weights` with the session's running class
    frequencies (:func:`running_frequency`, reset every session).

    Deviations: ignored pixels (PLOP's uncertain background, the dataset's void) carry no weight and are left
    out of the class frequencies and of the weights' mean (the official code counts them as background);
    "pseudo-labelled" means labelled background by the ground truth (the official ``label < old_classes``, the
    same when no class is taught again), so old classes taught again in a new domain (recurring) keep
    ground-truth weight; N_new of the clamp is the number of classes the session labels (new and recurring;
    the official ``tot - old`` is 0 in a session of recurring classes only) and the clamp interval is sorted
    (the official one is empty when N_new > N_old, which sets every weight to its upper end); frequencies
    by ``bincount`` (the official ``histc`` spreads its bins over the batch's label range, which matches
    classes only when the largest row is present); the Dice half of ``seg`` is PLOP's, unweighted.
    """

    name = "ucb"

    def __init__(self, options: UCBOptions | None = None, freeze: str | None = "none") -> None:
        o = options or UCBOptions()
        super().__init__(o, freeze)
        self.ucb = o
        self.freq: torch.Tensor | None = None  # the session's running class frequencies
        self.freq_images = 0
        self._n_taught = 1
        self._teacher_out = None

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self.freq = torch.zeros(len(state.seen), dtype=torch.float64, device=state.device) if self.teacher else None
        self.freq_images = 0
        self._n_taught = max(len(state.session.classes), 1)

    @torch.no_grad()
    def teacher_outputs(self, state: LoopState):
        out = super().teacher_outputs(state)
        self._teacher_out = out  # PLOP's after_forward runs the old model once; the re-weighting reuses it
        return out

    def after_forward(self, state: LoopState) -> None:
        super().after_forward(state)
        if self.teacher is None or self._teacher_out is None:
            return
        teacher_old = self._teacher_out.logits[:, : self.num_old]
        self._teacher_out = None
        cfg, logits, target = state.config, state.output.logits, state.target
        labels, nu = plop_pseudo_labels(teacher_old, target, self.thresholds, self._taught)
        if not self.o.adaptive_factor:
            nu = torch.ones_like(nu)
        class_weights = None
        if self.ucb.class_balance:
            self.freq, self.freq_images = running_frequency(self.freq, self.freq_images, labels)
            class_weights = class_balance_weights(self.freq, self.num_old, self._n_taught)
        weights = ucb_pixel_weights(
            teacher_old, labels, target == 0, class_weights, self.ucb.uncertainty_high, self.ucb.uncertainty
        )
        per_image = nu.view(-1, *([1] * (weights.dim() - 1))).to(weights.dtype)
        seg = cfg.lambda_ce * weighted_ce(logits, labels, per_image * weights)
        if self.o.dice and cfg.lambda_dice:
            seg = seg + cfg.lambda_dice * soft_dice_loss(F.softmax(logits, dim=1), labels)
        state.losses["seg"] = seg

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self.freq, self._teacher_out = None, None


@METHODS.register(
    "ucb",
    options=UCBOptions,
    paper="Liang et al., IEEE TIP 2025",
    doc="baseline: PLOP with uncertainty- and class-balance re-weighted pseudo-labels",
    fidelity="faithful",
)
def ucb(o: UCBOptions, config: RunConfig) -> Method:
    """UCB on PLOP: the old model's pseudo-labels weighted by their certainty and their class's rarity."""
    if not o.pod_scales or not all(isinstance(s, int) and s > 0 for s in o.pod_scales):
        raise ConfigError(f"method_args.ucb.pod_scales={o.pod_scales!r}: must be a list of positive integers")
    if not all(isinstance(s, str) for s in o.pod_layers):
        raise ConfigError(f"method_args.ucb.pod_layers={o.pod_layers!r}: must be a list of layer names")
    return Method("ucb", [UCBPlugin(o, freeze_policy(o.freeze))], "UCB: PLOP + uncertainty/class-balance weights")
