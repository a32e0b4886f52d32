"""EWC (Kirkpatrick et al., PNAS 2017) and online EWC (Schwarz et al., ICML 2018): quadratic penalties weighted
by the diagonal Fisher information of earlier sessions."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from jascl.engine.plugin import Method, Plugin
from jascl.methods.common import crops_for_volumes, labelled_crops
from jascl.methods.options import freeze_option, freeze_policy, option
from jascl.methods.registry import METHODS
from jascl.networks.base import eval_mode
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
from jascl.methods.baselines.regularization._shared import incremental_parameters, leading_rows, pad_rows

log = logging.getLogger("jascl")


def ewc_penalty(
    params: Mapping[str, torch.Tensor], anchors: Mapping[str, torch.Tensor], fisher: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Sum_i F_i (theta_i - theta*_i)^2 over the parameters named in ``fisher`` (Kirkpatrick et al. 2017, eq. 3
    without the lambda/2 factor).

    Args:
        params: name -> current parameter (any shape; may have more leading rows than its anchor).
        anchors: name -> theta* (the parameter at the end of the anchored session).
        fisher: name -> diagonal Fisher information, shaped like the anchor.

    Returns:
        0-dim tensor, differentiable w.r.t. ``params``.
    """
    total = None
    for name, f in fisher.items():
        theta = leading_rows(params[name], anchors[name])
        term = (f * (theta - anchors[name]) ** 2).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total


