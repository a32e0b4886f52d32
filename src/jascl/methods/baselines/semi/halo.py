"""HALO (Franco, Mandica, Kallidromitis, Guillory, Li, Darrell and Galasso, "Hyperbolic Active Learning for
Semantic Segmentation under Domain Shift", ICML 2024; arXiv 2306.11180; code github.com/paolomandica/HALO):
a hyperbolic pixel-embedding head and pixel acquisition by hyperbolic radius x region entropy.

HALO trains a segmenter whose head maps the decoder features onto the Poincare ball (1x1 channel
reduction, hyperbolic feature reweighting, exponential map) and classifies them by hyperbolic multinomial
logistic regression (:mod:`._hyperbolic`). In rounds of active learning on the target domain, every
unlabelled pixel gets the acquisition score (official ``ACTIVE.PURITY: radius``, ``UNCERTAINTY: entropy``,
``NORMALIZE: True``)::

    A = minmax(d_B(0, z)) * minmax(box_(2r+1) sum of H(p) / log K)

with z the pixel's ball embedding (its hyperbolic radius d_B(0, z), read as data scarcity) and H(p) the
entropy of its prediction summed over a (2r+1)^d window (r = 1); min-max per image. Per image and round,
regions are picked greedily: the best pixel's (2r+1)^d region is labelled, the (2m+1)^d window around it
(m = 5) is excluded from later picks of this and later rounds, until ``budget / rounds`` of the image's
pixels are labelled. The labelled pixels join the training set.

HALO is active learning: the acquired regions are *annotated*. jascl plays the annotator with an **oracle**
(``oracle: true``, the default, and so in the paper's plans): the acquired pixels take the pool's ground truth,
read from the pool's label files (global ids mapped to the session's classifier rows the way labelled data is:
classes the session does not teach become what ``other_classes`` says). Only pixels whose ground truth the pool
holds are offered for acquisition (borrowed pool images, ``unlabelled_sources``, have none: every label pixel is
255), so the budget is spent where the oracle can answer. The per-session budget is ``budget`` of the pool's
pixels, spent over ``rounds`` rounds: at most ``rounds * regions_per_round(...) * (2r+1)^d`` pixels per pool
image, ``budget`` x pool pixels in all (a last region that crosses the image border is smaller). The session's
record (``metrics.json``, ``pseudo_labels``; the report's pseudo-label table) states the pixels revealed, the
budget in pixels and the pool pixels without ground truth.

Without an oracle (``oracle: false``), the acquired pixels are *pseudo-labelled by the model* (its argmax at
selection time): self-training where HALO's score chooses which pool pixels the model learns from (the JASCL
paper: active learning "selects the most informative data"). This is the only option when the pool has no labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from jascl import distributed
from jascl.data.datasets import training_labels
from jascl.data.sampling import derive_seed
from jascl.engine.optim import make_optimizer
from jascl.engine.plugin import Method
from jascl.methods.baselines.semi._hyperbolic import HyperbolicHead, dist0
from jascl.methods.baselines.semi._shared import PoolPhasesPlugin, _schedule
from jascl.methods.mean_teacher import UnlabelledDataset
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.pas import pool_pseudo_label_report
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode, resize
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

# ============================================================================ pure functions


def minmax_per_image(x: torch.Tensor) -> torch.Tensor:
    """(B, *spatial) scaled to [0, 1] per image (an image with a constant map gets zeros)."""
    flat = x.reshape(x.shape[0], -1)
    low, high = flat.min(dim=1, keepdim=True).values, flat.max(dim=1, keepdim=True).values
    span = high - low
    scaled = torch.where(span > 0, (flat - low) / span.clamp_min(1e-300), torch.zeros_like(flat))
    return scaled.view_as(x)


def region_entropy(probs: torch.Tensor, radius: int = 1) -> torch.Tensor:
    """HALO's region uncertainty: the entropy H(p) / log K of each pixel, summed over the (2r+1)^d window
    around it (zero padding at the border). (B, K, *spatial) -> (B, *spatial)."""
    k = probs.shape[1]
    h = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=1, keepdim=True) / math.log(k)
    if radius == 0:
        return h.squeeze(1)
    size = 2 * radius + 1
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[h.dim() - 2]
    box = pool(h, size, stride=1, padding=radius, count_include_pad=True) * size ** (h.dim() - 2)
    return box.squeeze(1)


def halo_scores(probs: torch.Tensor, radii: torch.Tensor, radius: int = 1) -> torch.Tensor:
    """HALO's acquisition map ``minmax(hyperbolic radius) * minmax(region entropy)``, per image.

    Args:
        probs: (B, K, *spatial) predicted probabilities.
        radii: (B, *spatial) hyperbolic radii d_B(0, z) of the pixel embeddings.
        radius: r of the entropy window.
    """
    return minmax_per_image(radii.double()) * minmax_per_image(region_entropy(probs.double(), radius))


def _window(center: tuple[int, ...], radius: int) -> tuple[slice, ...]:
    return tuple(slice(max(c - radius, 0), c + radius + 1) for c in center)


def select_regions(
    score: torch.Tensor, count: int, region_radius: int = 1, mask_radius: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """HALO's greedy region picking on one image (official ``select_pixels_to_label``).

    ``count`` times: take the highest-scoring pixel (stop when none is left, score -inf), label its
    (2 region_radius + 1)^d window and exclude the (2 mask_radius + 1)^d window around it from later picks.
    Ties go to the first pixel in row-major order.

    Args:
        score: (*spatial) scores; -inf = not available (e.g. excluded by an earlier round).
        count: regions to pick.

    Returns:
        selected (*spatial) bool, the labelled pixels, and excluded (*spatial) bool, the windows excluded.
    """
    score = score.clone()
    selected = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    excluded = torch.zeros_like(selected)
    for _ in range(count):
        flat = int(score.argmax())
        if score.flatten()[flat] == -math.inf:
            break
        center = tuple(int(i) for i in np.unravel_index(flat, tuple(score.shape)))
        mask = _window(center, mask_radius)
        score[mask] = -math.inf
        excluded[mask] = True
        selected[_window(center, region_radius)] = True
    return selected, excluded


def oracle_rows(
    truth: np.ndarray, taught: Sequence[int], other_classes: str, class_index: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The oracle's answer for every pixel of one pool image: its classifier row, IGNORE_INDEX where the pool holds
    no ground truth.

    Args:
        truth: (*spatial) the pool's label, global class ids, 255 where there is none.
        taught: the session's taught classes; other classes become what ``other_classes`` says ("background": 0,
            "ignore": 255), as for labelled data (:func:`jascl.data.datasets.training_labels`).
        class_index: global ids -> classifier rows (``LoopState.class_index``).

    Returns:
        (*spatial) int64 rows.
    """
    truth = np.asarray(truth)
    labels = torch.from_numpy(training_labels(truth, taught, other_classes).astype("int64"))
    labels[torch.from_numpy(truth == IGNORE_INDEX)] = IGNORE_INDEX  # no ground truth: never "background"
    return class_index(labels)


