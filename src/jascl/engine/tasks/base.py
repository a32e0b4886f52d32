"""The interface a task fills (:class:`Task`); the loop calls nothing task-specific but these methods."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from jascl.data.types import SessionData
    from jascl.engine.config import RunConfig
    from jascl.engine.plugin import Method, Plugin
    from jascl.engine.prototypes import PrototypeRequest
    from jascl.engine.state import LoopState
    from jascl.protocols.schema import Protocol


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """What a task needs from the run it serves, and nothing more (not the trainer: the loop owns the task,
    so a task that held the loop would tie the two modules in a circle).

    Attributes:
        protocol: the validated protocol (sessions, classes, spatial dims).
        config: the resolved run configuration.
        data: one :class:`~jascl.data.types.SessionData` per protocol session.
        device: where models and batches live.
        seed: the run's seed (the configuration's, else the protocol's).
        method: the method being trained (the checkpoint plugin saves its plugins' state).
        autocast: a context manager for forwards in the run's precision.
        checkpoint_meta: ``t -> dict``, what a session-``t`` checkpoint must match to be loaded.
        memory_format: ``torch.channels_last[_3d]`` with ``channels_last``, else None.
        progress: show progress bars.
    """

    protocol: Protocol
    config: RunConfig
    data: Sequence[SessionData]
    device: torch.device
    seed: int
    method: Method
    autocast: Callable[[], AbstractContextManager]
    checkpoint_meta: Callable[[int], dict]
    memory_format: torch.memory_format | None = None
    progress: bool = True


class Task:
    """What the loop asks of a task.

    The loop (``jascl.engine.loop.ContinualTrainer``) owns the sessions, the events, the optimiser, the
    epochs and the checkpoints; the task supplies everything that depends on what is learnt:

    * the model: :meth:`new_model`, :meth:`load_weights` (``--weights``), :meth:`frozen_modules`;
    * the training batches: :meth:`labelled_dataset` and :attr:`collate`, then per step :meth:`training_batch`
      (the batch as the loop's events see it) and :meth:`model_inputs`
      (sets ``state.target`` and returns the arguments of ``state.forward``) and :meth:`training_forward`
      (the forward the loop calls, wrapped for DDP by :meth:`ddp_forward`);
    * the default plugins (:meth:`default_plugins`): classifier growth, the supervised loss, model selection,
      prototypes, evaluation and the checkpoint, by the same names whatever the task, so that a method replaces
      "supervised-loss" alike;
    * eq. 2 prototypes (:meth:`compute_prototypes`; several in one pass: :meth:`compute_prototype_requests`).

    Args:
        context: the run the task serves (:class:`TaskContext`: protocol, configuration, data, device, precision).
    """

    #: the protocol key's value
    name = ""

    def __init__(self, context: TaskContext) -> None:
        self.context = context

    #: collates a list of dataset items into a batch (None: torch's default)
    collate: Callable[[list[dict]], dict] | None = None

    def new_model(self, num_classes: int) -> nn.Module:
        """A fresh model with ``num_classes`` classifier rows (background included), on the run's device."""
        raise NotImplementedError

    def load_weights(self, model: nn.Module, path: str) -> None:
        """Load the user's pretrained weights (``--weights``) into a session-0 model."""
        raise NotImplementedError

    def frozen_modules(self, model: nn.Module, t: int, policy: str) -> list[nn.Module]:
        """The modules frozen in session ``t`` under the freezing policy ``policy`` (incremental sessions)."""
        raise NotImplementedError

    def labelled_dataset(self, t: int, augment: bool, crop: bool) -> Dataset:
        """Session ``t``'s labelled samples; ``crop``: training crops, else whole samples."""
        raise NotImplementedError

    def training_batch(self, batch: Any) -> Any:
        """The batch of the training loader as every event of the step sees it (``state.batch``): by default
        the loader's batch itself."""
        return batch

    def model_inputs(self, state: LoopState) -> tuple[Any, ...]:
        """From ``state.batch``: set ``state.target`` (and ``state.has_ignore``) and return the arguments of
        ``state.forward``, on the device."""
        raise NotImplementedError

    def training_forward(self, model: nn.Module) -> Callable[..., Any]:
        """The training forward of ``model`` (``state.forward`` when one process trains)."""
        raise NotImplementedError

    def ddp_forward(self, model: nn.Module, find_unused: bool) -> Callable[..., Any]:
        """The training forward under DistributedDataParallel (several processes)."""
        raise NotImplementedError

    def default_plugins(self) -> list[Plugin]:
        """The loop's default plugins for this task, in firing order."""
        raise NotImplementedError

    @torch.no_grad()
    def compute_prototypes(
        self,
        model: nn.Module,
        t: int,
        classes: list[int],
        normalize_pixels: bool = False,
        per_sample: bool = False,
        complement: bool = False,
        form: str = "eq2",
    ) -> dict[int, torch.Tensor]:
        """Eq. 2 prototypes of ``classes`` from session ``t``'s labelled data (see
        :meth:`jascl.engine.loop.ContinualTrainer.compute_prototypes`)."""
        raise NotImplementedError

    def compute_prototype_requests(
        self, model: nn.Module, t: int, requests: Sequence[PrototypeRequest]
    ) -> list[dict[int, torch.Tensor]]:
        """Several :meth:`compute_prototypes` on the same model and session, in the order given. A task may
        serve them in one pass over the data (segmentation does: the model's features feed every request's
        accumulator); by default each is its own call."""
        return [
            self.compute_prototypes(model, t, list(r.classes), r.normalize_pixels, r.per_sample, r.complement, r.form)
            for r in requests
        ]
