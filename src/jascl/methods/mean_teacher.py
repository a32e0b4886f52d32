"""Mean teacher on the session's unlabelled pool, with PAS or confidence-only pseudo-label filtering."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from monai.transforms import Compose, RandAdjustContrast, RandGaussianNoise, RandScaleIntensity
from torch.utils.data import DataLoader, Dataset, Subset

from jascl import distributed
from jascl.data.datasets import BatchStream, reseed
from jascl.data.sampling import derive_seed, seeded_loader, split_key
from jascl.engine.plugin import Plugin
from jascl.methods.gas import clean_state_dict
from jascl.methods.pas import (
    AnchorGroups,
    EMAPairs,
    FilterCounters,
    asymptotic_error,
    consistency_loss_probs,
    pas_filter,
    prototype_matrix,
)
from jascl.networks.base import eval_mode
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.data.types import Split
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")


def pixel_errors(pred: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """(2,) long tensor: wrong predictions and pixels with a known label (``truth`` != 255).

    Pool samples without ground truth (a dataset's label-free cases, samples borrowed from
    another source) are all 255 and count for neither, so they do not inflate the error.
    """
    known = truth != IGNORE_INDEX
    return torch.stack([((pred != truth) & known).sum(), known.sum()])


class UnlabelledDataset(Dataset):
    """Unlabelled images with their pool index; the hidden ground truth rides along for *measurement only* (never a loss).

    With ``views`` (intensity transforms), each item also carries ``views``:
    (len(views), C, *spatial), view ``v`` of sample ``i`` in pass ``p`` drawn from
    ``(seed, v, p, i)`` alone (see :mod:`jascl.data.sampling`); made in the
    loader's worker processes.
    """

    def __init__(self, split: Split, views: tuple[Compose, ...] = (), seed: int = 0) -> None:
        self.split = split
        self.views = views
        self.seed = seed

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        pass_index, index = split_key(key)
        image = torch.from_numpy(np.asarray(self.split.images[index])).float()
        item = {
            "image": image,
            "index": index,
            "truth": torch.from_numpy(np.asarray(self.split.labels[index]).astype("int64")),
        }
        if self.views:
            item["views"] = torch.stack(
                [apply_view(t, image, derive_seed(self.seed, v, pass_index, index)) for v, t in enumerate(self.views)]
            )
        return item


def apply_view(transform: Compose, image: torch.Tensor, seed: int) -> torch.Tensor:
    """``transform`` applied to one (C, *spatial) image with its random draws seeded by ``seed``; a plain float tensor."""
    reseed(transform, seed)  # as transform.set_random_state(seed=seed), without building new random states
    # plain tensors: MONAI MetaTensors would slow down every later operation
    return torch.as_tensor(transform(image)).as_subclass(torch.Tensor).float()


def view_transform(seed: int) -> Compose:
    """Intensity-only augmentation (pixels stay aligned between the student's and the teacher's views)."""
    return Compose(
        [
            RandScaleIntensity(factors=0.1, prob=1.0),
            RandAdjustContrast(gamma=(0.8, 1.25), prob=1.0),
            RandGaussianNoise(std=0.03, prob=1.0),
        ]
    ).set_random_state(seed)


class TeacherPhases(Plugin):
    """What every mean teacher on a session's unlabelled pool shares (pixels: :class:`MeanTeacherPlugin`; boxes:
    :class:`jascl.methods.detection.pas.DetectionMeanTeacherPlugin`): the teacher, a frozen copy of the student
    made when an incremental session has a pool (:meth:`start_teacher`), its EMA, and the unlabelled phases,
    every ``every`` epochs from ``start_epoch``, each one pass over the pool's loader (``self._loader``, set by
    the subclass). Subclasses set ``start_epoch``, ``every``, ``ema_decay`` and ``ema``: "step" (one EMA step of
    parameters and buffers after every optimiser step, the standard mean teacher) or "phase" (one EMA step of the
    parameters at the end of each unlabelled phase, the teacher's buffers kept: the authors' ``update_teacher``).
    """

    start_epoch = 25
    every = 25
    ema_decay = 0.99
    ema = "step"
    teacher: Any = None
    _ema: EMAPairs | None = None
    _loader: Any = None
    _batches: BatchStream | None = None

    def start_teacher(self, state: LoopState) -> bool:
        """Make the session's teacher (and its EMA pairs) when it has an unlabelled pool; whether it has one."""
        self.teacher = None
        pool = state.data.unlabelled
        if state.session.index == 0 or pool is None or len(pool) == 0:
            return False
        self.teacher = state.new_model(state.model.num_classes)
        self.teacher.load_state_dict(clean_state_dict(state.model))
        self.teacher.eval().requires_grad_(False)
        self._ema = EMAPairs(self.teacher, clean_state_dict(state.model), buffers=self.ema == "step")
        return True

    def _is_phase(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (epoch - self.start_epoch) % max(self.every, 1) == 0

    def epoch_iterations(self, state: LoopState) -> int | None:
        if self.teacher is not None and self._is_phase(state.epoch):
            return len(self._loader)
        return None

    def after_update(self, state: LoopState) -> None:
        if self.ema == "step" and self.teacher is not None and self._ema is not None:
            self._ema.step(self.ema_decay)

    def after_epoch(self, state: LoopState) -> None:
        if self.ema == "phase" and self.teacher is not None and self._ema is not None and self._is_phase(state.epoch):
            self._ema.step(self.ema_decay)

    def after_session(self, state: LoopState) -> None:
        self.teacher = None
        self._ema = None
        self._loader = None
        self._batches = None


class MeanTeacherPlugin(TeacherPhases):
    """Student-teacher consistency on unlabelled data, filtered by PAS (or by confidence only).

    In every incremental session with an unlabelled pool the teacher starts as a
    copy of the student and follows it by EMA after every optimiser step (the
    standard mean teacher; the authors' code applies one EMA step per
    unlabelled phase, which leaves the teacher almost at its starting point).
    From ``start_epoch`` on, every ``every`` epochs is an *unlabelled phase*:
    the epoch makes one pass over the unlabelled pool, each step pairing a
    labelled batch with an unlabelled one, and adds
    ``weight * L_consistency`` (eq. 5) on the pixels valid for both models.
    Prototypes for PAS are recomputed from the session's labelled data at the
    start of every phase (as the authors do), falling back to stored ones for
    classes the session does not teach. The defaults follow eqs. 2-3 literally: a
    sample's prototype is the plain mean of its class features, the class prototype
    P_c the mean of the unit-normalised sample prototypes, and eq. 3 the cosine to
    P_c. Two departures are options (together: the ``jascl-anchors`` preset; their
    measured effect is in docs/method.md, "PAS: literal or per-sample anchors"):

    * ``normalize_pixels``: average L2-normalised pixel features, as the authors'
      ``get_prototype`` does. With eq. 2's plain mean, high-norm pixels steer the
      direction eq. 3 compares against: in synthetic-2d-ss's xray session,
      unlabelled old-class objects inside the labelled background have about 3x
      the feature norm of true background, the background prototype leans
      towards them, and PAS keeps missed objects while rejecting real background.
    * ``anchors="per-sample"``: keep every labelled sample's prototype (the
      summands of eq. 2) and test eq. 4 against the best-matching one. Under
      domain shift the background varies from image to image and a single mean
      rejects most of it; stored anchors from *other* domains are not added,
      because there they match the wrong pixels (a CT background anchor matches
      dark xray objects).

    Args:
        filter: "pas" (confidence and prototype similarity) or "confidence".
        tau_conf, tau_sim: thresholds (paper: 0.7 / 0.7).
        weight: lambda_cons (authors, medical: 0.05).
        ema_decay: teacher EMA decay (authors: 0.99).
        start_epoch, every: unlabelled-phase schedule (authors' medical code: every 25 epochs).
        batch_size: unlabelled batch size (default: the labelled one).
        normalize_pixels: session prototypes from L2-normalised pixel features (False: eq. 2's plain mean).
        max_anchors: at most this many per-sample anchors per class (a spread-out subset,
            :func:`jascl.methods.pas.select_anchors`; 0 = all): every pixel is compared with each.
        anchors: "mean" (eq. 2: one prototype per class) or "per-sample" (eq. 2's summands, one
            anchor per labelled sample of the class; a pixel's sim is its best-matching anchor's).
        ema: "step" or "phase" (:class:`TeacherPhases`).
    """

    name = "cons"
    loss_terms = ("cons",)
    #: the filters counted in :attr:`counters`, in order
    COUNTED = ("filter", "confidence", "filter_foreground", "confidence_foreground")
    #: views of the teacher's and the student's own tensors: restored with the models, not again
    snapshot_exclude = ("_ema",)
    #: a phase's set-up is in the checkpoint: the stream's position, the anchors' source tensor
    mid_epoch_resume = True

    def __init__(
        self,
        filter: str = "pas",
        tau_conf: float = 0.7,
        tau_sim: float = 0.7,
        weight: float = 0.05,
        ema_decay: float = 0.99,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        normalize_pixels: bool = False,
        anchors: str = "mean",
        max_anchors: int = 16,
        ema: str = "step",
    ) -> None:
        if filter not in ("pas", "confidence"):
            raise ValueError(f"filter must be 'pas' or 'confidence', got {filter!r}")
        if ema not in ("step", "phase"):
            raise ValueError(f"ema must be 'step' or 'phase', got {ema!r}")
        self.ema = ema
        if anchors not in ("mean", "per-sample"):
            raise ValueError(f"anchors must be 'mean' or 'per-sample', got {anchors!r}")
        self.anchors = anchors
        self.max_anchors = max_anchors
        self.filter = filter
        self.tau_conf, self.tau_sim = tau_conf, tau_sim
        self.weight = weight
        self.ema_decay = ema_decay
        self.start_epoch, self.every = start_epoch, every
        self.batch_size = batch_size
        self.normalize_pixels = normalize_pixels
        self.teacher = None
        self._batches: BatchStream | None = None
        self._loader: DataLoader | None = None
        self._anchor_source: torch.Tensor | None = None  # (K, A, D) anchors of the phase, kept for checkpoints
        self._anchors: AnchorGroups | None = None
        self._phase = False

    # ---------------------------------------------------------------- events

    def before_session(self, state: LoopState) -> None:
        if not self.start_teacher(state):
            return
        t = state.session.index
        views = (view_transform(state.seed + 1), view_transform(state.seed + 2))
        self._loader = seeded_loader(
            UnlabelledDataset(state.data.unlabelled, views, derive_seed(state.seed, "views", t)),
            self.batch_size or state.config.batch_size,
            derive_seed(state.seed, "unlabelled", t),
            **state.loader_options,
        )
        self._batches = BatchStream(self._loader)
        self._seen = torch.as_tensor(state.seen, device=state.device)  # classifier row -> global class id
        # counted side by side on the same predictions: PAS (the filter in use), confidence-only (for
        # comparison), and the same two restricted to foreground pseudo-labels
        self.counters = FilterCounters(filters=len(self.COUNTED))
        self.eps0: float | None = None
        self.phases = 0

    def before_epoch(self, state: LoopState) -> None:
        self._phase = self.teacher is not None and self._is_phase(state.epoch)
        if not self._phase:
            return
        self._batches = BatchStream(self._loader)
        if self.filter == "pas":
            current = state.compute_prototypes(
                [0, *state.session.classes],
                normalize_pixels=self.normalize_pixels,
                per_sample=self.anchors == "per-sample",
            )
            self._anchor_source = prototype_matrix(
                state.seen, current, state.prototypes, state.model.backbone.feature_channels, self.max_anchors
            )
            self._anchors = AnchorGroups(self._anchor_source, state.device)
        if self.eps0 is None:  # the student trained on labelled data only so far
            self.eps0 = self.pool_error(state, state.model)
        self.phases += 1

    def resume_epoch(self, state: LoopState) -> None:
        if self._phase and self.filter == "pas" and self._anchor_source is not None:
            self._anchors = AnchorGroups(self._anchor_source, state.device)

    def _student_teacher_views(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's and the teacher's view of an unlabelled batch, each (B, C, *spatial)."""
        return batch["views"][:, 0], batch["views"][:, 1]

    def after_forward(self, state: LoopState) -> None:
        if not self._phase:
            return
        batch = next(self._batches)
        x_s, x_t = (v.to(state.device, non_blocking=True) for v in self._student_teacher_views(batch))
        out_s = state.model.forward_features(x_s)
        with torch.no_grad():
            out_t = self.teacher.forward_features(x_t)
        protos = self._anchors if self.filter == "pas" else None
        p_s = torch.softmax(out_s.logits.float(), dim=1)  # shared by the filter and the loss
        p_t = torch.softmax(out_t.logits.float(), dim=1)
        s = pas_filter(out_s.logits, out_s.features.detach(), protos, self.tau_conf, self.tau_sim, probs=p_s.detach())
        t = pas_filter(out_t.logits, out_t.features, protos, self.tau_conf, self.tau_sim, probs=p_t)
        valid = s.valid & t.valid
        state.losses[self.name] = self.weight * consistency_loss_probs(p_s, p_t, valid)
        pred_ids = self._seen[t.pred]
        conf_only = (s.conf > self.tau_conf) & (t.conf > self.tau_conf)
        both = torch.stack([valid, conf_only])
        self.counters.update(torch.cat([both, both & (pred_ids != 0)]), pred_ids, batch["truth"].to(state.device))

    @torch.no_grad()
    def pool_error(self, state: LoopState, model: torch.nn.Module) -> float:
        """Pixel error rate of ``model`` on the unlabelled pool (hidden ground truth where known), GAS noise off."""
        seen = torch.as_tensor(state.seen, device=state.device)
        counts = torch.zeros(2, dtype=torch.long, device=state.device)  # wrong, total
        pool = Subset(UnlabelledDataset(state.data.unlabelled), distributed.shard(range(len(state.data.unlabelled))))
        with eval_mode(model), state.autocast():
            for batch in DataLoader(pool, batch_size=self._loader.batch_sampler.batch_size):
                pred = seen[model(batch["image"].to(state.device)).argmax(1)]
                counts += pixel_errors(pred, batch["truth"].to(state.device))
        wrong, total = (int(v) for v in distributed.all_reduce_sum(counts))
        return wrong / total if total else float("nan")

    def after_training(self, state: LoopState) -> None:
        if self.teacher is None:
            return
        self.counters.all_reduce()
        c, conf, fg, fg_conf = (self.counters.stats(f) for f in range(len(self.COUNTED)))
        gamma = self.weight / (1.0 + self.weight)
        eps_final = self.pool_error(state, self.teacher)
        eps0 = self.eps0 if self.eps0 is not None else eps_final
        stats = {
            "filter": self.filter,
            "phases": self.phases,
            "coverage": c.coverage,
            "precision": c.precision,
            "confidence_only_coverage": conf.coverage,
            "confidence_only_precision": conf.precision,
            "foreground_precision": fg.precision,
            "confidence_only_foreground_precision": fg_conf.precision,
            "per_class": {str(k): {"kept": n, "precision": r} for k, (n, r) in c.per_class().items()},
            "confidence_only_per_class": {
                str(k): {"kept": n, "precision": r} for k, (n, r) in conf.per_class().items()
            },
            "gamma": gamma,
            "eps0": eps0,
            "eps_inf_predicted": asymptotic_error(c.coverage, c.precision, gamma, eps0) if c.kept else eps0,
            "teacher_error_final": eps_final,
        }
        state.report["pseudo_labels"] = stats
        log.info(
            "session %d pseudo-labels: %s",
            state.session.index,
            ", ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in stats.items()
                if not isinstance(v, dict)
            ),
        )

    def after_session(self, state: LoopState) -> None:
        super().after_session(state)
        self._anchor_source, self._anchors = None, None
