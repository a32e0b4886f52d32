"""The bounded labelled replay memory (jascl.methods.labelled_memory): the class-balanced selection rule on
hand-made class sets, the memory's bounds, sampler and safetensors round trip, and the plugin filling it from a
session's labelled samples (training crops, training labels) exactly once per session."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jascl.data.types import Split
from jascl.errors import ConfigError
from jascl.methods.labelled_memory import LabelledMemory, LabelledMemoryPlugin, balanced_selection, foreground_classes
from jascl.protocols.schema import IGNORE_INDEX


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- the selection rule


def test_foreground_classes_leave_out_background_and_ignore():
    assert foreground_classes(torch.tensor([[0, 3], [IGNORE_INDEX, 1]])) == {1, 3}
    assert foreground_classes(torch.zeros(2, 2, dtype=torch.long)) == set()


def test_held_class_over_its_quota_is_cut_for_a_new_class():
    # size 4, classes {1, 2}: quota 2 each; four held samples of class 1 -> two kept, two new of class 2
    keep, taken = balanced_selection([1, 1, 1, 1], [{2}, {2}, {1, 2}, set()], 4, _gen())
    assert len(keep) == 2 and set(keep) <= {0, 1, 2, 3}
    assert len(taken) == 2 and all(c == 2 for _, c in taken) and {i for i, _ in taken} <= {0, 1, 2}


def test_quota_remainder_goes_to_the_smaller_class_id():
    # size 5 over classes {1, 2}: quotas 3 and 2 (size % K = 1 extra slot to class 1)
    offered = [{1}] * 4 + [{2}] * 4
    keep, taken = balanced_selection([], offered, 5, _gen())
    assert keep == []
    classes = [c for _, c in taken]
    assert classes.count(1) == 3 and classes.count(2) == 2
    assert all(c in offered[i] for i, c in taken)


def test_free_slots_go_back_to_held_samples_when_a_class_has_too_few():
    # quota 2 each; class 2 has one sample only: the third held sample of class 1 fills the last slot
    keep, taken = balanced_selection([1, 1, 1], [{2}], 4, _gen())
    assert keep == [0, 1, 2] and taken == [(0, 2)]


def test_background_only_samples_fill_slots_last():
    keep, taken = balanced_selection([], [set(), {1}, set()], 3, _gen())
    assert keep == [] and taken == [(0, 0), (1, 1), (2, 0)]
    # when foreground samples fill the memory, no background-only sample is taken
    keep, taken = balanced_selection([0], [{1}, {1}, set()], 2, _gen())
    assert keep == [] and taken == [(0, 1), (1, 1)]


def test_selection_is_seeded_and_bounded():
    offered = [{1 + i % 3} for i in range(30)]
    a = balanced_selection([], offered, 7, _gen(5))
    assert a == balanced_selection([], offered, 7, _gen(5))
    assert len(a[1]) == 7
    counts = sorted([c for _, c in a[1]].count(k) for k in (1, 2, 3))
    assert counts == [2, 2, 3]  # 7 = 3 + 2 + 2
    assert balanced_selection([1, 2], offered, 0, _gen()) == ([], [])


# ---------------------------------------------------------------- the memory


def _images(n: int, shape=(1, 2, 2), start: float = 0.0) -> list[torch.Tensor]:
    return [torch.full(shape, start + i) for i in range(n)]


def test_memory_fills_cuts_and_samples(tmp_path):
    memory = LabelledMemory(3)
    labels0 = [torch.tensor([[0, 1], [0, 0]]), torch.tensor([[0, 1], [1, 0]]), torch.tensor([[2, 2], [0, 0]])]
    memory.add_session(0, _images(3), labels0, _gen())
    assert len(memory) == 3 and memory.offered == [0]
    assert memory.class_counts() == {1: 2, 2: 1}  # quotas 2 and 1, and exactly that many samples
    assert memory.labels is not None and memory.labels.dtype == torch.uint8
    # every stored image is the one its label came with (image value = its index in the session)
    assert memory.images is not None
    for x, y in zip(memory.images, memory.labels):
        assert torch.equal(y.long(), labels0[int(x[0, 0, 0])])

    # a new class: quotas 1 / 1 / 1 over classes 1, 2, 3 -> one class-1 sample of session 0 is dropped
    memory.add_session(1, _images(2, start=10.0), [torch.tensor([[3, 0], [0, 0]])] * 2, _gen())
    assert memory.class_counts() == {1: 1, 2: 1, 3: 1}
    assert sorted(memory.sessions.tolist()) == [0, 0, 1]
    memory.add_session(1, _images(2), [torch.tensor([[1, 0], [0, 0]])] * 2, _gen())  # offered before: ignored
    assert memory.class_counts() == {1: 1, 2: 1, 3: 1} and memory.offered == [0, 1]

    batch = memory.sample(5, _gen())
    assert batch is not None and batch["image"].shape == (3, 1, 2, 2) and batch["label"].dtype == torch.long
    assert sorted(batch["index"].tolist()) == [0, 1, 2]
    assert torch.equal(batch["image"], memory.images[batch["index"]])

    # safetensors round trip: the same memory
    save_file(memory.to_tensors(), str(tmp_path / "m.safetensors"))
    again = LabelledMemory(3)
    again.load_tensors(load_file(str(tmp_path / "m.safetensors")))
    assert again.offered == [0, 1] and torch.equal(again.images, memory.images)
    assert torch.equal(again.labels, memory.labels) and torch.equal(again.classes, memory.classes)
    assert torch.equal(again.sessions, memory.sessions)


def test_memory_edge_cases():
    empty = LabelledMemory(0)
    empty.add_session(0, _images(2), [torch.ones(2, 2, dtype=torch.long)] * 2, _gen())
    assert len(empty) == 0 and empty.sample(4, _gen()) is None
    assert empty.to_tensors().keys() == {"offered"}
    with pytest.raises(ConfigError, match="size >= 0"):
        LabelledMemory(-1)
    memory = LabelledMemory(4)
    memory.add_session(0, _images(1), [torch.ones(2, 2, dtype=torch.long)], _gen())
    with pytest.raises(ConfigError, match="patch_size"):
        memory.add_session(1, _images(1, shape=(1, 3, 3)), [torch.full((3, 3), 2)], _gen())
    assert memory.offered == [0]  # the refused session left the memory as it was


# ---------------------------------------------------------------- the plugin


def _state(session: int, classes: list[int], labels: np.ndarray) -> SimpleNamespace:
    n = labels.shape[0]
    images = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1) * np.ones((1, 1, 4, 4), dtype=np.float32)
    split = Split(images, labels.astype(np.uint8), [f"s{session}-{i}" for i in range(n)])
    return SimpleNamespace(
        session=SimpleNamespace(index=session, classes=classes, other_classes="background"),
        data=SimpleNamespace(train=split),
        config=SimpleNamespace(patch_size=None),
        seed=0,
        report={},
    )


def test_plugin_stores_training_labels_once_per_session_and_round_trips():
    labels = np.zeros((3, 4, 4), dtype=np.uint8)
    labels[0, :2] = 1
    labels[1, :2] = 2  # class 2 is not taught in this session: hidden as background
    labels[2, 0, 0] = 1
    plugin = LabelledMemoryPlugin(size=5)
    plugin.session_restored(_state(0, [1], labels))
    memory = plugin.memory
    assert len(memory) == 3 and memory.offered == [0]
    assert memory.class_counts() == {0: 1, 1: 2}  # sample 1 shows no taught class
    assert memory.images is not None and memory.labels is not None
    by_image = {int(x[0, 0, 0]): y for x, y in zip(memory.images, memory.labels)}
    assert int(by_image[1].max()) == 0 and torch.equal(by_image[0], torch.from_numpy(labels[0]))

    # restoring a later checkpoint's memory, then its session_restored, does not offer that session again
    tensors = plugin.extra_state()
    assert set(tensors) == {"offered", "images", "labels", "classes", "sessions"}
    other = LabelledMemoryPlugin(size=5)
    other.load_extra_state(tensors)
    other.after_session(_state(0, [1], labels))
    assert len(other.memory) == 3 and torch.equal(other.memory.images, memory.images)
    state = _state(1, [2], labels)
    other.after_session(state)
    assert other.memory.offered == [0, 1] and state.report["labelled_memory"]["size"] == 5
    assert "memory" not in other.state_dict()  # unchanged within a session: not in in-session checkpoints
