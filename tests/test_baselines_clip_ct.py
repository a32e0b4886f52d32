"""CLIP-CT (Zhang et al., MICCAI 2023): dynamic class-specific heads, pseudo-label targets and the binary losses
on hand-computed values; the plugin's heads on a tiny U-Net with a fixture embeddings file (no training)."""

import math
from types import SimpleNamespace

import pytest
import torch

from jascl.engine.config import resolve_config
from jascl.engine.losses import binary_segmentation_losses
from jascl.errors import ConfigError
from jascl.methods.baselines.distillation.clip_ct import CLIPCTHead, CLIPCTOptions, CLIPCTPlugin, clip_ct_targets
from jascl.methods.registry import create_method
from jascl.networks.base import create_segmenter
from jascl.networks.clip_driven import dynamic_heads, head_param_count, onehot_embeddings
from jascl.networks.text_embeddings import write_text_embeddings

# toy protocol classes (conftest): 1 disc, 2 square, 3 cross; session 1 teaches 3 (new) and 1 (recurring)
VECTORS = {
    "background": torch.tensor([9.0, 9.0, 9.0]),
    "disc": torch.tensor([1.0, 0.0, -1.0]),
    "square": torch.tensor([0.5, 2.0, 0.0]),
    "cross": torch.tensor([-3.0, 1.0, 0.25]),
}


@pytest.fixture
def embeddings_file(tmp_path):
    path = tmp_path / "toy-clip.safetensors"
    write_text_embeddings(path, VECTORS)
    return path


def test_dynamic_head_by_hand():
    # c = 2: W1 = [[1, 1], [0, -1]], b1 = 0 -> relu([3, -2]) = [3, 0] at h = [1, 2]
    # W2 = [[0, 1], [2, 0]], b2 = [1, -1] -> relu([1, 5]) = [1, 5]; w3 = [1, -1], b3 = 0.5 -> 1 - 5 + 0.5 = -3.5
    assert head_param_count(2) == 15 and head_param_count(8) == 153  # the official 8*8 + 8*8 + 8 + 8 + 8 + 1
    params = torch.tensor([[1.0, 1, 0, -1, 0, 1, 2, 0, 1, -1, 0, 0, 1, -1, 0.5]])
    h = torch.tensor([[1.0, 2.0], [0.0, 0.0]]).t().reshape(1, 2, 2)  # pixels [1, 2] and [0, 0]
    # a second head: all zero but b3 = -2
    second = torch.zeros(1, 15)
    second[0, -1] = -2.0
    out = dynamic_heads(h, torch.stack([params, second], dim=1))
    # pixel [0, 0]: relu([0, 0]) -> relu([1, -1]) = [1, 0] -> 1 + 0.5 = 1.5
    assert torch.allclose(out, torch.tensor([[[-3.5, 1.5], [-2.0, -2.0]]]))
    # 3D spatial input: the same value at every voxel
    h3 = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1, 1).expand(1, 2, 2, 3, 1)
    assert torch.allclose(dynamic_heads(h3, params.unsqueeze(1)), torch.full((1, 1, 2, 3, 1), -3.5))


def test_targets_take_old_pseudo_labels_on_background_pixels_only():
    target = torch.tensor([[0, 0, 1, 255]])  # rows; row 2 is an old class hidden in the background
    probs = torch.tensor([[[0.9, 0.3, 0.95, 0.9]]])
    y, valid = clip_ct_targets(target, 3, old_rows=[2], teacher_probs=probs)
    assert y.tolist() == [[[0, 0, 1, 0], [1, 0, 0, 0]]]
    assert valid.tolist() == [[[True, True, True, False], [True, True, True, False]]]
    # an unsure background pixel (max(p, 1-p) = 0.7 < 0.8) is ignored for the old row only
    _, valid = clip_ct_targets(target, 3, old_rows=[2], teacher_probs=probs, confidence=0.8)
    assert valid.tolist() == [[[True, True, True, False], [True, False, True, False]]]
    # without a teacher: plain one-vs-rest labels
    y, _ = clip_ct_targets(target, 3)
    assert y.tolist() == [[[0, 0, 1, 0], [0, 0, 0, 0]]]


