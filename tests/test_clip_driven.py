"""CLIP-driven universal model: the dynamic head by hand, growth, text conditioning, the partial-label loss,
the clip-driven backbone's rows, and one toy run of the method with an embeddings file written here."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import toy_protocol_dict
from jascl.engine.config import resolve_config
from jascl.errors import ConfigError
from jascl.methods.baselines.domain.clip_driven import partial_label_losses
from jascl.networks.clip_driven import ClipDrivenBackbone, TextDrivenClassifier, dynamic_heads, onehot_embeddings
from jascl.networks.text_embeddings import ROWS_KEY, write_text_embeddings
from jascl.protocols import parse_protocol
from jascl.protocols.schema import IGNORE_INDEX

C, D = 4, 5


def _classifier(rows: int = 3, table_rows: int = 5, seed: int = 0) -> TextDrivenClassifier:
    torch.manual_seed(seed)
    table = torch.randn(table_rows, D)
    table[0] = 0
    return TextDrivenClassifier(C, table[:rows], table, hidden=6, head_channels=3)


def test_dynamic_head_by_hand():
    # h = 1: y1 = relu(2x + 0.5), y2 = relu(3 y1 - 1), out = 4 y2 + 0.25
    x = torch.tensor([[[1.0, -2.0]]])  # (B=1, h=1, S=2)
    theta = torch.tensor([[[2.0, 3.0, 4.0, 0.5, -1.0, 0.25]]])  # (B=1, K=1, P=6): W1, W2, w3, b1, b2, b3
    out = dynamic_heads(x, theta)
    assert torch.equal(out, torch.tensor([[[4 * 6.5 + 0.25, 0.25]]]))  # x=1: y1=2.5, y2=6.5; x=-2: y1=0, y2=0


def test_logits_are_the_head_of_each_rows_text_and_the_image_mean():
    head = _classifier()
    features = torch.randn(2, C, 3, 2)
    logits = head(features)
    assert logits.shape == (2, 3, 3, 2)
    assert torch.equal(logits[:, 0], torch.zeros(2, 3, 2))  # background: logit 0 = sigmoid 0.5
    # row 2 by hand, for image 1 at pixel (1, 0)
    g = F.relu(head.global_proj(features[1].mean(dim=(1, 2))))
    t = F.relu(head.text_proj(head.weight[2]))
    theta = head.controller(torch.cat([g, t]))
    x = head.feature_proj(features[1, :, 1, 0])
    w1, w2, w3, b1, b2, b3 = torch.split(theta, [9, 9, 3, 3, 3, 1])  # weights first, then biases (official)
    y = F.relu(w1.view(3, 3) @ x + b1)
    y = F.relu(w2.view(3, 3) @ y + b2)
    torch.testing.assert_close(logits[1, 2, 1, 0], (w3 @ y + b3)[0])


def test_the_heads_parameters_depend_on_the_embedding_and_only_that_rows_output_changes():
    head = _classifier()
    features = torch.randn(2, C, 3, 3)
    with torch.no_grad():
        before = head(features)
        theta = head.class_parameters(features, head.weight[1:])
        head.weight[2] += 1.0
        after = head(features)
        moved = head.class_parameters(features, head.weight[1:])
    assert torch.equal(theta[:, 0], moved[:, 0]) and not torch.allclose(theta[:, 1], moved[:, 1])
    assert torch.equal(after[:, :2], before[:, :2])
    assert not torch.allclose(after[:, 2], before[:, 2])


def test_growth_keeps_old_outputs_identical_and_takes_the_new_rows_text():
    head = _classifier()
    features = torch.randn(2, C, 4, 4)
    with torch.no_grad():
        old = head(features)
        head.grow(1, init=torch.randn(1, C))  # imprinting rows are ignored: the text decides
        assert torch.equal(head.weight[3], head.table[3])
        extra = torch.randn(1, D)
        head.grow(1, embeddings=extra)
        new = head(features)
    assert head.num_classes == 5 and torch.equal(head.weight[4], extra[0])
    torch.testing.assert_close(new[:, :3], old)  # identical up to float rounding of the batched products
    with pytest.raises(ConfigError, match="no text embedding for rows 5..5"):
        head.grow(1)


def test_vectors_are_classified_as_one_pixel_images():
    head = _classifier()
    vectors = torch.randn(6, C)
    with torch.no_grad():
        torch.testing.assert_close(head(vectors), head(vectors[:, :, None, None])[:, :, 0, 0], rtol=0, atol=0)


def test_partial_label_losses_by_hand():
    logits = torch.zeros(1, 3, 1, 2)
    logits[0, 1] = torch.tensor([[2.0, -1.0]])
    logits[0, 2] = torch.tensor([[5.0, 5.0]])  # row 2 is not labelled: no loss whatever it says
    target = torch.tensor([[[1, 0]]])
    bce, dice = partial_label_losses(logits, target, [1])
    p = torch.sigmoid(torch.tensor([2.0, -1.0]))
    expected_bce = (-torch.log(p[0]) - torch.log(1 - p[1])) / 2
    expected_dice = 1 - (2 * p[0] + 1e-5) / (p.sum() + 1 + 1e-5)
    torch.testing.assert_close(bce, expected_bce)
    torch.testing.assert_close(dice, expected_dice)
    # an ignored pixel counts nowhere
    ignored = torch.tensor([[[1, IGNORE_INDEX]]])
    bce, dice = partial_label_losses(logits, ignored, [1])
    torch.testing.assert_close(bce, -torch.log(p[0]))
    torch.testing.assert_close(dice, 1 - (2 * p[0] + 1e-5) / (p[0] + 1 + 1e-5))
    assert partial_label_losses(logits, target, [])[0] == 0


def test_onehot_codes():
    assert torch.equal(onehot_embeddings([1, 2, 5], [5, 1]), torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))


def _toy_embeddings(path, names=("disc", "square", "cross"), rows=True):
    vectors = {n: torch.randn(D, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(names)}
    meta = {ROWS_KEY: json.dumps(["background", *names])} if rows else None
    write_text_embeddings(path, vectors, meta)
    return vectors


def test_backbone_rows_come_from_the_file_and_errors_name_it(tmp_path):
    path = tmp_path / "toy.safetensors"
    vectors = _toy_embeddings(path)
    body = {"features": [4, 4, 8, 8, 8, 8]}
    backbone = ClipDrivenBackbone(2, 1, embeddings=str(path), hidden=6, head_channels=3, **body)
    assert backbone.rows == ["background", "disc", "square", "cross"]
    assert backbone.feature_channels == 8 and backbone.layer_aliases["encoder"].startswith("body.net.")
    head = backbone.make_classifier(3)
    assert torch.equal(head.weight, torch.stack([torch.zeros(D), vectors["disc"], vectors["square"]]))
    head.grow(1)
    assert torch.equal(head.weight[3], vectors["cross"])
    with pytest.raises(ConfigError, match="5 classifier rows, but the text embeddings list 4"):
        backbone.make_classifier(5)
    plain = tmp_path / "plain.safetensors"
    _toy_embeddings(plain, rows=False)
    with pytest.raises(ConfigError) as exc:
        ClipDrivenBackbone(2, 1, embeddings=str(plain), **body)
    assert f"{plain}: the text embeddings file does not list the protocol's classes" in str(exc.value)
    with pytest.raises(ConfigError, match="'liver'"):
        ClipDrivenBackbone(2, 1, embeddings=str(plain), classes=["background", "disc", "liver"], **body)
    with pytest.raises(ConfigError, match="set backbone_args.embeddings"):
        ClipDrivenBackbone(2, 1, **body)
    onehot = ClipDrivenBackbone(2, 1, encoding="onehot", classes=["background", "a", "b"], **body)
    assert torch.equal(onehot.make_classifier(3).weight, torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))


def test_toy_run_with_an_embeddings_file(tmp_path):
    from jascl.experiments.runner import run_benchmark

    path = tmp_path / "toy.safetensors"
    vectors = _toy_embeddings(path)
    spec = toy_protocol_dict(2)
    spec["training"].update({"epochs_base": 1, "epochs_incremental": 1})
    protocol = parse_protocol(spec, source="toy.yaml")
    overrides = [f"method_args.clip-driven.embeddings={path}", "method_args.clip-driven.encoding=clip"]
    overrides += ["method_args.clip-driven.hidden=8"]
    config = resolve_config(protocol.training, "toy.yaml", overrides=overrides)
    out = tmp_path / "run"
    results = run_benchmark(
        protocol, config, ["clip-driven"], out, cache_dir=tmp_path / "cache", progress=False, echo=lambda *a: None
    )
    assert [s["session"] for s in results["methods"]["clip-driven"]["sessions"]] == [0, 1]
    folder = next((out / "clip-driven").glob("s1-*"))
    extra = load_file(str(folder / "plugins.safetensors"))
    assert extra["0.clip-driven.classes"].tolist() == [1, 2, 3]
    head_rows = extra["0.clip-driven.head.weight"]
    assert head_rows.shape == (4, D)
    assert torch.equal(head_rows[0], torch.zeros(D))  # the background row gets no gradient
    assert not torch.equal(head_rows[3], vectors["cross"])  # the new class's row started at its text and trained
    # the saved model keeps the (unused, untrained) pixel classifier, grown with a zero row for the new class
    base = load_file(str(next((out / "clip-driven").glob("s0-*")) / "model.safetensors"))
    model = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model["classifier.weight"][:3], base["classifier.weight"])
    assert torch.equal(model["classifier.weight"][3], torch.zeros(8))


# ----------------------------------------------------------------------------- the universal model's released weights


def _universal_checkpoint(path, feature_size=12, seed=0):
    """A file laid out as the authors' released ``clip_driven_universal_swin_unetr.pth``: ``{"net": state}`` with the
    Swin UNETR body under ``module.backbone.`` (MONAI's SwinUNETR names, its output block included) and the universal
    head beside it (``controller``, ``organ_embedding``, ``text_to_vision``, ``GAP``, ``precls_conv``), at toy width."""
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(seed)
    body = SwinUNETR(in_channels=1, out_channels=32, feature_size=feature_size, spatial_dims=3)
    state = {f"module.backbone.{k}": v for k, v in body.state_dict().items()}
    state.update(
        {
            "module.precls_conv.0.weight": torch.ones(feature_size),
            "module.precls_conv.2.weight": torch.randn(8, feature_size, 1, 1, 1),
            "module.GAP.3.weight": torch.randn(256, 16 * feature_size, 1, 1, 1),
            "module.controller.weight": torch.randn(153, 512, 1, 1, 1),
            "module.controller.bias": torch.randn(153),
            "module.organ_embedding": torch.randn(32, 512),
            "module.text_to_vision.weight": torch.randn(256, 512),
        }
    )
    torch.save({"net": state, "epoch": 0}, path)
    return state


def test_the_universal_models_released_weights_load_through_weights_into_swinunetr(tmp_path):
    """What ``--weights clip_driven_universal_swin_unetr.pth --backbone swinunetr`` does (``RunConfig.weights``,
    loaded into the session-0 model): the body's every tensor is loaded; the universal head and the body's output
    block, which jascl's backbone replaces, are skipped; a body of another width is refused in one line."""
    from jascl.engine.loop import ContinualTrainer
    from jascl.engine.plugin import Method
    from jascl.errors import CheckpointError

    path = tmp_path / "clip_driven_universal_swin_unetr.pth"
    state = _universal_checkpoint(path)
    protocol = parse_protocol(toy_protocol_dict(3), source="toy-3d.yaml")

    def trainer(feature_size):
        config = resolve_config(
            protocol.training,
            "toy-3d.yaml",
            overrides=[
                "backbone=swinunetr",
                f"backbone_args={{feature_size: {feature_size}}}",
                f"weights={path}",
                "patch_size=[64, 64, 64]",
            ],
        )
        return ContinualTrainer(protocol, config, Method("vanilla"), {}, progress=False)

    model = trainer(12).initial_model(3)
    loaded = model.backbone.state_dict()
    body = {k[len("module.backbone.") :]: v for k, v in state.items() if k.startswith("module.backbone.")}
    assert all(torch.equal(loaded[f"net.{k}"], v) for k, v in body.items() if not k.startswith("out."))
    assert not any(k.startswith("net.out.") for k in loaded)  # the output block is the Identity jascl puts there
    with pytest.raises(CheckpointError, match=r"clip_driven_universal_swin_unetr.pth: weights do not fit") as err:
        trainer(24).initial_model(3)
    assert "\n" not in str(err.value)
