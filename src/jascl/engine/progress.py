"""In-session checkpoints: write, restore and synchronise a session's training state.

``progress.safetensors`` in a session folder holds everything the rest of the
session depends on (model, optimiser, the method's and the loop's default plugins'
states, e.g. the model selection's best weights so far, the labelled loader's
position, random number generators, scalar metrics), after an epoch or, with
``checkpoint_steps``, after a step inside one. A session that finds it continues
from there with bit-identical results on the same machine and thread count.
Only rank 0 writes; nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from jascl import distributed
from jascl.data.sampling import SeededBatchSampler
from jascl.engine.checkpoint import load_progress, save_progress
from jascl.engine.plugin import Method, Plugin
from jascl.engine.snapshot import load_module_state, module_state, rng_state, set_rng_state
from jascl.engine.state import LoopState
from jascl.engine.stop import REQUEST, Stopped
from jascl.errors import CheckpointError, TrainingError


def _sampler(loader: DataLoader) -> SeededBatchSampler:
    sampler = loader.batch_sampler
    if not isinstance(sampler, SeededBatchSampler):
        raise TypeError("in-session checkpoints need the labelled loader's SeededBatchSampler")
    return sampler


@dataclass
class Resume:
    """Where an in-session checkpoint was taken: after ``epoch``, or (``step`` set) inside it after that many steps."""

    epoch: int
    step: int | None = None
    running: torch.Tensor | None = None  # the epoch's loss sum so far
    loader_start: dict | None = None  # the labelled loader's position at the epoch's start

    @property
    def inside(self) -> bool:
        return self.step is not None

    @property
    def where(self) -> str:
        return f"inside epoch {self.epoch}, after step {self.step}" if self.inside else f"after epoch {self.epoch}"


class SessionProgress:
    """The in-session checkpoint of one session of one method.

    Args:
        path: the session folder's ``progress.safetensors``.
        method: the method (its plugins' states are saved).
        meta: what the checkpoint must match to be loaded (protocol, backbone, classes, session, method).
        defaults: the loop's default plugins in use (their states are saved by name; a checkpoint
            written before they were saved restores none).
    """

    def __init__(self, path: Path, method: Method, meta: dict, defaults: Sequence[Plugin] = ()) -> None:
        self.path = path
        self.method = method
        self.meta = meta
        self.defaults = list(defaults)
        #: where the last checkpoint of this session was taken (None: none yet)
        self.saved: str | None = None

    def save(self, state: LoopState, loader: DataLoader, epoch: int, inside: dict | None = None) -> None:
        """Checkpoint after ``epoch``, or (``inside``: ``step``, ``running`` loss sum, ``loader_start``) inside it."""
        self.saved = (
            f"inside epoch {epoch}, after step {inside['step']}" if inside is not None else f"after epoch {epoch}"
        )
        if not distributed.is_main():
            return
        assert state.optimizer is not None, "checkpoints are taken after the optimiser is built"
        metrics = {k: v for k, v in state.metrics.items() if isinstance(v, (int, float, str, bool))}
        payload = {
            "epoch": epoch,
            "iteration": state.iteration,
            "model": module_state(state.model),
            "optimizer": state.optimizer.state_dict(),
            "plugins": self.method.state_dict(),
            "defaults": {p.name: p.state_dict() for p in self.defaults},
            "loader": _sampler(loader).state_dict(),
            "rng": rng_state(),
            "metrics": metrics,
        }
        meta = {**self.meta, "epoch": epoch}
        if inside is not None:
            payload["inside"] = inside
            meta["step"] = inside["step"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        save_progress(self.path, meta, payload)

    def restore(self, state: LoopState, loader: DataLoader) -> Resume | None:
        """Load the checkpoint, if there is one, into a freshly set-up session; returns where it was taken."""
        if not self.path.exists():
            return None
        _, payload = load_progress(self.path, self.meta)
        inside = payload.get("inside")
        if inside is not None and self.method.mid_epoch_blockers():
            raise CheckpointError(
                f"{self.path}: taken inside epoch {payload['epoch']}, but plugin(s) "
                f"{', '.join(self.method.mid_epoch_blockers())} of {self.method.name} cannot resume "
                "there; delete it to restart this session from its beginning"
            )
        assert state.optimizer is not None, "a session is restored after its optimiser is built"
        load_module_state(state.model, payload["model"])
        state.optimizer.load_state_dict(payload["optimizer"])
        self.method.load_state_dict(payload["plugins"])
        saved_defaults = payload.get("defaults", {})
        for plugin in self.defaults:
            if plugin.name in saved_defaults:
                plugin.load_state_dict(saved_defaults[plugin.name])
        _sampler(loader).load_state_dict(payload["loader"])
        set_rng_state(payload["rng"])
        state.iteration = int(payload["iteration"])
        state.metrics.update(payload["metrics"])
        resume = (
            Resume(int(payload["epoch"]))
            if inside is None
            else Resume(int(payload["epoch"]), int(inside["step"]), inside["running"], inside["loader_start"])
        )
        self.saved = resume.where
        return resume

    def sync(
        self,
        state: LoopState,
        running: torch.Tensor,
        steps: int,
        lr: float,
        recent: Sequence[tuple[torch.Tensor, object]] = (),
    ) -> tuple[float, bool]:
        """(mean training loss so far in the epoch, whether any rank was asked to stop).

        One host synchronisation, and with several processes one collective: every rank calls it at
        the same steps, and the stop signal travels with the loss.

        Args:
            recent: (loss, sample ids) of every step since the last sync, to name the batch whose loss
                first became non-finite (only read then).

        Raises:
            TrainingError: the loss is not finite; the session stops, its last good checkpoint is kept.
        """
        flag = torch.full((), float(REQUEST.requested), device=running.device)
        loss_sum, stops = distributed.all_reduce_sum(torch.stack([running.float(), flag])).tolist()
        mean_loss = loss_sum / max(steps * distributed.world_size(), 1)
        if not math.isfinite(mean_loss):
            t, session = state.session.index, state.session
            kept = (
                f"its last good checkpoint ({self.saved}) is kept in {self.path}"
                if self.saved is not None
                else "no checkpoint of it had been written yet"
            )
            raise TrainingError(
                f"{self.method.name} session {t} ({session.name}) epoch {state.epoch}: the training "
                f"loss became {mean_loss}{_culprit(recent, steps)}; the session stopped and {kept}; lower the "
                f"learning rate ({'lr_base' if t == 0 else 'lr_incremental'}={lr}) or check those samples "
                "('jascl data check'), then rerun to resume"
            )
        return mean_loss, stops > 0

    def stopped(self, state: LoopState) -> Stopped:
        """The exception that ends a run stopped by a signal after this session's last checkpoint."""
        session = state.session
        return REQUEST.stopped(
            f"in {self.method.name} session {session.index} ({session.name}): its training state "
            f"{self.saved} is saved in {self.path}"
        )


def _culprit(recent: Sequence[tuple[torch.Tensor, object]], steps: int) -> str:
    """ ", first at step N of the epoch, in the batch of samples a, b, c" for the first non-finite loss of
    ``recent`` (the steps up to ``steps``); "" when this process saw none (another process's batch)."""
    if not recent:
        return ""
    losses = torch.stack([loss.float().reshape(()) for loss, _ in recent])
    bad = (~torch.isfinite(losses)).nonzero()
    if bad.numel() == 0:
        return " (in another process's batch)" if distributed.world_size() > 1 else ""
    index = int(bad[0, 0])
    step = steps - len(recent) + index + 1
    ids = recent[index][1]
    if isinstance(ids, (list, tuple)) and ids:
        names = [str(i) for i in ids]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return f", first at step {step} of the epoch, in the batch of samples {shown}"
    return f", first at step {step} of the epoch"
