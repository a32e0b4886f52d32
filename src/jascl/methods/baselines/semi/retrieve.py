"""RETRIEVE (Killamsetty, Zhao, Chen and Iyer, "RETRIEVE: Coreset Selection for Efficient and Robust
Semi-Supervised Learning", NeurIPS 2021; code CORDS, cords/selectionstrategies/SSL/retrievestrategy.py): greedy
bilevel coreset selection of the unlabelled pool on last-layer gradients, under the confidence-filtered mean teacher."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader, Subset

from jascl.data.datasets import BatchStream
from jascl.engine.plugin import Method
from jascl.methods.common import crops_for_volumes, labelled_crops, labelled_loader
from jascl.methods.mean_teacher import MeanTeacherPlugin, UnlabelledDataset, view_transform
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.pas import consistency_loss, pas_filter
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode, resize
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter
from jascl.methods.baselines.semi._shared import _schedule


def retrieve_greedy(
    unlabelled_grads: torch.Tensor,
    val_grad: Callable[[torch.Tensor], torch.Tensor],
    budget: int,
    eta: float,
    candidates: Callable[[list[int]], list[int]] | None = None,
) -> list[int]:
    """RETRIEVE's greedy coreset selection (Killamsetty et al. 2021, Alg. 1, last-layer version).

    Gain of adding element e to S: the one-step Taylor estimate of the drop of
    the labelled loss, ``g_e . grad L_L(theta_S)``, where
    ``theta_S = theta - eta * sum_{j in S} g_j`` (the inner step on S); after
    each choice theta_S and the labelled gradient are updated.

    Args:
        unlabelled_grads: (N, P) gradient of each element's (weighted) unlabelled loss.
        val_grad: maps a (P,) parameter step delta to the (P,) labelled-loss
            gradient at theta + delta.
        budget: elements to choose (at most N).
        eta: step size of the inner step.
        candidates: maps the remaining indices to those evaluated at this step
            (stochastic greedy); None = all (naive greedy).

    Returns:
        chosen indices in order of choice.
    """
    remaining = list(range(unlabelled_grads.shape[0]))
    chosen: list[int] = []
    step_sum = torch.zeros_like(unlabelled_grads[0])
    grad = val_grad(torch.zeros_like(step_sum))
    while len(chosen) < min(budget, unlabelled_grads.shape[0]):
        pool = candidates(remaining) if candidates is not None else remaining
        gains = unlabelled_grads[pool] @ grad
        best = pool[int(gains.argmax())]
        chosen.append(best)
        remaining.remove(best)
        step_sum = step_sum + unlabelled_grads[best]
        grad = val_grad(-eta * step_sum)
    return chosen


@dataclass
class RetrieveOptions:
    """``method_args.retrieve`` options (defaults: CORDS' SSL configs unless noted).

    Attributes:
        fraction: pool fraction in the coreset (paper: 10-30 %; 0.1).
        greedy: "stochastic" (CORDS' default for RETRIEVE) or "naive".
        epsilon: stochastic-greedy accuracy; each step evaluates N/k * ln(1/epsilon) candidates (0.01).
        tau_conf: confidence threshold of the mean teacher's pseudo-label filter
            (the repository's ``mean-teacher-conf``; -1 = ``config.pas.tau_conf``).
        freeze: "config" (default), "none" or "all_but_classifier".
    """

    fraction: float = option(0.1, gt=0, le=1)
    greedy: str = option("stochastic", choices=("stochastic", "naive"))
    epsilon: float = option(0.01, gt=0, lt=1)
    tau_conf: float = option(-1.0, le=1)
    freeze: str = freeze_option()


class RetrievePlugin(MeanTeacherPlugin):
    """RETRIEVE: the confidence-filtered mean teacher, trained on a coreset of the pool re-chosen every phase.

    At the start of every unlabelled phase the coreset (``fraction`` of the
    pool, at least one image) is chosen by :func:`retrieve_greedy`: element
    gradients are those of ``weight * L_consistency`` (eq. 5, the mean
    teacher's term) of each pool image with respect to the classifier
    parameters; the labelled loss is the cross-entropy of the session's
    labelled images (training labels, no augmentation; volumes as training
    crops, :func:`jascl.methods.common.crops_for_volumes`, so the cached
    features of a session of CT volumes fit in memory) through
    the classifier, evaluated exactly at the stepped classifier parameters on
    cached features; eta is the optimiser's current learning rate. The
    phase's pass then runs the mean teacher over the coreset only; the loss
    key is ``retrieve``.

    Deviations: elements are whole images (their pixels' losses averaged);
    the last layer is our classifier (cosine or linear), whose stepped loss
    is recomputed exactly rather than through CORDS' linearised logits; the
    selection interval is the unlabelled-phase schedule (CORDS reselects every
    20 epochs); the underlying SSL algorithm is the repository's mean teacher
    with confidence filtering (the paper pairs RETRIEVE with VAT, Mean Teacher
    and FixMatch; FixMatch's confidence mask is the m_jt of its formulation).
    """

    name = "retrieve"
    loss_terms = ("retrieve",)

    def __init__(
        self,
        fraction: float = 0.1,
        greedy: str = "stochastic",
        epsilon: float = 0.01,
        tau_conf: float = 0.7,
        weight: float = 0.05,
        ema_decay: float = 0.99,
        start_epoch: int = 25,
        every: int = 25,
        batch_size: int | None = None,
        freeze: str | None = None,
    ) -> None:
        super().__init__(
            filter="confidence",
            tau_conf=tau_conf,
            tau_sim=0.0,
            weight=weight,
            ema_decay=ema_decay,
            start_epoch=start_epoch,
            every=every,
            batch_size=batch_size,
        )
        self.fraction, self.greedy, self.epsilon = fraction, greedy, epsilon
        self.freeze_incremental = freeze
        self.coresets: list[list[int]] = []

    def before_session(self, state: LoopState) -> None:
        super().before_session(state)
        self.coresets = []
        if self.teacher is not None:
            self._generator = torch.Generator().manual_seed(state.seed * 7919 + state.session.index)
            self._select_rng = torch.Generator().manual_seed(state.seed * 104729 + state.session.index)
            self._views = (view_transform(state.seed + 1), view_transform(state.seed + 2))

    def _coreset_loader(self, state: LoopState, coreset: list[int]) -> DataLoader:
        return DataLoader(
            Subset(UnlabelledDataset(state.data.unlabelled), coreset),
            batch_size=self.batch_size or state.config.batch_size,
            shuffle=True,
            generator=self._generator,
        )

    def before_epoch(self, state: LoopState) -> None:
        if self.teacher is not None and self._is_phase(state.epoch):
            chosen = self.select(state)
            self.coresets.append(sorted(chosen))
            self._loader = self._coreset_loader(state, self.coresets[-1])
        super().before_epoch(state)

    def resume_epoch(self, state: LoopState) -> None:
        """The phase's coreset loader again (the coreset and its stream's position are in the checkpoint)."""
        if self._phase:
            position = self._batches.state_dict()
            self._loader = self._coreset_loader(state, self.coresets[-1])
            self._batches = BatchStream(self._loader)
            self._batches.load_state_dict(position)
        super().resume_epoch(state)

    def _view(self, images: torch.Tensor, which: int) -> torch.Tensor:
        t = self._views[which]
        # plain tensors: MONAI's MetaTensor slows every later operation down
        return torch.stack([torch.as_tensor(t(img)).as_subclass(torch.Tensor) for img in images]).float()

    def _student_teacher_views(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view(batch["image"], 0), self._view(batch["image"], 1)

    def _classifier_params(self, model: Segmenter) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.classifier.named_parameters()}

    def _logits(
        self, model: Segmenter, params: dict[str, torch.Tensor], features: torch.Tensor, size: torch.Size
    ) -> torch.Tensor:
        logits = functional_call(model.classifier, params, (features,))
        return resize(logits, size)

    def select(self, state: LoopState) -> list[int]:
        """Choose this phase's coreset of pool indices (see the class docstring)."""
        model = state.model
        base = self._classifier_params(model)
        names = list(base)
        with eval_mode(model):
            grads = []
            pool = UnlabelledDataset(state.data.unlabelled)
            for batch in DataLoader(pool, batch_size=1):
                images = batch["image"]
                with torch.no_grad():
                    features = model.backbone(self._view(images, 0).to(state.device))
                    out_t = self.teacher.forward_features(self._view(images, 1).to(state.device))
                params = {n: v.clone().requires_grad_(True) for n, v in base.items()}
                logits = self._logits(model, params, features, images.shape[2:])
                s = pas_filter(logits.detach(), features, None, self.tau_conf, self.tau_sim)
                t = pas_filter(out_t.logits, out_t.features, None, self.tau_conf, self.tau_sim)
                loss = self.weight * consistency_loss(logits, out_t.logits, s.valid & t.valid)
                g = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
                grads.append(
                    torch.cat(
                        [(gi if gi is not None else torch.zeros_like(params[n])).flatten() for gi, n in zip(g, names)]
                    )
                )
            cached = []
            with torch.no_grad():
                # volumes as training crops: their features are kept for the whole selection, which for whole
                # volumes would be gigabytes each; images whole (one at a time where their sizes vary)
                labelled = (
                    DataLoader(labelled_crops(state, "retrieve"), batch_size=state.config.batch_size)
                    if crops_for_volumes(state)
                    else labelled_loader(state)
                )
                for batch in labelled:
                    cached.append(
                        (
                            model.forward_features(batch["image"].to(state.device)).features,
                            state.class_index(batch["label"].to(state.device)),
                        )
                    )
        shapes = [base[n].shape for n in names]
        flat0 = torch.cat([base[n].flatten() for n in names])

        def val_grad(delta: torch.Tensor) -> torch.Tensor:
            flat = (flat0 + delta).detach().requires_grad_(True)
            params = dict(zip(names, [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]))
            total, count = 0.0, 0
            for features, target in cached:
                ce = F.cross_entropy(
                    self._logits(model, params, features, target.shape[1:]),
                    target,
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                total = total + ce
                count += int((target != IGNORE_INDEX).sum())
            return torch.autograd.grad(total / max(count, 1), flat)[0]

        n = len(grads)
        budget = max(1, math.ceil(self.fraction * n))
        size = min(n, max(1, math.ceil(n / budget * math.log(1 / self.epsilon))))

        def sample(remaining: list[int]) -> list[int]:  # stochastic greedy (Mirzasoleiman et al., AAAI 2015)
            if len(remaining) <= size:
                return remaining
            pick = torch.randperm(len(remaining), generator=self._select_rng)[:size]
            return [remaining[i] for i in pick.tolist()]

        eta = state.optimizer.param_groups[0]["lr"] if state.optimizer is not None else state.config.lr_incremental
        chooser = sample if self.greedy == "stochastic" else None
        return retrieve_greedy(torch.stack(grads), val_grad, budget, eta, chooser)

    def after_training(self, state: LoopState) -> None:
        super().after_training(state)
        if "pseudo_labels" in state.report and self.coresets:
            state.report["pseudo_labels"]["coresets"] = self.coresets


@METHODS.register(
    "retrieve",
    options=RetrieveOptions,
    paper="Killamsetty et al., NeurIPS 2021",
    doc="baseline: greedy bilevel coreset of the unlabelled pool under a mean teacher",
    fidelity="faithful",
)
def retrieve(o: RetrieveOptions, config: RunConfig) -> Method:
    """RETRIEVE under the confidence-filtered mean teacher of ``method_args.jascl.pas`` (its weight, EMA, schedule)."""
    from jascl.methods.presets import jascl_options

    p = jascl_options(config).pas
    plugin = RetrievePlugin(
        fraction=o.fraction,
        greedy=o.greedy,
        epsilon=o.epsilon,
        tau_conf=p.tau_conf if o.tau_conf < 0 else o.tau_conf,
        weight=p.weight,
        ema_decay=p.ema_decay,
        freeze=freeze_policy(o.freeze),
        **_schedule(config),
    )
    return Method("retrieve", [plugin], "RETRIEVE: coreset selection + confidence-filtered mean teacher")