def segmentation_log_likelihood(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image log-likelihood used for the Fisher: minus the mean cross-entropy over labelled pixels.

    Args:
        logits: (1, K, *spatial).
        target: (1, *spatial) classifier rows, 255 = ignore.
    """
    return -F.cross_entropy(logits, target, ignore_index=255)


def fisher_diagonal(
    model: Callable[[torch.Tensor], torch.Tensor],
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
    params: Mapping[str, torch.Tensor],
    labels: str = "empirical",
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Diagonal Fisher information: the mean over samples of the squared per-sample gradient of the log-likelihood.

    A "sample" is one image/volume; its log-likelihood is minus the mean pixel
    cross-entropy (:func:`segmentation_log_likelihood`). Kirkpatrick et al. (2017)
    use the Fisher at theta*; "empirical" takes the gradient at the ground-truth
    labels, "sampled" at labels drawn per pixel from the model's own softmax (the
    true Fisher, estimated with one draw per image).

    Args:
        model: maps (1, C_in, *spatial) to logits (1, K, *spatial'); put it in the
            mode you want (eval mode keeps BatchNorm statistics untouched).
        samples: (image (1, C_in, *spatial), target (1, *spatial) classifier rows, 255 = ignore).
        params: name -> parameter to measure (``requires_grad`` must be True).
        labels: "empirical" or "sampled".
        generator: random stream for "sampled".

    Returns:
        name -> tensor shaped like the parameter (zeros if no sample had a labelled pixel).
    """
    if labels not in ("empirical", "sampled"):
        raise ValueError(f"labels must be 'empirical' or 'sampled' (got {labels!r})")
    names = list(params)
    tensors = [params[n] for n in names]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    count = 0
    for image, target in samples:
        logits = model(image)
        if logits.shape[2:] != target.shape[1:]:
            raise ValueError(f"logits {tuple(logits.shape)} do not match target {tuple(target.shape)}")
        if labels == "sampled":
            probs = logits.detach().softmax(1).movedim(1, -1).reshape(-1, logits.shape[1])
            drawn = torch.multinomial(probs.cpu(), 1, generator=generator).view(target.shape).to(target.device)
            target = drawn
        elif not (target != IGNORE_INDEX).any():
            continue
        grads = torch.autograd.grad(segmentation_log_likelihood(logits, target), tensors, allow_unused=True)
        for acc, g in zip(total, grads):
            if g is not None:
                acc += g.detach().float() ** 2
        count += 1
    return {n: t / max(count, 1) for n, t in zip(names, total)}


#: the share of SGD's stability bound the penalty's curvature may take (the task loss has curvature of its own)
STABILITY_MARGIN = 0.5


def sgd_stable_curvature(lr: float, momentum: float = 0.0, nesterov: bool = False) -> float:
    """The curvature h above which PyTorch's SGD diverges on the quadratic (h/2) x^2.

    One step maps (x, v) linearly; its eigenvalues stay inside the unit circle while lr * h < 2 (1 + beta) for
    heavy-ball momentum beta (2 without momentum), and lr * h < 2 (1 + beta) / (1 + 2 beta) for PyTorch's Nesterov
    form (v <- beta v + g; x <- x - lr (g + beta v), whose characteristic polynomial is
    z^2 - (1 + beta)(1 - lr h) z + beta (1 - lr h)). With beta = 0.9: 3.8 / lr and 1.357 / lr.
    """
    if lr <= 0:
        return float("inf")
    if nesterov and momentum > 0:
        return 2 * (1 + momentum) / (1 + 2 * momentum) / lr
    return 2 * (1 + momentum) / lr


def capped_importances(importances: list[Mapping[str, torch.Tensor]], cap: float) -> list[dict[str, torch.Tensor]]:
    """Scale the sessions' importances element by element so that their sum is at most ``cap``.

    Every session's value of one parameter element is multiplied by min(1, cap / sum over sessions), so the
    penalty's minimiser (the importance-weighted mean of the anchors) stays where it was and only its curvature
    is bounded. Elements whose sum is within ``cap`` are untouched; rows that grew later count from their session.
    """
    totals: dict[str, torch.Tensor] = {}
    for importance in importances:
        for name, f in importance.items():
            prev = totals.get(name)
            if prev is None:
                totals[name] = f.clone()
            else:
                shape = max(prev.shape, f.shape, key=lambda size: size[0] if len(size) else 0)
                totals[name] = pad_rows(prev, shape) + pad_rows(f, shape)
    out = []
    for importance in importances:
        scaled = {}
        for name, f in importance.items():
            factor = (cap / totals[name].clamp(min=1e-30)).clamp(max=1.0)
            scaled[name] = f * leading_rows(factor, f)
        out.append(scaled)
    return out


def online_fisher_update(
    accumulated: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor], gamma: float
) -> dict[str, torch.Tensor]:
    """Online EWC's running Fisher F~ <- gamma * F~ + F_t (Schwarz et al. 2018, online EWC).

    Parameters that grew since the last update (classifier rows) get zero
    accumulated Fisher in their new rows; parameters new to ``new`` start at F_t.
    """
    out = {}
    for name, f in new.items():
        prev = (accumulated or {}).get(name)
        out[name] = f.clone() if prev is None else gamma * pad_rows(prev.to(f), f.shape) + f
    return out


