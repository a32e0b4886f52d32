"""What several methods use: session gates, frozen copies of the model, the labelled set as a loader and its
samples' outputs in bounded memory.

The freeze option every baseline has is :func:`jascl.methods.options.freeze_option`; the ignore index is
:data:`jascl.protocols.schema.IGNORE_INDEX`; eval mode with the modes restored is
:func:`jascl.networks.base.eval_mode`, 2D/3D resizing :func:`jascl.networks.base.resize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from jascl.data.sampling import derive_seed
from jascl.data.types import dense
from jascl.engine.state import LoopState
from jascl.methods.gas import clean_state_dict
from jascl.networks.base import Segmenter, SegmenterOutput, whole_sample_forward
from jascl.protocols.schema import IGNORE_INDEX

if TYPE_CHECKING:
    from jascl.data.datasets import LabelledDataset


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
    """The session's labelled training set without augmentation, whole samples in order (for statistics passes).

    Batches hold ``image``, ``label`` (untaught classes hidden as the protocol's ``other_classes`` says) and ``id``.
    Samples are batched ``batch_size`` (default: the run's) at a time only when the split says they share one
    shape (``images.uniform``, synthetic data); real datasets vary in size, and their samples come one at a
    time. Feed a batch's images to the model with :func:`whole_forward`.
    """
    from jascl.data.datasets import LabelledDataset  # (MONAI: imported where a method needs the loader)

    train = state.data.train
    dataset = LabelledDataset(dense(train), state.session.classes, state.session.other_classes, augment=False)
    uniform = getattr(train.images, "uniform", True)
    return DataLoader(dataset, batch_size=(batch_size or state.config.batch_size) if uniform else 1)


def labelled_crops(state: LoopState, purpose: str) -> LabelledDataset:
    """The session's labelled samples as training crops without augmentation (``patch_size``; whole samples when it
    is null), all of one shape: for a pass that should see what the model trains on, in bounded memory. The crop
    of sample i is drawn from the run's seed, ``purpose``, the session and i alone. On synthetic protocols (the
    patch is the samples' shape or none) the items are the whole samples."""
    from jascl.data.datasets import LabelledDataset  # (MONAI: imported where a method needs the loader)

    return LabelledDataset(
        dense(state.data.train),
        state.session.classes,
        state.session.other_classes,
        augment=False,
        patch_size=state.config.patch_size,
        seed=derive_seed(state.seed, purpose, state.session.index),
    )


def crops_for_volumes(state: LoopState) -> bool:
    """Whether a pass that takes gradients of, or keeps results for, every labelled sample reads training crops
    (:func:`labelled_crops`) rather than whole samples: for volumes (3D with a patch), whose backward pass or kept
    full-resolution features would not fit in memory; images (2D) stay whole, as the methods' papers had them."""
    return len(state.config.patch_size or ()) == 3


def whole_forward(state: LoopState, model: Segmenter, images: torch.Tensor) -> SegmenterOutput:
    """``model``'s logits and features of whole samples (a :func:`labelled_loader` batch, on the device): volumes
    larger than the training patch through sliding windows, as the evaluation scores them
    (:func:`jascl.networks.base.whole_sample_forward`), everything else in one forward."""
    cfg = state.config
    return whole_sample_forward(model, images, cfg.patch_size, cfg.sw_batch_size, cfg.sw_overlap)


def patch_around(
    image: torch.Tensor,
    label: torch.Tensor,
    patch: Sequence[int] | None,
    rng: np.random.Generator,
    cls: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A training-patch-sized window of one whole sample, for a method that keeps samples to train on later
    (exemplars, a copy-paste memory): every kept sample then has the patch's shape, as training batches do,
    and a kept volume costs a patch, not a volume.

    ``image`` (C, *spatial) and ``label`` (*spatial) are padded at their far end where smaller than ``patch``
    (image 0, label 255 = ignore, as training crops are), then cut to ``patch`` around one pixel of class
    ``cls`` (any class but background and ignore when None) drawn with ``rng``, the window clamped to the
    sample; without such a pixel, around the centre. A sample already of the patch's shape, or ``patch`` None,
    comes back as it is and draws nothing from ``rng``.
    """
    if patch is None or tuple(label.shape) == tuple(patch):
        return image, label
    widths: list[int] = []
    for size, p in reversed(list(zip(label.shape, patch))):
        widths += [0, max(p - size, 0)]
    image = F.pad(image, widths)
    label = F.pad(label, widths, value=IGNORE_INDEX)
    shown = (label == cls) if cls is not None else (label != 0) & (label != IGNORE_INDEX)
    where = shown.nonzero()
    if len(where):
        centre = where[int(rng.integers(len(where)))].tolist()
    else:
        centre = [s // 2 for s in label.shape]
    starts = [min(max(c - p // 2, 0), s - p) for c, p, s in zip(centre, patch, label.shape)]
    window = tuple(slice(a, a + p) for a, p in zip(starts, patch))
    return image[(slice(None),) + window].clone(), label[window].clone()
