"""NNCSL (Kang, Fini, Nabi, Ricci and Alahari, "A Soft Nearest-Neighbor Framework for Continual Semi-Supervised
Learning", ICCV 2023; arXiv 2212.05102; code github.com/kangzhiq/NNCSL): a PAWS-style soft nearest-neighbour
learner over labelled support samples (CSL) plus nearest-neighbour distillation (NND), at the pixel level.

**It keeps real labelled images of earlier sessions** in a bounded memory
(:mod:`jascl.methods.labelled_memory`, ``memory_size`` samples, 20 by default), which the JASCL setting otherwise
forbids: NNCSL's support set of earlier classes is drawn from such a replay buffer, and without it the method
does not exist. No other method uses the memory by default.

The soft nearest-neighbour classifier (PAWS, Assran et al., ICCV 2021): for a query embedding q and support
embeddings s_j with (label-smoothed) one-hot labels y_j, all L2-normalised,
``snn(q) = sum_j softmax_j(q . s_j / tau) y_j``; targets are sharpened, ``p^(1/T) / sum p^(1/T)``.

Every incremental session (session 0 is the shared base: NNCSL leaves it alone, as the paper's tables do):

* ``nncsl_memory`` (every step): the cross-entropy of the segmentation head on a batch drawn from the memory
  (``memory_batch_size``, 0 = the run's batch size). NNCSL mixes its buffer into the labelled loader, which
  trains its online linear classifier; here the segmentation head is that classifier and the loop's
  supervised loss already covers the current labelled batch, so the memory batch gets the same loss.
* ``nncsl_paws`` (unlabelled phases): PAWS on pixels of the unlabelled pool. Each pool image is seen in two
  views, the image and a second view (mirrored along the last spatial axis, intensity scaled by
  ``1 + U(-j, j)`` and shifted by ``U(-j, j)`` per image, ``j = view_jitter``), whose features are mirrored
  back so that pixels correspond; ``query_pixels`` positions are drawn per step. Supports: up to
  ``support_pixels`` pixels per class of the current session (background and its taught classes; the
  official ``mask: true`` keeps the supports to the current task) from the labelled batch and from the memory
  batch (memory pixels of the session's foreground classes only: a memory label's background may hold classes
  taught later). The loss is PAWS's: the cross-entropy between the sharpened soft-NN prediction of one view
  (targets: detached features of both queries and supports) and the soft-NN prediction of the other, both
  ways, plus ``me_max_weight`` x the mean-entropy maximisation (the negative entropy of the mean sharpened
  prediction).
* ``nncsl_nnd`` (every step): NND, ``nnd_weight x ((1 - alpha) L_snn + alpha L_feat)`` (official ``w_dist``,
  ``alpha``). L_snn is the cross-entropy between the previous session's model's soft-NN distribution over
  the *old* classes (rows of the previous classifier, background included) and the current model's: queries
  are the pool's query pixels in unlabelled phases, else ``query_pixels`` pixels of the labelled batch;
  supports are up to ``support_pixels`` memory pixels per old class, embedded by each model. L_feat
  (``feature_weight`` = alpha > 0) is the squared error between a linear projector g (D x D, initialised to
  the identity, trained with the model) applied to the current query features and the previous model's:
  the feature-level path of NND through a projector.

Defaults are the official CIFAR-100 NNCSL configuration (``configs/nncsl/cifar100/*_nncsl.yaml``):
tau 0.1, sharpening T 0.25, label smoothing 0.1, ``w_paws`` 1, ``w_me_max`` 1, ``w_dist`` 0.2, alpha 0 (so
the projector is off by default, as in every released configuration).

Deviations for dense prediction under joint nonstationarity:

* pixels instead of images: queries and supports are pixels of the pre-classifier feature map (labels
  nearest-resized to it), sampled per class and step; the feature map itself is the embedding (no separate
  projection MLP: the cosine segmentation head reads the same space, and a head kept across sessions would
  have to be distilled too). The previous model's distribution is computed in its own feature space.
* background is a class of the support set (segmentation labels have one); the PAWS supports are the current
  session's classes, the NND supports the previous classifier's rows.
* the memory holds ``memory_size`` *images* (20 by default, against the paper's 500-5120 CIFAR / ImageNet
  images), class-balanced by the rule of :mod:`jascl.methods.labelled_memory` instead of reservoir sampling,
  filled at the end of every session instead of during training; stored as training crops.
* two views by mirroring and an intensity jitter instead of PAWS's multi-crop colour augmentations (the views
  must keep pixel correspondence); no multi-crop.
* unlabelled data on the repository's unlabelled-phase schedule (``method_args.jascl.pas.start_epoch`` /
  ``every``, shared with the other pool baselines) instead of every step; outside phases NND queries the
  labelled batch.
* the run's optimiser, schedule and epochs instead of LARS with a warm-up cosine schedule; the whole network
  trains by default (``freeze`` "none": PAWS and NND act on the features).
* the hidden labels of the pool never enter a loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from jascl import distributed
from jascl.data.sampling import derive_seed
from jascl.engine.optim import make_optimizer
from jascl.engine.plugin import Method
from jascl.engine.prototypes import align_labels
from jascl.methods.baselines.contrastive._shared import pixel_vectors, sample_per_class, sample_uniform, step_generator
from jascl.methods.baselines.semi._shared import PoolPhasesPlugin, _schedule
from jascl.methods.common import frozen_copy
from jascl.methods.labelled_memory import LabelledMemory, LabelledMemoryPlugin
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter

#: targets below this are set to 0 (PAWS, for numerical stability)
TARGET_FLOOR = 1e-4


def soft_nearest_neighbours(
    queries: torch.Tensor, supports: torch.Tensor, support_labels: torch.Tensor, temperature: float
) -> torch.Tensor:
    """PAWS's soft nearest-neighbour classifier: ``softmax_j(q^ . s^_j / tau) @ Y`` on L2-normalised rows.

    Args:
        queries: (N, D); supports: (M, D); support_labels: (M, K) (soft) labels of the supports.
        temperature: tau.

    Returns:
        (N, K) float32 class probabilities (rows sum to 1 for one-hot or smoothed labels), computed outside autocast.
    """
    with torch.autocast(queries.device.type, enabled=False):  # in full precision, as PAWS computes its loss
        q = F.normalize(queries.float(), dim=1)
        s = F.normalize(supports.float(), dim=1)
        return torch.softmax(q @ s.T / temperature, dim=1) @ support_labels.float()


def sharpen(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """``p^(1/T)`` renormalised over the classes (dim 1)."""
    sharp = probs ** (1.0 / temperature)
    return sharp / sharp.sum(dim=1, keepdim=True)


def smoothed_labels(rows: torch.Tensor, columns: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Label-smoothed one-hot labels over ``columns`` (PAWS's labels matrix).

    Args:
        rows: (M,) class of each support, every one in ``columns``.
        columns: (K,) the classes of the support set, in column order.
        smoothing: s; the true column gets ``1 - s + s / K``, the others ``s / K``.

    Returns:
        (M, K) float32.
    """
    k = columns.numel()
    onehot = (rows.unsqueeze(1) == columns.unsqueeze(0)).float()
    return onehot * (1.0 - smoothing) + smoothing / k