class _FisherSessions:
    """Fisher computation at the end of a session, and the penalty's curvature bound, shared by EWC and online EWC.

    The bound: the penalty (lambda / 2) F (theta - theta*)^2 has curvature lambda F, and SGD diverges on a
    quadratic whose curvature exceeds :func:`sgd_stable_curvature` at its rate. The Fisher is unnormalised
    (Kirkpatrick et al.), so lambda F has no fixed scale: on the med-ss fixtures the cosine classifier's Fisher
    reached 20.7, and lambda = 500 at the protocol's lr 0.01 (SGD, Nesterov 0.9) gives lr lambda F = 104 against
    a bound of 1.36; the penalty grew to 1e38 within two sessions. Under SGD the importances are therefore
    scaled so that lambda times their sum over sessions is at most :data:`STABILITY_MARGIN` of the bound at the
    optimiser's current rates (:func:`capped_importances`); the elements this touches are held at their anchors
    as firmly as SGD can integrate, and the others are unchanged. Adam and AdamW are left alone: their steps are
    bounded by their rate whatever the gradient's scale. (MiB's code, the source of lambda = 500, rescales each
    Fisher to [0, 1] and trains incremental steps at lr 0.001, where 2 lambda lr = 1 stays stable.)
    """

    fisher_labels = "empirical"
    fisher_samples = 0
    weight = 0.0
    consolidated = -1
    snapshot_exclude: tuple[str, ...] = ("_capped", "_capped_key")
    _capped: list[dict[str, torch.Tensor]] | None = None
    _capped_key: tuple | None = None

    def curvature_cap(self, state: LoopState) -> float | None:
        """The most importance (per element, summed over sessions) the penalty may give under the run's SGD;
        None under another optimiser, before the session's optimiser exists, or with ``weight`` 0."""
        optimizer = getattr(state, "optimizer", None)
        if not isinstance(optimizer, torch.optim.SGD) or self.weight <= 0:
            return None
        bound = min(
            sgd_stable_curvature(g["lr"], g.get("momentum", 0.0), bool(g.get("nesterov", False)))
            for g in optimizer.param_groups
        )
        return None if bound == float("inf") else STABILITY_MARGIN * bound / self.weight

    def stable_importances(
        self, state: LoopState, importances: list[dict[str, torch.Tensor]]
    ) -> list[dict[str, torch.Tensor]]:
        """``importances`` capped by :meth:`curvature_cap` (computed again when the cap or the sessions change;
        one log line the first time elements are capped)."""
        cap = self.curvature_cap(state)
        if cap is None:
            return importances
        key = (cap, self.consolidated, len(importances))
        if self._capped is None or self._capped_key != key:
            self._capped, self._capped_key = capped_importances(importances, cap), key
            total = sum(v.numel() for f in importances for v in f.values())
            capped = sum(
                int((a != b).sum()) for f, g in zip(importances, self._capped) for a, b in zip(f.values(), g.values())
            )
            if capped:
                largest = max(float(v.max()) for f in importances for v in f.values())
                log.info(
                    "%s: %d of %d Fisher values capped at %.4g (largest %.4g) so that weight x Fisher stays within "
                    "SGD's stability bound at lr %.4g",
                    getattr(self, "name", "ewc"),
                    capped,
                    total,
                    cap,
                    largest,
                    max(g["lr"] for g in state.optimizer.param_groups),
                )
        return self._capped

    def session_fisher(self, state: LoopState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(Fisher, anchors) at the current parameters on the session's labelled training data (eval mode): whole
        images in 2D, as Kirkpatrick et al.; volumes (3D with a patch) as training crops
        (:func:`jascl.methods.common.labelled_crops`), because each sample's gradient is a backward pass, which for
        a whole CT volume would need several times the memory of its forward (tens of GB). The synthetic 3D
        protocols' volumes are their own crops."""
        from jascl.data.datasets import LabelledDataset

        model = state.model
        targets = incremental_parameters(state)
        flags = {n: p.requires_grad for n, p in targets.items()}
        if crops_for_volumes(state):
            dataset = labelled_crops(state, "ewc-fisher")
        else:
            dataset = LabelledDataset(state.data.train, state.session.classes, state.session.other_classes)
        limit = len(dataset) if self.fisher_samples <= 0 else min(self.fisher_samples, len(dataset))

        def samples():
            for i in range(limit):
                item = dataset[i]
                yield (item["image"][None].to(state.device), state.class_index(item["label"][None].to(state.device)))

        generator = torch.Generator().manual_seed(state.seed * 1000 + state.session.index)
        try:
            for p in targets.values():
                p.requires_grad_(True)
            with eval_mode(model), torch.enable_grad():
                fisher = fisher_diagonal(model, samples(), targets, self.fisher_labels, generator)
        finally:
            for n, p in targets.items():
                p.requires_grad_(flags[n])
        anchors = {n: p.detach().clone() for n, p in targets.items()}
        return fisher, anchors


class EWCPlugin(_FisherSessions, Plugin):
    """Elastic weight consolidation: one quadratic penalty per earlier session.

    loss += (lambda / 2) * sum_{k < t} sum_i F_{k,i} (theta_i - theta*_{k,i})^2
    (Kirkpatrick et al., PNAS 2017, eq. 3, with one penalty per earlier task as
    the paper does for more than two tasks). F_k is the diagonal Fisher at the
    end of session k on its labelled training images (:func:`fisher_diagonal`).

    Args:
        weight: lambda.
        fisher_labels: "empirical" (ground-truth labels) or "sampled" (model's own predictions).
        fisher_samples: images used for the Fisher (0 = the whole labelled set).
        freeze: incremental freezing policy (see the module docstring).
    """

    name = "ewc"
    loss_terms = ("ewc",)

    def __init__(
        self,
        weight: float = 500.0,
        fisher_labels: str = "empirical",
        fisher_samples: int = 0,
        freeze: str | None = None,
    ) -> None:
        self.weight = weight
        self.fisher_labels = fisher_labels
        self.fisher_samples = fisher_samples
        self.freeze_incremental = freeze
        #: per consolidated session: (fisher, anchors)
        self.sessions: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.consolidated = -1

    def penalty(self, state: LoopState) -> torch.Tensor | None:
        if not self.sessions:
            return None
        params = dict(state.model.named_parameters())
        fishers = self.stable_importances(state, [fisher for fisher, _ in self.sessions])
        return sum(ewc_penalty(params, anchors, fisher) for fisher, (_, anchors) in zip(fishers, self.sessions))

    def after_forward(self, state: LoopState) -> None:
        if state.session.index > 0:
            penalty = self.penalty(state)
            if penalty is not None:
                state.losses[self.name] = 0.5 * self.weight * penalty

    def consolidate(self, state: LoopState) -> None:
        self._capped = None
        fisher, anchors = self.session_fisher(state)
        self.sessions.append((fisher, anchors))
        self.consolidated = state.session.index

    def after_session(self, state: LoopState) -> None:
        self.consolidate(state)

    def session_restored(self, state: LoopState) -> None:
        if self.consolidated != state.session.index:  # not loaded from this session's saved state
            self.consolidate(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {"consolidated": torch.tensor(self.consolidated)}
        for k, (fisher, anchors) in enumerate(self.sessions):
            out.update({f"s{k}.fisher.{n}": v for n, v in fisher.items()})
            out.update({f"s{k}.anchor.{n}": v for n, v in anchors.items()})
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self._capped = None
        self.consolidated = int(tensors["consolidated"])
        sessions: dict[int, tuple[dict, dict]] = {}
        for key, value in tensors.items():
            if key == "consolidated":
                continue
            index, kind, name = key.split(".", 2)
            fisher, anchors = sessions.setdefault(int(index[1:]), ({}, {}))
            (fisher if kind == "fisher" else anchors)[name] = value
        self.sessions = [sessions[k] for k in sorted(sessions)]


class OnlineEWCPlugin(_FisherSessions, Plugin):
    """Online EWC: one running Fisher and one anchor (the latest session's parameters).

    F~_t = gamma * F~_{t-1} + F_t;  loss += (lambda / 2) * sum_i F~_{t-1,i} (theta_i - theta*_{t-1,i})^2
    (Schwarz et al., ICML 2018, "Progress & Compress", online EWC).

    Args:
        weight: lambda.
        gamma: decay of earlier sessions' Fisher (gamma = 1: plain sum).
        fisher_labels, fisher_samples, freeze: as :class:`EWCPlugin`.
    """

    name = "online-ewc"
    loss_terms = ("online-ewc",)

    def __init__(
        self,
        weight: float = 500.0,
        gamma: float = 1.0,
        fisher_labels: str = "empirical",
        fisher_samples: int = 0,
        freeze: str | None = None,
    ) -> None:
        self.weight = weight
        self.gamma = gamma
        self.fisher_labels = fisher_labels
        self.fisher_samples = fisher_samples
        self.freeze_incremental = freeze
        self.fisher: dict[str, torch.Tensor] | None = None
        self.anchors: dict[str, torch.Tensor] | None = None
        self.consolidated = -1

    def after_forward(self, state: LoopState) -> None:
        if self.fisher is not None and state.session.index > 0:
            (fisher,) = self.stable_importances(state, [self.fisher])
            penalty = ewc_penalty(dict(state.model.named_parameters()), self.anchors, fisher)
            state.losses[self.name] = 0.5 * self.weight * penalty

    def consolidate(self, state: LoopState) -> None:
        self._capped = None
        fisher, self.anchors = self.session_fisher(state)
        self.fisher = online_fisher_update(self.fisher, fisher, self.gamma)
        self.consolidated = state.session.index

    def after_session(self, state: LoopState) -> None:
        self.consolidate(state)

    def session_restored(self, state: LoopState) -> None:
        if self.consolidated != state.session.index:
            self.consolidate(state)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {"consolidated": torch.tensor(self.consolidated)}
        if self.fisher is not None:
            out.update({f"fisher.{n}": v for n, v in self.fisher.items()})
            out.update({f"anchor.{n}": v for n, v in self.anchors.items()})
        return out

    def load_extra_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self._capped = None
        self.consolidated = int(tensors["consolidated"])
        fisher = {k[len("fisher.") :]: v for k, v in tensors.items() if k.startswith("fisher.")}
        anchors = {k[len("anchor.") :]: v for k, v in tensors.items() if k.startswith("anchor.")}
        self.fisher, self.anchors = (fisher, anchors) if fisher else (None, None)


@dataclass
class EWCOptions:
    """EWC / online EWC options (``method_args.ewc``, ``method_args.online-ewc``).

    Attributes:
        weight: lambda; 500, the value MiB's code (Cermelli et al., CVPR 2020) uses for EWC on segmentation (there
            on a Fisher rescaled to [0, 1]; here Kirkpatrick et al.'s, unnormalised, capped under SGD where
            lambda F would make the step diverge: :class:`_FisherSessions`).
        gamma: online EWC's decay of the running Fisher; 1.0 as in the reference configurations of Mammoth and
            van de Ven et al.'s code (EWC ignores it).
        fisher_labels: "empirical" (ground truth) or "sampled" (the model's predictions).
        fisher_samples: images per session for the Fisher (0 = all).
    """

    weight: float = option(500.0, ge=0)
    gamma: float = option(1.0, ge=0, le=1)
    fisher_labels: str = option("empirical", choices=("empirical", "sampled"))
    fisher_samples: int = option(0, ge=0)
    freeze: str = freeze_option()


@METHODS.register(
    "ewc",
    options=EWCOptions,
    paper="Kirkpatrick et al., PNAS 2017",
    doc="baseline: elastic weight consolidation, one Fisher penalty per earlier session",
    fidelity="faithful",
)
def ewc(o: EWCOptions, config: RunConfig) -> Method:
    """EWC: a quadratic penalty per earlier session, weighted by that session's diagonal Fisher information."""
    plugin = EWCPlugin(o.weight, o.fisher_labels, o.fisher_samples, freeze_policy(o.freeze))
    return Method("ewc", [plugin], "EWC: quadratic penalty weighted by the diagonal Fisher of every earlier session")


@METHODS.register(
    "online-ewc",
    options=EWCOptions,
    paper="Schwarz et al., ICML 2018",
    doc="baseline: online EWC, one running Fisher and the latest anchor",
    fidelity="faithful",
)
def online_ewc(o: EWCOptions, config: RunConfig) -> Method:
    """Online EWC: one running Fisher decayed by ``gamma``, anchored at the previous session."""
    plugin = OnlineEWCPlugin(o.weight, o.gamma, o.fisher_labels, o.fisher_samples, freeze_policy(o.freeze))
    return Method("online-ewc", [plugin], "online EWC: decayed running Fisher, anchored at the previous session")
