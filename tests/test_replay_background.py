"""The replay's background prototypes: each class's complement (authors) or one per session."""

import pytest
import torch

from jascl.data.synthetic import load_or_generate
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeAccumulator, PrototypeStore, class_prototypes
from jascl.methods import Method
from jascl.methods.replay import PrototypeReplayPlugin, replay_set
from jascl.protocols.schema import IGNORE_INDEX


def _batch():
    # one sample, D = 2, a 2x2 map in raster order: labels 1, 0, 2, ignore
    f = torch.tensor([[3.0, 0.0], [0.0, 2.0], [2.0, 2.0], [9.0, -9.0]])
    return f.t().reshape(1, 2, 2, 2), torch.tensor([[1, 0, 2, IGNORE_INDEX]]).reshape(1, 2, 2)


def test_complement_prototypes_by_hand():
    feats, labels = _batch()
    comp = class_prototypes(feats, labels, [0, 1, 2], complement=True)
    # class 1: pixels labelled 0 and 2 (ignore left out): mean (1, 2) -> (1, 2)/sqrt(5)
    assert torch.allclose(comp[1], torch.tensor([1.0, 2.0]) / 5**0.5, atol=1e-6)
    # class 2: pixels labelled 1 and 0: mean (1.5, 1) -> (3, 2)/sqrt(13)
    assert torch.allclose(comp[2], torch.tensor([3.0, 2.0]) / 13**0.5, atol=1e-6)
    # background's complement: pixels of classes 1 and 2: mean (2.5, 1) -> (5, 2)/sqrt(29)
    assert torch.allclose(comp[0], torch.tensor([5.0, 2.0]) / 29**0.5, atol=1e-6)
    # a class absent from the sample has no complement; normalised pixels first (the authors' get_prototype)
    assert 3 not in class_prototypes(feats, labels, [3], complement=True)
    norm = class_prototypes(feats, labels, [1], normalize_pixels=True, complement=True)[1]
    assert torch.allclose(norm, torch.tensor([0.5**0.5, 1 + 0.5**0.5]) / (0.5 + (1 + 0.5**0.5) ** 2) ** 0.5, atol=1e-6)


def test_complement_needs_something_else_in_the_sample():
    feats = torch.ones(1, 2, 1, 2)
    labels = torch.tensor([[[4, IGNORE_INDEX]]])  # class 4 and ignore only: no complement pixel
    assert class_prototypes(feats, labels, [4], complement=True) == {}
    acc = PrototypeAccumulator([4], complement=True)
    acc.update(feats, labels)
    assert acc.compute() == {}


def test_replay_set_per_class_and_session():
    store = {(0, 0): torch.tensor([1.0, 0.0]), (0, 1): torch.tensor([0.0, 1.0]), (0, 2): torch.tensor([0.6, 0.8])}
    comps = {(0, 1): torch.tensor([0.8, 0.6]), (0, 2): torch.tensor([1.0, 0.0])}
    vectors, ids = replay_set(store, comps, "per-class")
    # each class followed by its complement (target 0); the session's own background is not replayed
    assert ids.tolist() == [1, 0, 2, 0]
    assert torch.equal(vectors, torch.stack([store[(0, 1)], comps[(0, 1)], store[(0, 2)], comps[(0, 2)]]))
    vectors, ids = replay_set(store, comps, "session")
    assert ids.tolist() == [0, 1, 2] and torch.equal(vectors[0], store[(0, 0)])
    assert replay_set({}, {}, "per-class")[1].numel() == 0
    with pytest.raises(ValueError, match="background='pixel'"):
        replay_set(store, comps, "pixel")


@pytest.mark.parametrize("background", ["per-class", "session"])
def test_loop_replays_the_chosen_backgrounds(toy_protocol, toy_config, tmp_path, background):
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    plugin = PrototypeReplayPlugin(weight=0.1, background=background)
    trainer = ContinualTrainer(toy_protocol, toy_config, Method("t", [plugin]), data, progress=False)
    model, store = trainer.new_model(3), PrototypeStore()
    trainer.run_session(0, model, store, tmp_path / "s0")
    if background == "session":
        assert plugin.complements == {}
        trainer.run_session(1, model, store, tmp_path / "s1")
        assert plugin._targets.tolist() == [0, 1, 2]  # session 0's background, classes 1 and 2
        return
    assert set(plugin.complements) == {(0, 1), (0, 2)}
    # the complement is eq. 2 on the pixels that are not the class, with the model after training
    expected = trainer.compute_prototypes(model, 0, [1], complement=True)[1]
    assert torch.allclose(plugin.complements[(0, 1)], expected)
    assert not torch.allclose(plugin.complements[(0, 1)], store.entries[(0, 0)])
    trainer.run_session(1, model, store, tmp_path / "s1")
    assert plugin._targets.tolist() == [1, 0, 2, 0]
    # saved with the session checkpoint and read back when the session is reused
    saved = plugin.extra_state()
    assert set(saved) == {"bg.s0.c1", "bg.s0.c2", "bg.s1.c1", "bg.s1.c3"}
    other = PrototypeReplayPlugin()
    other.load_extra_state(saved)
    assert all(torch.equal(other.complements[k], v) for k, v in plugin.complements.items())


def test_restored_base_without_complements_gets_them(toy_protocol, toy_config, tmp_path):
    """A base shared with a method that has no replay (vanilla's) lacks the complements: they are computed."""
    data = load_or_generate(toy_protocol, tmp_path / "cache")
    vanilla = ContinualTrainer(toy_protocol, toy_config, Method("v", []), data, progress=False)
    model, store = vanilla.new_model(3), PrototypeStore()
    vanilla.run_session(0, model, store, tmp_path / "s0")
    plugin = PrototypeReplayPlugin()
    trainer = ContinualTrainer(toy_protocol, toy_config, Method("t", [plugin]), data, progress=False)
    trainer.restore_session(0, tmp_path / "s0", model, store)
    expected = trainer.compute_prototypes(model, 0, [1, 2], complement=True)
    assert set(plugin.complements) == {(0, 1), (0, 2)}
    assert all(torch.allclose(plugin.complements[(0, c)], expected[c]) for c in (1, 2))