def _log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))


def paws_loss(
    anchor_probs: torch.Tensor, target_probs: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PAWS's loss on soft-NN predictions.

    Args:
        anchor_probs: (N, K) predictions of the anchor views (with gradient).
        target_probs: (N, K) predictions of the paired views (detached); sharpened with T, values below
            :data:`TARGET_FLOOR` set to 0 (not renormalised, as in PAWS).
        temperature: T.

    Returns:
        (mean over anchors of the cross-entropy H(targets, anchors), the me-max term ``sum_k pbar_k log pbar_k``
        with pbar the mean sharpened anchor prediction; it is minus the entropy, minimised).
    """
    targets = sharpen(target_probs.detach(), temperature)
    targets = torch.where(targets < TARGET_FLOOR, torch.zeros_like(targets), targets)
    ce = -(targets * _log(anchor_probs)).sum(dim=1).mean()
    mean = sharpen(anchor_probs, temperature).mean(dim=0)
    return ce, (mean * _log(mean)).sum()


def nnd_loss(old_probs: torch.Tensor, current_probs: torch.Tensor) -> torch.Tensor:
    """NND's class-level term: mean over queries of the cross-entropy H(old soft-NN, current soft-NN). (N, K) each."""
    return -(old_probs.detach() * _log(current_probs)).sum(dim=1).mean()


def second_view(images: torch.Tensor, jitter: float, generator: torch.Generator) -> torch.Tensor:
    """The second view of (B, C, *spatial) images: mirrored along the last axis, then ``x * (1 + a) + b`` with
    a, b ~ U(-jitter, jitter) per image (drawn from ``generator``, on the images' device)."""
    b = images.shape[0]
    shape = (b,) + (1,) * (images.dim() - 1)
    ab = (torch.rand(2, b, generator=generator, device=images.device) * 2 - 1) * jitter
    return images.flip(-1) * (1 + ab[0].view(shape).to(images.dtype)) + ab[1].view(shape).to(images.dtype)


@dataclass
class NNCSLOptions:
    """``method_args.nncsl`` options (defaults: the official CIFAR-100 NNCSL configuration where it has one).

    Attributes:
        memory_size: labelled samples (images) the memory keeps, over all sessions (0: no memory; then only the
            PAWS term acts).
        memory_batch_size: memory samples per step (0 = the run's batch size).
        memory_weight: weight of the segmentation cross-entropy on the memory batch (1: as the current batch).
        paws_weight: ``w_paws`` (1).
        me_max_weight: ``w_me_max`` (1).
        nnd_weight: ``w_dist`` (0.2).
        feature_weight: ``alpha``, the share of NND's feature-level term through the projector (0).
        temperature: soft-NN temperature tau (0.1).
        sharpen: target sharpening temperature T (0.25).
        label_smoothing: support label smoothing (0.1).
        support_pixels: support pixels drawn per class and step.
        query_pixels: query pixels drawn per step.
        view_jitter: intensity jitter of the second view.
        freeze: incremental-session freezing ("none": NNCSL trains the whole network).
    """

    memory_size: int = option(20, ge=0)
    memory_batch_size: int = option(0, ge=0)
    memory_weight: float = option(1.0, ge=0)
    paws_weight: float = option(1.0, ge=0)
    me_max_weight: float = option(1.0, ge=0)
    nnd_weight: float = option(0.2, ge=0)
    feature_weight: float = option(0.0, ge=0, le=1)
    temperature: float = option(0.1, gt=0)
    sharpen: float = option(0.25, gt=0)
    label_smoothing: float = option(0.1, ge=0, lt=1)
    support_pixels: int = option(32, ge=1)
    query_pixels: int = option(256, ge=1)
    view_jitter: float = option(0.1, ge=0, lt=1)
    freeze: str = freeze_option("none")


class NNCSLPlugin(PoolPhasesPlugin):
    """NNCSL's losses on the jascl loop (see the module docstring), reading a :class:`LabelledMemory` that a
    :class:`LabelledMemoryPlugin` fills."""

    name = "nncsl"
    loss_terms = ("nncsl_memory", "nncsl_paws", "nncsl_nnd")
    snapshot_exclude = ("memory",)

    def __init__(
        self,
        memory: LabelledMemory,
        memory_batch_size: int = 0,
        memory_weight: float = 1.0,
        paws_weight: float = 1.0,
        me_max_weight: float = 1.0,
        nnd_weight: float = 0.2,
        feature_weight: float = 0.0,
        temperature: float = 0.1,
        sharpen: float = 0.25,
        label_smoothing: float = 0.1,
        support_pixels: int = 32,
        query_pixels: int = 256,
        view_jitter: float = 0.1,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        freeze: str | None = None,
    ) -> None:
        super().__init__(start_epoch, every, batch_size)
        self.memory = memory
        self.memory_batch_size, self.memory_weight = memory_batch_size, memory_weight
        self.paws_weight, self.me_max_weight = paws_weight, me_max_weight
        self.nnd_weight, self.feature_weight = nnd_weight, feature_weight
        self.temperature, self.sharpen_t, self.smoothing = temperature, sharpen, label_smoothing
        self.support_pixels, self.query_pixels, self.view_jitter = support_pixels, query_pixels, view_jitter
        self.freeze_incremental = freeze
        self.teacher: Segmenter | None = None
        self.projector: nn.Linear | None = None
        self.n_old = 0
        self.current_rows: list[int] = []

    # -------------------------------------------------- set-up

    def before_session(self, state: LoopState) -> None:
        self.teacher, self.projector = None, None
        if state.session.index == 0:
            return
        self.teacher = frozen_copy(state)
        self.n_old = len(state.previous_seen)
        self.current_rows = [state.seen.index(c) for c in [0, *state.session.classes]]
        if self.feature_weight > 0:
            d = state.model.backbone.feature_channels
            self.projector = nn.Linear(d, d, bias=False)
            with torch.no_grad():
                self.projector.weight.copy_(torch.eye(d))
            self.projector.to(state.device)
        self._setup_pool(state, salt=11)

    def make_optimizer(self, state: LoopState, params: list, lr: float) -> torch.optim.Optimizer | None:
        if self.projector is None:
            return None
        return make_optimizer(state.config, [*params, *self.projector.parameters()], lr)

    def after_backward(self, state: LoopState) -> None:
        if self.projector is not None:
            distributed.average_gradients(self.projector.parameters())

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self.teacher, self.projector = None, None

    # -------------------------------------------------- losses

    def _memory_batch(self, state: LoopState) -> dict[str, torch.Tensor] | None:
        n = self.memory_batch_size or state.config.batch_size
        seed = derive_seed(state.seed, state.session.index, state.epoch, state.iteration, distributed.rank(), "nncsl")
        return self.memory.sample(n, torch.Generator().manual_seed(seed))

    def _supports(self, rows: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Up to ``support_pixels`` pixels per class of ``rows`` (N,) (-1: not a support): their indices and
        smoothed labels over the classes drawn (ascending); None when there is none."""
        index = sample_per_class(rows, self.support_pixels, generator)
        if index.numel() == 0:
            return None
        chosen = rows[index]
        return index, smoothed_labels(chosen, torch.unique(chosen), self.smoothing)

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        device = state.device
        generator = step_generator(state, "nncsl")
        x = state.batch["image"].to(device)
        h = state.output.features
        rows = align_labels(state.target, h.shape[2:])

        memory = self._memory_batch(state)
        h_m = rows_m = h_m_old = None
        if memory is not None:
            x_m = memory["image"].to(device)
            out_m = state.model.forward_features(x_m)
            target_m = state.class_index(memory["label"].to(device))
            valid = target_m != IGNORE_INDEX
            ce = F.cross_entropy(out_m.logits, target_m, ignore_index=IGNORE_INDEX) if valid.any() else None
            state.losses["nncsl_memory"] = self.memory_weight * (ce if ce is not None else out_m.logits.sum() * 0.0)
            h_m, rows_m = out_m.features, align_labels(target_m, out_m.features.shape[2:])
            with torch.no_grad():
                h_m_old = self.teacher.forward_features(x_m).features

        queries: torch.Tensor | None = None
        query_images: torch.Tensor | None = None
        positions: torch.Tensor | None = None
        if self._phase:
            x_u = self._pool_batch()["image"].to(device)
            views = state.model.forward_features(torch.cat([x_u, second_view(x_u, self.view_jitter, generator)]))
            f_a, f_b = views.features.chunk(2)
            q_a, q_b = pixel_vectors(f_a).float(), pixel_vectors(f_b.flip(-1)).float()
            positions = sample_uniform(q_a.shape[0], self.query_pixels, generator, device)
            q_a, q_b = q_a[positions], q_b[positions]
            queries, query_images = q_a, x_u
            self._paws(state, h, rows, h_m, rows_m, q_a, q_b, generator)

        if h_m is None or rows_m is None or h_m_old is None:
            return
        if queries is None or query_images is None or positions is None:
            vectors = pixel_vectors(h).float()
            positions = sample_uniform(vectors.shape[0], self.query_pixels, generator, device)
            queries, query_images = vectors[positions], x
        self._nnd(state, h_m, rows_m, h_m_old, queries, query_images, positions, generator)

    def _paws(
        self,
        state: LoopState,
        h: torch.Tensor,
        rows: torch.Tensor,
        h_m: torch.Tensor | None,
        rows_m: torch.Tensor | None,
        q_a: torch.Tensor,
        q_b: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        current = torch.tensor(self.current_rows, device=rows.device)
        vectors = [pixel_vectors(h)]
        labels = [torch.where(torch.isin(rows, current), rows, -1).reshape(-1)]
        if h_m is not None and rows_m is not None:
            vectors.append(pixel_vectors(h_m))
            keep = torch.isin(rows_m, current) & (rows_m != 0)
            labels.append(torch.where(keep, rows_m, -1).reshape(-1))
        support = self._supports(torch.cat(labels), generator)
        if support is None:
            return
        index, y = support
        s = torch.cat(vectors)[index].float()
        probs = torch.cat(
            [soft_nearest_neighbours(q_a, s, y, self.temperature), soft_nearest_neighbours(q_b, s, y, self.temperature)]
        )
        with torch.no_grad():  # PAWS: each view's targets from the other view, supports detached
            targets = torch.cat(
                [
                    soft_nearest_neighbours(q_b, s, y, self.temperature),
                    soft_nearest_neighbours(q_a, s, y, self.temperature),
                ]
            )
        ce, me_max = paws_loss(probs, targets, self.sharpen_t)
        state.losses["nncsl_paws"] = self.paws_weight * ce + self.me_max_weight * me_max

    def _nnd(
        self,
        state: LoopState,
        h_m: torch.Tensor,
        rows_m: torch.Tensor,
        h_m_old: torch.Tensor,
        queries: torch.Tensor,
        query_images: torch.Tensor,
        positions: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        assert self.teacher is not None
        old_rows = torch.where(rows_m < self.n_old, rows_m, -1).reshape(-1)  # 255 (ignore) is >= n_old
        support = self._supports(old_rows, generator)
        if support is None:
            return
        index, y = support
        with torch.no_grad():
            old_queries = pixel_vectors(self.teacher.forward_features(query_images).features).float()[positions]
            old_probs = soft_nearest_neighbours(old_queries, pixel_vectors(h_m_old).float()[index], y, self.temperature)
        current = soft_nearest_neighbours(queries, pixel_vectors(h_m).float()[index], y, self.temperature)
        loss = (1 - self.feature_weight) * nnd_loss(old_probs, current)
        if self.projector is not None:
            loss = loss + self.feature_weight * F.mse_loss(self.projector(queries), old_queries)
        state.losses["nncsl_nnd"] = self.nnd_weight * loss


@METHODS.register(
    "nncsl",
    options=NNCSLOptions,
    paper="Kang et al., ICCV 2023",
    doc="baseline: PAWS soft nearest-neighbour learner + NN distillation over a labelled replay memory",
    fidelity=(
        "simplified: pre-classifier features as the embedding (no projection MLP); mirrored and intensity-jittered "
        "views instead of multi-crop"
    ),
    flags=("uses exemplars",),
)
def nncsl(o: NNCSLOptions, config: RunConfig) -> Method:
    """NNCSL with a labelled memory of ``memory_size`` samples, on the unlabelled-phase schedule of
    ``method_args.jascl.pas``."""
    store = LabelledMemoryPlugin(o.memory_size)
    plugin = NNCSLPlugin(
        store.memory,
        memory_batch_size=o.memory_batch_size,
        memory_weight=o.memory_weight,
        paws_weight=o.paws_weight,
        me_max_weight=o.me_max_weight,
        nnd_weight=o.nnd_weight,
        feature_weight=o.feature_weight,
        temperature=o.temperature,
        sharpen=o.sharpen,
        label_smoothing=o.label_smoothing,
        support_pixels=o.support_pixels,
        query_pixels=o.query_pixels,
        view_jitter=o.view_jitter,
        freeze=freeze_policy(o.freeze),
        **_schedule(config),
    )
    return Method("nncsl", [store, plugin], "NNCSL: soft nearest-neighbour learner + NN distillation, labelled memory")
