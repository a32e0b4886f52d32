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
``prototypes``         before_eval     eq. 2 prototypes of the session's classes into the store
``evaluation``         evaluate        every test split so far, over all seen classes; the record
``checkpoint``         save_session    model, prototypes, plugins' extra state, ``metrics.json``
=====================  ==============  ===========================================================
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from jascl import distributed
from jascl.data.types import SessionData
from jascl.engine.checkpoint import save_model, save_tensors
from jascl.engine.losses import SegmentationLoss
from jascl.engine.plugin import Method, Plugin
from jascl.evaluation.evaluator import EvalResult, evaluate
from jascl.evaluation.metrics import harmonic_mean, summarise
from jascl.fileio import atomic_write_text
from jascl.protocols.schema import Protocol

if TYPE_CHECKING:
    from jascl.engine.state import LoopState

log = logging.getLogger("jascl")

#: the in-session checkpoint of a session folder (removed once the session is complete)
PROGRESS = "progress.safetensors"


class ClassifierGrowth(Plugin):
    """Grows the classifier to the session's classes; new rows imprinted from their eq. 2 prototypes.

    Rows whose class has no labelled pixel in the session get a random initialisation (with a warning).
    """

    name = "classifier-growth"

    def setup_model(self, state: LoopState) -> None:
        new = state.seen[state.model.num_classes :]
        if not new:
            return
        protos = state.compute_prototypes(new)
        if all(c in protos for c in new):
            init = torch.stack([protos[c] for c in new])
        else:
            init = None
            log.warning(
                "session %d: some new classes have no labelled pixels; random classifier rows", state.session.index
            )
        state.model.classifier.grow(len(new), init)


class SupervisedLoss(Plugin):
    """``losses["seg"]``: lambda_ce * CE + lambda_dice * Dice of the logits against ``state.target``."""

    name = "supervised-loss"

    def __init__(self, lambda_ce: float = 1.0, lambda_dice: float = 1.0) -> None:
        self.loss = SegmentationLoss(lambda_ce, lambda_dice)

    def state_dict(self) -> dict:
        return {}  # stateless (its MONAI loss modules hold only their settings)

    def after_forward(self, state: LoopState) -> None:
        assert state.output is not None and state.target is not None  # set by the loop before after_forward
        state.losses["seg"] = self.loss(state.output.logits, state.target, state.has_ignore)


_LOSSES: dict[tuple[float, float], SegmentationLoss] = {}


def default_supervised_loss(state: LoopState) -> torch.Tensor:
    """The ``supervised-loss`` default's "seg" term on the current batch.

    For a plugin that replaces the default in some sessions only (a distillation method's own loss
    needs the previous model, so its base session keeps the default's).
    """
    assert state.output is not None and state.target is not None  # set by the loop before after_forward
    key = (state.config.lambda_ce, state.config.lambda_dice)
    if key not in _LOSSES:
        _LOSSES[key] = SegmentationLoss(*key)
    return _LOSSES[key](state.output.logits, state.target, state.has_ignore)


class StorePrototypes(Plugin):
    """Adds the session's eq. 2 prototypes (background and its classes) to ``state.prototypes``.

    Computed after training, before the method's own ``before_eval`` (which may swap the classifier).
    """

    name = "prototypes"

    def before_eval(self, state: LoopState) -> None:
        state.prototypes.add(state.session.index, state.compute_prototypes([0, *state.session.classes]))


def session_record(protocol: Protocol, t: int, result: EvalResult, background_in_mean: bool = False) -> dict:
    """The record of session ``t``: all / old / new / HM (of old and new) / base means of the protocol's metric,
    per-class scores. ``background_in_mean`` counts class 0 in ``all`` (``RunConfig.background_in_mean``)."""
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
                [d.test for d in self.data[: t + 1]],
                state.seen,
                state.device,
                mode=cfg.eval_mode,
                roi=cfg.patch_size,
                batch_size=cfg.batch_size,
                sw_batch_size=cfg.sw_batch_size,
                overlap=cfg.sw_overlap,
                mc_samples=cfg.eval_mc_samples,
                seed=state.seed + t,
                before_split=before_split,
                progress=self.progress and distributed.is_main(),
            )
        state.eval_session = None
        state.metrics["eval"] = result
        state.record = session_record(state.protocol, t, result, cfg.background_in_mean)


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
