"""Saving-100x (J. Chen, R. Cong, Y. Luo, H. H. S. Ip, S. Kwong, "Saving 100x Storage: Prototype Replay for
Reconstructing Training Sample Distribution in Class-Incremental Semantic Segmentation", NeurIPS 2023; method "STAR",
official code github.com/jinpeng0528/STAR). Not the ``star`` method (Eskandar et al., ICLR 2025)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.defaults import default_supervised_loss
from jascl.engine.plugin import Method
from jascl.engine.prototypes import align_labels
from jascl.methods.baselines.distillation._shared import (
    TeacherPlugin,
    absorbed_rows,
    merge_absorbed_probabilities,
    soft_dice_loss,
    unbiased_cross_entropy,
)
from jascl.methods.common import labelled_loader, whole_forward
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.replay._shared import (
    ClassStatistics,
    FeatureStatistics,
    ReplayStore,
    _small_logits,
    log,
    ocfm_loss,
    replay_balanced_ce,
    sad_loss,
    sample_replay_features,
)


@dataclass
class Saving100xOptions:
    """Options of ``saving100x`` (defaults: STAR's official ``configs/config_voc.json``).

    Attributes:
        ocfm_weight: weight of the old-class features maintaining loss (``pkd`` 5).
        sad_weight: weight of the similarity-aware discriminative loss (``cont`` 0.05).
        replay: replay prototypes and repeat true background (false: only OCFM / SAD).
        max_replay_per_class: synthetic features drawn per class and iteration at
            most; larger counts are represented by importance weights (same
            expected loss, bounded memory on 3D data).
        dice: add the run's ``lambda_dice`` x soft Dice on background-merged probabilities.
        freeze: incremental-session freezing ("none": STAR trains the whole network;
            OCFM needs trainable features).
    """

    ocfm_weight: float = option(5.0, ge=0)
    sad_weight: float = option(0.05, ge=0)
    replay: bool = True
    max_replay_per_class: int = option(4096, ge=1)
    dice: bool = True
    freeze: str = freeze_option("none")


class Saving100xPlugin(TeacherPlugin):
    """STAR (Chen et al., NeurIPS 2023) on the jascl loop.

    End of every session (``after_training``; ``session_restored`` for the shared
    base): :class:`FeatureStatistics` of the session's taught classes from the
    final model on the labelled set, stored in a :class:`ReplayStore` that is
    saved with each checkpoint; the true-background pixel count accumulates.

    Incremental sessions: at the start, the old model counts, on the labelled
    set's background pixels, those it predicts as each old class and as true
    background. Each iteration replays ``(count_c - present_c) / iterations``
    synthetic features of every old class c (``present_c``: pixels of c already
    in the session's images) and repeats the true-background pixels of the batch
    ``stored background / session true background`` times, combined with the
    current pixels by :func:`replay_balanced_ce` -- the current part *replaces* the
    loop's ``state.losses["seg"]`` (+ Dice), the rest is ``<name>_replay``;
    ``<name>_ocfm`` and ``<name>_sad`` add the feature terms.

    Deviations (STAR trains one sigmoid head per class and supervises only the
    new heads with the current labels, old heads untouched): with our softmax
    classifier the current pixels use MiB's background-merged cross-entropy (a
    background pixel may be background or a hidden old class -- the softmax
    analogue of "not a new class"); replayed features are classified as their
    own class and repeated true background as background; statistics at the
    features' resolution instead of 1/16 subsampled labels; one norm per
    synthetic feature; draws capped per class with importance weights; the
    distribution-matching counts use STAR's "overlap" rule without its VOC
    constants; pixels the old model predicts as a class taught again are left out
    of OCFM; new classifier rows keep the loop's prototype imprinting (STAR:
    random); the Dice half of "seg".
    """

    name = "saving100x"
    loss_terms = ("saving100x_replay", "saving100x_ocfm", "saving100x_sad")
    replaces = ("supervised-loss",)  # "seg" is the method's own in incremental sessions
    sad_key = "sad"

    def __init__(self, options: Saving100xOptions | None = None, freeze: str | None = "none") -> None:
        super().__init__(freeze, init="imprint")
        self.o = options or Saving100xOptions()
        self.store = ReplayStore()
        self._pred_background = 0.0
        self._labelled_background = 0.0
        self._replay: list[tuple[int, int, float]] = []  # (stored class id, draws per iteration, weight per draw)
        self._bg_ratio = 0.0
        self._generator: torch.Generator | None = None

    def key(self, term: str) -> str:
        return f"{self.name}_{term}"

    # ------------------------------------------------------------------ plugin state

    def extra_state(self) -> dict[str, torch.Tensor]:
        return self.store.to_tensors()

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.store = ReplayStore.from_tensors(tensors)

    # ------------------------------------------------------------------ statistics passes

    @torch.no_grad()
    def gather_statistics(self, state: LoopState) -> dict[int, ClassStatistics]:
        """Statistics of the session's taught classes from the current model (eval mode)."""
        model = state.model
        with eval_mode(model):
            acc = FeatureStatistics(state.session.classes, model.backbone.feature_channels)
            background = 0.0
            for batch in labelled_loader(state):
                features = whole_forward(state, model, batch["image"].to(state.device)).features
                labels = align_labels(batch["label"].to(state.device), features.shape[2:])
                acc.update(features, labels)
                background += float((labels == 0).sum())
        self._labelled_background = background
        return acc.compute()

    def _store_session(self, state: LoopState, trained: bool) -> None:
        stats = self.gather_statistics(state)
        for cid, s in stats.items():
            self.store.add(cid, s)
        if state.session.index == 0:
            self.store.background = self._labelled_background
        elif trained:
            self.store.background += self._pred_background
        else:  # a reused incremental session without saved statistics: no old model to separate true background
            self.store.background += self._labelled_background
            log.warning(
                "%s: session %d reused without saved statistics; its background count includes old classes",
                self.name,
                state.session.index,
            )

    def session_restored(self, state: LoopState) -> None:
        if any(c not in self.store.classes for c in state.session.classes):
            self._store_session(state, trained=False)

    @torch.no_grad()
    def count_present(self, state: LoopState) -> tuple[dict[int, float], float]:
        """Old-model counts on the labelled set: pixels of each stored class already present, and true background.

        Taught classes count their labelled pixels; untaught old classes the
        background-labelled pixels the old model predicts as them.
        """
        present = {cid: 0.0 for cid in self.store.classes}
        true_bg = 0.0
        for batch in labelled_loader(state):
            out = whole_forward(state, self.teacher, batch["image"].to(state.device))
            pred = _small_logits(self.teacher, out)[:, : self.num_old].argmax(dim=1)
            labels = align_labels(state.class_index(batch["label"].to(state.device)), out.features.shape[2:])
            background = labels == 0
            true_bg += float((background & (pred == 0)).sum())
            for cid in present:
                row = state.seen.index(cid)
                if cid in state.session.classes:
                    present[cid] += float((labels == row).sum())
                else:
                    present[cid] += float((background & (pred == row)).sum())
        return present, true_bg

    # ------------------------------------------------------------------ events

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        if self.teacher is None:
            return
        self._absorbed = absorbed_rows(state)
        self._new_rows = [state.seen.index(c) for c in state.session.new_classes]
        self._old_ids = [c for c in sorted(self.store.classes) if c in state.previous_seen]
        present, true_bg = self.count_present(state)
        self._pred_background = true_bg
        iterations = max(math.ceil(len(state.data.train) / state.config.batch_size), 1)
        self._replay = []
        for cid in self._old_ids:
            per_iter = int(max(self.store.classes[cid].count - present[cid], 0.0) / iterations)
            if per_iter > 0:
                draws = min(per_iter, self.o.max_replay_per_class)
                self._replay.append((cid, draws, per_iter / draws))
        self._bg_ratio = self.store.background / true_bg if true_bg > 0 else 0.0
        self._prototypes = (
            torch.stack([self.store.classes[c].prototype for c in self._old_ids]).to(state.device)
            if self._old_ids
            else torch.zeros(0, state.model.backbone.feature_channels, device=state.device)
        )
        self._generator = torch.Generator(device=state.device).manual_seed(state.seed * 7919 + state.session.index)
        log.info(
            "%s session %d: replay per iteration %s, background ratio %.3f",
            self.name,
            state.session.index,
            {c: n for c, n, _ in self._replay},
            self._bg_ratio,
        )

    def replay_loss_sums(self, state: LoopState) -> tuple[torch.Tensor, float]:
        """(sum of replayed CE, number of replayed features represented) for this iteration."""
        if not (self.o.replay and self._replay):
            return state.output.logits.sum() * 0.0, 0.0
        total, represented = [], 0.0
        for cid, draws, weight in self._replay:
            s = self.store.classes[cid]
            fake = sample_replay_features(
                s.prototype.to(state.device), s.noise.to(state.device), s.norm_mean, s.norm_std, draws, self._generator
            )
            target = torch.full((draws,), state.seen.index(cid), device=state.device, dtype=torch.long)
            total.append(weight * F.cross_entropy(state.model.classifier(fake), target, reduction="sum"))
            represented += weight * draws
        return torch.stack(total).sum(), represented

    def after_forward(self, state: LoopState) -> None:
        if self.teacher is None:
            state.losses["seg"] = default_supervised_loss(state)
            return
        cfg = state.config
        out, out_t = state.output, self.teacher_outputs(state)
        target = state.target
        current = unbiased_cross_entropy(out.logits, target, self._absorbed)
        dice = 0.0
        if self.o.dice and cfg.lambda_dice:
            merged, mapped = merge_absorbed_probabilities(out.logits, target, self._absorbed)
            dice = cfg.lambda_dice * soft_dice_loss(merged, mapped)

        small = _small_logits(state.model, out)
        labels = align_labels(target, out.features.shape[2:])
        pred_old = _small_logits(self.teacher, out_t)[:, : self.num_old].argmax(dim=1)
        background = labels == 0
        replay_sum, n_replay = self.replay_loss_sums(state)
        true_bg = background & (pred_old == 0)
        if self.o.replay and self._bg_ratio > 0 and true_bg.any():
            bg_ce = F.cross_entropy(small, torch.zeros_like(labels), reduction="none")[true_bg].sum()
        else:
            bg_ce = small.sum() * 0.0
        ratio = self._bg_ratio if self.o.replay else 0.0
        cur, rep = replay_balanced_ce(current, replay_sum, n_replay, bg_ce, float(true_bg.sum()), ratio, labels.numel())
        state.losses["seg"] = cfg.lambda_ce * cur + dice
        state.losses[self.key("replay")] = cfg.lambda_ce * rep

        hidden_old = torch.isin(pred_old, torch.as_tensor(self._absorbed[1:], device=state.device, dtype=torch.long))
        state.losses[self.key("ocfm")] = self.o.ocfm_weight * ocfm_loss(
            out.features, out_t.features, background & hidden_old
        )
        state.losses[self.key(self.sad_key)] = self.o.sad_weight * sad_loss(
            out.features, labels, self._new_rows, self._prototypes
        )

    def after_training(self, state: LoopState) -> None:
        self._store_session(state, trained=True)


@METHODS.register(
    "saving100x",
    options=Saving100xOptions,
    paper="Chen et al., NeurIPS 2023 (STAR)",
    doc="baseline: prototype + statistics replay, OCFM, SAD",
    fidelity="simplified: softmax classifier instead of new-only sigmoid heads; replay capped per class",
)
def saving100x(o: Saving100xOptions, config: RunConfig) -> Method:
    """STAR: prototype replay that reconstructs the training distribution, with OCFM and SAD."""
    return Method(
        "saving100x",
        [Saving100xPlugin(o, freeze_policy(o.freeze))],
        "STAR: prototype replay reconstructing the training distribution",
    )
