"""Adapt-Replay (G. Zhu, D. Wu, C. Gao, R. Wang, W. Yang, N. Sang, "Adaptive Prototype Replay for Class
Incremental Semantic Segmentation", AAAI 2025; method "Adapter", official code github.com/zhu-gl-ux/Adapter):
Saving-100x plus adaptive deviation compensation (ADC), an uncertainty-aware constraint (UAC) and compensated
prototypes in the SAD term (CPD)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method
from jascl.engine.prototypes import align_labels
from jascl.methods.common import labelled_loader, whole_forward
from jascl.methods.options import freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.replay._shared import (
    _small_logits,
    compensate_prototypes,
    log,
    prediction_certainty,
    uncertainty_constraint_loss,
)
from jascl.methods.baselines.replay.saving100x import Saving100xOptions, Saving100xPlugin


@dataclass
class AdaptReplayOptions(Saving100xOptions):
    """Options of ``adapt-replay`` (defaults: Adapter's official ``configs/config_voc.json``).

    Attributes:
        uac_weight: weight of the uncertainty-aware constraint (``uncer`` 0.1).
        certainty: top-1 minus top-2 threshold of the ADC pixels, and tau of UAC (0.7).
        adc: compensate the stored prototypes at the end of each session (the
            official release has this call commented out; the paper describes it).
    """

    uac_weight: float = option(0.1, ge=0)
    certainty: float = option(0.7, ge=0, le=1)
    adc: bool = True


class AdaptReplayPlugin(Saving100xPlugin):
    """Adapter (Zhu et al., AAAI 2025): STAR + ADC + UAC, with CPD (SAD on compensated prototypes).

    ``adapter_uac`` adds :func:`uncertainty_constraint_loss`; at the end of each
    incremental session, before the new statistics are stored, the stored
    prototypes of untaught old classes are moved by :func:`compensate_prototypes`,
    estimated on the labelled set's background pixels that the old and the new
    model both predict as that class with certainty > ``certainty``; later
    sessions replay and push away from the compensated prototypes.

    Deviations: those of :class:`Saving100xPlugin`; softmax probabilities for
    the certainty (Adapter: sigmoids); ADC's ratio clipped to [0, 1]; ADC is
    applied although the official release leaves its call commented out.
    """

    name = "adapter"
    loss_terms = ("adapter_replay", "adapter_ocfm", "adapter_cpd", "adapter_uac")
    sad_key = "cpd"

    def __init__(self, options: AdaptReplayOptions | None = None, freeze: str | None = "none") -> None:
        super().__init__(options or AdaptReplayOptions(), freeze)

    def after_forward(self, state: LoopState) -> None:
        super().after_forward(state)
        if self.teacher is None:
            return
        target = state.class_index(state.batch["label"].to(state.device))
        state.losses[self.key("uac")] = self.o.uac_weight * uncertainty_constraint_loss(
            state.output.logits, target, self.o.certainty
        )

    @torch.no_grad()
    def compensate(self, state: LoopState) -> None:
        """ADC on the stored prototypes of the old classes not taught in this session."""
        rows = self._absorbed[1:]
        ids = [state.previous_seen[r] for r in rows if state.previous_seen[r] in self.store.classes]
        if not ids:
            return
        rows = [state.seen.index(c) for c in ids]
        d = state.model.backbone.feature_channels
        before = torch.zeros(len(ids), d, dtype=torch.float64)
        after = torch.zeros_like(before)
        confident = torch.zeros(len(ids), dtype=torch.float64)
        with eval_mode(state.model):
            for batch in labelled_loader(state):
                x = batch["image"].to(state.device)
                out_s, out_t = whole_forward(state, state.model, x), whole_forward(state, self.teacher, x)
                p_t = F.softmax(_small_logits(self.teacher, out_t)[:, : self.num_old], dim=1)
                p_s = F.softmax(_small_logits(state.model, out_s), dim=1)
                labels = align_labels(state.class_index(batch["label"].to(state.device)), out_s.features.shape[2:])
                sure = (
                    (labels == 0)
                    & (prediction_certainty(p_t) > self.o.certainty)
                    & (prediction_certainty(p_s) > self.o.certainty)
                )
                pred_t, pred_s = p_t.argmax(dim=1), p_s.argmax(dim=1)
                unit_t, unit_s = F.normalize(out_t.features, dim=1), F.normalize(out_s.features, dim=1)
                for i, row in enumerate(rows):
                    m = (sure & (pred_t == row) & (pred_s == row)).unsqueeze(1)
                    if m.any():
                        dims = [0, *range(2, unit_t.dim())]
                        before[i] += (unit_t * m).sum(dim=dims).double().cpu()
                        after[i] += (unit_s * m).sum(dim=dims).double().cpu()
                        confident[i] += float(m.sum())
        stats = [self.store.classes[c] for c in ids]
        stored = torch.stack([s.prototype for s in stats]).double()
        protos, noise = compensate_prototypes(
            stored,
            torch.stack([s.noise for s in stats]).double(),
            before,
            after,
            confident,
            torch.tensor([s.count for s in stats], dtype=torch.float64),
        )
        for i, s in enumerate(stats):
            s.prototype, s.noise = protos[i].float(), noise[i].float()
        log.info(
            "%s session %d: ADC on classes %s from %s confident pixels, prototype moves %s",
            self.name,
            state.session.index,
            ids,
            [int(v) for v in confident],
            [round(float(v), 4) for v in (protos - stored).norm(dim=1)],
        )

    def after_training(self, state: LoopState) -> None:
        if self.teacher is not None and self.o.adc:
            self.compensate(state)
        super().after_training(state)


@METHODS.register(
    "adapt-replay",
    options=AdaptReplayOptions,
    paper="Zhu et al., AAAI 2025 (Adapter)",
    doc="baseline: adaptive prototype replay, ADC + UAC + CPD",
    fidelity="simplified: as saving100x; prototype compensation on although the official release comments it out",
)
def adapt_replay(o: AdaptReplayOptions, config: RunConfig) -> Method:
    """Adapter: STAR with compensated prototypes and an uncertainty-aware constraint."""
    return Method(
        "adapt-replay",
        [AdaptReplayPlugin(o, freeze_policy(o.freeze))],
        "Adapter: STAR with compensated prototypes and an uncertainty constraint",
    )
