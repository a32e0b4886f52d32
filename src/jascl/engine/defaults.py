"""The loop's default plugins: what every method gets unless one of its plugins replaces it.

Fired before the method's own plugins on each event (:meth:`jascl.engine.plugin.Method.compose`),
so their results (the "seg" loss term first, the grown classifier, the stored prototypes) are
there when the method's plugins run. A method replaces one by naming it in
:attr:`~jascl.engine.plugin.Plugin.replaces` and doing that work itself:

=====================  ==============  ===========================================================
name                   event           what it does
=====================  ==============  ===========================================================
``classifier-growth``  setup_model     appends the session's new classes' classifier rows, imprinted
                                       from their eq. 2 prototypes (old rows kept bit-exactly)
``supervised-loss``    after_forward   ``losses["seg"]``: DiceCE on the labelled batch (ignore-aware)
``model-selection``    after_epoch,    with ``model_selection`` best_val_*: scores the validation samples every
                       after_training  ``validate_every`` epochs, keeps the best epoch's weights and loads them
                                       after training; ``selection`` in the record
``prototypes``         before_eval     eq. 2 prototypes of the session's classes into the store
``evaluation``         evaluate        every test split so far, over all seen classes; the record
``checkpoint``         save_session    model, prototypes, plugins' extra state, ``metrics.json``
=====================  ==============  ===========================================================
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from jascl import distributed
from jascl.data.types import SessionData, dense
from jascl.engine.checkpoint import save_model, save_tensors
from jascl.engine.losses import SegmentationLoss
from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import PrototypeRequest
from jascl.evaluation.evaluator import EvalResult, evaluate
from jascl.evaluation.metrics import harmonic_mean, summarise
from jascl.fileio import atomic_write_text
from jascl.networks.base import eval_mode
from jascl.protocols.schema import Protocol

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")

#: the in-session checkpoint of a session folder (removed once the session is complete)
PROGRESS = "progress.safetensors"


class ClassifierGrowth(Plugin):
    """Grows the classifier to the session's classes; new rows imprinted from their eq. 2 prototypes.

    Rows whose class has no labelled pixel in the session get a random initialisation (with a warning).
    ``imprint=authors`` (configuration) imprints the authors' prototype values instead
    (:mod:`jascl.engine.prototypes`, ``form="authors"``).
    """

    name = "classifier-growth"

    def setup_model(self, state: LoopState) -> None:
        new = state.seen[state.model.num_classes :]
        if not new:
            return
        protos = state.compute_prototypes(new, form=state.config.imprint)
        if all(c in protos for c in new):
            init = torch.stack([protos[c] for c in new])
        else:
            init = None
            log.warning(
                "session %d: some new classes have no labelled pixels; random classifier rows", state.session.index
            )
        state.model.classifier.grow(len(new), init)


class SupervisedLoss(Plugin):
    """``losses["seg"]``: lambda_ce * CE + lambda_dice * Dice of the logits against ``state.target``
    (:meth:`jascl.engine.losses.SegmentationLoss.for_session`: the configuration's weights for the session)."""

    name = "supervised-loss"

    def state_dict(self) -> dict:
        return {}  # stateless (the MONAI loss modules it uses hold only their settings)

    def after_forward(self, state: LoopState) -> None:
        state.losses["seg"] = default_supervised_loss(state)


_LOSSES: dict[tuple, SegmentationLoss] = {}


def default_supervised_loss(state: LoopState) -> torch.Tensor:
    """The ``supervised-loss`` default's "seg" term on the current batch.

    For a plugin that replaces the default in some sessions only (a distillation method's own loss
    needs the previous model, so its base session keeps the default's).
    """
    assert state.output is not None and state.target is not None  # set by the loop before after_forward
    return session_loss(state.config, state.session.index, state.output.logits.shape[1])(
        state.output.logits, state.target, state.has_ignore
    )


def session_loss(config: RunConfig, session: int, num_classes: int) -> SegmentationLoss:
    """The configuration's supervised loss of ``session`` with ``num_classes`` classifier rows, made once."""
    cfg = config
    key = (
        cfg.lambda_ce,
        cfg.lambda_dice,
        cfg.lambda_ce_base if session == 0 else None,
        cfg.lambda_dice_base if session == 0 else None,
        session == 0,
        cfg.class_weights,
        cfg.dice,
        num_classes if cfg.class_weights != "none" else None,
    )
    if key not in _LOSSES:
        _LOSSES[key] = SegmentationLoss.for_session(cfg, session, num_classes)
    return _LOSSES[key]


class StorePrototypes(Plugin):
    """Adds the session's eq. 2 prototypes (background and its classes) to ``state.prototypes``.

    Computed after training, before the method's own ``before_eval`` (which may swap the classifier).
    """

    name = "prototypes"

    def prototype_requests(self, state: LoopState) -> list[PrototypeRequest]:
        return [PrototypeRequest((0, *state.session.classes))]

    def before_eval(self, state: LoopState) -> None:
        state.prototypes.add(state.session.index, state.compute_prototypes([0, *state.session.classes]))


def evaluation_options(cfg: RunConfig) -> dict:
    """The evaluator's keywords that come from the run configuration (mode, window and batch sizes)."""
    return {
        "mode": cfg.eval_mode,
        "roi": cfg.patch_size,
        "batch_size": cfg.batch_size,
        "sw_batch_size": cfg.sw_batch_size,
        "overlap": cfg.sw_overlap,
    }


def session_record(protocol: Protocol, t: int, result: EvalResult, background_in_mean: bool = False) -> dict:
    """The record of session ``t``: all / old / new / HM (of old and new) / base means of the protocol's metric,
    per-class scores (both metrics) and their support (pixels / voxels and samples of each class in the test
    ground truth). ``background_in_mean`` counts class 0 in ``all`` (``RunConfig.background_in_mean``)."""
    seen = protocol.seen_classes(t)
    session = protocol.sessions[t]
    old = [c for c in seen if c != 0 and c not in session.new_classes]
    new = list(session.new_classes)
    per_class = result.metric(protocol.metric)
    summary = summarise(per_class, old, new, include_background=background_in_mean)
    base = summarise(per_class, protocol.base_classes(), [], include_background=False)["old"]
    return {
        "session": t,
        "name": session.name,
        "domains": list(session.domains),
        "all": summary["all"],
        "old": summary["old"],
        "new": summary["new"],
        "hm": harmonic_mean(summary["old"], summary["new"]),
        "base": base,
        "background": summary["background"],
        "per_class": {str(c): v for c, v in per_class.items()},
        "dice": {str(c): v for c, v in result.dice.items()},
        "iou": {str(c): v for c, v in result.iou.items()},
        "support": {str(c): v for c, v in result.support.items()},
        "samples": {str(c): v for c, v in result.samples.items()},
    }


class Evaluation(Plugin):
    """Scores the model on the test split of every session so far, over all seen classes.

    Sliding-window or the authors' crops (``eval_mode``), optionally Monte-Carlo over the model's
    sampling modules (``eval_mc_samples``); fires ``before_eval_split`` before each split. Sets
    ``state.metrics["eval"]`` and ``state.record``.

    Args:
        data: every session's data (the test splits are read).
        autocast: the run's precision context.
        progress: show a progress bar.
    """

    name = "evaluation"

    def __init__(
        self, data: Sequence[SessionData], autocast: Callable[[], AbstractContextManager], progress: bool
    ) -> None:
        self.data = data
        self.autocast = autocast
        self.progress = progress

    def state_dict(self) -> dict:
        return {}

    def evaluate(self, state: LoopState) -> None:
        cfg, t = state.config, state.session.index

        def before_split(index: int) -> None:
            state.eval_session = index
            state.fire("before_eval_split")

        with self.autocast():
            result = evaluate(
                state.model,
                [dense(d.test) for d in self.data[: t + 1]],
                state.seen,
                state.device,
                **evaluation_options(cfg),
                mc_samples=cfg.eval_mc_samples,
                seed=state.seed + t,
                before_split=before_split,
                progress=self.progress and distributed.is_main(),
            )
        state.eval_session = None
        state.metrics["eval"] = result
        state.record = session_record(state.protocol, t, result, cfg.background_in_mean)


#: the session's first validation warns when it costs more than its epoch's training and the session's
#: validations would add up to more than this many seconds
VALIDATION_COST_WARNING_S = 600.0


def warn_validation_cost(state: LoopState, splits: list, trained: float, validated: float, epochs: int) -> None:
    """One warning when validating costs the session more than its training does (measured on its first epoch
    validated: the epoch's training and the validation that followed) and adds up to more than
    :data:`VALIDATION_COST_WARNING_S`: the way to cut it is the user's choice, not a default's."""
    cfg = state.config
    every = cfg.validate_every
    count = epochs // every + (1 if epochs % every else 0)  # every N-th epoch and the last
    if validated <= trained * every or validated * count <= VALIDATION_COST_WARNING_S or not distributed.is_main():
        return
    mode = cfg.eval_mode if cfg.validation_eval_mode == "same" else cfg.validation_eval_mode
    log.warning(
        "%s session %d (%s): one validation (%d samples, %s) took %.1f s, %.1fx the epoch's training (%.1f s); "
        "the session's %d validations (validate_every=%d) will take about %.1f h against %.1f h of training. "
        "--set validate_every=N validates every N epochs; --set validation_eval_mode=authors scores one crop per "
        "volume, as the authors selected (docs/protocols.md, 'What validation costs')",
        state.method_name,
        state.session.index,
        state.session.name,
        sum(len(s) for s in splits),
        mode,
        validated,
        validated / max(trained, 1e-9),
        trained,
        count,
        every,
        validated * count / 3600,
        trained * epochs / 3600,
    )


class ModelSelection(Plugin):
    """With ``model_selection`` best_val_new / best_val_all: the session ends with its best-validation epoch.

    Every ``validate_every`` epochs and after the last one, ``after_epoch`` scores the model on validation
    samples (the protocol's ``validation`` per class) with the evaluator in the run's ``eval_mode`` (or
    ``validation_eval_mode``, when it is not "same"),
    deterministically (no GAS noise, whatever ``eval_mc_samples`` says), over the seen classes, and keeps
    its weights (state dict, on the CPU) when the score beats the best so far (ties: the earlier epoch; a
    NaN score never wins). ``after_training`` loads the kept weights into the model, so prototypes, the
    method's own ``after_training`` and the evaluation see the selected model, and adds
    ``selection: {mode, epoch, score, kept, history: [[epoch, score], ...]}`` to the session's record
    (``kept``: "best validation", or "last epoch" when nothing could be scored).

    Scores (Dice, as the authors selected their checkpoints, whatever the protocol's headline metric):

    * ``best_val_new``: mean Dice of the session's own classes (new, and recurring ones taught again in a
      new domain, which the authors' code gives new ids) on the session's validation samples;
    * ``best_val_all``: mean Dice of every seen foreground class on the validation samples of every
      session so far.

    Validation scores the model as it trains; ``before_eval_split`` is not fired (a method with
    per-domain parameters, MDIL, is scored with the current domain's). The kept weights, best score,
    best epoch and history are the plugin's :meth:`state_dict`, saved in the in-session checkpoint (which
    then holds a second copy of the model), so a resumed session selects exactly as an uninterrupted one.
    Scoring draws no random numbers and changes no weights: the epochs train as with "last". A session
    without validation samples (or whose scores are all NaN) keeps its last epoch, with one warning. With
    ``model_selection: last`` the plugin does nothing. When the session's first validation costs more than
    the epoch's training before it and the session's validations would add up to more than ten minutes, one
    warning says so with the measured seconds and the two ways to cut them (:func:`warn_validation_cost`):
    whole-volume sliding windows on every validation volume every epoch can cost a 5-shot session many times
    its training (docs/protocols.md, "What validation costs").

    Args:
        data: every session's data (the validation splits are read).
        autocast: the run's precision context.
    """

    name = "model-selection"
    mid_epoch_resume = True  # (before_epoch only starts the clock of the cost warning)
    #: the session's first validation is compared with its epoch's training by this clock (tests replace it)
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, data: Sequence[SessionData], autocast: Callable[[], AbstractContextManager]) -> None:
        self.data = data
        self.autocast = autocast
        self._epoch_start: float | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_epoch: int | None = None
        self.best_score: float | None = None
        self.history: list[list] = []

    def state_dict(self) -> dict:
        return {
            "best_state": self.best_state,
            "best_epoch": self.best_epoch,
            "best_score": self.best_score,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: dict) -> None:
        self.best_state = state.get("best_state")
        self.best_epoch = state.get("best_epoch")
        self.best_score = state.get("best_score")
        self.history = [list(h) for h in state.get("history", [])]

    def splits(self, state: LoopState) -> list:
        """The validation splits scored in session ``state.session`` (none: the last epoch is kept)."""
        t = state.session.index
        sessions = [t] if state.config.model_selection == "best_val_new" else range(t + 1)
        return [
            s.validation for s in (self.data[i] for i in sessions) if s.validation is not None and len(s.validation)
        ]

    def before_epoch(self, state: LoopState) -> None:
        self._epoch_start = self.clock()

    def resume_epoch(self, state: LoopState) -> None:
        self._epoch_start = None  # (part of an epoch: no comparison)

    def before_session(self, state: LoopState) -> None:
        self.best_state, self.best_epoch, self.best_score, self.history = None, None, None, []
        if state.config.model_selection != "last" and not self.splits(state):
            log.warning(
                "%s session %d (%s): model_selection=%s, but there are no validation samples (the protocol's "
                "'validation' per class); the session keeps its last epoch",
                state.method_name,
                state.session.index,
                state.session.name,
                state.config.model_selection,
            )

    def score(self, state: LoopState, splits: list) -> float:
        """The selection score of the current model (NaN when none of its classes is in the validation samples)."""
        cfg, t = state.config, state.session.index
        options = evaluation_options(cfg)
        if cfg.validation_eval_mode != "same":
            options["mode"] = cfg.validation_eval_mode
        with eval_mode(state.model), state.autocast():
            result = evaluate(
                state.model, splits, state.seen, state.device, **options, mc_samples=0, seed=state.seed + t
            )
        if cfg.model_selection == "best_val_new":
            return summarise(result.dice, [], state.session.classes)["new"]
        return summarise(result.dice, [c for c in state.seen if c != 0], [])["all"]

    def after_epoch(self, state: LoopState) -> None:
        cfg = state.config
        if cfg.model_selection == "last":
            return
        splits = self.splits(state)
        epochs = cfg.epochs_base if state.session.index == 0 else cfg.epochs_incremental
        if not splits or ((state.epoch + 1) % cfg.validate_every and state.epoch != epochs - 1):
            return
        started = self.clock()
        score = self.score(state, splits)
        if not self.history and self._epoch_start is not None:
            warn_validation_cost(state, splits, started - self._epoch_start, self.clock() - started, epochs)
        self.history.append([state.epoch, score])
        if math.isfinite(score) and (self.best_score is None or score > self.best_score):
            self.best_score, self.best_epoch = score, state.epoch
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in state.model.state_dict().items()}
        log.info(
            "%s session %d epoch %d: validation %s %.4f (best %s at epoch %s)",
            state.method_name,
            state.session.index,
            state.epoch,
            cfg.model_selection,
            score,
            "-" if self.best_score is None else f"{self.best_score:.4f}",
            self.best_epoch,
        )

    def after_training(self, state: LoopState) -> None:
        cfg = state.config
        if cfg.model_selection == "last":
            return
        epochs = cfg.epochs_base if state.session.index == 0 else cfg.epochs_incremental
        if self.best_state is not None:
            state.model.load_state_dict(self.best_state)
            self.best_state = None  # the weights are the model's now
            epoch, score, kept = self.best_epoch, self.best_score, "best validation"
        else:
            if self.history:
                log.warning(
                    "%s session %d: no finite validation score (none of the scored classes is in the validation "
                    "samples); the session keeps its last epoch",
                    state.method_name,
                    state.session.index,
                )
            epoch, score, kept = (epochs - 1 if epochs else None), None, "last epoch"
        state.report["selection"] = {
            "mode": cfg.model_selection,
            "epoch": epoch,
            "score": score,
            "kept": kept,
            "history": self.history,
        }