def regions_per_round(num_pixels: int, budget: float, rounds: int, region_radius: int, spatial_dims: int) -> int:
    """``ceil(pixels * budget / rounds / region size)`` regions per image and round (official, 2D and 3D)."""
    return math.ceil(num_pixels * budget / rounds / (2 * region_radius + 1) ** spatial_dims)


# ============================================================================ plugin


@dataclass
class HALOOptions:
    """``method_args.halo`` options (defaults: the official code, ``core/configs/defaults.py`` and the
    ``configs/gtav/*RA*.yaml`` runs).

    Attributes:
        budget: fraction of each pool image's pixels acquired over all rounds (``ACTIVE.BUDGET`` 5%).
        rounds: acquisition rounds, one at the start of each unlabelled phase (``SELECT_ITER``: 5).
        region_radius: r of the labelled (2r+1)^d region and of the entropy window (``RADIUS_K`` 1).
        mask_radius: m of the (2m+1)^d window excluded around a pick (``MASK_RADIUS_K`` 5).
        channels: dimension of the ball embeddings (``REDUCED_CHANNELS`` 64).
        curvature: c, the ball's curvature is -c (``CURVATURE`` 1).
        hfr: hyperbolic feature reweighting (``HFR`` True).
        head_weight: weight of the hyperbolic head's cross-entropy on the labelled batch.
        acquired_weight: weight of the cross-entropy on acquired pool pixels (model and head).
        oracle: acquired pixels take the pool's ground truth (active learning, HALO as published; default) instead
            of the model's argmax (self-training).
        freeze: "config" (default), "none" or "all_but_classifier".
    """

    budget: float = option(0.05, gt=0, le=1)
    rounds: int = option(5, ge=1)
    region_radius: int = option(1, ge=0)
    mask_radius: int = option(5, ge=0)
    channels: int = option(64, ge=1)
    curvature: float = option(1.0, gt=0)
    hfr: bool = True
    head_weight: float = option(1.0, gt=0)
    acquired_weight: float = option(1.0, gt=0)
    oracle: bool = True
    freeze: str = freeze_option()


