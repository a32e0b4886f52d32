"""What several methods use: session gates, frozen copies of the model, the labelled set as a loader.

The freeze option every baseline has is :func:`jascl.methods.options.freeze_option`; the ignore index is
:data:`jascl.protocols.schema.IGNORE_INDEX`; eval mode with the modes restored is
:func:`jascl.networks.base.eval_mode`, 2D/3D resizing :func:`jascl.networks.base.resize`.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from jascl.data.types import dense
from jascl.engine.state import LoopState
from jascl.methods.gas import clean_state_dict
from jascl.networks.base import Segmenter


class SessionGate:
    """Mixin deciding whether a plugin acts in a session: incremental sessions only, or also session 0 (``in_base``)."""

    in_base = False

    def active(self, state: LoopState) -> bool:
        return self.in_base or state.session.index > 0


def frozen_copy(state: LoopState, keep_random_stream: bool = True) -> Segmenter:
    """The current model as a frozen teacher, in eval mode (at the start of a session: the previous session's model).

    Built with ``state.new_model`` (the model as grown this session) and the current weights; GAS
    parametrisations, if any, are dropped.

    Args:
        keep_random_stream: leave the global random stream untouched (``new_model`` reseeds it). The
            few-shot family (PIFS, GAPS) passes False: their published runs in this project were made
            with the reseeding, and keeping it keeps their results.
    """
    if keep_random_stream:
        devices = [state.device.index or 0] if state.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            teacher = state.new_model(state.model.num_classes)
    else:
        teacher = state.new_model(state.model.num_classes)
    teacher.load_state_dict(clean_state_dict(state.model))
    return teacher.eval().requires_grad_(False)


def labelled_loader(state: LoopState, batch_size: int | None = None) -> DataLoader:
    """The session's labelled training set without augmentation, in order (for statistics passes).

    Batches hold ``image``, ``label`` (untaught classes hidden as the protocol's ``other_classes`` says) and ``id``.
    """
    from jascl.data.datasets import LabelledDataset  # (MONAI: imported where a method needs the loader)

    dataset = LabelledDataset(
        dense(state.data.train), state.session.classes, state.session.other_classes, augment=False
    )
    return DataLoader(dataset, batch_size=batch_size or state.config.batch_size)