class SessionCheckpoint(Plugin):
    """Writes the finished session into ``state.out_dir`` (rank 0 only).

    ``model.safetensors`` (with ``meta``), ``prototypes.safetensors``, ``plugins.safetensors``
    (the method's extra state) and, last, ``metrics.json``, which marks the session complete;
    the in-session checkpoint is then removed.

    Args:
        method: the method whose plugins' extra state is saved.
        meta: session -> what a checkpoint of it must match to be loaded.
    """

    name = "checkpoint"

    def __init__(self, method: Method, meta: Callable[[int], dict]) -> None:
        self.method = method
        self.meta = meta

    def state_dict(self) -> dict:
        return {}

    def save_session(self, state: LoopState) -> None:
        if not distributed.is_main():
            return
        out, t = state.out_dir, state.session.index
        assert out is not None, "the trainer sets the session folder"
        out.mkdir(parents=True, exist_ok=True)
        save_model(state.model, out / "model.safetensors", {**self.meta(t), "session": t, "method": self.method.name})
        state.prototypes.save(out / "prototypes.safetensors")
        save_tensors(self.method.extra_state(), out / "plugins.safetensors")
        # written last: marks the session complete
        atomic_write_text(out / "metrics.json", json.dumps(state.record, indent=2, default=float))
        (out / PROGRESS).unlink(missing_ok=True)
