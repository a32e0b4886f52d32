"""NNCSL (jascl.methods.baselines.semi.nncsl): the soft nearest-neighbour classifier, sharpening, smoothed
labels, the PAWS and NND losses and the second view on hand-computed tensors; the plugin on the toy protocol
with a 4-image pool in session 1 (one short run on an untrained session-0 model)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import toy_protocol_dict
from jascl.data.synthetic import load_or_generate
from jascl.engine.config import resolve_config
from jascl.engine.loop import ContinualTrainer
from jascl.engine.prototypes import PrototypeStore
from jascl.errors import ConfigError
from jascl.methods import Plugin
from jascl.methods.baselines.semi.nncsl import (
    NNCSLPlugin,
    nnd_loss,
    paws_loss,
    second_view,
    sharpen,
    smoothed_labels,
    soft_nearest_neighbours,
)
from jascl.methods.labelled_memory import LabelledMemoryPlugin
from jascl.methods.registry import create_method
from jascl.protocols import parse_protocol

E = math.e


def test_soft_nearest_neighbours_is_a_softmax_over_cosine_similarities():
    queries = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    supports = torch.tensor([[2.0, 0.0], [0.0, 5.0], [0.0, 1.0]])  # norms do not matter
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    p = soft_nearest_neighbours(queries, supports, labels, temperature=1.0)
    # query 1: similarities (1, 0, 0) -> weights (e, 1, 1) / (e + 2); class 1 gets the last two
    expected = torch.tensor([[E / (E + 2), 2 / (E + 2)], [1 / (1 + 2 * E), 2 * E / (1 + 2 * E)]])
    assert torch.allclose(p, expected)
    sharp = soft_nearest_neighbours(queries, supports, labels, temperature=0.5)
    assert torch.allclose(sharp[0], torch.tensor([E**2 / (E**2 + 2), 2 / (E**2 + 2)]))


def test_sharpen_and_smoothed_labels():
    assert torch.allclose(sharpen(torch.tensor([[0.8, 0.2]]), 0.5), torch.tensor([[0.64, 0.04]]) / 0.68)
    y = smoothed_labels(torch.tensor([3, 0, 3]), torch.tensor([0, 3]), 0.1)
    assert torch.allclose(y, torch.tensor([[0.05, 0.95], [0.95, 0.05], [0.05, 0.95]]))
    assert torch.allclose(y.sum(1), torch.ones(3))


def test_paws_loss_cross_entropy_floor_and_me_max():
    anchors = torch.tensor([[0.5, 0.5]], requires_grad=True)
    # targets [0.9, 0.1] sharpened with T = 0.25: 0.9^4 / (0.9^4 + 0.1^4), both above the 1e-4 floor
    ce, me_max = paws_loss(anchors, torch.tensor([[0.9, 0.1]]), 0.25)
    assert ce.item() == pytest.approx(math.log(2), rel=1e-6)
    assert me_max.item() == pytest.approx(-math.log(2), rel=1e-6)  # minus the entropy of (0.5, 0.5)
    # [0.99, 0.01] -> the sharpened 0.01 is ~1e-8 < 1e-4: dropped (not renormalised)
    ce, _ = paws_loss(torch.tensor([[0.25, 0.75]]), torch.tensor([[0.99, 0.01]]), 0.25)
    t0 = 0.99**4 / (0.99**4 + 0.01**4)
    assert ce.item() == pytest.approx(-t0 * math.log(0.25), rel=1e-6)
    # me-max: two confident anchors on different classes have the uniform mean (entropy log 2)
    _, me_max = paws_loss(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 0.25)
    assert me_max.item() == pytest.approx(-math.log(2), rel=1e-6)


def test_nnd_loss_is_cross_entropy_old_to_current_without_gradient_to_the_old():
    old = torch.tensor([[0.25, 0.75]], requires_grad=True)
    current = torch.tensor([[0.5, 0.5]], requires_grad=True)
    loss = nnd_loss(old, current)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    loss.backward()
    assert old.grad is None
    assert torch.allclose(current.grad, torch.tensor([[-0.25 / 0.5, -0.75 / 0.5]]))


def test_second_view_mirrors_and_jitters_each_image():
    x = torch.arange(8.0).view(2, 1, 1, 4)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(second_view(x, 0.0, g), x.flip(-1))
    ones = torch.ones(3, 1, 2, 2)
    g = torch.Generator().manual_seed(1)
    ab = (torch.rand(2, 3, generator=torch.Generator().manual_seed(1)) * 2 - 1) * 0.1
    v = second_view(ones, 0.1, g)
    assert torch.allclose(v, (1 + ab[0] + ab[1]).view(3, 1, 1, 1).expand_as(v))


def test_options_are_checked_and_composed():
    protocol = parse_protocol(toy_protocol_dict(2), source="toy.yaml")
    config = resolve_config(protocol.training, "toy.yaml", overrides=["method_args.nncsl.memory_size=7"])
    method = create_method("nncsl", config)
    store, plugin = method.plugins
    assert isinstance(store, LabelledMemoryPlugin) and isinstance(plugin, NNCSLPlugin)
    assert plugin.memory is store.memory and store.memory.size == 7
    assert plugin.freeze_incremental == "none" and not method.changes_base_session
    with pytest.raises(ConfigError, match="method_args.nncsl.feature_weight"):
        create_method(
            "nncsl", resolve_config(protocol.training, "t.yaml", overrides=["method_args.nncsl.feature_weight=2"])
        )


class Recorder(Plugin):
    name = "recorder"

    def __init__(self):
        self.losses = []

    def before_backward(self, state):
        self.losses.append({k: float(v.detach()) for k, v in state.losses.items()})


def test_nncsl_trains_session_1_from_the_memory_and_saves_it(tmp_path):
    d = toy_protocol_dict(2)
    d["sessions"][1]["unlabelled"] = 4
    protocol = parse_protocol(d, source="toy-nncsl.yaml")
    config = resolve_config(
        protocol.training,
        "toy-nncsl.yaml",
        overrides=[
            "pas.start_epoch=1",
            "pas.every=1",
            "method_args.nncsl.feature_weight=0.5",
            "method_args.nncsl.memory_batch_size=2",
        ],
    )
    data = load_or_generate(protocol, tmp_path / "cache")
    method = create_method("nncsl", config)
    store, plugin = method.plugins
    rec = Recorder()
    method.plugins.append(rec)
    trainer = ContinualTrainer(protocol, config, method, data, progress=False)
    model, prototypes = trainer.new_model(3), PrototypeStore()
    trainer.restore_session(0, tmp_path / "s0", model, prototypes)  # an (untrained) reused base
    memory = store.memory
    assert len(memory) == 8 and memory.offered == [0]  # session 0's 8 labelled images fit in 20
    assert set(memory.class_counts()) <= {1, 2} and sorted(memory.sessions.tolist()) == [0] * 8
    trainer.run_session(1, model, prototypes, tmp_path / "s1")

    # epoch 0 is no unlabelled phase (start_epoch 1): memory CE and NND only; epoch 1 adds PAWS
    assert [sorted(r) for r in rec.losses] == [
        ["nncsl_memory", "nncsl_nnd", "seg"],
        ["nncsl_memory", "nncsl_nnd", "nncsl_paws", "seg"],
    ]
    assert all(r["nncsl_memory"] > 0 and r["nncsl_nnd"] > 0 for r in rec.losses)
    assert rec.losses[1]["nncsl_paws"] != 0
    assert plugin.teacher is None and plugin.projector is None  # released after the session

    # after session 1: its 4 labelled images (2 shots of classes 1 and 3) joined (12 <= 20), saved with the
    # session checkpoint in safetensors
    assert len(data[1].train) == 4
    assert len(memory) == 12 and memory.offered == [0, 1] and sorted(memory.sessions.tolist()) == [0] * 8 + [1] * 4
    saved = load_file(tmp_path / "s1" / "plugins.safetensors")
    assert torch.equal(saved["0.labelled-memory.images"], memory.images)
    assert saved["0.labelled-memory.offered"].tolist() == [0, 1]