def test_binary_losses_by_hand():
    logits = torch.zeros(1, 2, 4)
    targets = torch.tensor([[[1.0, 1, 0, 0], [1, 1, 1, 1]]])
    valid = torch.tensor([[[True] * 4, [False] * 4]])  # the second class has no valid pixel: not counted
    bce, dice = binary_segmentation_losses(logits, targets, valid)
    assert bce.item() == pytest.approx(math.log(2))
    assert dice.item() == pytest.approx(1 - (2 * 1.0 + 1) / (2.0 + 2.0 + 1))  # p = 0.5 everywhere: 0.4
    # a masked pixel does not count: logits +-inf-like on the valid ones give ~0 BCE
    logits = torch.tensor([[[20.0, -20.0, 5.0]]])
    bce, dice = binary_segmentation_losses(logits, torch.tensor([[[1.0, 0, 0]]]), torch.tensor([[[True, True, False]]]))
    assert bce.item() == pytest.approx(0.0, abs=1e-8)
    assert dice.item() == pytest.approx(0.0, abs=1e-8)
    none = binary_segmentation_losses(logits, torch.zeros(1, 1, 3), torch.zeros(1, 1, 3, dtype=torch.bool))
    assert none[0].item() == 0.0 and none[1].item() == 0.0


def test_head_rows_background_zero_and_new_classes_leave_old_rows():
    torch.manual_seed(0)
    head = CLIPCTHead(4, global_dim=6, hidden=5, head_channels=3)
    head.add_class(1, torch.tensor([1.0, 0.0]))
    head.add_class(2, torch.tensor([0.0, 1.0]))
    features = torch.randn(2, 4, 5, 6)
    before = head(features)
    assert before.shape == (2, 3, 5, 6)
    assert torch.equal(before[:, 0], torch.zeros(2, 5, 6))
    head.add_class(7, torch.tensor([1.0, 1.0]))
    after = head(features)
    assert head.classes == [1, 2, 7] and head.num_classes == 4
    assert torch.equal(after[:, :3], before)
    assert head(torch.randn(1, 4, 3, 3, 2)).shape == (1, 4, 3, 3, 2)  # 3D features


def test_onehot_embeddings():
    assert onehot_embeddings([1, 2, 3], [3, 1]).tolist() == [[0, 0, 1], [1, 0, 0]]


def _state(toy_protocol, session: int, seen, model):
    return SimpleNamespace(
        protocol=toy_protocol,
        session=toy_protocol.sessions[session],
        seen=list(seen),
        previous_seen=[0, 1, 2] if session else [],
        seed=3,
        device=torch.device("cpu"),
        model=model,
        new_model=lambda k: _unet(k),
    )


def _unet(num_classes: int):
    return create_segmenter("unet", spatial_dims=2, in_channels=1, num_classes=num_classes, features=[4, 4, 8, 8, 8, 8])


