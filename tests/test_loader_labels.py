"""Training labels travel from the loader as uint8 and are widened to int64 on the device in the training step:
the step's target and loss are those of the int64 labels of before (hand-checked on a small volume)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jascl.data.datasets import LabelledDataset
from jascl.data.types import Split
from jascl.engine.losses import SegmentationLoss
from jascl.engine.state import LoopState
from jascl.engine.tasks.segmentation import SegmentationTask

# one 2 x 2 x 2 volume of global ids: background, the taught classes 2 and 5, an untaught 7 and an ignored voxel
# (the training-label policy hides 7 and 255 as 0 with other_classes "background", as 255 with "ignore")
LABEL = np.array([[[0, 2], [5, 7]], [[255, 2], [0, 5]]], np.int64)


def _split() -> Split:
    images = np.arange(8, dtype=np.float32).reshape(1, 1, 2, 2, 2)
    return Split(images, LABEL[None], ["case"])


def test_the_training_loader_yields_uint8_labels_with_the_int64_values():
    compact = LabelledDataset(_split(), [2, 5], "ignore", augment=True, seed=4, label_dtype=torch.uint8)
    wide = LabelledDataset(_split(), [2, 5], "ignore", augment=True, seed=4)
    for key in [(0, 0), (1, 0), (2, 0)]:
        a, b = compact[key], wide[key]
        assert a["label"].dtype == torch.uint8 and b["label"].dtype == torch.int64
        assert torch.equal(a["label"].long(), b["label"]) and torch.equal(a["image"], b["image"])
        assert a["ignore"] is b["ignore"] is True
    # without flips: the label as written, 7 and 255 hidden as 0 (then no voxel is ignored)
    hidden = LabelledDataset(_split(), [2, 5], label_dtype=torch.uint8)[0]
    assert hidden["label"].tolist() == [[[0, 2], [5, 0]], [[0, 2], [0, 5]]] and hidden["ignore"] is False
    with pytest.raises(ValueError, match="label_dtype"):
        LabelledDataset(_split(), [2, 5], label_dtype=torch.int32)


def _state(batch: dict) -> LoopState:
    fields = dict.fromkeys(["protocol", "config", "method_name", "session", "data", "model", "prototypes"])
    return LoopState(**fields, device=torch.device("cpu"), seen=[0, 2, 5], batch=batch)


def test_the_training_step_widens_uint8_labels_to_the_int64_target_and_loss_of_before():
    task = SegmentationTask(SimpleNamespace(device=torch.device("cpu"), memory_format=None))  # type: ignore[arg-type]
    dataset = LabelledDataset(_split(), [2, 5], "ignore", label_dtype=torch.uint8)
    item = dataset[0]
    batch = {k: torch.stack([item[k]] * 2) if k in ("image", "label") else [item[k]] * 2 for k in item}
    batch["ignore"] = torch.tensor([item["ignore"]] * 2)
    assert batch["label"].dtype == torch.uint8
    widened = task.training_batch(batch)
    assert widened["label"].dtype == torch.int64 and torch.equal(widened["label"], batch["label"].long())
    assert task.training_batch(widened) is widened  # int64 batches (a plugin's) pass as they are
    before = {**batch, "label": batch["label"].long()}  # what the loader yielded before: int64
    targets = []
    for b in (widened, before):
        state = _state(b)
        task.model_inputs(state)
        targets.append(state.target)
        assert state.has_ignore is True
    # classifier rows of seen [0, 2, 5]: 0 -> 0, 2 -> 1, 5 -> 2, 255 stays; the untaught 7 was hidden as 255
    rows = [[[0, 1], [2, 255]], [[255, 1], [0, 2]]]
    assert targets[0].dtype == torch.int64 and targets[0].tolist() == [rows, rows]
    assert torch.equal(targets[0], targets[1])
    # logits (ln 2, 0, 0) everywhere: softmax (1/2, 1/4, 1/4), so cross-entropy ln 2 on the two row-0 voxels
    # and ln 4 on the four of rows 1-2 not ignored: (2 ln 2 + 4 ln 4) / 6 = 5/3 ln 2
    logits = torch.zeros(2, 3, 2, 2, 2)
    logits[:, 0] = math.log(2)
    ce = SegmentationLoss(lambda_ce=1.0, lambda_dice=0.0)
    assert ce(logits, targets[0], True).item() == pytest.approx(5 / 3 * math.log(2), abs=1e-6)
    logits = torch.randn(2, 3, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    loss = SegmentationLoss()
    assert torch.equal(loss(logits, targets[0], True), loss(logits, targets[1], True))