class HALOPlugin(PoolPhasesPlugin):
    """HALO: a hyperbolic head on the decoder features, and acquisition of pool pixels by HALO's score.

    Every incremental session:

    * ``halo_hyp`` (every step): ``head_weight`` x cross-entropy of the hyperbolic head
      (:class:`._hyperbolic.HyperbolicHead`, one row per classifier row) on the labelled batch; it trains the
      head and, through the shared decoder features, the network.
    * ``halo_al`` (unlabelled phases): ``acquired_weight`` x (cross-entropy of the model + cross-entropy of
      the hyperbolic head) on the pool pixels acquired so far. At the start of each of the first ``rounds``
      phases, one acquisition round (:meth:`acquire`): :func:`halo_scores` of every pool image (model and
      head in eval mode), :func:`select_regions` per image with ``regions_per_round`` regions, and as the label
      of the picked pixels the pool's ground truth (``oracle``; :func:`oracle_rows`) or the model's argmax.

    Deviations: the oracle is the pool's label files, not an annotator (see the module docstring); the network's own classifier stays Euclidean (the loop's classifier growth, prototypes, evaluation and
    GAS act on it) and the hyperbolic head is an auxiliary head on the same features, built anew (seeded)
    every incremental session and dropped after it, since the shared base session has no hyperbolic head
    (HALO's row in the JASCL paper starts from that base); hyperplane offsets are kept on the ball by an
    exponential map (the official code leaves them Euclidean); one round per unlabelled phase instead of
    rounds at fixed iterations; 3D volumes use (2r+1)^3 regions; the entropy is normalised by log K instead
    of the official fixed log 19; embeddings are resized to the label grid by (bi/tri)linear interpolation
    without corner alignment; the acquisition runs on the pool's images as stored (no cropping).
    """

    name = "halo"
    loss_terms = ("halo_hyp", "halo_al")

    def __init__(
        self,
        budget: float = 0.05,
        rounds: int = 5,
        region_radius: int = 1,
        mask_radius: int = 5,
        channels: int = 64,
        curvature: float = 1.0,
        hfr: bool = True,
        head_weight: float = 1.0,
        acquired_weight: float = 1.0,
        oracle: bool = True,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        freeze: str | None = None,
    ) -> None:
        super().__init__(start_epoch, every, batch_size)
        self.budget, self.rounds = budget, rounds
        self.region_radius, self.mask_radius = region_radius, mask_radius
        self.channels, self.curvature, self.hfr = channels, curvature, hfr
        self.head_weight, self.acquired_weight = head_weight, acquired_weight
        self.oracle = oracle
        self.freeze_incremental = freeze
        self.head: HyperbolicHead | None = None
        self.pseudo: torch.Tensor | None = None
        self.excluded: torch.Tensor | None = None
        self.rounds_done = 0
        self.revealed = 0  # pixels whose ground truth the oracle revealed this session
        self.budget_pixels = 0  # the most pixels the session's rounds can acquire
        self.without_truth = 0  # pool pixels the oracle cannot answer (not offered for acquisition)

    def before_session(self, state: LoopState) -> None:
        self.head, self.pseudo, self.excluded, self.rounds_done = None, None, None, 0
        self.revealed = self.budget_pixels = self.without_truth = 0
        if state.session.index == 0:
            return
        devices = [state.device.index or 0] if state.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # a seeded head; the loop's random stream untouched
            torch.manual_seed(derive_seed(state.seed, self.name, state.session.index))
            self.head = HyperbolicHead(
                state.model.backbone.feature_channels, len(state.seen), self.channels, self.curvature, self.hfr
            )
        self.head.to(state.device)
        if self._setup_pool(state, salt=5):
            pool = state.data.unlabelled
            shape = (len(pool), *np.asarray(pool.labels[0]).shape)
            self.pseudo = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
            self.excluded = torch.zeros(shape, dtype=torch.bool)
            spatial = shape[1:]
            per_round = regions_per_round(
                int(np.prod(spatial)), self.budget, self.rounds, self.region_radius, len(spatial)
            )
            self.budget_pixels = len(pool) * self.rounds * per_round * (2 * self.region_radius + 1) ** len(spatial)
            if self.oracle:
                self.without_truth = int(sum((np.asarray(y) == IGNORE_INDEX).sum() for y in pool.labels))

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if self.head is None:
            return None
        return make_optimizer(state.config, [*params, *self.head.parameters()], lr)

    def before_epoch(self, state: LoopState) -> None:
        super().before_epoch(state)
        if self._phase and self.pseudo is not None and self.rounds_done < self.rounds:
            self.acquire(state)

    @torch.no_grad()
    def acquire(self, state: LoopState) -> int:
        """One acquisition round over the pool; returns the number of pixels newly labelled (by the oracle, or
        pseudo-labelled by the model)."""
        assert self.head is not None and self.pseudo is not None and self.excluded is not None
        spatial = tuple(self.pseudo.shape[1:])
        count = regions_per_round(int(np.prod(spatial)), self.budget, self.rounds, self.region_radius, len(spatial))
        loader = DataLoader(UnlabelledDataset(state.data.unlabelled), batch_size=self._loader.batch_size)
        added = 0
        with eval_mode(state.model), eval_mode(self.head):
            for batch in loader:
                out = state.model.forward_features(batch["image"].to(state.device))
                probs = torch.softmax(out.logits.float(), dim=1)
                radii = dist0(resize(self.head.embed(out.features), spatial), self.curvature)
                scores = halo_scores(probs, radii, self.region_radius).cpu()
                labels = probs.argmax(dim=1).cpu()
                for row, index in enumerate(batch["index"].tolist()):
                    unavailable = self.excluded[index]
                    answer = labels[row]
                    if self.oracle:
                        answer = oracle_rows(
                            state.data.unlabelled.labels[index],
                            state.session.classes,
                            state.session.other_classes,
                            state.class_index,
                        )
                        unavailable = unavailable | (answer == IGNORE_INDEX)
                    score = scores[row].masked_fill(unavailable, -math.inf)
                    picked, excluded = select_regions(score, count, self.region_radius, self.mask_radius)
                    new = picked & (self.pseudo[index] == IGNORE_INDEX) & (answer != IGNORE_INDEX)
                    self.pseudo[index][new] = answer[new]
                    self.excluded[index] |= excluded
                    added += int(new.sum())
        self.rounds_done += 1
        if self.oracle:
            self.revealed += added
        return added

    def after_forward(self, state: LoopState) -> None:
        if self.head is None:
            return
        logits, _ = self.head(state.output.features)
        logits = resize(logits, state.target.shape[1:])
        state.losses["halo_hyp"] = self.head_weight * F.cross_entropy(logits, state.target, ignore_index=IGNORE_INDEX)
        if not self._phase or self.pseudo is None:
            return
        batch = self._pool_batch()
        out = state.model.forward_features(batch["image"].to(state.device))
        target = self.pseudo[batch["index"]].to(state.device)
        if (target != IGNORE_INDEX).any():
            head_logits = resize(self.head(out.features)[0], target.shape[1:])
            loss = F.cross_entropy(out.logits, target, ignore_index=IGNORE_INDEX) + F.cross_entropy(
                head_logits, target, ignore_index=IGNORE_INDEX
            )
        else:
            loss = out.logits.sum() * 0.0
        state.losses["halo_al"] = self.acquired_weight * loss

    def after_backward(self, state: LoopState) -> None:
        if self.head is not None:
            distributed.average_gradients(self.head.parameters())

    def after_training(self, state: LoopState) -> None:
        if self.pseudo is None:
            return
        report = pool_pseudo_label_report(
            state.data.unlabelled.labels, self.pseudo, state.seen, "halo", self.rounds_done
        )
        report["filter"] = "oracle" if self.oracle else "model argmax"
        report["budget_pixels"] = self.budget_pixels
        if self.oracle:
            report.update(revealed=self.revealed, without_truth=self.without_truth)
        state.report["pseudo_labels"] = report

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self.head, self.pseudo, self.excluded = None, None, None


@METHODS.register(
    "halo",
    options=HALOOptions,
    paper="Franco et al., ICML 2024",
    doc="baseline: hyperbolic head + pool pixels acquired by hyperbolic radius x entropy, annotated by an oracle",
    fidelity=(
        "simplified: the oracle is the pool's label files; the network's classifier stays Euclidean, the hyperbolic "
        "head is auxiliary"
    ),
    flags=("annotation oracle",),
)
def halo(o: HALOOptions, config: RunConfig) -> Method:
    """HALO on the unlabelled pool, on the unlabelled-phase schedule of ``method_args.jascl.pas``."""
    plugin = HALOPlugin(
        budget=o.budget,
        rounds=o.rounds,
        region_radius=o.region_radius,
        mask_radius=o.mask_radius,
        channels=o.channels,
        curvature=o.curvature,
        hfr=o.hfr,
        head_weight=o.head_weight,
        acquired_weight=o.acquired_weight,
        oracle=o.oracle,
        freeze=freeze_policy(o.freeze),
        **_schedule(config),
    )
    labels = "annotated by the pool's ground truth (oracle)" if o.oracle else "pseudo-labelled by the model"
    return Method("halo", [plugin], f"HALO: hyperbolic radius x entropy acquisition, {labels}")
