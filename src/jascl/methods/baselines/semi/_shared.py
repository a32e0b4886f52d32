"""What the pool baselines share: the unlabelled-phase schedule (an epoch that makes one pass over the pool,
pairing every labelled batch with an unlabelled one) and eval-mode logits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from jascl.data.datasets import BatchStream
from jascl.engine.plugin import Plugin
from jascl.errors import ConfigError
from jascl.methods.mean_teacher import UnlabelledDataset
from jascl.networks.base import eval_mode

if TYPE_CHECKING:
    from jascl.engine.config import RunConfig
    from jascl.engine.state import LoopState
    from jascl.networks.base import Segmenter


log = logging.getLogger("jascl")


def _eval_logits(model: Segmenter, images: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` in eval mode (train/eval modes restored afterwards)."""
    with eval_mode(model):
        return model(images)


class PoolPhasesPlugin(Plugin):
    """Base for plugins that train on the unlabelled pool during unlabelled phases.

    Subclasses call :meth:`_setup_pool` in ``before_session`` and take a pool
    batch with :meth:`_pool_batch` in ``after_forward`` while ``self._phase``.
    """

    #: a phase's set-up (the pool stream's position, pseudo-labels chosen at its start) is in the checkpoint
    mid_epoch_resume = True

    def __init__(self, start_epoch: int = 25, every: int = 25, batch_size: int | None = None) -> None:
        if start_epoch < 0 or every < 1:
            raise ConfigError(f"unlabelled phases need start_epoch >= 0 and every >= 1 (got {start_epoch}, {every})")
        self.start_epoch, self.every, self.batch_size = start_epoch, every, batch_size
        self._loader: DataLoader | None = None
        self._batches: BatchStream | None = None
        self._phase = False

    def _setup_pool(self, state: LoopState, salt: int) -> bool:
        """Build the pool loader for an incremental session with a pool; False if there is none."""
        self._loader, self._batches, self._phase = None, None, False
        pool = state.data.unlabelled
        if state.session.index == 0 or pool is None or len(pool) == 0:
            return False
        generator = torch.Generator().manual_seed(state.seed * 7919 + state.session.index * 31 + salt)
        self._loader = DataLoader(
            UnlabelledDataset(pool),
            batch_size=self.batch_size or state.config.batch_size,
            shuffle=True,
            generator=generator,
        )
        self._batches = BatchStream(self._loader)
        return True

    def _is_phase(self, epoch: int) -> bool:
        return self._loader is not None and epoch >= self.start_epoch and (epoch - self.start_epoch) % self.every == 0

    def epoch_iterations(self, state: LoopState) -> int | None:
        return len(self._loader) if self._is_phase(state.epoch) else None

    def before_epoch(self, state: LoopState) -> None:
        self._phase = self._is_phase(state.epoch)
        if self._phase:
            self._batches = BatchStream(self._loader)

    def _pool_batch(self) -> dict:
        return next(self._batches)

    def after_session(self, state: LoopState) -> None:
        self._loader, self._batches, self._phase = None, None, False


def _schedule(config: RunConfig) -> dict:
    """The unlabelled-phase schedule of ``method_args.jascl.pas``: every pool method follows the same one."""
    from jascl.methods.presets import jascl_options

    p = jascl_options(config).pas
    return {"start_epoch": p.start_epoch, "every": p.every, "batch_size": p.batch_size}