def test_plugin_heads_from_the_embeddings_file_and_the_teacher(toy_protocol, embeddings_file):
    torch.manual_seed(0)
    model = _unet(3)
    original = model.classifier
    plugin = CLIPCTPlugin(CLIPCTOptions(embeddings=str(embeddings_file), hidden=7, global_dim=5, head_channels=2))
    state = _state(toy_protocol, 0, [0, 1, 2], model)
    plugin.before_session(state)
    assert model.classifier is plugin.head and plugin.teacher is None
    controllers = plugin.head.controllers
    assert torch.equal(controllers["1"].embedding, VECTORS["disc"])
    assert torch.equal(controllers["2"].embedding, VECTORS["square"])
    plugin.after_session(state)
    assert model.classifier is original

    # session 1: class 3 is new, 1 recurs, 2 (row 2) is hidden in the background
    model.classifier.grow(1)
    state = _state(toy_protocol, 1, [0, 1, 2, 3], model)
    plugin.before_session(state)
    assert plugin._old_rows == [2]
    assert torch.equal(plugin.head.controllers["3"].embedding, VECTORS["cross"])
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        student = model.forward_features(x).logits
        teacher = plugin.teacher.forward_features(x).logits
    assert student.shape == (2, 4, 32, 32) and teacher.shape == (2, 3, 32, 32)
    assert torch.allclose(student[:, :3], teacher)  # the new head leaves the old outputs as they were

    target = torch.zeros(2, 32, 32, dtype=torch.long)
    target[:, :8] = 3
    target[:, 8:12] = 1
    target[0, -1] = 255
    state.batch = {"image": x}
    state.target = target
    state.output = SimpleNamespace(logits=student)
    state.config = SimpleNamespace(lambda_ce=1.0, lambda_dice=0.5)
    state.losses = {}
    plugin.after_forward(state)
    y, valid = clip_ct_targets(target, 4, [2], torch.sigmoid(teacher[:, [2]]))
    bce, dice = binary_segmentation_losses(student[:, 1:], y, valid)
    assert state.losses["clipct_bce"].item() == pytest.approx(bce.item())
    assert state.losses["clipct_dice"].item() == pytest.approx(0.5 * dice.item())

    # the head round-trips through the session checkpoint's plugin state
    plugin.after_session(state)
    restored = CLIPCTPlugin()
    restored.load_extra_state(plugin.extra_state())
    features = torch.randn(1, model.backbone.feature_channels, 8, 8)
    assert restored.head.classes == [1, 2, 3]
    assert torch.equal(restored.head(features), plugin.head(features))


def test_embedding_sources_and_errors(toy_protocol, embeddings_file, tmp_path, caplog):
    state = SimpleNamespace(protocol=toy_protocol)
    auto = CLIPCTPlugin()
    assert not auto.uses_clip()
    assert auto.class_embeddings(state, [2, 3]).tolist() == [[0, 1, 0], [0, 0, 1]]  # one-hot over 1, 2, 3
    with pytest.raises(ConfigError, match="needs method_args.clip-ct.embeddings"):
        CLIPCTPlugin(CLIPCTOptions(encoding="clip")).class_embeddings(state, [1])
    missing = tmp_path / "absent.safetensors"
    with pytest.raises(ConfigError, match="absent.safetensors"):
        CLIPCTPlugin(CLIPCTOptions(embeddings=str(missing))).class_embeddings(state, [1])
    partial = tmp_path / "partial.safetensors"
    write_text_embeddings(partial, {"disc": VECTORS["disc"]})
    with pytest.raises(ConfigError, match="partial.safetensors.*'cross'"):
        CLIPCTPlugin(CLIPCTOptions(embeddings=str(partial))).class_embeddings(state, [1, 3])
    onehot = CLIPCTPlugin(CLIPCTOptions(embeddings=str(embeddings_file), encoding="onehot"))
    assert onehot.class_embeddings(state, [1]).tolist() == [[1, 0, 0]]
    with pytest.raises(ConfigError, match="method_args.clip-ct.confidence"):
        CLIPCTPlugin(CLIPCTOptions(confidence=0.4))


def test_registered_with_its_options(embeddings_file):
    config = resolve_config(
        overrides=[f"method_args.clip-ct.embeddings={embeddings_file}", "method_args.clip-ct.confidence=0.7"]
    )
    (plugin,) = create_method("clip-ct", config).plugins
    assert isinstance(plugin, CLIPCTPlugin)
    assert plugin.options.embeddings == str(embeddings_file) and plugin.options.confidence == 0.7
    assert plugin.uses_clip() and plugin.changes_base_session and plugin.freeze_incremental == "none"
    assert plugin.replaces == ("supervised-loss",)
